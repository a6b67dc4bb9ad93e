"""The special tokens of one checkpoint, checked before export: every file that states them must agree.

A checkpoint states BOS, EOS, pad and whether BOS is prepended in several places: the tokenizer
(tokenizer.json's post-processor, tokenizer_config.json, special_tokens_map.json), config.json and
generation_config.json. The runtime reads only the bundle's tokenizer.json and manifest, so a
disagreement silently changes what a prompt encodes to or where generation stops. Here:

- A disagreement is repaired where the checkpoint's own metadata settles it: a GGUF's metadata
  (the authority for a converted GGUF), or config.json and generation_config.json agreeing against
  the tokenizer. Each repair is one line, reported and recorded in the manifest.
- Any other disagreement is refused with one line naming the fields and their values.
- Every end-of-turn token the chat template emits after an assistant message joins the stop set.
- Every tokenizer id must have a row in the model's head (more rows than tokens is padding).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import SpecdeployError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
FIELDS = ("bos", "eos", "pad")


@dataclass(frozen=True)
class Checked:
    checkpoint: Any  # checkpoint.Checkpoint, with the agreed ids
    tokenizer_dir: Path  # the folder to copy the tokenizer from (a repaired copy when anything was repaired)
    repairs: tuple[str, ...]  # one line per repair, naming the fields and values


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise SpecdeployError(f"{path}: not valid JSON") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    """A special-token entry: a string, an AddedToken dict ({"content": ...}), or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


class _Tokenizer:
    """tokenizer.json as JSON (to rewrite it) and as a tokenizers.Tokenizer (to look tokens up)."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self.json = _read_json(folder / "tokenizer.json")
        self.vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)
        self.by_id = {i: t for t, i in self.vocab.items()}
        self.special = [t["content"] for t in self.json.get("added_tokens", []) if t.get("special")]

    def show(self, token_id: int | None) -> str:
        return "none" if token_id is None else f"{self.by_id.get(token_id, '?')!r} ({token_id})"

    def prepended(self) -> list[str] | None:
        """The special tokens the post-processor puts before a single sequence (None: no template post-processor)."""
        processors = _template_processors(self.json.get("post_processor"))
        if not processors:
            return None
        tokens = []
        for piece in processors[0].get("single", []):
            if "Sequence" in piece:
                break
            tokens.append(piece["SpecialToken"]["id"])
        return tokens


def _template_processors(processor) -> list[dict]:
    if not isinstance(processor, dict):
        return []
    if processor.get("type") == "TemplateProcessing":
        return [processor]
    if processor.get("type") == "Sequence":
        return [p for p in processor.get("processors", []) if isinstance(p, dict) and p.get("type") == "TemplateProcessing"]
    return []


def _set_prepended_bos(tokenizer_json: dict, bos: str | None, bos_id: int | None) -> None:
    """Make the post-processor prepend bos (None: prepend nothing), leaving the rest of it as it was."""
    processors = _template_processors(tokenizer_json.get("post_processor"))
    if not processors:
        if bos is None:
            return
        template = {"type": "TemplateProcessing", "single": [], "pair": [], "special_tokens": {}}
        template["single"] = [{"Sequence": {"id": "A", "type_id": 0}}]
        template["pair"] = [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}]
        existing = tokenizer_json.get("post_processor")
        tokenizer_json["post_processor"] = (template if existing is None
                                            else {"type": "Sequence", "processors": [existing, template]})
        processors = [template]
    for template in processors:
        for key in ("single", "pair"):
            pieces, rebuilt, type_id = template.get(key, []), [], 0
            for index, piece in enumerate(pieces):
                # a special token directly before a sequence is that sequence's BOS
                starts = "SpecialToken" in piece and index + 1 < len(pieces) and "Sequence" in pieces[index + 1]
                if starts:
                    continue
                if "Sequence" in piece:
                    type_id = piece["Sequence"].get("type_id", 0)
                    if bos is not None:
                        rebuilt.append({"SpecialToken": {"id": bos, "type_id": type_id}})
                rebuilt.append(piece)
            template[key] = rebuilt
        used = {p["SpecialToken"]["id"] for key in ("single", "pair") for p in template[key] if "SpecialToken" in p}
        specials = {k: v for k, v in template.get("special_tokens", {}).items() if k in used}
        if bos is not None:
            specials[bos] = {"id": bos, "ids": [bos_id], "tokens": [bos]}
        template["special_tokens"] = specials


def _chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def end_of_turn_tokens(template: str, special: list[str], bos: str | None, eos: str | None) -> list[str]:
    """The special tokens the template writes right after an assistant message (before any other text),
    rendered by the runtime's own ChatTemplate, as generate(messages=...) will render it."""
    from ..runtime.chat import ChatTemplate

    after = ChatTemplate(template, {"bos_token": bos or "", "eos_token": eos or ""}).end_of_turn_text()
    found = []
    by_length = sorted(set(special), key=len, reverse=True)
    while True:
        after = after.lstrip()
        token = next((t for t in by_length if after.startswith(t)), None)
        if token is None:
            return found
        found.append(token)
        after = after[len(token):]


