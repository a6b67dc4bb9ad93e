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
- A decoder that drops the space its text starts with is written without that step (leading_space.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import SpecdeployError
from .leading_space import unstripped

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


@dataclass
class _Statements:
    """Everything one checkpoint's files state about its special tokens, and the repairs found so far."""
    role: str
    where: str  # the flag and path that errors name
    tokenizer: _Tokenizer
    tokenizer_config: dict
    special_map: dict
    config: dict
    generation: dict
    gguf: Any  # the GGUF's own special tokens, or None
    repairs: list[str] = dataclasses.field(default_factory=list)  # whole: the manifest records them
    briefs: list[str] = dataclasses.field(default_factory=list)   # one short line each, for the export's log

    def repair(self, line: str, overruled: list[str]) -> None:
        """A repair: `line` names the value kept and where from; `overruled`, the statements it replaced."""
        self.repairs.append(f"{line}, was {', '.join(overruled)}" if overruled else line)
        count = len(overruled)
        self.briefs.append(f"{line}, over {count} other statement{'s' if count != 1 else ''} (the manifest lists them)"
                           if overruled else line)

    @classmethod
    def read(cls, checkpoint, tokenizer_dir: Path) -> "_Statements":
        config = _read_json(checkpoint.path / "config.json")
        return cls(role=checkpoint.role, where=f"--{checkpoint.role} {checkpoint.source or checkpoint.path}",
                   tokenizer=_Tokenizer(tokenizer_dir),
                   tokenizer_config=_read_json(tokenizer_dir / "tokenizer_config.json"),
                   special_map=_read_json(tokenizer_dir / "special_tokens_map.json"),
                   config=config.get("text_config", config) if "vocab_size" not in config else config,
                   generation=_read_json(checkpoint.path / "generation_config.json"),
                   gguf=checkpoint.gguf_tokens)

    def token_id(self, text: str | None):
        if text is None:
            return None
        return self.tokenizer.vocab.get(text, text)  # an unknown string stays a string: it disagrees with every id

    def show(self, value) -> str:
        return self.tokenizer.show(value) if isinstance(value, int) else repr(value)

    def refuse(self, what: str) -> SpecdeployError:
        return SpecdeployError(f"{self.where}: the special tokens disagree: {what}; "
                               "nothing in the checkpoint says which is right (fix the files to agree)")


def _agree_bos_pad(stated: _Statements, prepended: list[str] | None) -> dict[str, Any]:
    """BOS and pad as every file states them, settled by the GGUF or by both configs together."""
    agreed: dict[str, Any] = {}
    for field in ("bos", "pad"):
        sources = [(f"tokenizer_config.json {field}_token",
                    stated.token_id(_token_text(stated.tokenizer_config.get(f"{field}_token")))),
                   (f"tokenizer_config.json {field}_token_id", stated.tokenizer_config.get(f"{field}_token_id")),
                   (f"special_tokens_map.json {field}_token",
                    stated.token_id(_token_text(stated.special_map.get(f"{field}_token")))),
                   (f"config.json {field}_token_id", stated.config.get(f"{field}_token_id")),
                   (f"generation_config.json {field}_token_id", stated.generation.get(f"{field}_token_id"))]
        if field == "bos" and prepended:
            sources.append(("tokenizer.json post-processor's first token", stated.token_id(prepended[0])))
        key = {"bos": "bos_token_id", "pad": "padding_token_id"}[field]
        authority = None if stated.gguf is None else (f"GGUF tokenizer.ggml.{key}", getattr(stated.gguf, f"{field}_token_id"))
        value, repair = _agree(field, sources, authority, (sources[3][1], sources[4][1]), stated.where, stated.show)
        agreed[field] = value
        if repair:
            wrong = [f"{s} {stated.show(v)}" for s, v in sources if v is not None and v != value]
            origin = authority[0] if authority and authority[1] is not None else "config.json and generation_config.json"
            stated.repair(f"{stated.role}: {field} {stated.show(value)} from {origin}", wrong)
    return agreed


def _agree_eos(stated: _Statements) -> tuple[int | None, list[int]]:
    """The primary EOS and the stop set. config.json and generation_config.json may list several EOS
    ids; the tokenizer names one, which must be among them (the GGUF's, where there is one)."""
    config_eos, generation_eos = _ids(stated.config.get("eos_token_id")), _ids(stated.generation.get("eos_token_id"))
    gguf_eos = None if stated.gguf is None else stated.gguf.eos_token_id
    if gguf_eos is not None:
        stop = [gguf_eos, *[i for i in generation_eos + config_eos if i != gguf_eos]]
    else:
        if config_eos and generation_eos and not set(config_eos) & set(generation_eos):
            raise stated.refuse(f"eos: config.json eos_token_id {list(config_eos)}, "
                                f"generation_config.json eos_token_id {list(generation_eos)}")
        stop = list(dict.fromkeys(generation_eos + config_eos))
    tokenizer_eos = [("tokenizer_config.json eos_token",
                      stated.token_id(_token_text(stated.tokenizer_config.get("eos_token")))),
                     ("tokenizer_config.json eos_token_id", stated.tokenizer_config.get("eos_token_id")),
                     ("special_tokens_map.json eos_token", stated.token_id(_token_text(stated.special_map.get("eos_token"))))]
    wrong_eos = [(s, v) for s, v in tokenizer_eos if v is not None and v not in stop]
    if gguf_eos is not None:
        primary, origin = gguf_eos, "GGUF tokenizer.ggml.eos_token_id"
        wrong_eos = [(s, v) for s, v in tokenizer_eos if v is not None and v != primary]
    elif config_eos and generation_eos:
        primary, origin = next(i for i in config_eos if i in generation_eos), "config.json and generation_config.json"
    else:
        primary, origin = (stop[0] if stop else None), None
    if wrong_eos and origin is None and stop:  # with no EOS in either config, the tokenizer's is the stop token
        listed = ", ".join(f"{s} {stated.show(v)}" for s, v in wrong_eos)
        theirs = "config.json" if config_eos else "generation_config.json"
        raise stated.refuse(f"eos: {listed}, {theirs} eos_token_id {list(stop)}")
    if not stop:
        stop = [v for _, v in tokenizer_eos if isinstance(v, int)][:1]
        primary = stop[0] if stop else None
    if wrong_eos:
        stated.repair(f"{stated.role}: eos {stated.show(primary)} from {origin}",
                      [f"{s} {stated.show(v)}" for s, v in wrong_eos])
    return primary, stop


def _agree_add_bos(stated: _Statements, prepended: list[str] | None, bos: int | None) -> bool | None:
    """add_bos_token: tokenizer_config.json's flag against what the post-processor does (what the runtime does)."""
    add_sources = [("tokenizer_config.json add_bos_token", stated.tokenizer_config.get("add_bos_token")),
                   ("tokenizer.json post-processor prepends BOS", bool(prepended))]
    authority = None if stated.gguf is None else (
        "GGUF tokenizer.ggml.add_bos_token (or llama.cpp's default for its tokenizer)", stated.gguf.add_bos_token)
    add_bos, repair = _agree("add_bos_token", add_sources, authority, (None, None), stated.where, repr)
    if add_bos and bos is None:
        raise SpecdeployError(f"{stated.where}: the tokenizer prepends BOS but no file names a BOS token")
    if prepended and add_bos and stated.token_id(prepended[0]) != bos:
        repair = True
    if repair:
        wrong = [f"{s} {v!r}" for s, v in add_sources if v is not None and v != add_bos]
        stated.repair(f"{stated.role}: add_bos_token {add_bos!r} from {authority[0] if authority else 'the tokenizer'}"
                      + ("" if wrong else f" (prepending {stated.show(bos)})"), wrong)
    return add_bos


def _template_stops(stated: _Statements, tokenizer_dir: Path, agreed: dict, stop: list[int]) -> list[str]:
    """Adds to stop every end-of-turn token the chat template writes after an assistant turn; one line each."""
    template = _chat_template(tokenizer_dir, stated.tokenizer_config)
    if template is None:
        return []
    by_id = stated.tokenizer.by_id
    bos_text = by_id.get(agreed["bos"]) if agreed["bos"] is not None else None
    eos_text = by_id.get(agreed["eos"]) if agreed["eos"] is not None else None
    try:
        closing = end_of_turn_tokens(template, stated.tokenizer.special, bos_text, eos_text)
    except Exception as exc:  # noqa: BLE001 - a template is arbitrary Jinja
        raise SpecdeployError(f"{stated.where}: cannot render the chat template to find its end-of-turn token: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    additions = []
    for text in closing:
        token = stated.tokenizer.vocab[text]
        if token not in stop:
            additions.append(f"{stated.role}: eos_token_ids + {stated.show(token)}: the chat template ends an "
                             f"assistant turn with it, and the stop set was {list(stop)}")
            stop.append(token)
    return additions


def check_special_tokens(checkpoint, tokenizer_dir: Path, work_dir: Path,
                         report: Callable[[str, str], None]) -> Checked:
    """Check (and where settled, repair) the special tokens of one checkpoint; see the module docstring."""
    stated = _Statements.read(checkpoint, tokenizer_dir)
    head_rows = getattr(checkpoint.config, "vocab_size", None) or stated.config.get("vocab_size")
    vocab = stated.tokenizer.vocab
    num_tokens = max(vocab.values()) + 1
    if head_rows and num_tokens > head_rows:
        raise SpecdeployError(f"{stated.where}: the tokenizer has ids up to {num_tokens - 1} ({len(vocab)} tokens) "
                              f"but the model's head has {head_rows} rows (config.json vocab_size)")

    prepended = stated.tokenizer.prepended()
    agreed = _agree_bos_pad(stated, prepended)
    agreed["eos"], stop = _agree_eos(stated)
    add_bos = _agree_add_bos(stated, prepended, agreed["bos"])
    stop_additions = _template_stops(stated, tokenizer_dir, agreed, stop)
    if agreed["eos"] is not None and agreed["eos"] not in stop:
        stop.insert(0, agreed["eos"])
    for token in (agreed["bos"], agreed["pad"], *stop):
        if isinstance(token, str):
            raise SpecdeployError(f"{stated.where}: the special token {token!r} is not in the tokenizer's vocabulary")
        if token is not None and head_rows and not 0 <= token < head_rows:
            raise SpecdeployError(f"{stated.where}: special token id {token} has no row in the model's head "
                                  f"({head_rows} rows)")

    decoder = unstripped(stated.tokenizer.json.get("decoder"))
    if decoder is not None:
        stated.repair(f"{stated.role}: the tokenizer's decoder drops the space a text starts with; "
                      "written without that step, so that a reply keeps its first space", [])
    for line in stated.briefs + stop_additions:
        report("load", line)
    checked = dataclasses.replace(checkpoint, bos_token_id=agreed["bos"], eos_token_ids=tuple(stop),
                                  pad_token_id=agreed["pad"])
    if not stated.repairs:  # nothing in the tokenizer files to rewrite: the stop set lives in the manifest
        return Checked(checked, tokenizer_dir, tuple(stop_additions))
    folder = work_dir / f"{stated.role}-tokenizer-checked"
    folder.mkdir()
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, folder / name)
    texts = {field: stated.tokenizer.by_id.get(agreed[field]) if agreed[field] is not None else None for field in FIELDS}
    _write_tokenizer(folder, texts, agreed, add_bos, decoder)
    return Checked(checked, folder, tuple(stated.repairs + stop_additions))


def _write_tokenizer(folder: Path, texts: dict, ids: dict, add_bos: bool | None, decoder: dict | None) -> None:
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
    if decoder is not None:
        tokenizer_json["decoder"] = decoder
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
