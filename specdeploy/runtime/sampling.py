"""Logits processing (presence/frequency and repetition penalties, temperature, top-k, top-p, min-p) and drawing tokens.

The NumPy functions here are the definition, in plain NumPy that calls nothing faster:
`process_logits` forms the distribution every sampled token is drawn from: OpenAI's presence and
frequency penalties over the generated tokens first (as vLLM counts them), then Hugging Face's
processors in its order and with its names (repetition_penalty, then temperature, top_k, top_p,
min_p), and `draw` /
`residual_draw` are the inverse-CDF draws. Speculative sampling applies the same processing to the
draft's and the target's logits, each row with the context up to its own position, so the
distribution it preserves is exactly the one target-only sampling draws from.

Every truncation only chooses a support; the distribution is then the softmax of the (penalized)
logits over that support. The C kernel (csrc/sampling.c, bound as `CProcessor`; built whenever a C
compiler is present) computes the same rows without touching more of the vocabulary than it must
(top-k by partial selection, top-p from a histogram of the mass instead of a sort, min-p in the
exponential pass): the same supports and the same probabilities to float rounding (its own exp,
its own order of summation), so a top-p cut whose preceding mass lies within rounding of top_p, or
a draw within rounding of a token's boundary, may fall on the other side. The tests hold it to that.
`Sampler` is the one object the generate loop, the drafters and the accept rule form their rows
through: with the kernel every row goes through it, else through the definition, so target-only
sampling and the verify scan agree bit for bit either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# CProcessor: the C kernel's row processor (csrc/sampling.c, bound in _fastsample.c), None where it was not built.
# Each Sampler holds an instance (its `kernel`); with None here, Samplers made from then on run the NumPy
# definition (the tests set it so to hold both paths to one distribution), as json.scanner.c_make_scanner does.
try:
    from ._fastsample import Processor as CProcessor
except ImportError:  # no C compiler at install time: NumPy computes the same, only slower
    CProcessor = None

FLOAT32 = np.dtype(np.float32)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax of the penalized logits); no distribution is formed
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off; keeps tokens at least min_p times as likely as the most likely one
    repetition_penalty: float = 1.0  # 1.0: off; > 1 discourages tokens already in the context
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from the logit of every token generated so far
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence among the tokens generated so far

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def counted(self) -> bool:
        """Whether the presence or frequency penalty is on (they read the generated tokens' counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def penalize(logits: np.ndarray, token_ids: np.ndarray, penalty: float) -> np.ndarray:
    """logits [vocab] with HF's repetition penalty on token_ids [m] (distinct): a positive logit is divided
    by the penalty, a negative one multiplied; returns a float32 copy (the engine's rows are left alone)."""
    out = np.array(logits, dtype=np.float32)
    if len(token_ids):
        chosen = out[token_ids]
        factor = np.float32(penalty)
        out[token_ids] = np.where(chosen < 0, chosen * factor, chosen / factor)
    return out


def support(logits: np.ndarray, params: SamplingParams) -> np.ndarray | None:
    """The tokens the truncations keep, as a mask [vocab] (None: all of them), from penalized logits [vocab].

    top-k keeps every token at least as high as the k-th highest logit; top-p then the smallest set of
    most probable tokens (of the top-k distribution; equal probabilities ranked by the higher logit, then
    the lower token id, so the most likely token, which min-p keeps, always ranks first) whose mass
    reaches top_p;
    min-p then the tokens whose probability is at least min_p times the top one's, tested as
    logit / T - max / T >= log(min_p) on the scaled logits the softmax forms (the same test)."""
    vocab = logits.shape[0]
    keep = None
    if 0 < params.top_k < vocab:
        kth = np.partition(logits, vocab - params.top_k)[vocab - params.top_k]
        keep = logits >= kth
    if params.top_p < 1.0 or params.min_p > 0.0:
        scaled = logits * np.float32(1.0 / params.temperature)
        scaled -= scaled.max()
        if params.top_p < 1.0:
            weights = np.exp(scaled) if keep is None else np.where(keep, np.exp(scaled), np.float32(0.0))
            nucleus = _nucleus(weights, params.top_p, logits)
            keep = nucleus if keep is None else keep & nucleus  # rounding never readmits what top-k removed
        if params.min_p > 0.0:
            above = scaled >= np.float32(math.log(params.min_p))
            keep = above if keep is None else keep & above
    return keep


def _nucleus(weights: np.ndarray, top_p: float, logits: np.ndarray, candidates: int = 64) -> np.ndarray:
    """Mask [vocab] of the tokens whose preceding mass (of tokens ranked before them: higher weight; equal
    weight and a higher logit; or both equal and a lower id) is below top_p of the total, from non-negative
    weights [vocab] (the exponentials of logits [vocab]).

    Only the most probable tokens are sorted (argpartition), unless they hold less than top_p of the mass."""
    vocab = weights.shape[0]
    total = weights.sum(dtype=np.float64)
    count = min(candidates, vocab)
    while True:
        # The count most probable tokens and every token tied with the last of them, so that ties rank by id.
        top = np.flatnonzero(weights >= np.partition(weights, vocab - count)[vocab - count]) if count < vocab \
            else np.arange(vocab)
        top = top[np.lexsort((top, -logits[top], -weights[top]))]  # most probable first, ties by logit, then id
        mass_before = np.cumsum(weights[top], dtype=np.float64) - weights[top]
        if count == vocab or mass_before[-1] + weights[top[-1]] >= top_p * total:
            break
        count = min(vocab, count * 8)
    keep = np.zeros(vocab, dtype=bool)
    keep[top[mass_before < top_p * total]] = True
    return keep


def count_penalties(counts: np.ndarray, params: SamplingParams) -> np.ndarray:
    """What OpenAI's penalties subtract from each logit, float32 [n], for tokens generated counts [n] times
    (frequency_penalty * count + presence_penalty where the count is not 0)."""
    counts = np.asarray(counts, dtype=np.float32)
    return (np.float32(params.frequency_penalty) * counts
            + np.float32(params.presence_penalty) * (counts > 0).astype(np.float32))


def penalize_counts(logits: np.ndarray, output_ids, params: SamplingParams) -> np.ndarray:
    """logits [vocab] less OpenAI's presence and frequency penalties for the generated tokens output_ids [m]
    (repeats counted); a float32 copy."""
    counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=len(logits))
    return np.asarray(logits, dtype=np.float32) - count_penalties(counts, params)


