"""The export's options (`ExportConfig`), checked, and what they make of each model's weights.

`weights_for` decides what each model of a bundle keeps: a GGUF's own quantized blocks (gguf), float
weights (none), or weights rounded to int8 / int4 here; the rest of the export follows from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import SpecdeployError

DTYPES = ("fp32", "fp16")
GRAPHS = ("auto", "fused", "optimum")
MIN_DRAFT_WINDOW = 64  # parity compares a windowed draft over its window (59 + 5 tokens at the least)
QUANTIZE = ("gguf", "none", "int8", "int4")


@dataclass(frozen=True)
class ExportConfig:
    target: str  # checkpoint folder (or a hub id already in the local cache)
    draft: str | None  # None: a bundle of the target alone, which the runtime drafts by prompt lookup
    out: str  # the bundle folder to create
    dtype: str = "fp32"  # fp32 | fp16
    # Both models' weights. gguf: a .gguf checkpoint's own quantized blocks, kept as they are (blocks.py);
    # none: float; int8 | int4: weight-only MatMulNBits rounded here. auto: gguf for a .gguf checkpoint
    # whose architecture export reads in place (gguf_weights.ARCHITECTURES), none for anything else.
    quantize: str = "auto"
    # The draft alone: gguf | none | int8 | int4, or auto. The draft's numbers never reach the output (the
    # target verifies every token), so a quantized draft only trades a little acceptance for a
    # cheaper step. auto: gguf for a .gguf draft read in place; else int8 when the draft's weights are
    # float32 and the target is unquantized or a GGUF's blocks (measured on codepair: draft step 0.38 ->
    # 0.17 ms, speculative greedy 1.12x and sampled 1.14x faster, same output), kept in fp32 if the
    # quantized draft fails its parity check; otherwise as quantize.
    draft_quantize: str = "auto"
    # Each draft query attends to its last this-many positions, itself included (None: all). Output is unchanged
    # (the target checks every token); a draft trained on short windows proposes better past them
    # and reads less: codepair (trained on 512) at 1,920-token prompts with 512: acceptance 0.32
    # -> 0.41, speculative 348 -> 405 tok/s. Needs the fused graph for the draft.
    draft_window: int | None = None
    max_context: int | None = None  # default: the smaller max_position_embeddings of the two
    force: bool = False  # replace an existing --out, if it is a specdeploy bundle (or an empty folder)
    # An --out that already holds a bundle (perhaps made by a concurrent export while this one
    # waited for the lock) is kept and its manifest returned: the default bundle's first use.
    reuse_existing: bool = False
    trust_remote_code: bool = False  # run model code shipped with a checkpoint (auto_map)
    allow_pickle: bool = False  # load pytorch_model.bin (pickle) weights when a checkpoint has no safetensors
    opset: int | None = None  # default: optimum's choice for the architecture
    # auto: the fused in-place-KV graph where the architecture allows it (fused.unsupported_reason),
    # optimum's graph elsewhere; fused / optimum force one (fused fails where it cannot apply).
    graph: str = "auto"
    # Keep a rounded (int8 / int4 / fp16) target whose greedy agreement with its fp32 model falls below
    # the parity threshold; the manifest records the figure and this option.
    allow_lossy: bool = False
    # The draft's head covers this many of the most frequent tokens: by the counts of a distilled draft
    # folder's draft_vocab.json, or for any other draft by the target's tokens over draft_vocab_text
    # (draft_vocab.py); None: the folder's own subset if it has one, else the whole vocabulary; 0: the whole vocabulary.
    draft_vocab: int | None = None
    # UTF-8 text files (a sample of the traffic to serve) whose tokens rank draft_vocab for a draft without
    # draft_vocab.json; empty: the texts specdeploy/data/ ships (code).
    draft_vocab_text: tuple[str, ...] = ()


# stage name, detail -> None; the CLI draws progress from it, library callers may pass None.
Reporter = Callable[[str, str], None]


def check_options(config: ExportConfig) -> Path:
    if config.dtype not in DTYPES:
        raise SpecdeployError(f"unknown --dtype '{config.dtype}' (choose from {', '.join(DTYPES)})")
    if config.quantize not in ("auto", *QUANTIZE):
        raise SpecdeployError(f"unknown --quantize '{config.quantize}' (choose from auto, {', '.join(QUANTIZE)})")
    if config.draft_quantize not in ("auto", *QUANTIZE):
        raise SpecdeployError(
            f"unknown --draft-quantize '{config.draft_quantize}' (choose from auto, {', '.join(QUANTIZE)})"
        )
    if config.draft_window is not None and config.draft_window < MIN_DRAFT_WINDOW:
        raise SpecdeployError(f"--draft-window must be at least {MIN_DRAFT_WINDOW} (got {config.draft_window})")
    if config.graph not in GRAPHS:
        raise SpecdeployError(f"unknown --graph '{config.graph}' (choose from {', '.join(GRAPHS)})")
    if config.dtype != "fp32" and (config.quantize not in ("auto", "none")
                                   or config.draft_quantize not in ("auto", "none")):
        raise SpecdeployError("--quantize/--draft-quantize gguf/int8/int4 are weights beside fp32 activations; "
                              "use them with --dtype fp32")
    if config.draft_vocab is not None and config.draft_vocab < 0:
        raise SpecdeployError(f"--draft-vocab {config.draft_vocab}: must be a count of tokens (0: the whole vocabulary)")
    if config.draft is None:
        given = [flag for flag, value in (("--draft-quantize", config.draft_quantize != "auto"),
                                          ("--draft-window", config.draft_window is not None),
                                          ("--draft-vocab", bool(config.draft_vocab))) if value]
        if given:
            raise SpecdeployError(f"{given[0]} describes the draft model, and no --draft was given: pass --draft too, "
                                  f"or leave {given[0]} out")
    if config.draft_vocab_text:
        if not config.draft_vocab:
            raise SpecdeployError("--draft-vocab-text ranks the tokens --draft-vocab N keeps: pass --draft-vocab N too, "
                                  "or leave --draft-vocab-text out")
        from .draft_vocab import read_sample

        read_sample(tuple(config.draft_vocab_text))  # an unreadable or empty file is refused before any model loads
    if config.max_context is not None and config.max_context < 2:
        raise SpecdeployError("--max-context must be at least 2")
    out = Path(config.out).expanduser().resolve()
    if not out.parent.is_dir():
        raise SpecdeployError(f"--out {out}: the folder {out.parent} does not exist")
    return out


def max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def weights_for(role: str, config: ExportConfig, checkpoints: dict, eagle_draft: bool) -> tuple[str, bool]:
    """The model's weights (gguf, none, int8, int4), and whether auto chose int8 (then an fp32 fallback is allowed).
    eagle_draft: the draft is an eagle head, whose own weights are float (its checkpoint is the target's)."""
    in_file = {name: c.gguf_file is not None and config.dtype == "fp32" for name, c in checkpoints.items()}
    target = config.quantize if config.quantize != "auto" else ("gguf" if in_file["target"] else "none")
    if role == "target":
        chosen = target
    elif config.draft_quantize != "auto":
        chosen = config.draft_quantize
    elif in_file["draft"] and config.quantize in ("auto", "gguf") and not eagle_draft:
        chosen = "gguf"
    elif config.dtype == "fp32" and target in ("none", "gguf"):
        return "int8", True
    else:
        chosen = target
    if chosen == "gguf" and (checkpoints[role].gguf_file is None or (role == "draft" and eagle_draft)):
        what = checkpoints[role].source or checkpoints[role].path
        raise SpecdeployError(f"--{'quantize' if role == 'target' else 'draft-quantize'} gguf keeps a .gguf file's own "
                              f"blocks; the {role} ({what}) is not a GGUF whose architecture export reads in place "
                              f"({', '.join(gguf_architectures())}): choose none, int8 or int4")
    return chosen, False


def gguf_architectures() -> tuple[str, ...]:
    from .gguf_weights import ARCHITECTURES

    return ARCHITECTURES
