"""Logits processing (temperature, top-k, top-p) and drawing tokens, as pure NumPy functions.

Speculative sampling applies the same processing to the draft's and the target's logits, so the
distribution it preserves is exactly the one target-only sampling draws from.

The softmax and the draws of float32 rows (the runtime's) run in a small C extension when it was
built at install (`_fastsample.c`, compiled whenever a C compiler is present): one call per row
instead of about fifteen NumPy calls, each of which runs cold right after an ONNX Runtime pass. The
NumPy code here computes the same quantities (tests hold the two together, to float rounding) and
runs where the extension is missing. Either way, target-only sampling and the verify scan form
their distributions through the same function, so they agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

try:
    from . import _fastsample
except ImportError:  # no C compiler at install time: NumPy computes the same, only slower
    _fastsample = None


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax); no distribution is formed
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Logits [n, vocab] -> probabilities [n, vocab] after temperature, then top-k, then top-p (as transformers orders them).

    float32 throughout: this runs for sampled tokens, and float32 ratios of probabilities are exact
    to ~1e-7, far below anything a 100k-trial distribution test can see. Every row is computed alone
    (in C, or by the same NumPy arithmetic), so a row's bits do not depend on the rows beside it.
    """
    logits = np.asarray(logits, dtype=np.float32)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:  # the same set before or after dividing by a positive temperature
        kth = np.partition(logits, vocab - params.top_k, axis=-1)[:, vocab - params.top_k][:, None]  # [n, 1]
        logits = np.where(logits < kth, np.float32(-np.inf), logits)
    probs = np.empty(logits.shape, dtype=np.float32)
    for row, out in zip(logits, probs):
        softmax_row(row, out, params.temperature)
    if params.top_p < 1.0:
        for row in probs:
            _top_p_row(row, params.top_p)
    return probs


def c_takes(*arrays: np.ndarray) -> bool:
    """Whether the C kernel was built and takes these arrays as they are (float32, C-contiguous); else NumPy runs."""
    if _fastsample is None:
        return False
    for a in arrays:  # a loop, not all() over a generator: this runs once a round, cold
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            return False
    return True


def softmax_row(logits: np.ndarray, out: np.ndarray, temperature: float) -> None:
    """out [vocab] = softmax(logits [vocab] / temperature), float32; -inf logits get probability 0."""
    if c_takes(logits, out):
        _fastsample.softmax(logits, out, 1.0 / temperature)
        return
    np.multiply(logits, np.float32(1.0 / temperature), out=out)
    out -= out.max()
    np.exp(out, out=out)
    out *= np.float32(1.0) / out.sum(dtype=np.float32)


def _temperature_only(params: SamplingParams, vocab: int) -> bool:
    return not 0 < params.top_k < vocab and params.top_p >= 1.0


def distribution(logits: np.ndarray, params: SamplingParams, out: np.ndarray) -> np.ndarray:
    """out [vocab] = process_logits(logits [vocab], params) for one row, without its allocations when temperature alone applies."""
    if _temperature_only(params, logits.shape[-1]) and logits.dtype == np.float32:
        softmax_row(logits, out, params.temperature)
    else:
        out[...] = process_logits(logits[None], params)[0]
    return out


def row_sampler(params: SamplingParams, vocab: int) -> Callable[[np.ndarray, float, np.ndarray], int]:
    """sample(logits [vocab], uniform, out [vocab]) -> the token that uniform (in [0, 1)) draws from the logits
    processed by params; out receives the distribution it was drawn from.

    Made once per generate call: the per-token call then does only the work (with temperature alone and
    the C extension, one call that forms the same softmax as distribution() and draws from it, from
    the exponentials just before they are divided by their sum: the same distribution, without a
    second pass over the row). The caller takes the uniforms from its generator, a round's worth in
    one call."""
    def general(logits: np.ndarray, uniform: float, out: np.ndarray) -> int:
        return draw(distribution(logits, params, out), uniform)

    if _fastsample is None or not _temperature_only(params, vocab):
        return general
    softmax, inverse = _fastsample.softmax, 1.0 / params.temperature

    def fast(logits: np.ndarray, uniform: float, out: np.ndarray) -> int:
        try:
            return softmax(logits, out, inverse, uniform)
        except TypeError:  # not float32, or not contiguous: the same draw, in NumPy
            return general(np.ascontiguousarray(logits, dtype=np.float32), uniform, out)

    return fast


UNIFORM_BLOCK = 256  # uniforms a BlockGenerator draws at a time
_FLOAT64 = np.float64


