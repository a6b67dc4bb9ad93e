"""`specdeploy chat`: an interactive conversation on the bundle's chat template, streamed as it decodes.

Each line read is a user message (a line ending in a backslash continues on the next); the reply
streams to stdout as its tokens are accepted, followed by a newline when it does not end in one.
The conversation (the system message and every turn since) is sent whole each time, rendered by
the tokenizer's chat template, and the generator reuses the KV cache of the prefix it shares
with the previous turn. When the conversation and a reply would not fit the context, the oldest
turns are dropped (the system message is kept) and a note says so on stderr.

Commands: /reset (forget the turns, keep the system message), /system TEXT (set it; /system alone
clears it), /exit (as does end of input, Ctrl-D). Ctrl-C stops the answer being written (what was
shown stays in the history) and the session goes on. Notes, stats and errors go to stderr; an
error about one message leaves the session running.
"""

from __future__ import annotations

import re
import sys
from dataclasses import asdict, dataclass, replace
from typing import Callable

import click

from .cli_input import strict_utf8
from .cli_support import format_stats, stream_text
from .errors import SpecdeployError
from .runtime.generate import SEED_LIMIT, GenerationConfig

COMMANDS = "/reset, /system TEXT, /exit"
PROMPT = "> "


@dataclass(frozen=True)
class ChatConfig:
    generation: GenerationConfig  # every reply's settings; reply i samples with seed + i
    system: str | None = None  # the first system message
    stats: bool = False  # a stats line (stderr) after each reply


