"""The commands as a user types them, on the shipped demo bundle: text arguments under an ASCII locale,
stdout closed early, a prompt file that is a pipe, chat's prompt with stdout redirected, and the docs
naming every option."""

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdeploy.cli import main
from specdeploy.cli_input import Utf8Text
from specdeploy.cli_support import EXIT_ERROR
from specdeploy.defaults import SHIPPED_BUNDLE

BUNDLE = str(SHIPPED_BUNDLE)
ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def specdeploy(*args, env=None, **kwargs):
    return subprocess.run([sys.executable, "-m", "specdeploy", *args], capture_output=True, env=env or ENV,
                          timeout=120, **kwargs)


def test_utf8_text_option_decodes_valid_utf8_bytes_kept_as_surrogates():
    """Under a non-UTF-8 filesystem encoding Python keeps argv's bytes as surrogates; valid UTF-8 must be
    taken as its text (Utf8Text checks that it is valid UTF-8, then discards the decoded text and refuses it)."""
    escaped = "h\udcc3\udca9llo"  # b"h\xc3\xa9llo" decoded as ASCII with surrogateescape
    assert Utf8Text().convert(escaped, None, None) == "h\u00e9llo"


def test_run_takes_a_utf8_prompt_argument_under_an_ascii_locale():
    """LC_ALL=C without Python's UTF-8 mode: `--prompt 'héllo → 世界'` must generate from that text (as
    --prompt-file and --prompt - do), not fail with 'contains a lone surrogate code point'."""
    prompt = "h\u00e9llo \u2192 \u4e16\u754c"
    args = ("run", BUNDLE, "--prompt", prompt, "--max-new-tokens", "2", "--json")
    utf8 = specdeploy(*args, env={**ENV, "PYTHONUTF8": "1"})
    ascii_locale = specdeploy(*args, env={**ENV, "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "LC_ALL": "C",
                                          "LANG": "C"})
    assert utf8.returncode == 0, utf8.stderr
    assert ascii_locale.returncode == 0, ascii_locale.stderr
    assert json.loads(ascii_locale.stdout)["token_ids"] == json.loads(utf8.stdout)["token_ids"]


def test_run_into_a_closed_pipe_exits_with_the_handlers_code_and_prints_nothing():
    """`specdeploy run ... | head -1`: ErrorMappingGroup's BrokenPipeError handler exits EXIT_ERROR (2, the
    documented code of every failure), but click's Command.main catches EPIPE first and exits 1, so the
    handler never runs."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte: every write to stdout fails with EPIPE
    try:
        result = subprocess.run([sys.executable, "-m", "specdeploy", "run", BUNDLE, "--prompt", "def fib(n):",
                                 "--max-new-tokens", "8"], stdout=write_end, stderr=subprocess.PIPE, env=ENV,
                                timeout=120)
    finally:
        os.close(write_end)
    assert b"Traceback" not in result.stderr and b"Exception ignored" not in result.stderr, result.stderr
    assert result.returncode == EXIT_ERROR, (result.returncode, result.stderr)


def test_run_reads_the_prompt_file_from_a_pipe():
    """`--prompt-file <(cmd)` or `--prompt-file /dev/stdin`: a pipe is a readable file (--messages reads one);
    it is refused as 'not a file'."""
    prompt = "def fib(n):\n"
    piped = specdeploy("run", BUNDLE, "--prompt-file", "/dev/stdin", "--max-new-tokens", "4", "--json",
                       input=prompt.encode())
    direct = specdeploy("run", BUNDLE, "--prompt", prompt, "--max-new-tokens", "4", "--json")
    assert direct.returncode == 0, direct.stderr
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["token_ids"] == json.loads(direct.stdout)["token_ids"]


def test_chat_on_a_terminal_with_stdout_redirected_keeps_its_prompt_off_stdout(tmp_path):
    """`specdeploy chat > replies.txt` typed at a terminal: stdout carries only the replies; the '> ' prompt
    (which input() writes to stdout when stdout is not a terminal) must not land in the file."""
    master, slave = pty.openpty()
    out = tmp_path / "replies.txt"
    with open(out, "wb") as stdout:
        process = subprocess.Popen([sys.executable, "-m", "specdeploy", "chat", BUNDLE, "--max-new-tokens", "3"],
                                   stdin=slave, stdout=stdout, stderr=subprocess.PIPE, env=ENV)
        os.close(slave)
        os.write(master, b"hello\n\x04")  # one message, then Ctrl-D at the start of a line
        try:
            _, stderr = process.communicate(timeout=120)
        finally:
            os.close(master)
    assert process.returncode == 0, stderr
    replies = out.read_bytes()
    reply = specdeploy("run", BUNDLE, "--chat", "hello", "--max-new-tokens", "3").stdout
    assert replies.rstrip(b"\n") == reply.rstrip(b"\n"), replies


@pytest.mark.parametrize("command", ["run", "chat", "inspect", "verify"])
def test_every_option_of_the_command_is_documented(command):
    """README.md or docs/ names every option of the commands a user types (`run --logprobs` and
    `run --stream` are in --help only)."""
    docs = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    missing = [option for param in main.commands[command].params
               for option in [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]
               if option.startswith("--") and option not in ("--help", "--debug")
               and not re.search(re.escape(option) + r"(?![\w-])", docs)]
    assert not missing, f"{command}: {missing} appear in no README.md or docs/*.md"


def test_every_option_has_a_description_and_fixed_choices_are_typed():
    """--help describes every option; an option with a fixed set of values lists them ([a|b|c]) and click
    refuses any other in one line."""
    import click

    from specdeploy.cli import main

    typed = {"--device", "--drafter", "--dtype", "--quantize", "--draft-quantize", "--graph", "--kind"}
    for name, command in main.commands.items():
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden:
                continue
            assert param.help, f"{name} {param.opts[0]} has no description"
            if param.opts[0] in typed:
                assert isinstance(param.type, click.Choice), f"{name} {param.opts[0]} lists its choices in prose"


def test_an_export_without_out_says_it_wrote_or_replaced_the_default_bundle(tmp_path, monkeypatch, agreeing_bundle):
    """Every command without a BUNDLE runs the default bundle: an export that writes it says so, and says when
    it replaced one."""
    import shutil

    from click.testing import CliRunner

    import specdeploy.export
    from specdeploy.bundle import load_manifest
    from specdeploy.cli import main

    def export_bundle(config, report=None):  # the bundle written at --out, without exporting one
        shutil.copytree(agreeing_bundle, config.out, dirs_exist_ok=True)
        return load_manifest(config.out)

    monkeypatch.setenv("SPECDEPLOY_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(specdeploy.export, "export_bundle", export_bundle)
    first = CliRunner().invoke(main, ["export"])
    again = CliRunner().invoke(main, ["export", "--force"])
    assert first.exit_code == again.exit_code == 0, first.output + again.output
    assert "wrote the default bundle" in first.stderr and "replaced the default bundle" in again.stderr
