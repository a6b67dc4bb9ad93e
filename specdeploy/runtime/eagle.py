"""The eagle drafter: a head that reads the target's features (docs/distill.md states the math).

Entry p of the head's KV cache is the head run on (feature_p, token_p+1); it predicts feature_p+1
(kept in the head's cache's feature buffer, row p) and, through the target's final norm and head,
the logits of token_p+2. The entries built from the target's own features are real; those a
proposal builds from the head's predictions are speculative and go at the start of the next one,
which writes the positions the target has verified since from the target's features (read from
the target cache's feature buffer, which every target pass fills: no extra pass). Rollback is
truncation, as for any cache.
"""

from __future__ import annotations

import numpy as np

from ..errors import SpecdeployError
from .drafters import ModelDrafter
from .session import PREFILL_CHUNK


class EagleDrafter(ModelDrafter):
    """A ModelDrafter whose passes also take feature rows: the target's for the positions it has
    verified, the head's own for the ones it drafts. Each slot's drafter reads that slot's target cache."""

    reads_target_features = True

    def __init__(self, engine, capacity: int, cache=None, vocab_ids: np.ndarray | None = None, target_cache=None):
        super().__init__(engine, capacity, cache, vocab_ids)
        if self.cache.features is None:
            raise SpecdeployError("an eagle draft's engine must keep its predicted features (OrtEngine features=)")
        self.target_cache = target_cache
        self._real = 0  # the head's entries 0.._real - 1 come from the target's features (and the followed context)
        self._first: int | None = None  # the context's first token, which every feature (not the cache's tokens) depends on

    def for_cache(self, cache, target_cache=None) -> "EagleDrafter":
        return EagleDrafter(self.engine, self.capacity, cache, self.vocab_ids, target_cache)

    def with_target(self, target_cache) -> "EagleDrafter":
        self.target_cache = target_cache
        return self

    def reset(self) -> None:
        super().reset()
        self._real, self._first = 0, None

    def prefill(self, context: list[int], limit: int | None = None) -> bool:
        """As ModelDrafter.prefill; with a limit, the head also runs only as far as the target's cache
        holds features (a prompt chunk riding in this iteration's packed pass has none yet)."""
        self._catch_up(context, min_rest=0, start=0, limit=limit)
        return self.cache.length == max(len(context) - 1, 0)  # a one-token prompt's context is empty

    def _catch_up(self, context: list[int], min_rest: int, start: int, limit: int | None = None) -> np.ndarray | None:
        """Make the head's cache hold the real entries for context (entry i: feature_i with context[i + 1]),
        or with a limit, at most `limit` more of them, those the target has features for; returns the
        last pass's logits rows (None when nothing ran)."""
        target = self.target_cache
        if target is None or target.features is None:
            raise SpecdeployError("an eagle drafter needs its slot's target cache, with the target's features")
        cache = self.cache
        if cache.length > self._real:  # the last proposal's speculative entries
            cache.truncate(self._real)
        first_token = int(context[0]) if len(context) else None
        if first_token != self._first:  # entry i reads feature i, which context[0] shaped: none is reusable
            cache.truncate(0)
            self._real, self._first = 0, first_token
        pairs = context[1:]
        rest = cache.truncate_to_prefix(pairs, min_rest=min_rest, start=min(start, self._real))
        first = len(pairs) - len(rest)
        if limit is not None:
            rest = rest[: max(0, min(limit, target.length - first))]
        if first + len(rest) > target.length:
            raise SpecdeployError("the eagle drafter runs ahead of the target's cache")
        logits = None
        for offset in range(0, len(rest), PREFILL_CHUNK):
            chunk = rest[offset : offset + PREFILL_CHUNK]
            position = first + offset
            logits = self.engine.run(chunk, cache, target.features[position : position + len(chunk)])
        self._real = cache.length
        return logits

    def step(self, token: int) -> np.ndarray:
        """One chain step: the drafted token with the head's own last predicted feature."""
        return self.widen(self.engine.run([token], self.cache, self.step_features())[0])

    def step_features(self) -> np.ndarray:
        """[1, F]: the head's last predicted feature, the input of its next chain step (a row the step does not write)."""
        cache = self.cache
        return cache.features[cache.length - 1 : cache.length]

    def first_step(self, context: list[int]) -> tuple[np.ndarray | None, int | None]:
        """As ModelDrafter.first_step (propose starts there too): the catch-up from the target's features
        always runs (its last entry is new every round); nothing before a (feature, next token) pair exists."""
        if len(context) < 2:
            return None, None
        return self.widen(self._catch_up(context, min_rest=1, start=self._real)[-1]), None