def process_row(logits: np.ndarray, params: SamplingParams, out: np.ndarray,
                penalized_ids: np.ndarray | None = None, output_ids=None) -> np.ndarray:
    """out [vocab] = the distribution params give logits [vocab] whose context holds penalized_ids [m] (distinct)
    and whose generated tokens are output_ids [g] (for the presence and frequency penalties)."""
    row = np.asarray(logits, dtype=np.float32)
    if params.counted and output_ids is not None:
        row = penalize_counts(row, output_ids, params)
    if params.penalized and penalized_ids is not None:
        row = penalize(row, penalized_ids, params.repetition_penalty)
    if params.truncated and not np.isfinite(row.max()):  # a NaN or an infinity: no distribution (as in C)
        out[:] = np.nan
        return out
    keep = support(row, params)
    if keep is not None:
        row = np.where(keep, row, np.float32(-np.inf))
    softmax_row(row, out, params.temperature)
    return out


def process_logits(logits: np.ndarray, params: SamplingParams, contexts=None, outputs=None) -> np.ndarray:
    """Logits [n, vocab] -> probabilities [n, vocab]; contexts: the token ids before each row (n sequences),
    whose distinct tokens the repetition penalty reads (None: no context, no penalty); outputs: the
    generated ids before each row, which the presence and frequency penalties count (None: none).

    float32 throughout: float32 ratios of probabilities are exact to ~1e-7, far below anything a
    100k-trial distribution test can see. Every row is computed alone, so a row's bits do not depend
    on the rows beside it."""
    logits = np.asarray(logits, dtype=np.float32)
    probs = np.empty(logits.shape, dtype=np.float32)
    for index, (row, out) in enumerate(zip(logits, probs)):
        ids = np.unique(np.asarray(contexts[index], dtype=np.int64)) if contexts is not None else None
        process_row(row, params, out, ids, outputs[index] if outputs is not None else None)
    return probs


def softmax_row(logits: np.ndarray, out: np.ndarray, temperature: float) -> None:
    """out [vocab] = softmax(logits [vocab] / temperature), float32; -inf logits get probability 0."""
    np.multiply(logits, np.float32(1.0 / temperature), out=out)
    out -= out.max()
    np.exp(out, out=out)
    out *= np.float32(1.0) / out.sum(dtype=np.float32)


