"""The rejection sampler of speculative decoding, as pure functions.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"). Vocabulary:
  - draft tokens: the k tokens the draft proposed, x_1..x_k, drawn from draft_probs;
  - accepted: x_i is kept with probability min(1, target_probs_i[x_i] / draft_probs_i[x_i]),
    scanning left to right until the first rejection;
  - recovered token: at the first rejection i, a token drawn from
    normalize(max(0, target_probs_i - draft_probs_i)), and the round ends;
  - bonus token: when all k are accepted, a token drawn from target_probs_{k+1}.
Every round therefore emits num_accepted + 1 tokens, and each is distributed exactly as the
target would have drawn it. (The shortcut "keep x when target_probs[x] >= draft_probs[x], else
discard" is not distribution-preserving; it is not used here.)

Greedy decoding is the temperature -> 0 limit: accept while the draft token is the target's
argmax, then emit the target's argmax.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import sampling
from .sampling import SamplingParams, distribution, draw, residual_draw, sample_tokens


def greedy_accept(draft_token_ids, target_logits: np.ndarray) -> tuple[int, int]:
    """draft_token_ids [k], target_logits [k + 1, vocab] -> (num_accepted, next_token).

    Rows are scanned up to the first mismatch only, as the sampled scan does."""
    for position, token in enumerate(draft_token_ids):
        choice = int(target_logits[position].argmax())
        if choice != token:
            return position, choice
    num_draft = len(draft_token_ids)
    return num_draft, int(target_logits[num_draft].argmax())


def rejection_sample(
    draft_token_ids: np.ndarray,  # [batch, k]
    draft_probs: np.ndarray,  # [batch, k, vocab]
    target_probs: np.ndarray,  # [batch, k + 1, vocab]
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (num_accepted [batch], next_token [batch]): the recovered or the bonus token of each row."""
    batch, num_draft = draft_token_ids.shape
    rows = np.arange(batch)[:, None]
    positions = np.arange(num_draft)[None, :]
    draft_p = draft_probs[rows, positions, draft_token_ids]  # [batch, k]
    target_p = target_probs[rows, positions, draft_token_ids]  # [batch, k]
    uniforms = rng.random((batch, num_draft))
    # u < t / d, written without the division; d > 0 for any token the draft actually drew.
    accepted = uniforms * draft_p < target_p  # [batch, k]
    num_accepted = np.where(accepted.all(axis=1), num_draft, np.argmin(accepted, axis=1))  # [batch]

    flat_rows = np.arange(batch)
    final_target = target_probs[flat_rows, num_accepted]  # [batch, vocab]
    rejected = num_accepted < num_draft
    final = final_target.copy()
    if rejected.any():
        at = np.minimum(num_accepted, num_draft - 1)
        residual = np.maximum(final_target - draft_probs[flat_rows, at], 0.0)  # [batch, vocab]
        mass = residual.sum(axis=-1, keepdims=True)
        # Zero residual mass only arises from rounding when the two rows are equal; then the target row is exact.
        usable = rejected[:, None] & (mass > 0)
        final = np.where(usable, residual / np.where(mass > 0, mass, 1.0), final_target)
    next_tokens = sample_tokens(final, rng.random(batch))
    return num_accepted, next_tokens


def rejection_sample_lazy(
    draft_token_ids: list[int],  # [k]
    draft_probs: np.ndarray,  # [k, vocab]
    target_row: Callable[[int], np.ndarray],  # i -> target_probs_i [vocab]
    rng: np.random.Generator,
) -> tuple[int, int]:
    """rejection_sample for one sequence, forming a target distribution only when the scan reaches it.

    The scan stops at the first rejection, so rows past it are never needed: at the sampled
    acceptance of the benchmark pair (~0.45) that skips the softmax of about half the k + 1 verify
    rows. Random numbers are drawn exactly as rejection_sample draws them for a batch of one (k
    uniforms, then one for the final draw), so both return the same tokens from the same state
    (the C residual draw sums in another order than NumPy: only a uniform within rounding of the
    boundary between two tokens could land on the other one)."""
    return _lazy_scan(draft_token_ids, draft_probs, target_row, rng.random(len(draft_token_ids) + 1))


def _lazy_scan(draft_token_ids, draft_probs, target_row, uniforms) -> tuple[int, int]:
    """rejection_sample_lazy with its k + 1 uniforms drawn ([k + 1]: k for the acceptance tests, one
    for the final draw; PCG64 gives the same numbers in one call as in the scan's k + 1 calls)."""
    num_draft = len(draft_token_ids)
    for position, token in enumerate(draft_token_ids):
        target = target_row(position)
        if uniforms[position] * draft_probs[position, token] < target[token]:
            continue
        return position, residual_draw(target, draft_probs[position], float(uniforms[num_draft]))
    return num_draft, draw(target_row(num_draft), float(uniforms[num_draft]))


Verifier = Callable[[list, np.ndarray, np.ndarray, np.random.Generator, np.ndarray], tuple[int, int]]


def sampled_verifier(params: SamplingParams, vocab: int) -> Verifier:
    """verify(draft_token_ids [k], draft_probs [k, vocab], target_logits [k + 1, vocab], rng, target_probs) ->
    (num_accepted, next_token): rejection_sample_lazy over the verify pass's logits, each row processed by
    params when the scan reaches it; target_probs [k + 1, vocab] receives the distributions it formed.

    Made once per generate call. With temperature alone and the C extension, the whole scan is one
    call (the same softmax, draws and random numbers: k + 1 uniforms, as the Python scan takes them),
    instead of ~15 Python-level steps per round that each run cold after the verify pass."""
    def python_scan(draft_token_ids, draft_probs, target_logits, uniforms, target_probs):
        return _lazy_scan(draft_token_ids, draft_probs,
                          lambda i: distribution(target_logits[i], params, target_probs[i]), uniforms)

    def general(draft_token_ids, draft_probs, target_logits, rng, target_probs):
        uniforms = rng.random(len(draft_token_ids) + 1)
        return python_scan(draft_token_ids, draft_probs, target_logits, uniforms, target_probs)

    if sampling._fastsample is None or not sampling._temperature_only(params, vocab):
        return general
    scan, inverse = sampling._fastsample.verify, 1.0 / params.temperature

    def fast(draft_token_ids, draft_probs, target_logits, rng, target_probs):
        uniforms = rng.random(len(draft_token_ids) + 1)
        try:
            return scan(draft_token_ids, draft_probs, target_logits, inverse, uniforms, target_probs)
        except TypeError:  # float64 or strided rows: the same scan with the same uniforms, in Python
            return python_scan(draft_token_ids, draft_probs, target_logits, uniforms, target_probs)

    return fast

