"""The commands at their edges, on the shipped demo bundle: bench's one-line JSONL prompts, largest seed and
--plot paths (format, suffix, ~), export's printed folder, and chat's piped input (CRLF, bad UTF-8)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from specdeploy.cli import main
from specdeploy.defaults import SHIPPED_BUNDLE

BUNDLE = str(SHIPPED_BUNDLE)
ROOT = Path(__file__).resolve().parent.parent


def invoke(*args, input=None):
    result = CliRunner().invoke(main, list(args), input=input)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_HOME", str(tmp_path / "specdeploy-home"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def _one_prompt(tmp_path):
    (tmp_path / "one.json").write_text('["def f(x):"]')
    return str(tmp_path / "one.json")


def test_bench_prompts_accepts_a_one_line_jsonl_file(tmp_path):
    """--prompts: 'JSONL with a prompt field'; a JSONL file of one line is one JSON object, refused as not a list."""
    (tmp_path / "one.jsonl").write_text('{"prompt": "def f(x):"}\n')
    code, stdout, stderr = invoke("bench", BUNDLE, "--prompts", str(tmp_path / "one.jsonl"), "--max-new-tokens", "2",
                                  "-k", "2", "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["prompts"] == 1


def test_bench_takes_the_largest_seed_it_accepts(tmp_path):
    """--seed accepts 0 .. 2**64 - 1, but bench adds the prompt's index to it without wrapping (chat wraps)."""
    (tmp_path / "two.json").write_text('["def f(x):", "class A:"]')
    code, stdout, stderr = invoke("bench", BUNDLE, "--prompts", str(tmp_path / "two.json"), "--max-new-tokens", "2",
                                  "-k", "2", "--json", "--seed", str(2**64 - 1))
    assert code == 0, stderr


def test_bench_plot_format_is_checked_before_the_benchmark(tmp_path, monkeypatch):
    """An unsupported --plot extension must be refused before the bundle loads (as a missing folder is),
    not after the whole benchmark with matplotlib's ValueError (the --json report is lost too)."""
    import specdeploy.runtime as runtime

    monkeypatch.setattr(runtime, "load", lambda *a, **k: pytest.fail("the bundle loaded before --plot was checked"))
    code, stdout, stderr = invoke("bench", BUNDLE, "--prompts", _one_prompt(tmp_path), "--max-new-tokens", "2",
                                  "-k", "2", "--plot", str(tmp_path / "k.xyz"))
    assert code == 2 and stderr.startswith("error: ") and "--plot" in stderr, stderr


def test_bench_plot_is_written_where_it_says(tmp_path):
    """--plot without an extension: matplotlib writes k.png, but the line says it saved to k."""
    plot = tmp_path / "k"
    code, stdout, stderr = invoke("bench", BUNDLE, "--prompts", _one_prompt(tmp_path), "--max-new-tokens", "2",
                                  "-k", "2", "--json", "--plot", str(plot))
    assert code == 0, stderr
    said = [line.removeprefix("plot: ") for line in stderr.splitlines() if line.startswith("plot: ")]
    assert said and Path(said[0]).is_file(), (said, sorted(os.listdir(tmp_path)))


def test_bench_plot_expands_the_tilde_it_checked(tmp_path, home, monkeypatch):
    """check_output_file and the 'plot:' line expand ~, but savefig gets the path unexpanded: after the
    benchmark it fails (FileNotFoundError './~/k.png'), or writes into a folder literally named '~'."""
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = invoke("bench", BUNDLE, "--prompts", _one_prompt(tmp_path), "--max-new-tokens", "2",
                                  "-k", "2", "--json", "--plot", "~/k.png")
    assert code == 0, stderr
    assert (home / "k.png").is_file()


def test_export_prints_the_folder_it_wrote(tmp_path, home, monkeypatch):
    """export_bundle writes to --out expanded (~), but the command prints Path(out).resolve(): ./~/b."""
    import specdeploy.cli as cli
    import specdeploy.export

    written = []

    def fake_export(config, report=None):  # what export_bundle does with --out (export.config.check_options)
        folder = Path(config.out).expanduser().resolve()
        folder.mkdir()
        written.append(folder)
        return SimpleNamespace(models=[])  # a manifest with no parity figures to print

    monkeypatch.setattr(specdeploy.export, "export_bundle", fake_export)
    monkeypatch.setattr(cli, "require_export_extra", lambda why: None)
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = invoke("export", "--out", "~/b")
    assert code == 0, stderr
    assert written == [home / "b"]
    assert stdout.strip() == str(home / "b")


def _chat_process(data: bytes, **env):
    return subprocess.run([sys.executable, "-m", "specdeploy", "chat", BUNDLE, "--max-new-tokens", "2"], input=data,
                          capture_output=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_chat_reads_crlf_lines():
    """Piped messages with Windows line ends: '/exit\\r' is not /exit, so the line after it is answered
    (and every message is sent with a stray carriage return)."""
    result = _chat_process(b"/exit\r\nhello\r\n")
    assert result.returncode == 0, result.stderr
    assert "unknown command" not in result.stderr.decode(), result.stderr
    assert result.stdout == b""  # /exit: nothing answered


def test_chat_invalid_utf8_on_stdin_is_one_message_error_and_the_session_goes_on():
    """stdin is read as text: in a UTF-8 locale with strict errors (the usual desktop one; here
    PYTHONIOENCODING=utf-8) a bad byte raises UnicodeDecodeError out of the loop and ends the whole
    session as an unexpected error, instead of refusing that message (run --chat - says 'not valid UTF-8: byte 0xe9
    at offset 3') and answering the next."""
    result = _chat_process(b"caf\xe9\nhi\n", PYTHONIOENCODING="utf-8")
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert "not valid UTF-8" in stderr and "UnicodeDecodeError" not in stderr, stderr
    assert result.stdout.strip(), "the second message was not answered"