class PenaltyContext:
    """The distinct tokens of a context, for the repetition penalty: a mask [vocab] and the ids [count].

    It follows one context list as the generate loop extends it (a round adds its few tokens); any
    other list, or one that got shorter, is read afresh."""

    def __init__(self, vocab: int):
        self.mask = np.zeros(vocab, dtype=np.uint8)  # [vocab]: 1 where the token is in the context
        self._ids = np.empty(vocab, dtype=np.int64)  # [vocab]: the distinct tokens, in order of appearance
        self.ids = self._ids[:0]  # [count]
        self._context: list[int] | None = None
        self._read = 0  # context[:_read] is in the mask

    def sync(self, context: list[int]) -> None:
        if context is not self._context or len(context) < self._read:
            self.mask[:] = 0
            self._context, self._read, self.ids = context, 0, self._ids[:0]
        if len(context) == self._read:
            return
        mask, ids, count = self.mask, self._ids, len(self.ids)
        for token in context[self._read :]:
            if not mask[token]:
                mask[token] = 1
                ids[count] = token
                count += 1
        self._read = len(context)
        self.ids = ids[:count]

    def with_extras(self, extras) -> np.ndarray:
        """The distinct ids [m] of the context followed by extras (tokens drafted after it)."""
        new = [t for i, t in enumerate(extras) if not self.mask[t] and t not in extras[:i]]
        return np.concatenate([self.ids, np.asarray(new, dtype=np.int64)]) if new else self.ids


class Sampler:
    """One generate call's processing of logits rows: SamplingParams over a vocabulary, and the context the
    repetition penalty reads (`sync` it to the context before a round).

    Every row a round forms (a draft step, a verify row, a target-only step) goes through argmax,
    sample or distribution; extras are the tokens drafted after the context so far (the row for
    draft position i penalizes the context and x_1..x_i). With the C kernel (`kernel`, a Processor with
    its own scratch) each is one call: logits go to it as float32 C-contiguous rows (the engines'
    rows are; others are copied so), and out must be a writable float32 C-contiguous row (a TypeError
    says so). Without the kernel the NumPy definition computes the same."""

    def __init__(self, params: SamplingParams, vocab: int, prompt_length: int = 0, constraint=None):
        self.params, self.vocab = params, vocab
        # A Constraint (constraint.py) masks every row first, after the extras before it (None: unconstrained).
        self.constraint = constraint
        self.greedy = params.greedy
        # The presence and frequency penalties: each token's count among the generated tokens (the
        # context after prompt_length), what the penalties subtract for it, and a row to subtract into.
        self.counted = params.counted
        if self.counted:
            self._counts = np.zeros(vocab, dtype=np.int64)  # [vocab]
            self._subtract = np.zeros(vocab, dtype=np.float32)  # [vocab]
            self._counted_row = np.empty(vocab, dtype=np.float32)  # [vocab]
            self._counted_upto = prompt_length
        self.penalty = PenaltyContext(vocab) if params.penalized else None
        self.kernel = None
        if CProcessor is not None:
            inverse = 0.0 if params.greedy else 1.0 / params.temperature
            top_k = min(params.top_k, vocab)  # as many or more: every token kept, as 0 does (the kernel takes a C size)
            self.kernel = CProcessor(inverse, top_k, params.top_p, params.min_p, params.repetition_penalty)
        # The penalty's ids [count] and mask [vocab] as the kernel takes them (None: no penalty).
        self._ids, self._mask = (None, None) if self.penalty is None else (self.penalty.ids, self.penalty.mask)

    def sync(self, context: list[int]) -> None:
        if self.penalty is not None:
            self.penalty.sync(context)
            self._ids, self._mask = self.penalty.ids, self.penalty.mask
        if self.counted and len(context) > self._counted_upto:
            new = np.asarray(context[self._counted_upto :], dtype=np.int64)
            np.add.at(self._counts, new, 1)
            touched = np.unique(new)
            self._subtract[touched] = count_penalties(self._counts[touched], self.params)
            self._counted_upto = len(context)

    def counted_rows(self, logits: np.ndarray, extras) -> np.ndarray:
        """Rows [k + 1, vocab] of a verify pass less the presence and frequency penalties, row i counting
        the first i extras too (a fresh array: the engine's logits are left as they are)."""
        rows = np.empty((len(logits), self.vocab), dtype=np.float32)  # [k + 1, vocab]
        for i in range(len(logits)):
            rows[i] = self._count(logits[i], extras[:i])  # _count reuses one row: each is copied out
        return rows

    def _count(self, logits: np.ndarray, extras) -> np.ndarray:
        """logits [vocab] less the penalties for the generated tokens and extras, in a row reused per call;
        the entries of the extras are computed from their whole counts, as penalize_counts does."""
        row = self._counted_row
        np.subtract(np.asarray(logits, dtype=np.float32), self._subtract, out=row)
        if len(extras):
            tokens, repeats = np.unique(np.asarray(extras, dtype=np.int64), return_counts=True)
            penalties = count_penalties(self._counts[tokens] + repeats, self.params)
            row[tokens] = np.asarray(logits, dtype=np.float32)[tokens] - penalties
        return row

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, in order, the constraint allows (all of them without one)."""
        return len(tokens) if self.constraint is None else self.constraint.allowed_prefix(tokens)

    def penalty_args(self) -> tuple:
        """(ids [count], mask [vocab]) for the C kernel, or (None, None) without a penalty."""
        return self._ids, self._mask

    def _penalized_ids(self, extras) -> np.ndarray | None:
        return None if self.penalty is None else self.penalty.with_extras(extras)

    def argmax(self, logits: np.ndarray, extras=()) -> int:
        """The greedy token of logits [vocab]: np.argmax of the penalized row (the first maximum)."""
        if self.constraint is not None:
            logits = self.constraint.apply(logits, extras)
        if self.counted:
            logits = self._count(logits, extras)
        if self.penalty is None:
            return int(logits.argmax())
        if self.kernel is not None:
            return self.kernel.argmax(kernel_rows(logits), self._ids, self._mask, extras)
        return int(penalize(logits, self._penalized_ids(extras), self.params.repetition_penalty).argmax())

    def distribution(self, logits: np.ndarray, out: np.ndarray, extras=()) -> np.ndarray:
        """out [vocab] = the processed distribution of logits [vocab] (process_row's)."""
        if self.constraint is not None:
            logits = self.constraint.apply(logits, extras)
        if self.counted:
            logits = self._count(logits, extras)
        if self.kernel is not None:
            self.kernel.sample(kernel_rows(logits), out, None, self._ids, self._mask, extras)
            return out
        return process_row(logits, self.params, out, self._penalized_ids(extras))

    def sample(self, logits: np.ndarray, uniform: float, out: np.ndarray, extras=()) -> int:
        """The token uniform (in [0, 1)) draws from the processed distribution of logits [vocab], which out
        [vocab] receives. The C kernel draws from the row's exponentials just before they are divided
        by their sum (the same distribution, without a second pass over the row)."""
        if self.constraint is not None:
            logits = self.constraint.apply(logits, extras)
        if self.counted:
            logits = self._count(logits, extras)
        if self.kernel is not None:
            return self.kernel.sample(kernel_rows(logits), out, uniform, self._ids, self._mask, extras)
        return draw(process_row(logits, self.params, out, self._penalized_ids(extras)), uniform)


def kernel_rows(array: np.ndarray) -> np.ndarray:
    """array as the C kernel reads it: float32 and C-contiguous (the array itself when it already is)."""
    if array.dtype is FLOAT32 and array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array, dtype=FLOAT32)


