"""Parity: the exported model in ONNX Runtime (through the runtime's own engine) against PyTorch.

Two checks on the same random tokens:
  (a) prefill: `prefill_tokens` tokens on an empty past;
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
from ..runtime.engine import OrtEngine, SessionConfig

FP32_MAX_ABS_DIFF = 1e-3
# Minimum greedy-token agreement where weights are rounded (stated in the README).
GREEDY_AGREEMENT = {"fp16": 0.9, "int8": 0.8, "int4": 0.6}


def tolerance_for(dtype: str, quantize: str) -> tuple[str, float]:
    if quantize != "none":
        return "greedy_agreement", GREEDY_AGREEMENT[quantize]
    if dtype == "fp16":
        return "greedy_agreement", GREEDY_AGREEMENT["fp16"]
    return "max_abs_diff", FP32_MAX_ABS_DIFF


def check_parity(
    torch_model,
    onnx_path: Path,
    spec: ModelSpec,
    prefill_tokens: int = 8,
    verify_tokens: int = 5,
    seed: int = 0,
) -> ParityReport:
    import torch

    rng = np.random.default_rng(seed)
    # Skip the lowest ids: special tokens are often there and say little about the weights.
    low = min(4, spec.vocab_size - 1)
    ids = rng.integers(low, spec.vocab_size, size=prefill_tokens + verify_tokens, dtype=np.int64)
    with torch.no_grad():
        reference = torch_model(input_ids=torch.from_numpy(ids)[None]).logits[0].float().numpy()  # [P + V, vocab]

    engine = OrtEngine(onnx_path, spec, SessionConfig(device="cpu", allow_spinning=True))
    prefill_cache = engine.new_cache(prefill_tokens + verify_tokens)
    prefill_logits = engine.forward(ids[:prefill_tokens], prefill_cache)  # [P, vocab]
    verify_logits = engine.forward(ids[prefill_tokens:], prefill_cache)  # [V, vocab]

    def agreement(ours: np.ndarray, theirs: np.ndarray) -> float:
        return float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))

    prefill_diff = float(np.abs(prefill_logits - reference[:prefill_tokens]).max())
    verify_diff = float(np.abs(verify_logits - reference[prefill_tokens:]).max())
    prefill_agree = agreement(prefill_logits, reference[:prefill_tokens])
    verify_agree = agreement(verify_logits, reference[prefill_tokens:])
    check, tolerance = tolerance_for(spec.dtype, spec.quantize)
    if check == "max_abs_diff":
        passed = max(prefill_diff, verify_diff) <= tolerance
    else:
        passed = min(prefill_agree, verify_agree) >= tolerance
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
