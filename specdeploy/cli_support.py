"""What the CLI does around its commands: one `error: ...` line per failure, strict text input.

Every failure of every command ends as one line on stderr and exit code 2 (130 for Ctrl-C):
SpecdeployError's message, click's usage errors, and anything unexpected as its type and first
line; `specdeploy --debug ...` re-raises instead, with the traceback. Text from the command line,
standard input and prompt files must be UTF-8: invalid bytes are refused with their offset, never
replaced, so what is generated from is exactly what was given.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from .errors import SpecdeployError, describe_unexpected

EXIT_ERROR, EXIT_INTERRUPTED = 2, 130


def fail(message: str, code: int = EXIT_ERROR):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


class ErrorMappingGroup(click.Group):
    """A click group whose every failure is one line (see the module docstring)."""

    def main(self, args=None, prog_name=None, **kwargs):
        args = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in args[: args.index("--") if "--" in args else len(args)]
        try:
            return super().main(args, prog_name, standalone_mode=False, **kwargs)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.exceptions.NoArgsIsHelpError as exc:  # a bare `specdeploy`: the help, not an error
            click.echo(exc.ctx.get_help())
            sys.exit(0)
        except click.Abort:
            fail("interrupted", EXIT_INTERRUPTED)
        except click.ClickException as exc:
            fail(exc.format_message().replace("\n", " "), EXIT_ERROR)
        except SpecdeployError as exc:
            if debug:
                raise
            fail(str(exc).replace("\n", " "))
        except KeyboardInterrupt:
            if debug:
                raise
            fail("interrupted", EXIT_INTERRUPTED)
        except BrokenPipeError:  # stdout closed early (| head): not an error of ours
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_ERROR)
        except Exception as exc:  # noqa: BLE001 - the one place every other failure becomes one line
            if debug:
                raise
            fail(f"{describe_unexpected(exc)} (run with --debug for the traceback)")


def strict_utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecdeployError(f"{where} is not valid UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start}") from None


class Utf8Text(click.ParamType):
    """A text option whose value must be valid UTF-8 (Python keeps argv's invalid bytes as surrogates)."""

    name = "text"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and any("\udc80" <= ch <= "\udcff" for ch in value):
            try:
                strict_utf8(os.fsencode(value), "the text")
            except SpecdeployError as exc:
                self.fail(str(exc), param, ctx)
        if isinstance(value, str) and any("\ud800" <= ch <= "\udfff" for ch in value):
            self.fail("contains a lone surrogate code point", param, ctx)
        return value


def read_stdin_text() -> str:
    return strict_utf8(sys.stdin.buffer.read(), "standard input")


def read_prompts_file(path: str) -> list[str]:
    """A --prompts file: it must exist, be UTF-8, and hold a JSON list of strings or JSONL with 'prompt'."""
    from .bench import read_prompts

    file = Path(path)
    if not file.is_file():
        raise SpecdeployError(f"--prompts {path}: no such file" if not file.exists() else f"--prompts {path}: not a file")
    try:
        strict_utf8(file.read_bytes(), f"--prompts {path}")
    except OSError as exc:
        raise SpecdeployError(f"--prompts {path}: cannot read it ({exc.strerror})") from None
    try:
        return read_prompts(file)
    except RecursionError:
        raise SpecdeployError(f"--prompts {path}: nested too deeply to be a list of prompts") from None


def check_output_file(path: str, option: str) -> None:
    """Fail before the work, not after it, when a file cannot be written where it is asked for."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise SpecdeployError(f"{option} {path} is a folder; give a file name")
    if not file.parent.is_dir():
        raise SpecdeployError(f"{option} {path}: the folder {file.parent} does not exist")
    if not os.access(file.parent, os.W_OK):
        raise SpecdeployError(f"{option} {path}: the folder {file.parent} is not writable")