BLOCK = 64


def draw(weights: np.ndarray, uniform: float) -> int:
    """One inverse-CDF draw from weights [vocab] (non-negative, not necessarily normalized).

    Two levels: a cumulative sum over blocks of 64 (their sums are one vectorized reduction),
    then one inside the chosen block. np.cumsum over a whole 8k vocabulary is sequential and cost
    24 us, more than the softmax before it; this costs ~5 us and draws from the same distribution.
    The sums are float64, as the C kernel's are, so both cut the same point at the same token."""
    vocab = weights.shape[0]
    full = vocab - vocab % BLOCK
    sums = weights[:full].reshape(-1, BLOCK).sum(axis=1, dtype=np.float64)
    if full < vocab:
        sums = np.append(sums, weights[full:].sum(dtype=np.float64))
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
    index = int(np.searchsorted(np.cumsum(inner, dtype=np.float64), point, side="right"))
    if index >= len(inner) or inner[index] == 0:  # rounding between the two levels: nearest token with mass
        nonzero = np.flatnonzero(inner)
        index = int(nonzero[min(np.searchsorted(nonzero, index), len(nonzero) - 1)])
    return start + index


def residual_draw(target_probs: np.ndarray, draft_probs: np.ndarray, uniform: float) -> int:
    """One draw from normalize(max(0, target_probs - draft_probs)) (both [vocab]), the recovered token of
    speculative sampling; from target_probs when the residual has no mass (the rows are equal up to rounding)."""
    residual = np.maximum(target_probs - draft_probs, 0.0)
    return draw(residual if residual.sum() > 0 else target_probs, uniform)
