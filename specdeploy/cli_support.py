"""What the CLI does around its commands: one `error: ...` line per failure, output and stats.

Every failure of every command ends as one line on stderr and exit code 2 (130 for Ctrl-C):
SpecdeployError's message, click's usage errors, and anything unexpected as its type and first
line; `--debug`, before or after the subcommand, re-raises instead, with the traceback. What a
command reads from its user is cli_input.py's.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Callable

import click

from .errors import EXIT_ERROR, EXIT_INTERRUPTED, SpecdeployError, describe_unexpected, install_hint
from .runtime.chat import NO_TEMPLATE
from .runtime.config import MAX_DRAFT_TOKENS

DEBUG_HELP = "Show the Python traceback of an error instead of one line (also after the subcommand)."
# The modules of the export extra that exporting imports first (optimum-onnx installs `optimum`).
EXPORT_MODULES = ("torch", "transformers", "optimum", "onnx")
SIGTERM_AS_INTERRUPT = frozenset({"export"})  # a terminated export deletes its partial folder as on Ctrl-C
RETURN_FREED_MEMORY = frozenset({"export", "distill", "run", "chat", "bench", "serve"})  # see return_freed_memory
LOG_TO_STDERR = frozenset({"serve"})  # the commands whose log records are their output (see _log_to_stderr)


def fail(message: str, code: int = EXIT_ERROR):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def combine_options(*options):
    """One decorator applying options that several commands share, so that each is declared once."""
    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command
    return apply


def note_debug(ctx: click.Context, param, value: bool) -> None:
    """The --debug option's callback: the group re-raises errors of this invocation."""
    if value:
        ctx.find_root().command.debug_requested = True


def command_line_process(command: str) -> Callable[[], None]:
    """The process-wide settings of a command-line process about to run `command`, made here and
    nowhere else; returns what undoes those that can be undone (the console entry's main calls both).

    A program that imports specdeploy keeps its own environment, signal handlers and allocator:
    neither `specdeploy.load` nor `create_app` changes any of them.
    - HF_HUB_OFFLINE=1 unless set: an export reads local checkpoints only, and Hugging Face's
      libraries read the variable when they are imported;
    - SIGTERM raises KeyboardInterrupt in an export (SIGTERM_AS_INTERRUPT), so that it cleans up;
    - glibc returns freed large blocks to the system in the commands that decode (RETURN_FREED_MEMORY);
    - the server's log lines and uvicorn's go to stderr (LOG_TO_STDERR)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    undo = []
    if command in SIGTERM_AS_INTERRUPT and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupt)
        undo.append(lambda: signal.signal(signal.SIGTERM, previous))
    if command in RETURN_FREED_MEMORY:
        return_freed_memory()
    if command in LOG_TO_STDERR:
        undo.append(_log_to_stderr())
    return lambda: [step() for step in undo]


def _log_to_stderr() -> Callable[[], None]:
    """Log records as plain lines on stderr: one handler on the root logger, which specdeploy's loggers and
    uvicorn's (access log included) propagate to, and specdeploy's at INFO (uvicorn sets its own levels).
    Returns what removes them again."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root, ours = logging.getLogger(), logging.getLogger("specdeploy")
    level = ours.level
    root.addHandler(handler)
    ours.setLevel(logging.INFO)

    def undo() -> None:
        root.removeHandler(handler)
        ours.setLevel(level)
    return undo


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


class _ClosedPipe(Exception):
    """A BrokenPipeError on its way past click's main, which would exit 1 for it."""


