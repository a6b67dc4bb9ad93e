"""`specdeploy run` as a user runs it: text, stats, JSON, stdin, and one-line errors."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest


def run(*args, input=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "specdeploy", "run", *args], capture_output=True, text=True,
                          env=env, input=input)


def test_run_streams_text_and_prints_stats(agreeing_bundle):
    result = run(str(agreeing_bundle), "--prompt", "def f(x):", "--max-new-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "tok/s" in result.stderr and "acceptance" in result.stderr


def test_run_json_matches_the_python_api(agreeing_bundle):
    import specdeploy

    result = run(str(agreeing_bundle), "--prompt", "def f(x):", "--max-new-tokens", "24", "--json", "-k", "3")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert set(payload) == {"text", "token_ids", "stats"}
    expected = specdeploy.load(agreeing_bundle).generate("def f(x):", max_new_tokens=24, num_draft_tokens=3)
    assert payload["token_ids"] == expected.token_ids and payload["text"] == expected.text
    stats = payload["stats"]
    for key in ("rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_tokens", "accepted_by_position",
                "draft_ms", "target_ms", "other_ms", "tokens_per_s"):
        assert key in stats


def test_exact_reaches_the_runtime_from_run_bench_and_serve(agreeing_bundle, tmp_path, monkeypatch):
    """--exact loads an exact generator: run's stats and its stats line, bench's JSON and serve's config say so."""
    from click.testing import CliRunner

    import specdeploy.serve
    from specdeploy.cli import main

    result = run(str(agreeing_bundle), "--prompt", "def f(x):", "--max-new-tokens", "8", "--json", "--exact")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stats"]["exact"] is True and "exact]" in result.stderr
    plain = run(str(agreeing_bundle), "--prompt", "def f(x):", "--max-new-tokens", "8", "--json")
    assert json.loads(plain.stdout)["stats"]["exact"] is False and "exact]" not in plain.stderr
    (tmp_path / "prompt.txt").write_text("def f(x):")
    bench = CliRunner().invoke(main, ["bench", str(agreeing_bundle), "--prompt-file", str(tmp_path / "prompt.txt"),
                                      "--max-new-tokens", "4", "-k", "2", "--json", "--exact"])
    assert bench.exit_code == 0, bench.output
    assert json.loads(bench.stdout.strip().splitlines()[-1])["exact"] is True
    served = []
    monkeypatch.setattr(specdeploy.serve, "serve", served.append)
    for flags, exact in (([], False), (["--exact"], True)):
        assert CliRunner().invoke(main, ["serve", str(agreeing_bundle), *flags]).exit_code == 0
        assert served[-1].exact is exact


def test_run_sampling_flags_are_the_python_apis(agreeing_bundle):
    import specdeploy

    flags = ["--temperature", "0.8", "--top-k", "50", "--top-p", "0.95", "--min-p", "0.05", "--repetition-penalty", "1.1"]
    result = run(str(agreeing_bundle), "--prompt", "def f(x):", "--max-new-tokens", "16", "--json", "--seed", "3", *flags)
    assert result.returncode == 0, result.stderr
    expected = specdeploy.load(agreeing_bundle).generate("def f(x):", max_new_tokens=16, seed=3, temperature=0.8, top_k=50,
                                                         top_p=0.95, min_p=0.05, repetition_penalty=1.1)
    assert json.loads(result.stdout)["token_ids"] == expected.token_ids


