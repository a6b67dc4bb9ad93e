"""GGUF checkpoints in: a .gguf file's metadata as a Hugging Face folder (config, generation config,
tokenizer), its weights read from the file itself.

For the architectures gguf_weights.py reads in place (Llama, Qwen 2, Gemma 3) the folder holds no
weights: export keeps the file's quantized blocks or dequantizes one tensor at a time from it. Any
other architecture transformers' GGUF loader reads is dequantized to fp32 by that loader and saved in
the folder, which the rest of the export reads like any other checkpoint. transformers' converted
tokenizer and config do not carry the GGUF's special tokens faithfully (its tokenizer takes BOS for
EOS; its config holds the model class's defaults), so the special tokens are read from the GGUF
metadata itself and passed on as the authority the special-token check repairs the folder from
(special_tokens.py). Where its tokenizer splits text otherwise than llama.cpp (SentencePiece
vocabularies, Llama 3's split), gguf_vocab.py rebuilds those parts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecdeployError, install_hint
from .convert import release_freed_memory
from .gguf_file import transformers_view
from .gguf_vocab import CONTROL, UNKNOWN, GgufVocab, read_vocab, rebuild_tokenizer

MAGIC = b"GGUF"


@dataclass(frozen=True)
class GgufTokens:
    """The special tokens as the GGUF's metadata states them (None: the key is absent)."""

    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool | None
    chat_template: str | None
    control_tokens: tuple[str, ...] = ()  # typed CONTROL (<start_of_turn>, <end_of_turn>, ...) or UNKNOWN
    # End of turn and end of message (Llama 3's <|eot_id|>, <|eom_id|>): llama.cpp ends generation at
    # them as at EOS, and so does the bundle (generation_config.json lists them after the EOS).
    end_token_ids: tuple[int, ...] = ()


def is_gguf(path: Path) -> bool:
    """A file named *.gguf, or any file that starts with the GGUF magic."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as handle:
        return handle.read(4) == MAGIC


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def open_gguf(path: Path, role: str):
    """The file's header, read once (gguf_file.GgufFile); one error line for anything that is not a readable GGUF."""
    from .gguf_file import GgufFile

    try:
        import gguf  # noqa: F401  (its type tables and dequantization)
    except ImportError:
        raise SpecdeployError(f"--{role} {path}: reading GGUF needs the gguf package ({install_hint('export')})") from None
    with open(path, "rb") as handle:
        if handle.read(4) != MAGIC:
            raise SpecdeployError(f"--{role} {path}: not a GGUF file (no GGUF magic at its start)")
    try:
        return GgufFile(path)
    except SpecdeployError as exc:
        detail = str(exc).removeprefix(f"{path}: ")
        raise SpecdeployError(f"--{role} {path}: cannot read the GGUF file: {detail}") from None
    except (ValueError, UnicodeDecodeError, OverflowError, MemoryError) as exc:  # a corrupt header fails anywhere
        raise SpecdeployError(f"--{role} {path}: cannot read the GGUF file: {_first_line(exc)}") from None


def read_tokens(file, role: str) -> tuple[str, GgufTokens, GgufVocab]:
    """The architecture, the special-token metadata and the vocabulary of a GgufFile."""
    path, value = file.path, file.metadata.get

    def token_id(key: str) -> int | None:
        raw = value(key)
        try:
            return None if raw is None else int(raw)
        except (TypeError, ValueError):
            raise SpecdeployError(f"--{role} {path}: the GGUF metadata key {key} is not a token id") from None

    architecture = value("general.architecture")
    if not isinstance(architecture, str):
        raise SpecdeployError(f"--{role} {path}: the GGUF file has no general.architecture")
    _check_whole_model(path, role, value, len(file.tensors))
    add_bos = value("tokenizer.ggml.add_bos_token")
    if add_bos is None:  # llama.cpp's default for the tokenizer's kind
        add_bos = llama_cpp_add_bos(value("tokenizer.ggml.model"), value("tokenizer.ggml.pre"))
    template = value("tokenizer.chat_template")
    vocab = read_vocab(value)  # the tokens and their types, read once
    control = tuple(token for token, kind in zip(vocab.tokens, vocab.types)  # llama.cpp matches UNKNOWN ones whole too
                    if kind in (CONTROL, UNKNOWN))
    return architecture, GgufTokens(
        bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
        eos_token_id=token_id("tokenizer.ggml.eos_token_id"),
        pad_token_id=token_id("tokenizer.ggml.padding_token_id"),
        add_bos_token=None if add_bos is None else bool(add_bos),
        chat_template=template if isinstance(template, str) else None,
        control_tokens=control,
        end_token_ids=tuple(dict.fromkeys(i for i in (token_id("tokenizer.ggml.eot_token_id"),
                                                      token_id("tokenizer.ggml.eom_token_id"),
                                                      *(i for i, t in enumerate(vocab.tokens) if t in EOG_TEXTS))
                                          if i is not None)),
    ), vocab