class ErrorMappingGroup(click.Group):
    """A click group whose every failure is one line (see the module docstring), and whose main is
    the one place that sets up the process (command_line_process).

    Every command it holds takes --debug too, parsed as its own option (so `--prompt --debug` is
    still a prompt), and the group's callback only records it."""

    debug_requested = False
    _undo_setup: Callable[[], None] | None = None

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        if not any(param.name == "debug" for param in cmd.params):
            cmd.params.append(click.Option(["--debug"], is_flag=True, expose_value=False, is_eager=True,
                                           callback=note_debug, help=DEBUG_HELP))
        super().add_command(cmd, name)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None and self._undo_setup is None:
            self._undo_setup = command_line_process(command.name)
        return name, command, rest

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # raised here, before click's main turns it into exit 1 (see main's handler)
            raise _ClosedPipe() from None

    def main(self, args=None, prog_name=None, **kwargs):
        args = list(sys.argv[1:] if args is None else args)
        self.debug_requested = False
        try:
            return self._main(args, prog_name, **kwargs)
        finally:
            undo, self._undo_setup = self._undo_setup, None
            if undo is not None:
                undo()

    def _main(self, args, prog_name, **kwargs):
        try:
            return super().main(args, prog_name, standalone_mode=False, **kwargs)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.exceptions.NoArgsIsHelpError as exc:  # a bare `specdeploy`: the help, not an error
            click.echo(exc.ctx.get_help())
            sys.exit(0)
        except click.Abort:
            fail("interrupted", EXIT_INTERRUPTED)
        except click.exceptions.NoSuchOption as exc:
            fail(self._no_such_option(exc), EXIT_ERROR)
        except click.ClickException as exc:
            fail(exc.format_message().replace("\n", " "), EXIT_ERROR)
        except SpecdeployError as exc:
            if self.debug_requested:
                raise
            fail(str(exc).replace("\n", " "))
        except KeyboardInterrupt:
            if self.debug_requested:
                raise
            fail("interrupted", EXIT_INTERRUPTED)
        except (BrokenPipeError, _ClosedPipe):  # stdout closed early (| head): not an error of ours
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_ERROR)
        except Exception as exc:  # noqa: BLE001 - the one place every other failure becomes one line
            if self.debug_requested:
                raise
            fail(f"{describe_unexpected(exc)} (run with --debug for the traceback)")

    def _no_such_option(self, exc: click.exceptions.NoSuchOption) -> str:
        """click's message (with its guess at a misspelling), or, where other commands take the option, which."""
        name = exc.ctx.info_name if exc.ctx is not None and exc.ctx.command is not self else None
        others = sorted(other for other, command in self.commands.items() if other != name
                        and any(exc.option_name in param.opts + param.secondary_opts for param in command.params))
        if name and others:
            return f"{name} takes no {exc.option_name} (an option of {', '.join(others)})"
        return exc.format_message().replace("\n", " ")