class Conversation:
    """A system message and the (user, assistant) turns since, kept within the generator's context."""

    def __init__(self, system: str | None = None, turns: list[tuple[str, str]] | None = None):
        self.system = system
        self.turns: list[tuple[str, str]] = list(turns or [])
        self.replies = 0  # replies since the chat started (/reset keeps counting): reply i samples with seed + i

    def messages(self, user: str) -> list[dict]:
        messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        for question, answer in self.turns:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return messages + [{"role": "user", "content": user}]

    def fit(self, user: str, encode: Callable[[list[dict]], list[int]], max_context: int,
            reply_tokens: int) -> tuple[list[dict], int]:
        """The messages for `user`'s message and how many of the oldest turns were dropped so that they and
        a reply of reply_tokens (at most half the context) fit max_context tokens."""
        reserve = min(reply_tokens, max_context // 2)
        turns = list(self.turns)  # the history changes only once the message fits
        while True:
            messages = Conversation(self.system, turns).messages(user)
            length = len(encode(messages))
            if length + reserve <= max_context or not turns:
                break
            turns.pop(0)
        if length >= max_context:
            raise SpecdeployError(f"this message is {length} tokens with the system message and the template; the "
                                  f"context holds {max_context} (shorten it, or /system to shorten that)")
        dropped, self.turns = len(self.turns) - len(turns), turns
        return messages, dropped


def read_lines(stream=None, interactive: bool = False) -> Callable[[], str | None]:
    """A function that returns the next message (None at end of input); a trailing backslash continues a line."""
    def read_one() -> str | None:
        if interactive:
            prompt = PROMPT if not parts else "  "
            try:
                if sys.stdout.isatty():
                    return input(prompt)
                sys.stderr.write(prompt)  # input() would write it into the redirected replies
                sys.stderr.flush()
                return input()
            except EOFError:  # Ctrl-D: the shell's prompt goes on a line of its own, not after "> "
                (sys.stdout if sys.stdout.isatty() else sys.stderr).write("\n")
                return None
            except UnicodeDecodeError as exc:  # the terminal's strict encoding: that message fails, not the session
                raise SpecdeployError(f"this message is not valid {exc.encoding} (the terminal's encoding): byte "
                                      f"0x{exc.object[exc.start]:02x} at offset {exc.start}") from None
        source = stream or getattr(sys.stdin, "buffer", sys.stdin)  # bytes: a bad one fails its message alone
        line = source.readline()
        if isinstance(line, bytes):
            line = strict_utf8(line, "this message") if line else ""
        for end in ("\r\n", "\n"):  # Windows line ends too: "/exit\r" is /exit
            if line.endswith(end):
                return line[: -len(end)]
        return line or None

    parts: list[str] = []

    def read() -> str | None:
        parts.clear()
        while True:
            line = read_one()
            if line is None:
                return "\n".join(parts) if parts else None
            if line.endswith("\\"):
                parts.append(line[:-1])
                continue
            parts.append(line)
            return "\n".join(parts)

    return read


def run_chat(generator, config: ChatConfig, read: Callable[[], str | None]) -> None:
    """The loop: read a message or a command, answer it, until /exit or the end of input."""
    conversation = Conversation(config.system)
    while True:
        try:
            line = read()
        except KeyboardInterrupt:  # at the prompt: a fresh prompt, as Python's REPL does
            click.echo("\n(Ctrl-D or /exit quits; /reset starts the conversation over; /system TEXT sets its system message)",
                       err=True)
            continue
        except SpecdeployError as exc:  # a message that is not UTF-8: the session goes on
            click.echo(f"error: {exc}", err=True)
            continue
        if line is None:
            return
        if not line.strip():
            continue
        if line.startswith("/") and not line.startswith("//"):
            if not _command(line, conversation):
                return
            continue
        user = line[1:] if line.startswith("//") else line  # "//text" sends "/text"
        try:
            _answer(generator, config, conversation, user)
        except SpecdeployError as exc:  # about this message: the session goes on
            click.echo(f"error: {str(exc).replace(chr(10), ' ')}", err=True)
        except KeyboardInterrupt:  # outside the reply's stream (the history's fitting, a stats line): the session goes on
            click.echo("\n(interrupted)", err=True)


def _command(line: str, conversation: Conversation) -> bool:
    """Apply a /command; False ends the session."""
    name, *rest = re.split(r"[ \n]", line, maxsplit=1)  # "/system\" continues onto its argument
    argument = rest[0] if rest else ""
    if name in ("/exit", "/quit"):
        return False
    if name == "/reset":
        conversation.turns.clear()
        click.echo("(conversation cleared" + ("; system message kept)" if conversation.system is not None else ")"),
                   err=True)
    elif name == "/system":
        conversation.system = argument.strip() or None
        click.echo("(system message set)" if conversation.system else "(system message cleared)", err=True)
    else:
        click.echo(f"unknown command {name} (commands: {COMMANDS}; start a message with // to send a leading /)",
                   err=True)
    return True


def _answer(generator, config: ChatConfig, conversation: Conversation, user: str) -> None:
    """Answer one message. The reply joins the history, and counts for the next reply's seed, as soon as
    it is decided (before anything else is written), so a Ctrl-C after it cannot lose it."""
    generation = config.generation
    messages, dropped = conversation.fit(user, generator.encode_chat, generator.max_context, generation.max_new_tokens)
    if dropped:
        click.echo(f"note: dropped the oldest {dropped} turn{'s' if dropped > 1 else ''} to fit the "
                   f"{generator.max_context}-token context", err=True)
    if generation.seed is not None:
        generation = replace(generation, seed=(generation.seed + conversation.replies) % SEED_LIMIT)
    shown: list[str] = []
    interrupted = False
    pieces = generator.stream(messages=messages, **asdict(generation))
    try:
        stream_text(pieces, shown)
    except KeyboardInterrupt:
        interrupted = True
    reply = "".join(shown)  # what was shown is what the history keeps, an interrupted answer too
    if reply or not interrupted:
        conversation.turns.append((user, reply))
        conversation.replies += 1
    if reply and not reply.endswith("\n"):
        click.echo()
    if interrupted:
        click.echo("(interrupted)", err=True)
    output = pieces.output
    if output is not None and config.stats:
        click.echo(format_stats(output.stats), err=True)
    if output is not None and output.stats.note:
        click.echo(f"note: {output.stats.note}", err=True)
