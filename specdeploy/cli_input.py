"""What a command reads from its user: text options and files held to UTF-8, standard input, prompt
and conversation files, each read up to MAX_INPUT_BYTES (an input without end, such as /dev/zero,
gets one error line, not the machine's memory).

Text from the command line, standard input and prompt files must be UTF-8: invalid bytes are refused
with their offset, never replaced, so what is generated from is exactly what was given."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from .errors import SpecdeployError


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
            try:  # argv's bytes under a non-UTF-8 locale: valid UTF-8 is taken as its text
                value = strict_utf8(os.fsencode(value), "the text")
            except SpecdeployError as exc:
                self.fail(str(exc), param, ctx)
        if isinstance(value, str) and any("\ud800" <= ch <= "\udfff" for ch in value):
            self.fail("contains a lone surrogate code point", param, ctx)
        return value


def read_capped(stream, where: str) -> bytes:
    """At most MAX_INPUT_BYTES of a binary stream; more is refused, naming the cap."""
    from .defaults import MAX_INPUT_BYTES

    data = stream.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        raise SpecdeployError(f"{where} is longer than {MAX_INPUT_BYTES >> 20} MiB, the most a command reads")
    return data


def read_stdin_text() -> str:
    return strict_utf8(read_capped(sys.stdin.buffer, "standard input"), "standard input")


def read_text_file(path: str, option: str) -> str:
    """A file's text, byte for byte (no newline translation, no BOM removed): it must exist and be UTF-8."""
    file = Path(path).expanduser()
    if not file.exists() or file.is_dir():  # a pipe (<(cmd), /dev/stdin) is read as a file
        raise SpecdeployError(f"{option} {path}: no such file" if not file.exists() else f"{option} {path}: not a file (a folder)")
    try:
        with file.open("rb") as stream:
            data = read_capped(stream, f"{option} {path}")
    except OSError as exc:
        raise SpecdeployError(f"{option} {path}: cannot read it ({exc.strerror})") from None
    return strict_utf8(data, f"{option} {path}")


def read_constraint(json_schema: str | None, regex: str | None, grammar: str | None) -> dict:
    """--json-schema FILE, --regex TEXT, --grammar FILE as GenerationConfig's constraint fields (only those given)."""
    fields = {"json_schema": read_text_file(json_schema, "--json-schema") if json_schema is not None else None,
              "regex": regex, "grammar": read_text_file(grammar, "--grammar") if grammar is not None else None}
    return {name: value for name, value in fields.items() if value is not None}


def bench_prompts(prompts_file: str | None, prompt_file: str | None) -> list[str]:
    """bench's prompts: --prompts' list, --prompt-file's one text, or the built-in code prompts."""
    from .bench import builtin_prompts

    if prompts_file and prompt_file:
        raise SpecdeployError("pass --prompts or --prompt-file, not both")
    if prompt_file:
        return [read_text_file(prompt_file, "--prompt-file")]
    return read_prompts_file(prompts_file) if prompts_file else builtin_prompts()


def read_prompts_file(path: str) -> list[str]:
    """A --prompts file: it must exist, be UTF-8, and hold a JSON list of strings or JSONL with 'prompt'."""
    from .bench import parse_prompts

    text = read_text_file(path, "--prompts")
    try:
        return parse_prompts(text, f"--prompts {path}")
    except RecursionError:
        raise SpecdeployError(f"--prompts {path}: nested too deeply to be a list of prompts") from None


def run_request(prompt, prompt_file, chat, system, messages_file) -> dict:
    """`run`'s input as generate's keyword: {"prompt": text} or {"messages": [...]}."""
    given = [name for name, value in (("--prompt", prompt), ("--prompt-file", prompt_file), ("--chat", chat),
                                      ("--messages", messages_file)) if value is not None]
    if len(given) != 1:
        raise SpecdeployError("pass one of --prompt, --chat or --messages"
                              + (f" (got {' and '.join(given)})" if given else " (or --prompt-file FILE)"))
    if prompt is not None or prompt_file is not None:
        if system is not None:
            raise SpecdeployError(f"--system goes with --chat or --messages ({given[0]} is sent as it is)")
        if prompt_file is not None:
            return {"prompt": read_text_file(prompt_file, "--prompt-file")}
        return {"prompt": read_stdin_text() if prompt == "-" else prompt}
    if chat is not None:
        messages = [{"role": "user", "content": read_stdin_text() if chat == "-" else chat}]
    else:
        messages = read_messages(messages_file)
    if system is not None:
        if messages[0]["role"] == "system":
            raise SpecdeployError(f"--system and the system message of {messages_file}: keep one")
        messages = [{"role": "system", "content": system}, *messages]
    return {"messages": messages}


def read_messages(path: str) -> list[dict]:
    """A --messages file: JSON holding a list of {"role", "content"} objects, checked by check_messages."""
    import json

    from .runtime.chat import check_messages

    try:
        with Path(path).open("rb") as stream:
            data = json.loads(read_capped(stream, f"--messages {path}").decode("utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecdeployError(f"cannot read --messages {path}: {exc}") from None
    except ValueError as exc:
        raise SpecdeployError(f"--messages {path} is not JSON: {exc}") from None
    except RecursionError:
        raise SpecdeployError(f"--messages {path}: the JSON nests too deeply") from None
    try:
        return check_messages(data)
    except SpecdeployError as exc:
        raise SpecdeployError(f"--messages {path}: {exc}") from None
