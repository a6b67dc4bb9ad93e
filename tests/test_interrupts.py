"""Ctrl-C: an interrupted export leaves nothing behind and an existing bundle untouched; an
interrupted run prints the text so far and the stats, and exits 130. Real processes, real SIGINT."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def start(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "specdeploy", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
        # A shell running us in the background ignores SIGINT, and children inherit that: restore it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_ctrl_c_during_export_leaves_the_old_bundle_and_nothing_else(checkpoints, bundles, tmp_path):
    pair = checkpoints("llama")
    out = tmp_path / "bundle"
    shutil.copytree(bundles("gpt2"), out)
    before = _tree(out)
    process = start("export", "--target", str(pair["target"]), "--draft", str(pair["draft"]), "--out", str(out), "--force")
    deadline = time.time() + 120
    while time.time() < deadline and not any(".partial-" in p.name for p in tmp_path.iterdir()):
        time.sleep(0.02)
    assert any(".partial-" in p.name for p in tmp_path.iterdir()), "the export never started building"
    time.sleep(0.5)  # well inside the build
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    stderr = stderr.decode()
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "error: interrupted" and "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # no partial folder, no lock file
    assert _tree(out) == before


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# --json prints nothing before the end: that run uses the concatenating draft (slow at length, its
# passes copy the cache) and is interrupted once it has spent CPU time well past starting up.
@pytest.mark.parametrize("extra", [["--no-speculative"], ["--json", "--drafter", "model"]], ids=["streamed", "json"])
def test_ctrl_c_during_run_prints_the_text_so_far_and_the_stats(long_bundle, extra):
    process = start("run", str(long_bundle), "--prompt", "def f(x):", "--max-new-tokens", "4500", "--temperature", "0.8",
                    *extra)
    if "--json" in extra:
        deadline = time.time() + 60
        while time.time() < deadline and _cpu_seconds(process.pid) < 4:
            time.sleep(0.05)
    else:
        assert process.stdout.read(20), "no text streamed"
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    stdout, stderr = stdout.decode(errors="replace"), stderr.decode()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    stats = stderr.strip().splitlines()[-1]
    assert "tokens in" in stats and stats.endswith("[interrupted]"), stderr
    new_tokens = int(stats.split()[0])
    assert 0 < new_tokens < 4500
    if "--json" in extra:
        import json

        payload = json.loads(stdout)
        assert payload["stats"]["finish_reason"] == "interrupted" and len(payload["token_ids"]) == new_tokens


def test_ctrl_c_during_the_commands_own_imports_prints_one_line():
    # The command's entry point imports the CLI (NumPy, click, the runtime: a few tenths of a second) under a
    # guard. The Ctrl-C is forced: importing NumPy raises it, as a Ctrl-C arriving then would.
    import tomllib

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["specdeploy"] == "specdeploy.console:main"
    code = ("import sys\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'numpy':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "from specdeploy.console import main\n"
            "main()\n")
    result = subprocess.run([sys.executable, "-c", code, "run", "--help"], capture_output=True, env=ENV)
    assert result.returncode == 130, result.stderr.decode()
    assert result.stderr.decode().strip() == "error: interrupted"


def test_python_m_exits_130_after_a_ctrl_c_that_interrupted_a_string_exec(tmp_path):
    # CPython marks a process as killed by Ctrl-C when one interrupts code run from a string (dataclasses
    # builds methods that way, so an interrupted import does it), even if the exception is caught; under
    # `python -m` that would turn the CLI's exit 130 into a SIGINT death. The interrupt here is forced.
    (tmp_path / "interrupted_main.py").write_text(
        "import runpy\nimport specdeploy.cli\nfrom specdeploy.cli_support import fail\n\n"
        "def main():\n    try:\n        exec('raise KeyboardInterrupt')\n    except KeyboardInterrupt:\n"
        "        fail('interrupted', 130)\n\n"
        "specdeploy.cli.main = main\nrunpy.run_module('specdeploy', run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-m", "interrupted_main"], cwd=tmp_path, capture_output=True, env=ENV)
    assert result.returncode == 130, result.stderr.decode()
    assert result.stderr.decode().strip() == "error: interrupted"