def test_run_reads_stdin_and_baseline_flag(agreeing_bundle):
    result = run(str(agreeing_bundle), "--prompt", "-", "--max-new-tokens", "8", "--json", "--no-speculative",
                 input="import os\n")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["stats"]["drafted"] == 0 and len(payload["token_ids"]) == 8


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1"], "--temperature must be"),
        (["--top-p", "0"], "--top-p must be"),
        (["--top-k", "-2"], "--top-k must be"),
        (["--min-p", "1.5"], "--min-p must be"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be"),
        (["--max-new-tokens", "-5"], "--max-new-tokens must be"),
        (["--num-draft-tokens", "40"], "--num-draft-tokens must be"),
        (["--device", "tpu"], "'tpu' is not one of 'cpu', 'cuda', 'tensorrt'"),
        (["--device", "cuda"], "onnxruntime-gpu"),
        (["--drafter", "oracle"], "'oracle' is not one of"),
    ],
)
def test_run_bad_options(agreeing_bundle, args, message):
    result = run(str(agreeing_bundle), "--prompt", "x", *args)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_run_bad_bundles(tmp_path, agreeing_bundle):
    result = run(str(tmp_path / "nothing"), "--prompt", "x")
    assert result.returncode != 0 and "bundle not found" in result.stderr
    (tmp_path / "specdeploy.json").write_text('{"format_version": 0}')
    result = run(str(tmp_path), "--prompt", "x")
    assert result.returncode != 0 and "format_version" in result.stderr and "Traceback" not in result.stderr
    long_prompt = "x = 1\n" * 2000
    result = run(str(agreeing_bundle), "--prompt", long_prompt)
    assert result.returncode != 0 and "max context" in result.stderr and "Traceback" not in result.stderr


def test_without_a_bundle_run_takes_the_shipped_one_until_one_is_exported(tmp_path, agreeing_bundle):
    import shutil

    from specdeploy.defaults import SHIPPED_BUNDLE

    env = {**os.environ, "SPECDEPLOY_HOME": str(tmp_path / "home")}

    def run_default():
        result = subprocess.run([sys.executable, "-m", "specdeploy", "run", "--prompt", "def add(a, b):\n",
                                 "--max-new-tokens", "12", "--json"], capture_output=True, text=True, env=env)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["token_ids"]

    def run_named(bundle):
        return json.loads(run(str(bundle), "--prompt", "def add(a, b):\n", "--max-new-tokens", "12", "--json").stdout)[
            "token_ids"]

    assert run_default() == run_named(SHIPPED_BUNDLE)
    assert not (tmp_path / "home").exists()  # nothing exported, nothing written
    shutil.copytree(agreeing_bundle, tmp_path / "home" / "demo-bundle")  # as `specdeploy export` would put one
    assert run_default() == run_named(agreeing_bundle) != run_named(SHIPPED_BUNDLE)


def test_stdout_is_exactly_the_generated_text(agreeing_bundle):
    """No newline the model did not write (stdout is a pipe here), streamed or not; the same text as --json's."""
    expected = json.loads(run(str(agreeing_bundle), "--prompt", "def f(x):", "--max-new-tokens", "16", "--json").stdout)
    assert not expected["text"].endswith("\n")  # so a trailing newline would be one the CLI added
    for flags in ([], ["--no-stream"]):
        result = run(str(agreeing_bundle), "--prompt", "def f(x):", "--max-new-tokens", "16", *flags)
        assert result.returncode == 0, result.stderr
        assert result.stdout == expected["text"]
    refused = run(str(agreeing_bundle), "--prompt", "x", "--temperature", "-1")
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.startswith("error: ")


