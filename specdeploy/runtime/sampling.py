"""Logits processing (temperature, top-k, top-p) and drawing tokens, as pure NumPy functions.

Speculative sampling applies the same processing to the draft's and the target's logits, so the
distribution it preserves is exactly the one target-only sampling draws from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

    float32 throughout: this runs for every draft token, and float32 ratios of probabilities are exact
    to ~1e-7, far below anything a 100k-trial distribution test can see.
    """
    probs = np.multiply(logits, np.float32(1.0 / params.temperature), dtype=np.float32)  # a fresh buffer we own
    vocab = probs.shape[-1]
    if probs.shape[0] == 1 and not 0 < params.top_k < vocab and params.top_p >= 1.0:
        # One row, temperature only (every draft token): the same arithmetic on a 1-D view, where each
        # NumPy call costs ~1 us instead of ~4 us for the keepdims reductions.
        row = probs[0]
        row -= row.max()
        np.exp(row, out=row)
        row *= np.float32(1.0) / row.sum(dtype=np.float32)
        return probs
    if 0 < params.top_k < vocab:
        kth = np.partition(probs, vocab - params.top_k, axis=-1)[:, vocab - params.top_k][:, None]  # [n, 1]
        probs[probs < kth] = -np.inf
    probs -= probs.max(axis=-1, keepdims=True)
    np.exp(probs, out=probs)
    probs *= np.float32(1.0) / probs.sum(axis=-1, keepdims=True, dtype=np.float32)  # as the one-row path
    if params.top_p < 1.0:
        for row in probs:
            _top_p_row(row, params.top_p)
    return probs


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
    24 us, more than the softmax before it; this costs ~5 us and draws from the same distribution."""
    vocab = weights.shape[0]
    full = vocab - vocab % BLOCK
    sums = weights[:full].reshape(-1, BLOCK).sum(axis=1)
    if full < vocab:
        sums = np.append(sums, weights[full:].sum())
    cdf = np.cumsum(sums)
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


def sample_token(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One inverse-CDF draw from probs [vocab]: one cumsum and a binary search."""
    return draw(probs, rng.random())
