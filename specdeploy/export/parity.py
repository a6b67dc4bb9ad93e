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
from ..runtime import OrtEngine, SessionConfig, global_pool_active

# Natural text makes the greedy check meaningful for trained models (on random ids every model is
# unsure, and rounding flips near-ties that no user would see).
PARITY_TEXT = '''def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1 if it is absent."""
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1
'''
FP32_MAX_ABS_DIFF = 1e-3
# Minimum greedy-token agreement where weights are rounded (stated in the README).
GREEDY_AGREEMENT = {"fp16": 0.9, "int8": 0.8, "int4": 0.6}


def tolerance_for(dtype: str, quantize: str) -> tuple[str, float]:
    if quantize != "none":
        return "greedy_agreement", GREEDY_AGREEMENT[quantize]
    if dtype == "fp16":
        return "greedy_agreement", GREEDY_AGREEMENT["fp16"]
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


def check_parity(
    torch_model,
    onnx_path: Path,
    spec: ModelSpec,
    tokenizer_json: Path,
    prefill_tokens: int = 32,
    verify_tokens: int = 5,
) -> ParityReport:
    import torch

    # A short --max-context caps the check (the fused graph's rotary tables end there).
    verify_tokens = min(verify_tokens, max(1, spec.max_context // 2))
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
