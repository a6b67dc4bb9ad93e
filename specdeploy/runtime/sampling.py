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
        order = np.argsort(-probs, axis=-1, kind="stable")  # [n, vocab]
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is below top_p.
        mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs[~keep] = 0.0
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample_tokens(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws: probs [n, vocab] (rows sum to 1, up to rounding), uniforms [n] in [0, 1) -> token ids [n]."""
    cdf = np.cumsum(probs, axis=-1)  # [n, vocab]
    targets = uniforms * cdf[:, -1]
    tokens = (cdf <= targets[:, None]).sum(axis=-1)
    # Rounding can leave a draw past the last token with mass; land it on the last such token.
    last_nonzero = probs.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)
    return np.minimum(tokens, last_nonzero)


def sample_token(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from probs [vocab]."""
    return int(sample_tokens(probs[None], rng.random(1))[0])
