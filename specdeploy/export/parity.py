"""Parity: the exported model in ONNX Runtime (through the runtime's own engine) against PyTorch.

Two checks on the same natural text (PARITY_TEXT: code, prose, a chat):
  (a) prefill: `prefill_tokens` tokens on an empty past (at least 256, and past any sliding window);
  (b) verify: `verify_tokens` (k + 1) tokens on top of a past of `past_tokens`, against a single
      no-cache PyTorch pass over the whole sequence, so it also proves that multi-token input
      with a past gives the logits of a plain forward pass.
fp32 must agree within an absolute logit tolerance; fp16 and quantized weights cannot, so for them
the check is how often the greedy (argmax) token agrees.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..bundle import ModelSpec, ParityReport
from ..runtime import OrtEngine, SessionConfig, global_pool_active

# Natural text makes the greedy check meaningful for trained models (on random ids every model is
# unsure, and rounding flips near-ties that no user would see): code, prose, a chat, other scripts.
PARITY_TEXT = (Path(__file__).resolve().parent.parent / "data" / "parity_text.txt").read_text(encoding="utf-8")
PARITY_TOKENS = 256  # at least this many positions compared, and past any sliding window (below)
FP32_MAX_ABS_DIFF = 1e-3
# Minimum greedy-token agreement where weights are rounded (stated in the README). A target's tokens
# are the output, so a rounded target must keep its fp32 model's greedy choice nearly everywhere
# (--allow-lossy lets a lower figure through, recorded in the manifest); a draft's tokens are only
# proposals the target checks, so a rounded draft only needs to stay useful.
GREEDY_AGREEMENT = {
    "target": {"fp16": 0.95, "int8": 0.95, "int4": 0.95},
    "draft": {"fp16": 0.9, "int8": 0.8, "int4": 0.6},
}


def tolerance_for(dtype: str, quantize: str, role: str = "target") -> tuple[str, float]:
    if quantize != "none":
        return "greedy_agreement", GREEDY_AGREEMENT[role][quantize]
    if dtype == "fp16":
        return "greedy_agreement", GREEDY_AGREEMENT[role]["fp16"]
    return "max_abs_diff", FP32_MAX_ABS_DIFF


def parity_tokens(tokenizer_json: Path, vocab_size: int, count: int, seed: int = 0) -> np.ndarray:
    """`count` ids of PARITY_TEXT, topped up with seeded random ids if the text is too short."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_json)).encode(PARITY_TEXT, add_special_tokens=False).ids[:count]
    ids = [i for i in ids if i < vocab_size]
    rng = np.random.default_rng(seed)
    # Skip the lowest ids: special tokens are often there and say little about the weights.
    low = min(4, vocab_size - 1)
    extra = rng.integers(low, vocab_size, size=count - len(ids))
    return np.concatenate([np.asarray(ids, dtype=np.int64), extra.astype(np.int64)])


def attention_window(config) -> int | None:
    """The sliding window some of the model's layers attend within, if any (Mistral, Qwen2, Gemma 3)."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", "") == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return window if isinstance(window, int) and window > 0 else None


def parity_length(config, max_context: int, verify_tokens: int) -> int:
    """Prefill positions to compare: PARITY_TOKENS with the verify pass's, or 64 past the sliding window."""
    window = attention_window(config)
    wanted = max(PARITY_TOKENS - verify_tokens, window + 64 if window else 0)
    return max(1, min(wanted, max_context - verify_tokens))


def overall_agreement(prefill_tokens: int, prefill_agreement: float, verify_tokens: int, verify_agreement: float) -> float:
    """Greedy agreement over all compared positions, prefill and verify together."""
    return (prefill_tokens * prefill_agreement + verify_tokens * verify_agreement) / (prefill_tokens + verify_tokens)


def check_parity(
    torch_model,
    onnx_path: Path,
    spec: ModelSpec,
    tokenizer_json: Path,
    prefill_tokens: int | None = None,
    verify_tokens: int = 5,
) -> ParityReport:
    """Compare the ONNX model with PyTorch; prefill_tokens defaults to parity_length (256 or past the window)."""
    import torch

    # A short --max-context caps the check (the fused graph's rotary tables end there).
    verify_tokens = min(verify_tokens, max(1, spec.max_context // 2))
    if prefill_tokens is None:
        prefill_tokens = parity_length(torch_model.config, spec.max_context, verify_tokens)
    if spec.attention_window:  # a windowed draft equals full attention only within its window
        prefill_tokens = min(prefill_tokens, spec.attention_window - verify_tokens)
    prefill_tokens = min(prefill_tokens, spec.max_context - verify_tokens)
    ids = parity_tokens(tokenizer_json, spec.vocab_size, prefill_tokens + verify_tokens)
    with torch.no_grad():
        reference = torch_model(input_ids=torch.from_numpy(ids)[None]).logits[0].float().numpy()  # [P + V, vocab]

    # Per-session threads leave the process free for optimum's own sessions, unless a runtime in this
    # process already switched ONNX Runtime to the shared pool (then optimum cannot run here either).
    engine = OrtEngine(onnx_path, spec, SessionConfig(device="cpu", shared_threads=global_pool_active()))
    prefill_cache = engine.new_cache(prefill_tokens + verify_tokens)
    prefill_logits = engine.run(ids[:prefill_tokens], prefill_cache)  # [P, vocab]
    verify_logits = engine.run(ids[prefill_tokens:], prefill_cache)  # [V, vocab]

    def agreement(ours: np.ndarray, theirs: np.ndarray) -> float:
        return float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))

    prefill_diff = float(np.abs(prefill_logits - reference[:prefill_tokens]).max())
    verify_diff = float(np.abs(verify_logits - reference[prefill_tokens:]).max())
    prefill_agree = agreement(prefill_logits, reference[:prefill_tokens])
    verify_agree = agreement(verify_logits, reference[prefill_tokens:])
    check, tolerance = tolerance_for(spec.dtype, spec.quantize, spec.role)
    if check == "max_abs_diff":
        passed = max(prefill_diff, verify_diff) <= tolerance
    else:  # over every position compared: a 5-token verify alone moves in steps of 0.2
        passed = overall_agreement(prefill_tokens, prefill_agree, verify_tokens, verify_agree) >= tolerance
    return ParityReport(
        prefill_tokens=prefill_tokens,
        past_tokens=prefill_tokens,
        verify_tokens=verify_tokens,
        prefill_max_abs_diff=prefill_diff,
        verify_max_abs_diff=verify_diff,
        prefill_greedy_agreement=prefill_agree,
        verify_greedy_agreement=verify_agree,
        check=check,
        tolerance=tolerance,
        passed=bool(passed),
    )