def test_prompt_file_is_read_byte_for_byte(agreeing_bundle, tmp_path, monkeypatch):
    import specdeploy
    import specdeploy.bench
    from click.testing import CliRunner

    from specdeploy.cli import main

    text = "def f(x):\r\n    return x\n"  # a CRLF and a trailing newline, both kept
    (tmp_path / "prompt.txt").write_bytes(text.encode())
    result = run(str(agreeing_bundle), "--prompt-file", str(tmp_path / "prompt.txt"), "--max-new-tokens", "8", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    generator = specdeploy.load(agreeing_bundle)
    assert payload["stats"]["prompt_tokens"] == len(generator.codec.encode(text))
    assert payload["token_ids"] == generator.generate(text, max_new_tokens=8).token_ids

    benched = []
    real = specdeploy.bench.run_bench
    monkeypatch.setattr(specdeploy.bench, "run_bench", lambda gen, config, **kw: benched.append(config) or real(gen, config, **kw))
    bench = CliRunner().invoke(main, ["bench", str(agreeing_bundle), "--prompt-file", str(tmp_path / "prompt.txt"),
                                      "--max-new-tokens", "4", "-k", "2", "--json"])
    assert bench.exit_code == 0, bench.output
    assert [config.prompts for config in benched] == [(text,)]


def test_debug_is_accepted_after_the_subcommand(agreeing_bundle):
    ok = run(str(agreeing_bundle), "--prompt", "x", "--max-new-tokens", "2", "--debug")
    assert ok.returncode == 0, ok.stderr
    failed = run(str(agreeing_bundle), "--prompt", "x", "--temperature", "-1", "--debug")
    assert failed.returncode != 0 and "Traceback" in failed.stderr and failed.stdout == ""
    prompt = run(str(agreeing_bundle), "--prompt", "--debug", "--max-new-tokens", "2", "--json")  # a value, not the flag
    assert prompt.returncode == 0 and json.loads(prompt.stdout)["stats"]["prompt_tokens"] > 0


def test_a_runtime_only_install_runs_and_benches_with_no_argument(tmp_path):
    """torch, transformers, optimum and onnx missing, no bundle named, none exported: run and bench take the
    shipped demo bundle; export fails with one line naming the extra to install."""
    (tmp_path / "prompts.json").write_text('["def fib(n):"]')
    hide = "import sys\nfor name in ('torch', 'transformers', 'optimum', 'onnx'):\n    sys.modules[name] = None\n"
    env = {**os.environ, "SPECDEPLOY_HOME": str(tmp_path / "home")}

    def cli(*args):
        code = hide + f"from specdeploy.cli import main\nmain({list(args)!r})\n"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)

    ran = cli("run", "--prompt", "def fib(n):", "--max-new-tokens", "8")
    assert ran.returncode == 0 and ran.stdout, ran.stderr
    benched = cli("bench", "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", "4", "-k", "2", "--json")
    assert benched.returncode == 0, benched.stderr
    assert json.loads(benched.stdout.splitlines()[-1])["identical_outputs"] is True
    exported = cli("export")
    lines = exported.stderr.strip().splitlines()
    assert exported.returncode == 2 and exported.stdout == "" and len(lines) == 1, exported.stderr
    assert lines[0].startswith("error: exporting needs the export extra") and "pip install '.[export]' in the specdeploy clone" in lines[0]
    assert not (tmp_path / "home").exists()


def test_serve_options_default_to_serve_config():
    """`serve` without flags configures the server as ServeConfig's own defaults do (a default written
    twice drifts), and parsing them imports no server package."""
    import dataclasses

    from specdeploy.cli import main
    from specdeploy.serve.config import ServeConfig

    options = {param.name: param.default for param in main.commands["serve"].params}
    renamed = {"drain_timeout": "drain_timeout_s"}
    checked = 0
    for name, default in options.items():
        field = next((f for f in dataclasses.fields(ServeConfig) if f.name == renamed.get(name, name)), None)
        if field is not None and field.default is not dataclasses.MISSING:
            assert default == field.default, name
            checked += 1
    assert checked >= 9
    code = "import sys, specdeploy.cli; print(sorted({m.split('.')[0] for m in sys.modules} & {'starlette', 'uvicorn'}))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


