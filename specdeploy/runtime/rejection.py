"""The accept rule of speculative decoding: one reference function, and the one call the loop makes.

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

`rejection_sample` defines the rule, in plain NumPy; the C kernel (sampling.py's `CProcessor.verify`)
computes the same tokens from the same uniforms (to the float rounding of its rows), forming each
target row only when the scan reaches it. `accept` is what the generate loop calls: greedy rounds,
then the kernel where it was built, else the reference.

Greedy decoding is the temperature -> 0 limit: accept while the draft token is the target's
argmax, then emit the target's argmax.
"""

from __future__ import annotations

import numpy as np

from .sampling import Sampler, draw, kernel_rows, residual_draw


def rejection_sample(draft_token_ids, draft_probs: np.ndarray, target_probs, uniforms: np.ndarray) -> tuple[int, int]:
    """draft_token_ids [k], draft_probs [k, vocab], target_probs [k + 1, vocab], uniforms [k + 1] in [0, 1)
    -> (num_accepted, next_token): the recovered token after a rejection, else the bonus token.

    uniforms[i] tests x_{i+1}: accepted when uniforms[i] * draft_probs[i, x] < target_probs[i, x] (the
    ratio test without the division; draft_probs[i, x] > 0 for a token the draft drew). uniforms[k]
    draws the final token by the inverse CDF (sampling.draw): from the residual, or from the target
    row when the residual has no mass (the two rows are equal up to rounding). Rows of target_probs
    past the first rejection are never read: it may be any object that forms row i when indexed."""
    num_draft = len(draft_token_ids)
    for position in range(num_draft):
        token = draft_token_ids[position]
        target = target_probs[position]
        if uniforms[position] * draft_probs[position, token] < target[token]:
            continue
        return position, residual_draw(target, draft_probs[position], float(uniforms[num_draft]))
    return num_draft, draw(target_probs[num_draft], float(uniforms[num_draft]))


def greedy_accept(draft_token_ids, target_logits: np.ndarray, argmax=None) -> tuple[int, int]:
    """draft_token_ids [k], target_logits [k + 1, vocab] -> (num_accepted, next_token); argmax(row, extras)
    picks a row's token (default: np.argmax); extras are the drafts before that row.

    Rows are scanned up to the first mismatch only, as the sampled scan does."""
    for position, token in enumerate(draft_token_ids):
        row = target_logits[position]
        choice = int(row.argmax()) if argmax is None else argmax(row, draft_token_ids[:position])
        if choice != token:
            return position, choice
    num_draft = len(draft_token_ids)
    row = target_logits[num_draft]
    return num_draft, int(row.argmax()) if argmax is None else argmax(row, draft_token_ids)


class _RowsOnDemand:
    """target_probs for rejection_sample: row i formed from target_logits [k + 1, vocab] when first read."""

    def __init__(self, sampler: Sampler, drafts: list[int], target_logits: np.ndarray, target_probs: np.ndarray):
        self.sampler, self.drafts, self.logits, self.probs = sampler, drafts, target_logits, target_probs

    def __getitem__(self, position: int) -> np.ndarray:
        return self.sampler.distribution(self.logits[position], self.probs[position], self.drafts[:position])


def accept(sampler: Sampler, draft_token_ids: list[int], draft_probs: np.ndarray | None, target_logits: np.ndarray,
           rng: np.random.Generator, target_probs: np.ndarray | None) -> tuple[int, int]:
    """One round's accept step -> (num_accepted, next_token).

    draft_token_ids [k], draft_probs [k, vocab] (None when greedy), target_logits [k + 1, vocab] from the
    verify pass; target_probs [k + 1, vocab] receives the target distributions the scan formed. A
    sampled round takes k + 1 uniforms from rng in one call (PCG64 gives the same numbers as k + 1
    calls), for the C kernel and the reference alike. With the kernel, draft_probs and target_logits
    go to it as float32 C-contiguous rows (copied so if they are not), and target_probs must be a
    writable float32 C-contiguous buffer (a TypeError says so)."""
    if sampler.greedy:
        plain = sampler.penalty is None and not sampler.counted and sampler.constraint is None
        return greedy_accept(draft_token_ids, target_logits, None if plain else sampler.argmax)
    uniforms = rng.random(len(draft_token_ids) + 1)
    kernel = sampler.kernel
    if kernel is not None:
        if sampler.constraint is not None:  # the kernel takes whole rows: each masked after the drafts before it
            target_logits = sampler.constraint.apply_rows(target_logits, draft_token_ids)
        if sampler.counted:  # the kernel knows the repetition penalty only: the counts come off first
            target_logits = sampler.counted_rows(target_logits, draft_token_ids)
        ids, mask = sampler.penalty_args()
        return kernel.verify(draft_token_ids, kernel_rows(draft_probs), kernel_rows(target_logits), uniforms,
                             target_probs, ids, mask)
    rows = _RowsOnDemand(sampler, draft_token_ids, target_logits, target_probs)
    return rejection_sample(draft_token_ids, draft_probs, rows, uniforms)