class BlockGenerator(np.random.Generator):
    """np.random.default_rng(seed), whose float64 uniforms are drawn UNIFORM_BLOCK at a time.

    random() and random(size) return exactly the numbers, in the order, that the plain generator's
    calls would: PCG64 fills an array with the draws that as many scalar calls would make. A round
    takes its uniforms in two calls (the draft's k, the verify scan's k + 1); each costs a slice here
    instead of a NumPy call, which runs cold right after an ONNX Runtime pass. Other draws (another
    dtype, `out=`, other distributions) come from the bit generator past the block drawn ahead."""

    def __init__(self, seed: int | None = None):
        super().__init__(np.random.PCG64(seed))
        self._block = super().random(UNIFORM_BLOCK)
        self._next = 0

    def random(self, size=None, dtype=_FLOAT64, out=None):
        if (dtype is not _FLOAT64 and np.dtype(dtype) != _FLOAT64) or out is not None:
            return super().random(size, dtype, out)
        start = self._next
        if size is None:
            if start < UNIFORM_BLOCK:
                self._next = start + 1
                return self._block.item(start)
            count = 1
        elif type(size) is int and size >= 0:
            count = size
        else:  # a shape: checked as NumPy checks it, before a number is taken
            count = int(np.prod(np.empty(size, dtype=np.bool_).shape))
        end = start + count
        if end > len(self._block):  # the rest of this block, then a new one
            self._block = np.concatenate([self._block[start:], super().random(max(UNIFORM_BLOCK, count))])
            start, end = 0, count
        self._next = end
        if size is None:
            return self._block.item(start)
        return self._block[start:end].reshape(size) if type(size) is not int else self._block[start:end]


def _top_p_row(row: np.ndarray, top_p: float, candidates: int = 64) -> None:
    """Zero, in place, every token outside the smallest most-probable set whose mass reaches top_p; renormalize.

    A token stays if the mass of the tokens ranked before it is below top_p. Only the few most
    probable tokens are sorted (argpartition), unless they hold less than top_p of the mass.
    """
    vocab = row.shape[0]
    count = min(candidates, vocab)
    while True:
        top = np.argpartition(row, vocab - count)[vocab - count :] if count < vocab else np.arange(vocab)
        top = top[np.argsort(-row[top], kind="stable")]  # [count], most probable first
        mass_before = np.cumsum(row[top]) - row[top]
        if count == vocab or mass_before[-1] + row[top[-1]] >= top_p:
            break
        count = min(vocab, count * 8)
    keep = top[mass_before < top_p]
    kept = row[keep]
    row[:] = 0.0
    row[keep] = kept / kept.sum()


BLOCK = 64


def draw(weights: np.ndarray, uniform: float) -> int:
    """One inverse-CDF draw from weights [vocab] (non-negative, not necessarily normalized).

    Two levels: a cumulative sum over blocks of 64 (their sums are one vectorized reduction),
    then one inside the chosen block. np.cumsum over a whole 8k vocabulary is sequential and cost
    24 us, more than the softmax before it; this costs ~5 us and draws from the same distribution.
    float32 rows go to the C extension, which draws the same way."""
    if c_takes(weights):
        return _fastsample.draw(weights, uniform)
    vocab = weights.shape[0]
    full = vocab - vocab % BLOCK
    sums = weights[:full].reshape(-1, BLOCK).sum(axis=1)
    if full < vocab:
        sums = np.append(sums, weights[full:].sum())
    cdf = np.cumsum(sums)
    if not (0 < cdf[-1] < np.inf):  # no mass, or NaN / infinite weights: no distribution (as in C)
        raise ValueError("weights have no positive entry")
    point = uniform * cdf[-1]
    block = int(np.searchsorted(cdf, point, side="right"))
    if block >= len(cdf):  # rounding ran off the end: the last block with mass
        block = int(np.flatnonzero(sums)[-1])
        point = cdf[block] - (cdf[block - 1] if block else 0.0)
    else:
        point -= cdf[block - 1] if block else 0.0
    start = block * BLOCK
    inner = weights[start : start + BLOCK]
    index = int(np.searchsorted(np.cumsum(inner), point, side="right"))
    if index >= len(inner) or inner[index] == 0:  # rounding between the two levels: nearest token with mass
        nonzero = np.flatnonzero(inner)
        index = int(nonzero[min(np.searchsorted(nonzero, index), len(nonzero) - 1)])
    return start + index


def sample_tokens(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws: probs [n, vocab] (rows sum to 1, up to rounding), uniforms [n] in [0, 1) -> token ids [n]."""
    if probs.shape[0] == 1:  # the runtime's case
        return np.array([draw(probs[0], float(uniforms[0]))])
    cdf = np.cumsum(probs, axis=-1)  # [n, vocab]
    targets = uniforms * cdf[:, -1]
    tokens = (cdf <= targets[:, None]).sum(axis=-1)
    # Rounding can leave a draw past the last token with mass; land it on the last such token.
    last_nonzero = probs.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)
    return np.minimum(tokens, last_nonzero)


def residual_draw(target_probs: np.ndarray, draft_probs: np.ndarray, uniform: float) -> int:
    """One draw from normalize(max(0, target_probs - draft_probs)) (both [vocab]), the recovered token of
    speculative sampling; from target_probs when the residual has no mass (the rows are equal up to rounding)."""
    if c_takes(target_probs, draft_probs):
        return _fastsample.residual_draw(target_probs, draft_probs, uniform)
    residual = np.maximum(target_probs - draft_probs, 0.0)
    return draw(residual if residual.sum() > 0 else target_probs, uniform)