# The tokens llama.cpp ends generation at by their text, whatever the metadata's keys say (llama-vocab.cpp's
# end-of-generation list, llama.cpp of llama-cpp-python 0.3.36): Llama 3's <|eot_id|> and <|eom_id|>, ChatML's
# <|im_end|>, Gemma's <end_of_turn>, <|endoftext|>, ...
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                       "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                       "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                       "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["})


# BPE pre-tokenizers for which llama.cpp prepends BOS when the GGUF has no tokenizer.ggml.add_bos_token
# (llama-vocab.cpp of llama-cpp-python 0.3.36); every other BPE prepends none.
BOS_PREPENDING_BPE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                                "jina-v5-nano", "tekken", "chameleon"})


def llama_cpp_add_bos(model, pre) -> bool | None:
    """Whether llama.cpp prepends BOS for a tokenizer of this kind (tokenizer.ggml.model, .pre) when the GGUF does
    not say; None for a kind it does not know."""
    if model == "gpt2":
        return pre in BOS_PREPENDING_BPE
    return {"llama": True, "bert": True, "t5": False, "rwkv": False}.get(model)


def _check_whole_model(path: Path, role: str, value, num_tensors: int) -> None:
    """A GGUF transformers would fill with random weights: a LoRA adapter (no model sizes: transformers builds a
    default 7B config), a split file's one part, or a vocabulary-only file."""
    if value("general.type") == "adapter" or value("adapter.type") is not None:
        raise SpecdeployError(f"--{role} {path}: a LoRA adapter, not a model (merge it into its base model first)")
    parts = value("split.count")
    if parts is not None and int(parts) > 1:
        raise SpecdeployError(f"--{role} {path}: one of {int(parts)} parts of a split GGUF; merge them first "
                              "(llama.cpp's llama-gguf-split --merge)")
    if num_tensors == 0:
        raise SpecdeployError(f"--{role} {path}: a vocabulary-only GGUF, no weights in it")


# llama.cpp's names that transformers' GGUF loader renames before it looks its architectures up.
GGUF_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
CONVERSION_BAR = "de-quantizing GGUF tensors"  # the description of transformers' progress bar


def _supported(architecture: str) -> bool:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return architecture in GGUF_SUPPORTED_ARCHITECTURES or GGUF_RENAMED.get(architecture) in GGUF_SUPPORTED_ARCHITECTURES