def check_output_file(path: str, option: str) -> None:
    """Fail before the work, not after it, when a file cannot be written where it is asked for."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise SpecdeployError(f"{option} {path} is a folder; give a file name")
    if not file.parent.is_dir():
        raise SpecdeployError(f"{option} {path}: the folder {file.parent} does not exist")
    if not os.access(file.parent, os.W_OK):
        raise SpecdeployError(f"{option} {path}: the folder {file.parent} is not writable")


def require_export_extra(why: str) -> None:
    """Fail, naming the extra to install, when exporting's packages are not installed (a runtime-only install)."""
    import importlib.util

    missing = [name for name in EXPORT_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise SpecdeployError(f"{why} needs the export extra, which is not installed (no {', '.join(missing)}): "
                              f"{install_hint('export')}")


def end_text(text: str) -> None:
    """Finish generated text on stdout: a terminal gets a newline after text that lacks one (so the
    stats line and the shell prompt start on their own line); a pipe or a file gets the text as it is."""
    if text and not text.endswith("\n") and sys.stdout.isatty():
        click.echo()


def stream_text(pieces, shown: list[str]) -> None:
    """Print pieces as they come, appending each to `shown`; Ctrl-C between pieces closes the stream (so
    it records what came out). Nothing is written before the first piece (a refused request prints none)."""
    try:
        for piece in pieces:
            shown.append(piece)  # first: Ctrl-C lands most often just after a piece appears
            click.echo(piece, nl=False)
            sys.stdout.flush()
    except KeyboardInterrupt:
        pieces.close()
        raise


EXACT_HELP = ("Every target pass computes a token as a multi-token pass does: greedy text the same with and without "
              "speculation at any k and batch, a seed's sample the same whatever the batch. Slower (a quantized "
              "target's target-only steps by about a quarter).")


def format_stats(stats) -> str:
    """The one stats line of a generation (stderr): speed, acceptance, where the time went, why it ended."""
    line = (f"{stats.new_tokens} tokens in {stats.decode_ms:.0f} ms ({stats.tokens_per_s:.1f} tok/s, prefill "
            f"{stats.prefill_ms:.0f} ms)")
    if stats.drafted:
        line += (f", acceptance {stats.acceptance_rate:.2f}, {stats.mean_accepted_tokens:.2f} tokens/round over "
                 f"{stats.rounds} rounds, by position {stats.accepted_by_position}")
    if stats.forced_tokens:
        line += f", {stats.forced_tokens} forced by the constraint"
    exact = ", exact" if stats.exact else ""
    return line + (f"; draft {stats.draft_ms:.0f} ms, target {stats.target_ms:.0f} ms, other {stats.other_ms:.0f} ms "
                   f"[{stats.finish_reason}{exact}]")


def return_freed_memory() -> None:
    """Have glibc give large freed blocks back to the system instead of keeping them in the heap.

    glibc raises its mmap threshold each time a large block is freed, so after the prefill's
    logits and activations are freed their memory stays resident. A fixed 128 KiB threshold
    (M_MMAP_THRESHOLD) keeps blocks that large in their own mappings, returned on free: measured
    -8 MB peak RSS for a run at the full 2,048-token context. The CLI owns its process; the
    library leaves the allocator alone."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)
    except (OSError, AttributeError):  # not glibc
        pass


def checked_generation(**options):
    """GenerationConfig(**options), validated before any bundle loads; an error names the flag
    (--max-new-tokens), not the field."""
    from .runtime.config import GenerationConfig

    config = GenerationConfig(**options)
    try:
        config.validate()
    except SpecdeployError as exc:
        field, _, rest = str(exc).partition(" ")
        if field not in options:
            raise
        raise SpecdeployError(f"--{field.replace('_', '-')} {rest}") from None
    return config


def require_chat_template(generator, bundle, instead: str) -> None:
    """Fail where a command renders messages and the bundle's tokenizer has no chat template; `instead`: what to pass."""
    if generator.chat_template is None:
        raise SpecdeployError(f"{bundle} has no chat template ({NO_TEMPLATE}): {instead}")


def parse_draft_tokens(value: str) -> tuple[int, ...] | None:
    if value == "auto":
        return None
    try:
        ks = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise SpecdeployError(f"--num-draft-tokens '{value}': expected K, a list like 2,4,8, or auto") from None
    if not all(1 <= k <= MAX_DRAFT_TOKENS for k in ks):
        raise SpecdeployError(f"--num-draft-tokens: each k must be in 1..{MAX_DRAFT_TOKENS}")
    return tuple(dict.fromkeys(ks))  # -k 4,4 benches k = 4 once


def parse_prompt_tokens(value: str | None, max_new_tokens: int, max_context: int) -> tuple[int | None, ...]:
    if value is None:
        return (None,)
    try:
        lengths = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise SpecdeployError(f"--prompt-tokens '{value}': expected N or a list like 128,1920") from None
    for length in lengths:
        if length < 1:
            raise SpecdeployError("--prompt-tokens: each length must be at least 1")
        if length + max_new_tokens > max_context:
            raise SpecdeployError(f"--prompt-tokens {length} + --max-new-tokens {max_new_tokens} exceed the bundle's "
                                  f"max context {max_context}")
    return lengths


def export_with_progress(target: str, draft: str | None, out: str, **options) -> None:
    """Run the export stage with a progress display and the parity figures at the end (stderr)."""
    from rich.console import Console

    try:
        from .export import ExportConfig, export_bundle
    except ImportError as exc:
        raise SpecdeployError(f"exporting needs the export extra ({install_hint('export')}): {exc}") from None

    config = ExportConfig(target=target, draft=draft, out=out, **options)
    console = Console(stderr=True, log_path=False)
    with console.status("export", spinner="dots") as status:
        def report(stage: str, detail: str) -> None:
            status.update(f"[bold]{stage}[/bold] {detail}")
            console.log(f"[bold]{stage:<8}[/bold] {detail}")

        manifest = export_bundle(config, report)
    for spec in manifest.models:
        p = spec.parity
        console.print(
            f"{spec.role:<6} ({spec.graph} graph) parity: prefill max|diff| {p.prefill_max_abs_diff:.2e}, verify max|diff| "
            f"{p.verify_max_abs_diff:.2e}, greedy agreement {p.prefill_greedy_agreement:.2f}/{p.verify_greedy_agreement:.2f} "
            f"({p.check} tolerance {p.tolerance:g}: {'pass' if p.passed else 'below, kept (--allow-lossy)'})"
        )
