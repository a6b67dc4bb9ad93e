"""The runtime must load and generate without torch, transformers or optimum."""

import json
import os
import subprocess
import sys
import textwrap


def test_runtime_never_imports_torch(agreeing_bundle):
    script = textwrap.dedent(f"""
        import sys
        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers", "optimum"):
                    raise ImportError("the runtime imported " + name)
        sys.meta_path.insert(0, Refuse())
        import specdeploy
        from specdeploy import cli
        gen = specdeploy.load({str(agreeing_bundle)!r})
        out = gen.generate("def f(x):", max_new_tokens=8, temperature=0.7)
        assert len(out.token_ids) == 8
        assert not any(m.split(".")[0] in ("torch", "transformers", "optimum") for m in sys.modules)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_shared_thread_pool_gives_the_same_tokens(agreeing_bundle):
    """The default process-wide pool (the suite itself runs per-session pools) changes speed, not output."""
    import specdeploy

    script = textwrap.dedent(f"""
        import json, specdeploy
        gen = specdeploy.load({str(agreeing_bundle)!r})
        from specdeploy.runtime.session import global_pool_active
        assert global_pool_active()
        print(json.dumps(gen.generate("def f(x):", max_new_tokens=24).token_ids))
    """)
    env = {k: v for k, v in os.environ.items() if k != "SPECDEPLOY_SHARED_THREADS"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    expected = specdeploy.load(agreeing_bundle).generate("def f(x):", max_new_tokens=24).token_ids
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


def test_the_package_imports_its_runtime_on_first_use():
    """`import specdeploy` loads nothing heavy (the command's entry point guards the CLI's imports), while its
    names and submodules stay attributes of the package, as an eager import made them."""
    script = textwrap.dedent("""
        import sys
        import specdeploy
        assert "numpy" not in sys.modules and "specdeploy.runtime" not in sys.modules
        assert specdeploy.load is specdeploy.runtime.load and specdeploy.bundle.load_manifest
        assert "Generator" in dir(specdeploy)
        try:
            specdeploy.no_such_name
        except AttributeError as exc:
            print(exc)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "module 'specdeploy' has no attribute 'no_such_name'"
