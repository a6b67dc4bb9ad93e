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

    The n-grams are indexed as the context grows (n-gram -> where its latest earlier occurrence
    ends), so a round costs a few dictionary operations, not a scan of the context. The index
    follows one context list as the generate loop extends it; any other list (or one that got
    shorter) is indexed afresh.
    """

    model = None  # no model to run

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._context: list[int] | None = None  # the list the index follows
        self._indexed = 0  # n-grams ending before this position are in the index
        self._ends: dict[tuple[int, ...], int] = {}

    def prefill(self, context: list[int]) -> None:
        self._context = None

    def propose(self, context, num_tokens, params, rng, min_confidence=0.0):
        self._index(context)
        tokens: list[int] = []
        length = len(context)
        for size in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = self._ends.get(tuple(context[length - size :]))
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

    def _index(self, context: list[int]) -> None:
        """Add the n-grams that end at positions up to len(context) - 2 (the last one is what we look up)."""
        if context is not self._context or len(context) < self._indexed + 1:
            self._context, self._indexed, self._ends = context, 0, {}
        ends = self._ends
        sizes = range(self.min_ngram, self.max_ngram + 1)
        for end in range(self._indexed, len(context) - 1):
            for size in sizes:
                if size <= end + 1:
                    ends[tuple(context[end - size + 1 : end + 1])] = end  # later ends overwrite: the latest wins
        self._indexed = max(self._indexed, len(context) - 1)


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
        self.lookup.prefill(context)
        self.model_drafter.prefill(context)

    def propose(self, context, num_tokens, params, rng, min_confidence=0.0):
        tokens, probs = self.lookup.propose(context, num_tokens, params, rng)
        if tokens:
            return tokens, probs
        return self.model_drafter.propose(context, num_tokens, params, rng, min_confidence)

    def update(self, num_accepted: int) -> None:
        pass
