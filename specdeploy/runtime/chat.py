"""Chat templates: the tokenizer config's Jinja template, rendered as Hugging Face's `apply_chat_template` does.

The template comes from the bundle's tokenizer folder: `chat_template.jinja` when present (the file
newer checkpoints save), else `tokenizer_config.json`'s `chat_template` (a string, or a list of
named templates of which "default" is used). It is rendered in transformers' environment (a
sandbox with trim_blocks, lstrip_blocks, loop controls, its `tojson`, `raise_exception` and
`strftime_now`) with `messages`, `add_generation_prompt=True`, `tools=None`, `documents=None` and
the special tokens (`bos_token`, `eos_token`, ...). The text is tokenized without adding special
tokens, since the template writes them itself.

A reply ends at the template's end of turn: the first special token the template writes after an
assistant message's content (`<|im_end|>` for ChatML, `<end_of_turn>` for Gemma, `<|eot_id|>` for
Llama 3), or where it writes none, its first added token that is not blank (a turn marker added
without the special flag), found by rendering a probe conversation once.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from ..errors import SpecdeployError
from .text import check_unicode

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ROLES = ("system", "user", "assistant", "tool")
NO_TEMPLATE = "no chat_template.jinja, and tokenizer_config.json names none"  # why a tokenizer has no template
_PROBE = "Xq7SpecdeployReplyZ"  # an assistant reply no template rewrites (no spaces to trim, no markup)


class ChatTemplate:
    """A chat template's source, compiled on first use, and the special tokens it may name."""

    def __init__(self, source: str, special_tokens: dict):
        self.source = source
        self.special_tokens = special_tokens
        self._template = None

    @property
    def template(self):
        if self._template is None:
            self._template = _compile(self.source)
        return self._template

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, ending where the assistant's reply begins."""
        import jinja2

        template = self.template
        try:
            return template.render(**self.special_tokens, messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt)
        except jinja2.exceptions.TemplateError as exc:
            raise SpecdeployError(f"the chat template refused these messages: {exc}") from None
        except Exception as exc:  # a template bug Jinja raises as Python's own error (str + int, say)
            raise SpecdeployError(f"the chat template failed on these messages: {type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''}") from None

    def end_of_turn_text(self) -> str:
        """What the template writes after an assistant message's content ("" when the probe fails)."""
        for messages in ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}],
                         [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": _PROBE}]):
            try:
                text = self.render(messages, add_generation_prompt=False)
            except SpecdeployError:
                continue
            if _PROBE in text:
                return text[text.rindex(_PROBE) + len(_PROBE):]
        return ""


def _compile(source: str):
    """The template in the environment transformers' `_compile_jinja_template` builds."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it to mark reply tokens)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationTag, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        return environment.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise SpecdeployError(f"the tokenizer's chat template does not compile: {exc}") from None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise SpecdeployError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value  # an AddedToken written out: {"content": ...}


def load_chat_template(tokenizer_dir: Path) -> ChatTemplate | None:
    """The bundle tokenizer's chat template, or None when it has none."""
    tokenizer_dir = Path(tokenizer_dir)
    config = _read_json(tokenizer_dir / "tokenizer_config.json")
    jinja_path = tokenizer_dir / "chat_template.jinja"
    try:
        source = jinja_path.read_text(encoding="utf-8") if jinja_path.is_file() else config.get("chat_template")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecdeployError(f"cannot read {jinja_path}: {exc}") from None
    if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source.strip():
        return None
    # transformers' special_tokens_map: the config's tokens, special_tokens_map.json's where the config has none
    token_map = _read_json(tokenizer_dir / "special_tokens_map.json")
    special_tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = _token_text(config.get(key)) or _token_text(token_map.get(key))
        if isinstance(value, str) and value:
            special_tokens[key] = value
    extra = config.get("additional_special_tokens") or token_map.get("additional_special_tokens")
    if isinstance(extra, list) and extra:
        special_tokens["additional_special_tokens"] = [_token_text(token) for token in extra]
    named = config.get("extra_special_tokens")  # a model's own names (Gemma 3's image_token, boi_token, ...)
    for key, token in (named.items() if isinstance(named, dict) else ()):
        value = _token_text(token)
        if isinstance(key, str) and key.isidentifier() and isinstance(value, str) and value:
            special_tokens.setdefault(key, value)
    return ChatTemplate(source, special_tokens)


def check_messages(messages) -> list[dict]:
    """A list of {"role", "content"} objects, each role one of ROLES and each content a string."""
    if not isinstance(messages, list) or not messages:
        raise SpecdeployError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise SpecdeployError(f"messages[{index}] must be an object with a string \"role\"")
        if message["role"] not in ROLES:
            raise SpecdeployError(f"messages[{index}]: unknown role '{message['role']}' (choose from {', '.join(ROLES)})")
        if not isinstance(message.get("content"), str):
            raise SpecdeployError(f"messages[{index}] ({message['role']}) needs a string \"content\"")
        check_unicode(message["content"], f"messages[{index}] ({message['role']}) content")
    return messages