def _agree(name: str, sources: list[tuple[str, Any]], authority: tuple[str, Any] | None,
           config_pair: tuple[Any, Any], where: str, show) -> tuple[Any, bool]:
    """The agreed value of one field, and whether some source must be repaired to it; refuses when unsettled."""
    present = [(s, v) for s, v in sources if v is not None]
    values = {v for _, v in present}
    if authority is not None and authority[1] is not None:
        return authority[1], any(v != authority[1] for v in values)
    if len(values) <= 1:
        return next(iter(values), None), False
    config_value, generation_value = config_pair
    if config_value is not None and config_value == generation_value:
        return config_value, True
    listed = ", ".join(f"{s} {show(v)}" for s, v in present)
    raise SpecdeployError(f"{where}: the special tokens disagree: {name}: {listed}; "
                          "nothing in the checkpoint says which is right (fix the files to agree)")


def check_special_tokens(checkpoint, tokenizer_dir: Path, work_dir: Path,
                         report: Callable[[str, str], None]) -> Checked:
    """Check (and where settled, repair) the special tokens of one checkpoint; see the module docstring."""
    role = checkpoint.role
    where = f"--{role} {checkpoint.source or checkpoint.path}"
    tokenizer = _Tokenizer(tokenizer_dir)
    tokenizer_config = _read_json(tokenizer_dir / "tokenizer_config.json")
    special_map = _read_json(tokenizer_dir / "special_tokens_map.json")
    config = _read_json(checkpoint.path / "config.json")
    config = config.get("text_config", config) if "vocab_size" not in config else config
    generation = _read_json(checkpoint.path / "generation_config.json")
    gguf = checkpoint.gguf_tokens

    head_rows = getattr(checkpoint.config, "vocab_size", None) or config.get("vocab_size")
    num_tokens = max(tokenizer.vocab.values()) + 1
    if head_rows and num_tokens > head_rows:
        raise SpecdeployError(f"{where}: the tokenizer has ids up to {num_tokens - 1} ({len(tokenizer.vocab)} tokens) "
                              f"but the model's head has {head_rows} rows (config.json vocab_size)")

    def token_id(text: str | None):
        if text is None:
            return None
        return tokenizer.vocab.get(text, text)  # an unknown string stays a string: it disagrees with every id

    def show(value) -> str:
        return tokenizer.show(value) if isinstance(value, int) else repr(value)

    prepended = tokenizer.prepended()
    repairs: list[str] = []
    agreed: dict[str, Any] = {}
    for field in ("bos", "pad"):
        sources = [(f"tokenizer_config.json {field}_token", token_id(_token_text(tokenizer_config.get(f"{field}_token")))),
                   (f"tokenizer_config.json {field}_token_id", tokenizer_config.get(f"{field}_token_id")),
                   (f"special_tokens_map.json {field}_token", token_id(_token_text(special_map.get(f"{field}_token")))),
                   (f"config.json {field}_token_id", config.get(f"{field}_token_id")),
                   (f"generation_config.json {field}_token_id", generation.get(f"{field}_token_id"))]
        if field == "bos" and prepended:
            sources.append(("tokenizer.json post-processor's first token", token_id(prepended[0])))
        key = {"bos": "bos_token_id", "pad": "padding_token_id"}[field]
        authority = None if gguf is None else (f"GGUF tokenizer.ggml.{key}", getattr(gguf, f"{field}_token_id"))
        value, repair = _agree(field, sources, authority, (sources[3][1], sources[4][1]), where, show)
        agreed[field] = value
        if repair:
            wrong = [f"{s} {show(v)}" for s, v in sources if v is not None and v != value]
            origin = authority[0] if authority and authority[1] is not None else "config.json and generation_config.json"
            repairs.append(f"{role}: {field} {show(value)} from {origin}, was {', '.join(wrong)}")

    # EOS: config.json and generation_config.json may list several; the tokenizer names one.
    config_eos, generation_eos = _ids(config.get("eos_token_id")), _ids(generation.get("eos_token_id"))
    if gguf is not None and gguf.eos_token_id is not None:
        stop = [gguf.eos_token_id, *[i for i in generation_eos + config_eos if i != gguf.eos_token_id]]
    else:
        if config_eos and generation_eos and not set(config_eos) & set(generation_eos):
            raise SpecdeployError(f"{where}: the special tokens disagree: eos: config.json eos_token_id "
                                  f"{list(config_eos)}, generation_config.json eos_token_id {list(generation_eos)}; "
                                  "nothing in the checkpoint says which is right (fix the files to agree)")
        stop = list(dict.fromkeys(generation_eos + config_eos))
    tokenizer_eos = [(f"tokenizer_config.json eos_token", token_id(_token_text(tokenizer_config.get("eos_token")))),
                     ("tokenizer_config.json eos_token_id", tokenizer_config.get("eos_token_id")),
                     ("special_tokens_map.json eos_token", token_id(_token_text(special_map.get("eos_token"))))]
    wrong_eos = [(s, v) for s, v in tokenizer_eos if v is not None and v not in stop]
    if gguf is not None and gguf.eos_token_id is not None:
        primary, origin = gguf.eos_token_id, "GGUF tokenizer.ggml.eos_token_id"
        wrong_eos = [(s, v) for s, v in tokenizer_eos if v is not None and v != primary]
    elif config_eos and generation_eos:
        primary, origin = next(i for i in config_eos if i in generation_eos), "config.json and generation_config.json"
    else:
        primary, origin = (stop[0] if stop else None), None
    if wrong_eos and origin is None and stop:  # with no EOS in either config, the tokenizer's is the stop token
        listed = ", ".join(f"{s} {show(v)}" for s, v in wrong_eos)
        theirs = "config.json" if config_eos else "generation_config.json"
        raise SpecdeployError(f"{where}: the special tokens disagree: eos: {listed}, {theirs} eos_token_id "
                              f"{list(stop)}; nothing in the checkpoint says which is right (fix the files to agree)")
    if not stop:
        stop = [v for _, v in tokenizer_eos if isinstance(v, int)][:1]
        primary = stop[0] if stop else None
    if wrong_eos:
        repairs.append(f"{role}: eos {show(primary)} from {origin}, was "
                       + ", ".join(f"{s} {show(v)}" for s, v in wrong_eos))
    agreed["eos"] = primary

    # add_bos_token: tokenizer_config.json's flag and what the post-processor does (what the runtime does).
    add_sources = [("tokenizer_config.json add_bos_token", tokenizer_config.get("add_bos_token")),
                   ("tokenizer.json post-processor prepends BOS", bool(prepended))]
    authority = None if gguf is None else ("GGUF tokenizer.ggml.add_bos_token", gguf.add_bos_token)
    add_bos, repair = _agree("add_bos_token", add_sources, authority, (None, None), where, repr)
    if add_bos and agreed["bos"] is None:
        raise SpecdeployError(f"{where}: the tokenizer prepends BOS but no file names a BOS token")
    if prepended and add_bos and token_id(prepended[0]) != agreed["bos"]:
        repair = True
    if repair:
        wrong = [f"{s} {v!r}" for s, v in add_sources if v is not None and v != add_bos]
        repairs.append(f"{role}: add_bos_token {add_bos!r} from {authority[0] if authority else 'the tokenizer'}"
                       + (f", was {', '.join(wrong)}" if wrong else f" (prepending {show(agreed['bos'])})"))

    stop_additions: list[str] = []
    template = _chat_template(tokenizer_dir, tokenizer_config)
    if template is not None:
        bos_text = tokenizer.by_id.get(agreed["bos"]) if agreed["bos"] is not None else None
        eos_text = tokenizer.by_id.get(agreed["eos"]) if agreed["eos"] is not None else None
        try:
            closing = end_of_turn_tokens(template, tokenizer.special, bos_text, eos_text)
        except Exception as exc:  # noqa: BLE001 - a template is arbitrary Jinja
            raise SpecdeployError(f"{where}: cannot render the chat template to find its end-of-turn token: "
                                  f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        for text in closing:
            token = tokenizer.vocab[text]
            if token not in stop:
                stop_additions.append(f"{role}: eos_token_ids + {show(token)}: the chat template ends an assistant "
                                      f"turn with it, and the stop set was {list(stop)}")
                stop.append(token)

    if primary is not None and primary not in stop:
        stop.insert(0, primary)
    for token in (agreed["bos"], agreed["pad"], *stop):
        if isinstance(token, str):
            raise SpecdeployError(f"{where}: the special token {token!r} is not in the tokenizer's vocabulary")
        if token is not None and head_rows and not 0 <= token < head_rows:
            raise SpecdeployError(f"{where}: special token id {token} has no row in the model's head ({head_rows} rows)")

    for line in repairs + stop_additions:
        report("load", line)
    checked = dataclasses.replace(checkpoint, bos_token_id=agreed["bos"], eos_token_ids=tuple(stop),
                                  pad_token_id=agreed["pad"])
    if not repairs:  # nothing in the tokenizer files to rewrite: the stop set lives in the manifest
        return Checked(checked, tokenizer_dir, tuple(stop_additions))
    folder = work_dir / f"{role}-tokenizer-checked"
    folder.mkdir()
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, folder / name)
    texts = {field: tokenizer.by_id.get(agreed[field]) if agreed[field] is not None else None for field in FIELDS}
    _write_tokenizer(folder, texts, agreed, add_bos)
    return Checked(checked, folder, tuple(repairs + stop_additions))


def _write_tokenizer(folder: Path, texts: dict, ids: dict, add_bos: bool | None) -> None:
    """The agreed special tokens written into every tokenizer file that states them."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if not path.is_file():
            continue
        data = _read_json(path)
        for field in FIELDS:
            key = f"{field}_token"
            if texts[field] is not None and (data.get(key) is not None or name == "tokenizer_config.json"):
                current = data.get(key)
                data[key] = {**current, "content": texts[field]} if isinstance(current, dict) else texts[field]
            if name == "tokenizer_config.json" and f"{key}_id" in data:
                data[f"{key}_id"] = ids[field]
        if name == "tokenizer_config.json" and add_bos is not None:
            data["add_bos_token"] = add_bos
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tokenizer_json = _read_json(folder / "tokenizer.json")
    _set_prepended_bos(tokenizer_json, texts["bos"] if add_bos else None, ids["bos"])
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