@contextlib.contextmanager
def _without_conversion_bar():
    """Standard error without transformers' dequantization bar, which would cut through the CLI's progress
    lines: transformers draws it with tqdm directly, which its disable_progress_bar() does not reach.
    Whatever else is written meanwhile (a warning) is passed on once the block ends."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        for line in re.split(r"[\r\n]+", captured.getvalue()):
            if line.strip() and CONVERSION_BAR not in line:
                print(line, file=sys.stderr)


def gguf_to_folder(path: Path, role: str, work_dir: Path) -> tuple[Path, GgufTokens]:
    """The GGUF's metadata as a Hugging Face folder under work_dir (once per file); returns it and the special tokens.

    config.json (naming the model class) and generation_config.json take their special tokens from the
    GGUF metadata; the tokenizer files are transformers' conversion, rebuilt where it tokenizes
    otherwise than llama.cpp (gguf_vocab.py) and left for the special-token check. The folder holds
    weights only for an architecture gguf_weights.py does not read (transformers' fp32 dequantization).

    Every read of a GGUF parses all its metadata, every token of the vocabulary included, so this
    module reads the file once (the special tokens and control tokens together), and the same file as
    draft reuses the folder and the metadata. What each step leaves freed goes back to the system
    before the next (release_freed_memory)."""
    path = path.resolve()
    key = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    folder, saved_tokens = work_dir / f"gguf-{key}", work_dir / f"gguf-{key}.tokens.json"
    if (folder / "config.json").is_file() and saved_tokens.is_file():  # the same file as target and draft
        return folder, GgufTokens(**{k: tuple(v) if isinstance(v, list) else v
                                     for k, v in json.loads(saved_tokens.read_text(encoding="utf-8")).items()})
    file = open_gguf(path, role)
    try:
        architecture, tokens, vocab = read_tokens(file, role)
    finally:
        file.close()
    if not _supported(architecture):
        raise SpecdeployError(
            f"--{role} {path}: transformers' GGUF loader does not read the architecture '{architecture}'"
        )
    from . import gguf_weights

    ids = {"bos_token_id": tokens.bos_token_id, "eos_token_id": tokens.eos_token_id,
           "pad_token_id": tokens.pad_token_id}
    partial = work_dir / f"gguf-{key}.partial"
    try:
        view = transformers_view(file)
        config = config_from_metadata(view, ids)
        if architecture in gguf_weights.ARCHITECTURES:
            config.architectures = [type(gguf_weights.skeleton(config)).__name__]
            config.save_pretrained(partial)
        else:
            _dequantized_checkpoint(path.parent, path.name, ids, partial)
        _generation_config(tokens, ids).save_pretrained(partial)
        tokenizer = tokenizer_from_metadata(view, config)
    except SpecdeployError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a GGUF it cannot convert
        raise SpecdeployError(f"--{role} {path}: transformers cannot load the GGUF: {_first_line(exc)}") from None
    release_freed_memory()
    _keep_control_tokens(tokens.control_tokens, tokenizer)
    save_tokenizer(tokenizer, partial)
    del tokenizer
    rebuild_tokenizer(partial / "tokenizer.json", vocab)  # where transformers' reading is not llama.cpp's
    release_freed_memory()
    if tokens.chat_template is not None and not (partial / "chat_template.jinja").is_file():
        _set_template(partial / "tokenizer_config.json", tokens.chat_template)
    partial.rename(folder)
    saved_tokens.write_text(json.dumps(dataclasses.asdict(tokens)))
    return folder, tokens


def _generation_config(tokens: GgufTokens, ids: dict):
    """generation_config.json: the GGUF's special tokens, and every token llama.cpp ends generation at as EOS."""
    from transformers import GenerationConfig

    stops = [i for i in (tokens.eos_token_id, *tokens.end_token_ids) if i is not None]
    return GenerationConfig(**{**{k: v for k, v in ids.items() if v is not None},
                               **({"eos_token_id": list(dict.fromkeys(stops))} if len(set(stops)) > 1 else {})})


def config_from_metadata(view: dict, ids: dict | None = None):
    """The config transformers' GGUF loader makes of the metadata (AutoConfig.for_model over its `config` dict),
    its special tokens the GGUF's own (the class's defaults otherwise)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**view["config"])
    for name, value in (ids or {}).items():
        setattr(config, name, value)
    return config


def tokenizer_from_metadata(view: dict, config):
    """The tokenizer transformers' GGUF loader makes of the metadata: its converter for the architecture, in the
    fast tokenizer class AutoTokenizer picks for the config, with the GGUF's tokenizer settings. The loader
    hands the converter's `legacy` to no class (Llama's keeps its default), so neither does this."""
    from transformers.integrations.ggml import convert_gguf_tokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    backend, extra = convert_gguf_tokenizer(view["config"]["model_type"], view["tokenizer"])
    fast_class = TOKENIZER_MAPPING[type(config)][1]
    extra = {key: value for key, value in extra.items() if key != "legacy"}
    with _quiet_transformers():  # Llama's class notes its default `legacy`, as it does for every GGUF
        return fast_class(tokenizer_object=backend, **{**view["tokenizer_config"], **extra})


def save_tokenizer(tokenizer, folder: Path, **options) -> None:
    """The tokenizer's files (save_pretrained's options), its class named as transformers names a tokenizer read
    from a GGUF (the slow class's name: the GGUF was the vocabulary file it could save)."""
    tokenizer.save_pretrained(folder, **options)
    config_file = folder / "tokenizer_config.json"
    data = json.loads(config_file.read_text(encoding="utf-8"))
    if str(data.get("tokenizer_class", "")).endswith("Fast"):
        data["tokenizer_class"] = data["tokenizer_class"][: -len("Fast")]
        config_file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _dequantized_checkpoint(where: Path, name: str, ids: dict, out: Path) -> None:
    """transformers' fp32 dequantization of the whole GGUF, saved as a checkpoint (its config names the model class)."""
    import torch
    from transformers import AutoModelForCausalLM

    with _without_conversion_bar():
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32, local_files_only=True)
    for name_, value in ids.items():
        setattr(model.config, name_, value)
    model.save_pretrained(out)
    del model
    release_freed_memory()


def weights_in_file(folder: Path) -> bool:
    """Whether a folder gguf_to_folder made reads its weights from the GGUF itself (it holds none of its own)."""
    return (folder / "config.json").is_file() and not any(folder.glob("*.safetensors"))


def _set_template(tokenizer_config: Path, template: str) -> None:
    data = json.loads(tokenizer_config.read_text(encoding="utf-8")) if tokenizer_config.is_file() else {}
    data.setdefault("chat_template", template)
    tokenizer_config.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")


def _keep_control_tokens(control_tokens: tuple[str, ...], tokenizer) -> None:
    """The GGUF's control tokens as special added tokens: some of transformers' converters (Gemma's) keep only
    BOS/EOS/pad/unk, which leaves <start_of_turn> and <end_of_turn> as plain pieces that text never encodes to."""
    special = set(tokenizer.all_special_tokens) | {str(t) for t in tokenizer.added_tokens_decoder.values()}
    control = [t for t in control_tokens if t not in special]
    if control:
        tokenizer.add_special_tokens({"additional_special_tokens": control}, replace_additional_special_tokens=False)