def test_the_library_changes_nothing_process_wide(agreeing_bundle):
    """Loading, generating and building the server's app leave the environment, SIGTERM's handler and
    logging as they were; the module that sets them (for the console entry) is never imported."""
    import textwrap

    script = textwrap.dedent(f"""
        import logging, os, signal, sys
        import specdeploy
        from specdeploy.serve import ServeConfig, create_app
        from starlette.testclient import TestClient
        specdeploy.load({str(agreeing_bundle)!r}).generate("def f(x):", max_new_tokens=4)
        with TestClient(create_app(ServeConfig(bundle={str(agreeing_bundle)!r}))) as client:
            client.get("/health")
        assert "HF_HUB_OFFLINE" not in os.environ
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert not logging.getLogger("uvicorn").handlers and not logging.getLogger("specdeploy.serve").handlers
        assert "specdeploy.cli_support" not in sys.modules
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_console_entry_sets_up_its_process_and_gives_it_back(monkeypatch, tmp_path):
    """Only the CLI's main turns SIGTERM into Ctrl-C, for an export, and it restores the handler it found."""
    import signal

    from click.testing import CliRunner

    import specdeploy.export
    from specdeploy.cli import main

    seen = []

    def export_bundle(config, report=None):  # what the process looks like while an export runs
        seen.append((signal.getsignal(signal.SIGTERM), os.environ.get("HF_HUB_OFFLINE")))
        return SimpleNamespace(models=[])  # a manifest with no parity figures to print

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(specdeploy.export, "export_bundle", export_bundle)
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(main, ["export", "--out", str(tmp_path / "bundle")])
    assert result.exit_code == 0, result.output
    (handler, offline), = seen
    assert handler is not before and callable(handler) and offline == "1"
    assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGTERM, None)


def test_run_takes_the_openai_penalties_and_logprobs(agreeing_bundle):
    """--presence-penalty/--frequency-penalty reach the generation (as Python's generate gives it), and
    --logprobs N puts each token's log-probability and N alternatives, each with its text and bytes, into --json's
    object."""
    from click.testing import CliRunner

    import specdeploy
    from specdeploy.cli import main

    args = ["run", str(agreeing_bundle), "--prompt", "def f(x):", "--max-new-tokens", "12", "--temperature", "0",
            "--frequency-penalty", "1.5", "--presence-penalty", "0.5", "--json", "--logprobs", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    expected = specdeploy.load(agreeing_bundle).generate("def f(x):", max_new_tokens=12, frequency_penalty=1.5,
                                                         presence_penalty=0.5, logprobs=2)
    assert record["token_ids"] == expected.token_ids
    assert [entry["token_id"] for entry in record["logprobs"]] == expected.token_ids
    assert all(len(entry["top_logprobs"]) == 2 for entry in record["logprobs"])
    # each token named as the server names it: its bytes, and their text (OpenAI's "bytes:\\x.." where they
    # are not whole characters); together the bytes spell the output
    assert b"".join(bytes(entry["bytes"]) for entry in record["logprobs"]).decode(errors="replace") == record["text"]
    for entry in record["logprobs"]:
        data = bytes(entry["bytes"])
        try:
            assert entry["token"] == data.decode()
        except UnicodeDecodeError:
            assert entry["token"] == "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)
    assert all({"token", "token_id", "logprob", "bytes"} <= set(top) for e in record["logprobs"] for top in e["top_logprobs"])
    refused = CliRunner().invoke(main, args[:-3] + ["--logprobs", "2"])  # without --json
    assert refused.exit_code == 2 and "--logprobs needs --json" in refused.stderr and refused.stdout == ""


def test_serve_logs_to_stderr_only_from_the_console_entry():
    """The console's serve puts one plain-line handler on the root logger (uvicorn's and specdeploy's loggers
    propagate to it) and takes it away again; other commands leave logging alone."""
    import logging

    from specdeploy.cli_support import command_line_process

    root, ours, uvicorn = logging.getLogger(), logging.getLogger("specdeploy"), logging.getLogger("uvicorn")
    handlers, level, uvicorn_handlers = list(root.handlers), ours.level, list(uvicorn.handlers)
    command_line_process("run")()
    assert root.handlers == handlers
    undo = command_line_process("serve")
    try:
        added = [h for h in root.handlers if h not in handlers]
        assert len(added) == 1 and added[0].stream is sys.stderr and ours.getEffectiveLevel() == logging.INFO
        assert uvicorn.handlers == uvicorn_handlers  # uvicorn's own loggers are left as they are
    finally:
        undo()
    assert root.handlers == handlers and ours.level == level
