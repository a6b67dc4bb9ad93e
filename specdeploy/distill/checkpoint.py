"""The distill folder: what is in it, atomic writes, the training checkpoint and the draft's files.

Every file is written to a temporary name in the same folder and renamed over the old one, so an
interrupted write leaves the previous file whole. `distill.json` is written last and names the
step of `checkpoint.pt`; it also marks the folder as a distill run, which is the only kind of
non-empty folder a run writes into.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ..errors import SpecdeployError
from .config import FLAGS

RUN_FILE = "distill.json"
STATE_FILE = "checkpoint.pt"
VOCAB_FILE = "draft_vocab.json"
GENERATED_FILE = "generated.json"
HELDOUT_FILE = "heldout.json"
RUN_FORMAT = "specdeploy-distill"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """write(temporary path) then rename it to `path`; on any failure the temporary file is removed."""
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        write(Path(temporary))
        with open(temporary, "rb") as file:
            os.fsync(file.fileno())
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes it private; the file is as any other the user writes
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: Path, value) -> None:
    atomic_write(path, lambda temporary: temporary.write_text(json.dumps(value, indent=1) + "\n"))


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def read_run(out: Path) -> dict | None:
    """distill.json of a distill folder, or None."""
    run = read_json(out / RUN_FILE)
    return run if run is not None and run.get("format") == RUN_FORMAT else None


def prepare_out(out: Path, resume: bool) -> dict | None:
    """Check --out against --resume; returns the run record to resume (None for a fresh run).

    A fresh run takes a new or empty folder, or a distill folder with no checkpoint yet (its cached
    generations are reused). Anything with a checkpoint needs --resume; anything else is refused."""
    if out.exists() and not out.is_dir():
        raise SpecdeployError(f"--out {out}: exists and is not a folder")
    run = read_run(out) if out.is_dir() else None
    # distill.json says step null until the first save completes: a save cut after checkpoint.pt landed still counts
    has_checkpoint = run is not None and (out / STATE_FILE).is_file()
    if resume:
        if run is None:
            raise SpecdeployError(f"--resume: no distill checkpoint in {out}")
        if not has_checkpoint:
            raise SpecdeployError(f"--resume: the run in {out} has no checkpoint yet; start it again without --resume")
        return run
    if has_checkpoint:
        at = f"at step {run['step']}" if run.get("step") is not None else "with a checkpoint"
        raise SpecdeployError(f"--out {out}: holds a distill run {at}; pass --resume to continue it, or choose another folder")
    if out.is_dir() and run is None and any(out.iterdir()):
        raise SpecdeployError(f"--out {out}: not empty and not a distill folder; choose a new or empty folder")
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is not None and not os.access(existing, os.W_OK):
        raise SpecdeployError(f"--out {out}: {existing} is not writable")
    return None


def create_out(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)


def check_resume(run: dict, state: dict, fingerprint: dict, target_identity: dict, out: Path) -> None:
    """The checkpoint must be this run's: same target, same shape-and-data options."""
    # checkpoint.pt is written first, distill.json last: a state ahead of the record means the writes after
    # it were cut (a kill, a second Ctrl-C). The state is whole (written atomically) and the next save
    # rewrites the rest; a state behind the record is not this run's.
    recorded = run.get("step") if isinstance(run.get("step"), int) else -1  # null: the first save was cut
    if not isinstance(state.get("step"), int) or state["step"] < recorded:
        raise SpecdeployError(f"--resume: {out / STATE_FILE} (step {state.get('step')}) does not match {RUN_FILE} "
                              f"(step {run.get('step')})")
    previous = state.get("target", {})
    for name in ("model_type", "vocab_size", "hidden_size", "num_layers", "source"):
        if previous.get(name) != target_identity[name]:
            raise SpecdeployError(f"--resume: the checkpoint in {out} was distilled from {previous.get('source')} "
                                  f"({name} {previous.get(name)}), not from {target_identity['source']} "
                                  f"({name} {target_identity[name]})")
    for name, value in fingerprint.items():
        before = state.get("fingerprint", {}).get(name)
        if before != value:
            shown = lambda v: " ".join(map(str, v)) if isinstance(v, list) else v  # noqa: E731
            raise SpecdeployError(f"--resume: the checkpoint in {out} was made with {FLAGS[name]} {shown(before)}, "
                                  f"this run has {FLAGS[name]} {shown(value)} (repeat the original options)")


def save_state(out: Path, state: dict) -> None:
    import torch

    atomic_write(out / STATE_FILE, lambda temporary: torch.save(state, temporary))


def load_state(out: Path) -> dict:
    import torch

    try:
        return torch.load(out / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file raises several types
        raise SpecdeployError(f"--resume: {out / STATE_FILE} cannot be read ({type(exc).__name__}); "
                              "it is not a complete checkpoint") from None


def copy_tokenizer(out: Path, target) -> None:
    """The target's tokenizer files, as they are (a .gguf target's tokenizer, converted from its metadata, is saved
    as its fast tokenizer only, named as export names it: export/gguf.py)."""
    if target.folder is not None:
        for name in TOKENIZER_FILES:
            if (target.folder / name).is_file():
                atomic_write(out / name, lambda temporary, name=name: shutil.copyfile(target.folder / name, temporary))
        return
    from ..export.gguf import save_tokenizer

    with tempfile.TemporaryDirectory(dir=out, prefix=".tokenizer.") as folder:
        save_tokenizer(target.tokenizer, Path(folder), legacy_format=False)
        for file in Path(folder).iterdir():
            if file.is_file():
                os.replace(file, out / file.name)


def _move_files(folder: Path, out: Path) -> list[str]:
    names = []
    for file in sorted(Path(folder).iterdir()):
        if file.is_file():
            os.chmod(file, 0o666 & ~_umask())
            os.replace(file, out / file.name)
            names.append(file.name)
    return names


def write_model_draft(out: Path, draft, target, draft_info: dict) -> list[str]:
    """An HF checkpoint `export --draft` takes: the LM with a full-vocabulary head (see ModelDraft.to_hf)."""
    import copy as copying

    lm = draft.to_hf(target)
    lm.config.specdeploy_draft = draft_info
    lm.generation_config = copying.deepcopy(target.model.generation_config)
    with tempfile.TemporaryDirectory(dir=out, prefix=".draft.") as folder:
        lm.save_pretrained(folder, safe_serialization=True)
        return _move_files(Path(folder), out)


def write_eagle_draft(out: Path, head, draft_info: dict) -> list[str]:
    """model.safetensors (the head's own weights) and config.json {"specdeploy_draft": {...}}; see docs/distill.md."""
    from safetensors.torch import save_file

    state = {name: tensor.detach().cpu().contiguous() for name, tensor in head.state_dict().items()}
    atomic_write(out / "model.safetensors", lambda temporary: save_file(state, str(temporary), metadata={"format": "pt"}))
    write_json(out / "config.json", {"specdeploy_draft": draft_info})
    return ["model.safetensors", "config.json"]
