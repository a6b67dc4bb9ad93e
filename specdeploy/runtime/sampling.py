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
    if 0 < params.top_k < vocab:
        kth = np.partition(probs, vocab - params.top_k, axis=-1)[:, vocab - params.top_k][:, None]  # [n, 1]
        probs[probs < kth] = -np.inf
    probs -= probs.max(axis=-1, keepdims=True)
    np.exp(probs, out=probs)
    probs /= probs.sum(axis=-1, keepdims=True)
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


def sample_tokens(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws: probs [n, vocab] (rows sum to 1, up to rounding), uniforms [n] in [0, 1) -> token ids [n]."""
    if probs.shape[0] == 1:  # the runtime's case: a binary search beats a pass over the vocabulary
        cdf = np.cumsum(probs[0])
        index = int(np.searchsorted(cdf, uniforms[0] * cdf[-1], side="right"))
        return np.array([index if index < len(cdf) else int(np.flatnonzero(probs[0])[-1])])
    cdf = np.cumsum(probs, axis=-1)  # [n, vocab]
    targets = uniforms * cdf[:, -1]
    tokens = (cdf <= targets[:, None]).sum(axis=-1)
    # Rounding can leave a draw past the last token with mass; land it on the last such token.
    last_nonzero = probs.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)
    return np.minimum(tokens, last_nonzero)


def sample_token(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One inverse-CDF draw from probs [vocab]: one cumsum and a binary search."""
    # The first entry past the draw always has mass; only rounding can run off the end.
    return int(sample_tokens(probs[None], np.array([rng.random()]))[0])
