"""Chat templates: the tokenizer config's Jinja template, rendered as Hugging Face's `apply_chat_template` does.

The template comes from the bundle's tokenizer folder: `chat_template.jinja` when present (the file
newer checkpoints save), else `tokenizer_config.json`'s `chat_template` (a string, or a list of
named templates of which "default" is used). It is rendered in a sandbox with `messages`,
`add_generation_prompt=True`, the special tokens (`bos_token`, `eos_token`, ...) and
`raise_exception`; the result is tokenized without adding special tokens, since the template
writes them itself.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from ..errors import SpecdeployError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplate:
    """A compiled chat template and the special tokens it may name."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(format):
            return datetime.datetime.now().strftime(format)

        # The environment transformers uses: blocks trimmed, loop controls, a sandbox (templates ship with models).
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = strftime_now
        try:
            self.template = environment.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise SpecdeployError(f"the tokenizer's chat template does not compile: {exc}") from None
        self.special_tokens = special_tokens

    def render(self, messages: list[dict]) -> str:
        """The prompt text for `messages`, ending where the assistant's reply begins."""
        import jinja2

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, tools=None, documents=None,
                                        **self.special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise SpecdeployError(f"the chat template refused these messages: {exc}") from None


def load_chat_template(tokenizer_dir: Path) -> ChatTemplate | None:
    """The bundle tokenizer's chat template, or None when it has none."""
    config_path = tokenizer_dir / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise SpecdeployError(f"cannot read {config_path}: {exc}") from None
    jinja_path = tokenizer_dir / "chat_template.jinja"
    source = jinja_path.read_text() if jinja_path.is_file() else config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source.strip():
        return None
    special_tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # an AddedToken written out: {"content": "<s>", ...}
            value = value.get("content")
        if isinstance(value, str):
            special_tokens[key] = value
    return ChatTemplate(source, special_tokens)
