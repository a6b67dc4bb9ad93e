"""Oracles for tests and the lossless check (`specdeploy verify --lossless`, lossless.py): what the runtime must equal.

Nothing on the way to a token imports this module (a test proves it; only the lossless check, which
measures the runtime against it, does): it holds the slow, obvious computations that the fast paths
are measured against.
"""

from __future__ import annotations

import numpy as np

from .runtime.generate import Generator
from .runtime.sampling import SamplingParams, process_logits


# The sampled settings users run (each benchmarked in docs/performance.md), as generate's options:
# what the lossless checks of the tests and of `specdeploy verify --lossless` go through.
SAMPLED_SETTINGS = {
    "T 0.8": dict(temperature=0.8),
    "T 0.8, top-k 50": dict(temperature=0.8, top_k=50),
    "T 0.8, top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "T 0.8, top-k 50, top-p 0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
    "T 0.8, min-p 0.05": dict(temperature=0.8, min_p=0.05),
    "T 0.8, top-p 0.95, repetition penalty 1.1": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1),
    "T 0.8, presence penalty 1.5": dict(temperature=0.8, presence_penalty=1.5),
    "T 0.8, frequency penalty 1.0": dict(temperature=0.8, frequency_penalty=1.0),
}


def exact_continuation_probs(generator: Generator, prompt_ids: list[int], params: SamplingParams,
                             length: int, min_probability: float = 0.0) -> dict[tuple[int, ...], float]:
    """The probability of every `length`-token continuation under the target alone.

    The reference that sampled speculative decoding is tested against: computed from the target's
    processed distributions, position by position, with no draft involved. Over a whole vocabulary
    (no small top-k) pass min_probability: only continuations at least that likely are formed (a
    prefix below it has no such continuation), and their total falls short of 1 by the rest."""
    def probs(context: list[int]) -> np.ndarray:  # [vocab]
        logits = generator.target.logits_after(context, generator.target_cache)  # [vocab]
        generated = context[len(prompt_ids) :]  # what the presence and frequency penalties count
        return process_logits(logits[None], params, [context], [generated])[0].astype(np.float64)

    result: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        extended = {}
        for sequence, probability in result.items():
            row = probability * probs(prompt_ids + list(sequence))
            for token in np.flatnonzero((row > 0) & (row >= min_probability)):
                extended[sequence + (int(token),)] = row[token]
        result = extended
    return result
