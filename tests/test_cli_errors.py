"""Every bad input to every command: one `error: ...` line on stderr, exit code 2, no traceback
(`--debug` shows it). Most run in-process (click's runner); argv bytes need a real process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specdeploy.bench_output import draw_report
from specdeploy.cli import main
from specdeploy.defaults import SHIPPED_BUNDLE
from specdeploy.errors import SpecdeployError
from specdeploy.inspect_output import format_size


def invoke(*args, input=None):
    result = CliRunner().invoke(main, list(args), input=input)
    return result.exit_code, result.stdout, result.stderr


def assert_one_line(code, stderr, message):
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in stderr


@pytest.fixture(scope="module")
def bundle(agreeing_bundle):
    return str(agreeing_bundle)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """A default bundle location of the test's own: nothing here reads or writes the user's."""
    monkeypatch.setenv("SPECDEPLOY_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def files(tmp_path):
    (tmp_path / "list.json").write_text('{"prompts": ["a"]}')
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "numbers.json").write_text("[1, 2]")
    (tmp_path / "latin1.json").write_bytes('["caf\xe9"]'.encode("latin-1"))
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    return tmp_path


RUN_CASES = [
    (["--seed", "-1"], "'--seed': -1 is not in the range 0<=x<=18446744073709551615"),
    (["--seed", str(2**64)], "is not in the range"),
    (["--seed", "1.5"], "'--seed'"),
    (["--max-new-tokens", "many"], "'--max-new-tokens': 'many' is not a valid integer"),
    (["--max-new-tokens", "-1"], "error: --max-new-tokens must be >= 0 (got -1)"),  # the flag, not the field
    (["--temperature", "nan"], "error: --temperature must be"),
    (["--temperature", "inf"], "error: --temperature must be"),
    (["--top-p", "1.5"], "error: --top-p must be in (0, 1]"),
    (["--num-draft-tokens", "0"], "error: --num-draft-tokens must be"),
    (["--draft-confidence", "1"], "error: --draft-confidence must be"),
    (["--json", "--logprobs", "21"], "error: --logprobs must be an integer in 0..20 (got 21)"),
    (["--device", "cuda"], "needs onnxruntime-gpu"),
    (["--device", "tensorrt"], "needs onnxruntime-gpu"),
    (["--device", "tpu"], "'tpu' is not one of 'cpu', 'cuda', 'tensorrt'"),
    (["--drafter", "oracle"], "'oracle' is not one of 'model', 'prompt-lookup', 'hybrid'"),
    (["--frobnicate"], "No such option '--frobnicate'"),
    (["--prompt", "\udcff\udcfe"], "not valid UTF-8: byte 0xff at offset 0"),
    (["--stop", "ok", "--stop", ""], "error: --stop strings must not be empty"),
    (["--stop", "ok\udcc3"], "not valid UTF-8: byte 0xc3 at offset 2"),
]


@pytest.mark.parametrize("args, message", RUN_CASES, ids=[" ".join(a)[:30] for a, _ in RUN_CASES])
def test_run_bad_input(bundle, args, message):
    prompt = [] if "--prompt" in args else ["--prompt", "x"]
    assert_one_line(*invoke("run", bundle, *prompt, *args)[::2], message)


def test_run_missing_prompt_and_bundle(tmp_path):
    assert_one_line(*invoke("run", str(tmp_path))[::2], "pass one of --prompt, --chat or --messages")
    assert_one_line(*invoke("run", str(tmp_path / "none"), "--prompt", "x")[::2], "bundle not found")
    assert_one_line(*invoke("run", str(tmp_path), "--prompt", "x")[::2], "not a specdeploy bundle")


def test_stdin_must_be_utf8(bundle):
    code, _, stderr = invoke("run", bundle, "--prompt", "-", input=b"def f():\n    return '\xe9'\n")
    assert_one_line(code, stderr, "standard input is not valid UTF-8: byte 0xe9 at offset 21")


def test_argv_bytes_in_a_real_process(bundle):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "specdeploy", "run", bundle, "--prompt", b"abc\xff"],
                            capture_output=True, text=True, env=env)
    assert_one_line(result.returncode, result.stderr, "not valid UTF-8: byte 0xff at offset 3")


@pytest.mark.parametrize("name, message", [
    ("missing.json", "no such file"),
    ("list.json", "expected a JSON list of strings"),
    ("empty.json", "expected a JSON list of strings"),
    ("numbers.json", "expected a JSON list of strings"),
    ("latin1.json", "is not valid UTF-8: byte 0xe9 at offset 5"),
    ("deep.json", "--prompts"),
    (".", "not a file"),
])
def test_bench_bad_prompts(bundle, files, name, message):
    assert_one_line(*invoke("bench", bundle, "--prompts", str(files / name))[::2], message)


def test_bench_bad_options(bundle, tmp_path):
    assert_one_line(*invoke("bench", bundle, "--plot", str(tmp_path / "no" / "plot.png"))[::2], "does not exist")
    assert_one_line(*invoke("bench", bundle, "--plot", str(tmp_path))[::2], "is a folder")
    assert_one_line(*invoke("bench", bundle, "--repeat", "0")[::2], "at least 1")
    assert_one_line(*invoke("bench", bundle, "-k", "2,x")[::2], "--num-draft-tokens '2,x'")
    assert_one_line(*invoke("bench", bundle, "--prompt-tokens", "100000")[::2], "exceed the bundle's max context")
    assert_one_line(*invoke("bench", bundle, "--seed", "-5")[::2], "'--seed'")


def test_zero_tokens_is_not_an_error(bundle):
    code, stdout, stderr = invoke("run", bundle, "--prompt", "x", "--max-new-tokens", "0", "--json")
    assert code == 0, stderr
    payload = json.loads(stdout)
    assert payload["token_ids"] == [] and payload["stats"]["tokens_per_s"] == 0.0
    code, _, stderr = invoke("run", bundle, "--prompt", "x", "--max-new-tokens", "0")
    assert code == 0 and "0 tokens" in stderr


def test_an_onnx_runtime_failure_names_the_model_and_the_pass(bundles, tmp_path, monkeypatch):
    """A real failure inside a run: the fused graphs' rotary tables end at the exported context, so a
    manifest that claims a longer one (and is otherwise consistent) fails in its first pass. Load refuses
    such a manifest (check_rotary_positions); with that check off, the pass itself fails inside ONNX Runtime."""
    import shutil

    from specdeploy.runtime import session

    monkeypatch.setattr(session, "check_rotary_positions", lambda *args: None)

    bundle = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), bundle)
    manifest = json.loads((bundle / "specdeploy.json").read_text())
    assert manifest["target"]["graph"] == "fused" and manifest["max_context"] == 256
    for data in (manifest, manifest["target"], manifest["draft"]):
        data["max_context"] = 1024
    (bundle / "specdeploy.json").write_text(json.dumps(manifest))
    args = ["run", str(bundle), "--prompt", "x = 1\n" * 150, "--max-new-tokens", "4", "--no-speculative"]
    code, _, stderr = invoke(*args)
    # load's warm-up runs the first prefill (15 tokens: its 16-token prompt less the pending one)
    assert_one_line(code, stderr, "ONNX Runtime failed in the target model's prefill pass (15 tokens after 0 cached; "
                                  "target/model.onnx): ")
    assert "GroupQueryAttention" in stderr and "--debug" in stderr
    result = CliRunner().invoke(main, ["--debug", *args])
    assert isinstance(result.exception, RuntimeError)  # --debug: the exception itself, for a bug report


def test_unexpected_errors_are_one_line_and_debug_shows_them(bundle, monkeypatch):
    import specdeploy.runtime as runtime

    def broken(*args, **kwargs):
        raise ValueError("something nobody planned for")

    monkeypatch.setattr(runtime, "load", broken)
    assert_one_line(*invoke("run", bundle, "--prompt", "x")[::2], "ValueError: something nobody planned for")
    result = CliRunner().invoke(main, ["--debug", "run", bundle, "--prompt", "x"])
    assert isinstance(result.exception, ValueError)


def test_export_and_inspect_bad_input(tmp_path):
    assert_one_line(*invoke("export", "--out", str(tmp_path / "no" / "bundle"))[::2], "does not exist")
    assert_one_line(*invoke("export", "--draft", str(tmp_path))[::2], "--draft needs --target: pass --target")
    assert_one_line(*invoke("export", "--max-context", "1")[::2], "--max-context must be at least 2")
    assert_one_line(*invoke("inspect", str(tmp_path))[::2], "not a specdeploy bundle")
    (tmp_path / "specdeploy.json").write_bytes(b"\xff\xfe{}")
    assert_one_line(*invoke("verify", str(tmp_path))[::2], "is not UTF-8 (byte 0)")
    assert_one_line(*invoke("frobnicate")[::2], "No such command 'frobnicate'")


def test_bare_command_shows_help_and_an_existing_non_bundle_is_named(tmp_path):
    code, stdout, _ = invoke()
    assert code == 0 and stdout.startswith("Usage:")
    (tmp_path / "notes.txt").write_text("mine")
    # without --force too: the message says it is not a bundle, not "pass --force"
    assert_one_line(*invoke("export", "--out", str(tmp_path))[::2], "is not a specdeploy bundle")
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("command", ["run", "bench"])
def test_bad_prompt_files(bundle, files, command):
    for name, message in (("missing.txt", "--prompt-file {}: no such file"), (".", "--prompt-file {}: not a file"),
                          ("latin1.json", "--prompt-file {} is not valid UTF-8: byte 0xe9 at offset 5")):
        path = str(files / name)
        code, stdout, stderr = invoke(command, bundle, "--prompt-file", path)
        assert_one_line(code, stderr, message.format(path))
        assert stdout == ""
    (files / "prompt.txt").write_text("x")
    assert_one_line(*invoke("run", bundle, "--prompt-file", str(files / "prompt.txt"), "--prompt", "y")[::2],
                    "(got --prompt and --prompt-file)")
    assert_one_line(*invoke("run", bundle, "--prompt-file", str(files / "prompt.txt"), "--system", "s")[::2],
                    "--system goes with --chat or --messages (--prompt-file is sent as it is)")
    assert_one_line(*invoke("bench", bundle, "--prompt-file", str(files / "prompt.txt"), "--prompts",
                            str(files / "list.json"))[::2], "pass --prompts or --prompt-file, not both")


def test_debug_anywhere_re_raises(bundle):
    for args in (["--debug", "run", bundle, "--prompt", "x", "--top-p", "0"],
                 ["run", bundle, "--prompt", "x", "--top-p", "0", "--debug"]):
        result = CliRunner().invoke(main, args)
        assert isinstance(result.exception, SpecdeployError) and "--top-p" in str(result.exception)
    assert_one_line(*invoke("run", bundle, "--prompt", "x", "--top-p", "0")[::2], "--top-p must be")  # and without it, one line


def test_inspect_fits_80_columns_with_sizes_in_their_units(bundle):
    from specdeploy.bundle import load_manifest

    code, stdout, stderr = invoke("inspect", bundle)
    assert code == 0, stderr
    manifest = load_manifest(bundle)
    paths = (bundle, manifest.target.source, manifest.draft.source)  # printed whole, never cut
    for line in stdout.splitlines():
        assert len(line) <= 80 or any(path in line for path in paths), line
    assert f"  target: {manifest.target.source}" in stdout.splitlines()
    onnx = next(entry for entry in manifest.target.files if entry.path.endswith("model.onnx"))
    line = next(line for line in stdout.splitlines() if line.strip().startswith(onnx.path + " "))
    assert "0.0 MB" not in line and line.split()[-2:] == format_size(onnx.size).split()
    assert "chat template: none" in stdout


def test_format_size():
    assert [format_size(n) for n in (0, 999, 18_600, 34_700_000, 1_760_000_000)] == \
        ["0 B", "999 B", "18.6 kB", "34.7 MB", "1.76 GB"]


def test_inspect_and_verify_default_to_the_demo_bundle(bundle, home):
    import shutil

    shutil.copytree(bundle, home / "demo-bundle")  # as `specdeploy export` would put one there
    code, stdout, stderr = invoke("inspect")
    assert code == 0, stderr
    assert stdout.startswith(f"bundle: {home / 'demo-bundle'}\n") and "exporting" not in stderr
    code, stdout, stderr = invoke("verify")
    assert code == 0 and stdout.startswith("ok: ") and "match their sha256" in stdout


def report_with(ks):
    rows = [{"num_draft_tokens": k, "speedup": 1.4 + 0.1 * k, "leviathan_bound": 1.6 + 0.1 * k,
             "accepted_by_position": [8 - i for i in range(k)], "speculative": {"rounds": 10},
             "acceptance_by_position": [(8 - i) / 10 for i in range(k - 1)] + [None]} for k in ks]
    return {"by_num_draft_tokens": rows, "temperature": 0.8, "top_k": 50, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "prompts": 10, "max_new_tokens": 128, "repeat": 1, "drafter": "hybrid",
            "prompt_tokens": None, "bundle": "/somewhere/my-bundle", "date": "2026-12-01T14:50:00+00:00",
            "machine": "Some CPU, 2 CPUs"}


@pytest.mark.parametrize("ks", [(4,), (2, 4, 8)])
def test_the_plot_is_titled_starts_at_zero_and_has_whole_draft_positions(ks):
    import matplotlib.pyplot as plt

    figure = draw_report(report_with(ks))
    speedup, acceptance = figure.axes
    title = figure.get_suptitle()
    for part in ("my-bundle", "temperature 0.8, top-k 50", "drafter hybrid", "2026-12-01", "Some CPU, 2 CPUs"):
        assert part in title
    assert speedup.get_ylim()[0] == 0 and acceptance.get_ylim() == (0, 1)
    assert [t.get_text() for t in speedup.get_xticklabels()] == [f"k = {k}" for k in ks]
    assert list(acceptance.get_xticks()) == list(range(1, max(ks) + 1))
    assert len(speedup.patches) == 2 * len(ks)  # measured and bound: one bar each per k
    plt.close(figure)


def test_bench_plot_says_where_it_saved_it(bundle, tmp_path):
    plot = tmp_path / "k.png"
    code, stdout, stderr = invoke("bench", bundle, "--max-new-tokens", "4", "-k", "2", "--json", "--plot", str(plot),
                                  "--prompts", str(_one_prompt(tmp_path)))
    assert code == 0, stderr
    assert f"plot: {plot.resolve()}" in stderr.splitlines() and plot.stat().st_size > 0
    report = json.loads(stdout)
    assert report["bundle"] == str(Path(bundle).resolve()) and report["machine"] and report["date"][:4].isdigit()


def _one_prompt(tmp_path):
    (tmp_path / "one.json").write_text('["def f(x):"]')
    return tmp_path / "one.json"


def test_bench_plot_without_matplotlib_fails_before_anything_loads(tmp_path, monkeypatch):
    """The missing extra is named before the bundle loads (here a bundle that does not exist), not after the run."""
    import sys

    for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` (and its modules) raise ImportError
    code, stdout, stderr = invoke("bench", str(tmp_path / "no-bundle"), "--plot", str(tmp_path / "k.png"))
    assert_one_line(code, stderr, "--plot needs matplotlib (pip install '.[bench]' in the specdeploy clone)")
    assert stdout == "" and not (tmp_path / "k.png").exists()


def _cuda_provider_available() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.parametrize("device, message", [
    ("gpu", "'gpu' is not one of 'cpu', 'cuda', 'tensorrt'"),
    pytest.param("cuda", "needs onnxruntime-gpu",
                 marks=pytest.mark.skipif(_cuda_provider_available(), reason="this onnxruntime has CUDA")),
])
def test_serve_refuses_an_unusable_device_before_it_listens(device, message):
    """`--device gpu` (not a device) and `--device cuda` without onnxruntime-gpu are refused as `run` and
    `bench` refuse them: one error line, exit 2, and no server started ("serving ... on http://...")."""
    result = subprocess.run([sys.executable, "-m", "specdeploy", "serve", str(SHIPPED_BUNDLE), "--port", "0",
                             "--device", device], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert "serving" not in result.stderr and "uvicorn" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_the_plot_formats_bench_checks_are_the_ones_matplotlib_writes():
    """bench --plot checks its file's suffix against PLOT_FORMATS without importing matplotlib (its memory would
    count in the reported peak); the list must stay the installed matplotlib's."""
    pytest.importorskip("matplotlib")
    from matplotlib.backend_bases import FigureCanvasBase

    from specdeploy.bench_output import PLOT_FORMATS

    assert sorted(PLOT_FORMATS) == sorted(FigureCanvasBase.get_supported_filetypes())


def test_an_option_of_another_command_is_named_as_such():
    code, stdout, stderr = invoke("chat", "--json")
    assert_one_line(code, stderr, "chat takes no --json (an option of bench, inspect, run, verify)")
    assert stdout == ""
    code, _, stderr = invoke("run", "--temprature", "1")  # a misspelling keeps click's guess
    assert_one_line(code, stderr, "No such option '--temprature'. Did you mean '--temperature'?")
