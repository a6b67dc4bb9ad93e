"""Parity: the exported model in ONNX Runtime (through the runtime's own engine) against PyTorch.

Two checks on the same natural text (PARITY_TEXT: code, prose, a chat):
  (a) prefill: `prefill_tokens` tokens on an empty past (at least 256, and past any sliding window);
  (b) verify: `verify_tokens` (k + 1) tokens on top of a past of `past_tokens`, against a single
      no-cache PyTorch pass over the whole sequence, so it also proves that multi-token input
      with a past gives the logits of a plain forward pass.
fp32 must agree within an absolute logit tolerance; fp16 and quantized weights cannot, so for them
the check is how often the greedy (argmax) token agrees. A GGUF's blocks (quantize gguf) are compared
with PyTorch over the same values, dequantized: what differs is the arithmetic (MatMulNBits
multiplies in int8), not the weights.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from ..bundle import ModelSpec, ParityReport
from ..runtime import OrtEngine, SessionConfig, global_pool_active
from ..runtime.engine import PREFILL_CHUNK
from .convert import release_freed_memory

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
    "target": {"fp16": 0.95, "int8": 0.95, "int4": 0.95, "gguf": 0.95},
    "draft": {"fp16": 0.9, "int8": 0.8, "int4": 0.6, "gguf": 0.8},
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
    load_model: Callable,
    onnx_path: Path,
    spec: ModelSpec,
    tokenizer_json: Path,
    model_config,
    prefill_tokens: int | None = None,
    verify_tokens: int = 5,
    columns: np.ndarray | None = None,
    eagle_head: Callable | None = None,
) -> ParityReport:
    """Compare the ONNX model with PyTorch; prefill_tokens defaults to parity_length (256 or past the window
    of model_config, the checkpoint's config). columns: the token ids of the graph's logits columns
    (a draft's vocabulary subset; None: all).

    The two copies of the weights are never resident together. ONNX Runtime runs first: the prefill
    in chunks of at most PREFILL_CHUNK tokens on one cache, as the runtime prefills, then the verify
    pass, each pass's logits rows written to a scratch file beside the graph as they come. Its session
    is let go before load_model() gives the PyTorch model, which then computes its rows chunk by
    chunk against the file's. No array of [prefill, vocab] logits exists (581 x 262,144 fp32 for
    Gemma 3 is 0.6 GB), and PyTorch's head is the model's own, not a copy.

    eagle_head(target_model) -> the distilled head: the graph is an eagle draft, and load_model gives
    its target. PyTorch runs first there (the target's features are the graph's input): the features
    and the head's reference rows, both small, then ONNX Runtime on them (_eagle_agreement)."""
    # A short --max-context caps the check (the fused graph's rotary tables end there).
    verify_tokens = min(verify_tokens, max(1, spec.max_context // 2))
    if prefill_tokens is None:
        prefill_tokens = parity_length(model_config, spec.max_context, verify_tokens)
    if spec.attention_window:  # a windowed draft equals full attention only within its window
        prefill_tokens = min(prefill_tokens, spec.attention_window - verify_tokens)
    prefill_tokens = min(prefill_tokens, spec.max_context - verify_tokens)
    # an eagle head's n positions read n + 1 tokens: the target's feature at i and the token at i + 1
    ids = parity_tokens(tokenizer_json, spec.vocab_size, prefill_tokens + verify_tokens + (eagle_head is not None))
    width = spec.vocab_subset or spec.vocab_size
    prefill, verify = Agreement(), Agreement()
    if eagle_head is not None:
        _eagle_agreement(load_model, eagle_head, onnx_path, spec, ids, prefill_tokens, columns, prefill, verify)
        return verdict(spec, prefill, verify, prefill_tokens, verify_tokens)
    with tempfile.TemporaryFile(dir=onnx_path.parent, prefix="parity-logits-") as onnx_rows:
        passes = _onnx_logits(onnx_path, spec, ids, prefill_tokens, onnx_rows)
        release_freed_memory()
        onnx_rows.seek(0)
        torch_model = load_model()
        reference = reference_logits(torch_model, ids)
        for start, stop in passes:
            ours = np.fromfile(onnx_rows, dtype=np.float32, count=(stop - start) * width).reshape(stop - start, -1)
            theirs = reference(start, stop)
            (verify if start == prefill_tokens else prefill).add(ours, theirs if columns is None else theirs[:, columns])
        del reference, torch_model
    return verdict(spec, prefill, verify, prefill_tokens, verify_tokens)


def _eagle_agreement(load_target: Callable, eagle_head: Callable, onnx_path: Path, spec: ModelSpec, ids: np.ndarray,
                     prefill_tokens: int, columns: np.ndarray | None, prefill: "Agreement", verify: "Agreement") -> None:
    """An eagle draft's parity over ids (n + 1 tokens): its n positions read (feature_i, ids[i + 1])."""
    from .eagle import EagleReference

    target = load_target()
    reference = EagleReference(eagle_head(target), target, columns)
    features = reference.features(ids)  # [n + 1, F]
    rows = reference.logits(features, ids)  # [n, columns]
    del reference, target
    release_freed_memory()
    width = spec.vocab_subset or spec.vocab_size
    with tempfile.TemporaryFile(dir=onnx_path.parent, prefix="parity-logits-") as onnx_rows:
        passes = _onnx_logits(onnx_path, spec, ids[1:], prefill_tokens, onnx_rows, features[:-1])
        onnx_rows.seek(0)
        for start, stop in passes:
            ours = np.fromfile(onnx_rows, dtype=np.float32, count=(stop - start) * width).reshape(stop - start, -1)
            (verify if start == prefill_tokens else prefill).add(ours, rows[start:stop])


def worst_abs_diff(*figures: float) -> float:
    """The largest figure, NaN if any is NaN (Python's max drops a NaN that comes second, and the check with it)."""
    return float(np.max(np.asarray(figures, dtype=np.float64)))


def verdict(spec: ModelSpec, prefill: "Agreement", verify: "Agreement", prefill_tokens: int,
            verify_tokens: int) -> ParityReport:
    """The parity report from the prefill's and the verify pass's agreement, judged by the tolerance of the
    model's precision (tolerance_for)."""
    check, tolerance = tolerance_for(spec.dtype, spec.quantize, spec.role)
    if check == "max_abs_diff":
        passed = worst_abs_diff(prefill.max_abs_diff, verify.max_abs_diff) <= tolerance
    else:  # over every position compared: a 5-token verify alone moves in steps of 0.2
        passed = overall_agreement(prefill_tokens, prefill.greedy_agreement, verify_tokens,
                                   verify.greedy_agreement) >= tolerance
    return ParityReport(
        prefill_tokens=prefill_tokens,
        past_tokens=prefill_tokens,
        verify_tokens=verify_tokens,
        prefill_max_abs_diff=prefill.max_abs_diff,
        verify_max_abs_diff=verify.max_abs_diff,
        prefill_greedy_agreement=prefill.greedy_agreement,
        verify_greedy_agreement=verify.greedy_agreement,
        check=check,
        tolerance=tolerance,
        passed=bool(passed),
    )


def _onnx_logits(onnx_path: Path, spec: ModelSpec, ids: np.ndarray,  # ids: [prefill + verify]
                 prefill_tokens: int, out, features: np.ndarray | None = None) -> list[tuple[int, int]]:
    """ONNX Runtime's prefill (in chunks, on one cache) and verify pass over ids, each pass's logits rows
    appended to the binary file out as float32 [rows, vocab]; returns each pass's (start, stop).
    features [len(ids), F]: an eagle draft's feature input, row i with ids[i]."""
    # Per-session threads leave the process free for optimum's own sessions, unless a runtime in this
    # process already switched ONNX Runtime to the shared pool (then optimum cannot run here either).
    # Each chunk's logits are written before the next pass, so they may land in the engine's scratch buffer.
    # An fp32 graph runs its MatMuls unpacked, without a second (repacked) copy of every weight: the same
    # kernels' arithmetic in another order. A quantized graph keeps packing: unpacked, MatMulNBits takes
    # another path (dequantized fp32 instead of accuracy_level's int8 arithmetic), and the check must
    # measure the kernels the runtime runs.
    prepack = not (spec.dtype == "fp32" and spec.quantize == "none")
    engine = OrtEngine(onnx_path, spec, SessionConfig(device="cpu", shared_threads=global_pool_active(),
                                                      prepack_weights=prepack), scratch_logits=True)
    cache = engine.new_cache(len(ids))
    # Equal chunks, none of a single token (a one-row pass takes other kernels than the runtime's prefill).
    chunks = np.array_split(np.arange(prefill_tokens), -(-prefill_tokens // PREFILL_CHUNK))
    passes = [(int(rows[0]), int(rows[-1]) + 1) for rows in chunks] + [(prefill_tokens, len(ids))]
    for start, stop in passes:
        rows = None if features is None else features[start:stop]
        np.asarray(engine.run(ids[start:stop], cache, rows), dtype=np.float32).tofile(out)
    out.flush()
    return passes


class Agreement:
    """The largest absolute logit difference and the greedy agreement, gathered chunk by chunk."""

    def __init__(self):
        self._max_abs_diff = np.float32(0.0)
        self._matches = self._rows = 0

    def add(self, ours: np.ndarray, theirs: np.ndarray) -> None:  # [rows, vocab] each
        # np.maximum, not max(): a NaN anywhere must stay in the figure (and fail the check).
        self._max_abs_diff = np.maximum(self._max_abs_diff, np.abs(ours - theirs).max())
        self._matches += int(np.count_nonzero(ours.argmax(-1) == theirs.argmax(-1)))
        self._rows += len(ours)

    @property
    def max_abs_diff(self) -> float:
        return float(self._max_abs_diff)

    @property
    def greedy_agreement(self) -> float:
        return self._matches / self._rows


def reference_logits(torch_model, ids: np.ndarray) -> Callable[[int, int], np.ndarray]:
    """PyTorch's logits of one no-cache pass over ids ([n]), as rows(start, stop) -> [stop - start, vocab] float32.

    The model runs once up to its output head, whose input (the hidden states, [n, hidden]) is
    kept; each call applies the head, and Gemma's final logit softcapping, to its rows only. That
    this gives the model's own logits is checked on the last row, which the model computes in
    full; a model whose logits come out of the head some other way is run whole instead (all its
    logits are then held)."""
    import torch

    input_ids = torch.from_numpy(ids)[None]
    head = torch_model.get_output_embeddings() if hasattr(torch_model, "get_output_embeddings") else None
    softcap = getattr(torch_model.config, "final_logit_softcapping", None)
    if isinstance(head, torch.nn.Linear):
        captured = []

        def keep_last_row(module, args):  # the head sees the hidden states; it computes the last row only
            if len(args) != 1 or not isinstance(args[0], torch.Tensor) or args[0].shape[:2] != input_ids.shape:
                return None
            captured.append(args[0])
            return (args[0][:, -1:],)

        handle = head.register_forward_pre_hook(keep_last_row)
        try:
            with torch.no_grad():
                last = torch_model(input_ids=input_ids).logits  # [1, 1, vocab] when the hook took the hidden states
        finally:
            handle.remove()

        # The head's own weights: the caller keeps the model while it asks for rows.
        weight = head.weight.detach()
        bias = None if head.bias is None else head.bias.detach()

        def rows(start: int, stop: int) -> np.ndarray:
            with torch.no_grad():
                logits = torch.nn.functional.linear(captured[0][:, start:stop], weight, bias)
                if softcap is not None:  # as Gemma 2 / 3 compute it (Gemma3ForCausalLM.forward)
                    logits = logits / softcap
                    logits = torch.tanh(logits)
                    logits = logits * softcap
            return logits[0].float().numpy()

        if len(captured) == 1 and last.shape[1] == 1 and np.array_equal(rows(len(ids) - 1, len(ids)), last[0].float().numpy()):
            return rows
    with torch.no_grad():
        logits = torch_model(input_ids=input_ids).logits[0].float().numpy()  # [n, vocab]
    return lambda start, stop: logits[start:stop]
