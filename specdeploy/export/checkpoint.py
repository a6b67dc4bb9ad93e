"""Local Hugging Face checkpoints: find them, check they can be exported, check a pair is compatible.

Nothing is downloaded: a folder is used as it is, a .gguf file's metadata becomes a folder in the
export's work folder (gguf.py; its weights are read from the file itself, gguf_weights.py), and a hub
id is only looked up in the local cache.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SpecdeployError

SAFE_WEIGHTS = "*.safetensors"
PICKLE_WEIGHTS = ("pytorch_model*.bin", "model*.bin")  # torch.load: unpickling can run arbitrary code
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Checkpoint:
    role: str
    path: Path
    config: Any  # transformers.PretrainedConfig
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    source: str = ""  # what was asked for: the folder, or the .gguf file it was converted from
    gguf_tokens: Any = None  # gguf.GgufTokens: the special tokens of the GGUF metadata (None: not a GGUF)
    # The .gguf file whose tensors are the weights, read in place (gguf_weights.py); None: the folder's own weights.
    gguf_file: Path | None = None


def resolve_checkpoint(name: str, role: str, work_dir: Path | None = None) -> tuple[Path, Any]:
    """A local folder, a .gguf file (converted into work_dir), or a hub id already in the local cache; never a download.

    Returns the folder and, for a GGUF, its special-token metadata."""
    from . import gguf

    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve(), None
    if path.exists():
        if not gguf.is_gguf(path):
            raise SpecdeployError(f"--{role} {name}: not a folder, nor a GGUF file")
        if work_dir is None:
            raise SpecdeployError(f"--{role} {name}: a GGUF file needs a work folder to be converted in")
        return gguf.gguf_to_folder(path, role, work_dir)
    if _HUB_ID.match(name) and not name.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(name, local_files_only=True)), None
        except Exception:
            raise SpecdeployError(
                f"--{role} {name}: no such folder, and not in the local Hugging Face cache "
                "(specdeploy never downloads; fetch it first or pass a local folder)"
            ) from None
    raise SpecdeployError(f"--{role} {name}: no such folder")


def _int_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def check_weights(path: Path, role: str, allow_pickle: bool) -> None:
    """safetensors weights, or pickle ones only when allowed (transformers loads safetensors first when both exist)."""
    if any(path.glob(SAFE_WEIGHTS)):
        return
    pickled = sorted(p.name for pattern in PICKLE_WEIGHTS for p in path.glob(pattern))
    if not pickled:
        raise SpecdeployError(f"--{role} {path}: has config.json but no weights (*.safetensors or pytorch_model*.bin)")
    if not allow_pickle:
        raise SpecdeployError(
            f"--{role} {path}: the weights are pickle files ({pickled[0]}), which can run code when loaded; "
            "convert them to safetensors, or pass --allow-pickle if you trust the checkpoint"
        )


def _read_config(path: Path, role: str, name: str = "config.json") -> dict:
    try:
        raw = json.loads((path / name).read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise SpecdeployError(f"--{role} {path}: {name} is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(raw, dict):
        raise SpecdeployError(f"--{role} {path}: {name} is not a JSON object")
    return raw


def load_checkpoint(name: str, role: str, trust_remote_code: bool = False, allow_pickle: bool = False,
                    work_dir: Path | None = None) -> Checkpoint:
    """Resolve, check for config and weights, and check that optimum can export it as a causal LM."""
    from .gguf import weights_in_file

    path, gguf_tokens = resolve_checkpoint(name, role, work_dir)
    if not (path / "config.json").is_file():
        raise SpecdeployError(f"--{role} {path}: no config.json (not a Hugging Face checkpoint folder)")
    gguf_file = Path(name).expanduser().resolve() if gguf_tokens is not None and weights_in_file(path) else None
    if gguf_file is None:
        check_weights(path, role, allow_pickle)
    raw = _read_config(path, role)
    if raw.get("auto_map") and not trust_remote_code:
        raise SpecdeployError(
            f"--{role} {path}: the checkpoint needs custom code (auto_map); pass --trust-remote-code if you trust it"
        )

    import optimum.exporters.onnx.model_configs  # noqa: F401  (registers the ONNX configs with the TasksManager)
    from optimum.exporters.tasks import TasksManager
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as exc:
        raise SpecdeployError(f"--{role} {path}: cannot read config.json: {str(exc).splitlines()[0]}") from None
    architectures = getattr(config, "architectures", None) or []
    if architectures and not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in architectures):
        raise SpecdeployError(
            f"--{role} {path}: {', '.join(architectures)} is not a causal language model (need *ForCausalLM)"
        )
    try:
        tasks = TasksManager.get_supported_tasks_for_model_type(config.model_type, "onnx", library_name="transformers")
    except Exception:
        tasks = {}
    if "text-generation-with-past" not in tasks:
        raise SpecdeployError(
            f"--{role} {path}: optimum cannot export model type '{config.model_type}' as a causal LM with a KV cache"
        )

    generation = {}
    if (path / "generation_config.json").is_file():
        generation = _read_config(path, role, "generation_config.json")
    try:
        eos = _int_ids(generation.get("eos_token_id", getattr(config, "eos_token_id", None)))
        bos, pad = (generation.get(key, getattr(config, key, None)) for key in ("bos_token_id", "pad_token_id"))
        bos, pad = (None if value is None else int(value) for value in (bos, pad))
    except (TypeError, ValueError):
        raise SpecdeployError(f"--{role} {path}: bos/eos/pad_token_id in config.json or generation_config.json "
                              "must be token ids (integers)") from None
    return Checkpoint(
        role=role,
        path=path,
        config=config,
        bos_token_id=bos,
        eos_token_ids=eos,
        pad_token_id=pad,
        source=str(Path(name).expanduser().resolve()) if gguf_tokens is not None else str(path),
        gguf_tokens=gguf_tokens,
        gguf_file=gguf_file,
    )


def load_tokenizer_json(checkpoint: Checkpoint, work_dir: Path) -> Path:
    """The checkpoint's tokenizer.json, converting a slow tokenizer with transformers when needed."""
    existing = checkpoint.path / "tokenizer.json"
    if existing.is_file():
        return checkpoint.path
    from transformers import AutoTokenizer

    where = f"--{checkpoint.role} {checkpoint.path}"
    if not any((checkpoint.path / name).is_file() for name in TOKENIZER_FILES + SLOW_TOKENIZER_FILES):
        raise SpecdeployError(f"{where}: no tokenizer (tokenizer.json, or a tokenizer_config.json with its vocabulary); "
                              "copy the tokenizer files of the pair into the checkpoint folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint.path, use_fast=True, local_files_only=True)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecdeployError(f"{where}: no usable tokenizer: {first}") from None
    if tokenizer is None or isinstance(tokenizer, bool):
        raise SpecdeployError(f"{where}: no usable tokenizer (transformers found none in the folder)")
    if not getattr(tokenizer, "is_fast", False):
        raise SpecdeployError(f"--{checkpoint.role} {checkpoint.path}: the tokenizer has no tokenizer.json form")
    out = work_dir / f"{checkpoint.role}-tokenizer"
    tokenizer.save_pretrained(out)
    return out


def check_pair(target: Checkpoint, draft: Checkpoint, target_tok_dir: Path, draft_tok_dir: Path) -> None:
    """Same logit space, same token ids, same special tokens; else one line saying what differs."""
    from tokenizers import Tokenizer

    if target.config.vocab_size != draft.config.vocab_size:
        raise SpecdeployError(
            f"draft and target differ in vocab_size: target {target.config.vocab_size}, draft {draft.config.vocab_size}"
        )
    target_vocab = Tokenizer.from_file(str(target_tok_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
    draft_vocab = Tokenizer.from_file(str(draft_tok_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
    if target_vocab != draft_vocab:
        only_target = sorted(set(target_vocab.items()) - set(draft_vocab.items()), key=lambda kv: kv[1])
        only_draft = sorted(set(draft_vocab.items()) - set(target_vocab.items()), key=lambda kv: kv[1])
        example = (only_target or only_draft)[0]
        raise SpecdeployError(
            f"draft and target tokenizers differ: {len(target_vocab)} vs {len(draft_vocab)} tokens, "
            f"{len(only_target)} target entries not in the draft (e.g. {example[0]!r} -> {example[1]})"
        )
    for name in ("bos_token_id", "eos_token_ids", "pad_token_id"):
        if name == "pad_token_id" and None in (target.pad_token_id, draft.pad_token_id):
            continue
        if getattr(target, name) != getattr(draft, name):
            raise SpecdeployError(
                f"draft and target differ in {name}: target {getattr(target, name)}, draft {getattr(draft, name)}"
            )
