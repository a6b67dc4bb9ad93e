"""Drafters: whatever proposes the k tokens the target then verifies.

The seam has two methods (as transformers' candidate generators do): `propose(context, k, ...)`
returns the draft tokens and the probabilities they were drawn from (None when greedy), and
`update(num_accepted)` hears how the last proposal fared.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .engine import CachedModel
from .sampling import SamplingParams, row_sampler


class Drafter(Protocol):
    model: CachedModel | None  # the draft model it runs, if any (timed and reset by the generator)

    def propose(
        self, context: list[int], num_tokens: int, params: SamplingParams, rng: np.random.Generator,
        min_confidence: float = 0.0,
    ) -> tuple[list[int], np.ndarray | None]:
        """Up to num_tokens draft tokens and the draft_probs [k, vocab] they were drawn from (None when greedy).

        A drafter may stop early, e.g. once its own top probability falls below min_confidence: how
        many tokens are proposed never depends on the target, so the acceptance rule stays exact."""

    def update(self, num_accepted: int) -> None: ...

    def prefill(self, context: list[int]) -> None: ...


class ModelDrafter:
    """The bundle's draft model, decoding autoregressively on its own KV cache."""

    def __init__(self, model: CachedModel):
        self.model = model

    def prefill(self, context: list[int]) -> None:
        self.model.prefill(context)

    def propose(self, context, num_tokens, params, rng, min_confidence=0.0):
        logits = self.model.logits_after(context)  # [vocab]
        tokens: list[int] = []
        # The full processed distribution of each draft token, written in place: proposing from a
        # truncated one (exact too) was measured slower on an 8k vocabulary (argpartition costs what
        # the softmax does) and lowered acceptance.
        draft_probs = None if params.greedy else np.empty((num_tokens, logits.shape[-1]), dtype=np.float32)
        sample = None if params.greedy else row_sampler(params, logits.shape[-1])
        for position in range(num_tokens):
            if draft_probs is None:
                token = int(logits.argmax())
                # Top probability at temperature 1: 1 / sum(exp(logits - max)).
                confident = min_confidence <= 0 or np.exp(logits - logits[token]).sum() * min_confidence <= 1.0
            else:
                row = draft_probs[position]
                token = sample(logits, rng, row)
                confident = min_confidence <= 0 or row.max() >= min_confidence
            tokens.append(token)
            if position + 1 < num_tokens and confident:
                logits = self.model.extend([token])[-1]
            else:
                break
        return tokens, (None if draft_probs is None else draft_probs[: len(tokens)])

    def update(self, num_accepted: int) -> None:
        pass


class PromptLookupDrafter:
    """N-gram drafting from the context itself (prompt lookup decoding): no model, no cost.

    It proposes the tokens that followed the most recent earlier occurrence of the context's last
    n-gram. Its proposal is deterministic, so draft_probs are one-hot rows, and the rejection rule
    stays exact: accept x with probability target_probs[x], else draw from the target without x.
    """

    model = None  # no model to run

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def prefill(self, context: list[int]) -> None:
        pass

    def propose(self, context, num_tokens, params, rng, min_confidence=0.0):
        tokens: list[int] = []
        reversed_context = context[::-1]
        for size in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            end = _last_earlier_occurrence(context, size, reversed_context)
            if end is not None:
                tokens = context[end + 1 : end + 1 + num_tokens]
                break
        if params.greedy or not tokens:
            return tokens, None
        one_hot = np.zeros((len(tokens), self.vocab_size), dtype=np.float32)  # float32, as the model's rows
        one_hot[np.arange(len(tokens)), tokens] = 1.0
        return tokens, one_hot

    def update(self, num_accepted: int) -> None:
        pass


def _last_earlier_occurrence(context: list[int], size: int, reversed_context: list[int] | None = None) -> int | None:
    """End index of the latest earlier occurrence of context's last `size` tokens, or None.

    The search runs from the end (on reversed_context, context[::-1]), so the first full match is
    the latest one; candidates are found with list.index (a C scan) on the n-gram's last token, so
    a round costs at most one pass over the context and usually a few positions."""
    if reversed_context is None:
        reversed_context = context[::-1]
    length = len(context)
    pattern = context[-size:]
    last = pattern[-1]
    back = 0  # position length - 1 - back in context; back = 0 is the pattern itself
    while True:
        try:
            back = reversed_context.index(last, back + 1, length - size + 1)
        except ValueError:
            return None
        end = length - 1 - back
        if context[end - size + 1 : end + 1] == pattern:
            return end


class HybridDrafter:
    """Prompt lookup when the context repeats itself, the draft model otherwise.

    A lookup proposal costs nothing, so it is taken whenever an n-gram of at least `min_ngram`
    tokens recurs; the draft model runs only in the other rounds (its cache catches up on the
    tokens it skipped in one multi-token pass). Which drafter proposes depends only on the context,
    never on the target, so the acceptance rule stays exact.
    """

    def __init__(self, model: ModelDrafter, lookup: PromptLookupDrafter):
        self.model = model.model  # the draft model's CachedModel, for timing and reset
        self.model_drafter = model
        self.lookup = lookup

    def prefill(self, context: list[int]) -> None:
        self.model_drafter.prefill(context)

    def propose(self, context, num_tokens, params, rng, min_confidence=0.0):
        tokens, probs = self.lookup.propose(context, num_tokens, params, rng)
        if tokens:
            return tokens, probs
        return self.model_drafter.propose(context, num_tokens, params, rng, min_confidence)

    def update(self, num_accepted: int) -> None:
        pass
