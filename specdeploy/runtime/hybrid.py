"""The hybrid drafter: prompt lookup where the context repeats itself, the draft model otherwise, and
where both could propose, the one whose rounds have emitted more tokens a second (SourceChoice)."""

from __future__ import annotations

import time
from typing import Callable

from .drafters import ModelDrafter, PromptLookupDrafter

# A round in PROBE_EVERY where the lookup matched goes to the source not preferred, so that its
# estimate follows the text; each source's sums decay by DECAY a round it is measured.
PROBE_EVERY = 8
DECAY = 0.85
LOOKUP, MODEL = "lookup", "model"


class SourceChoice:
    """Which source proposes a round where the lookup found a match: the one with more tokens a second.

    A source's rate is the tokens its rounds emitted over their time, each round read at the next
    proposal (the context's growth since the last one, and the clock's): the lookup's rounds cost a
    verify pass, the model's its draft steps too, and each keeps what its guesses are worth. Both are
    measured in matched rounds only, where the choice is made (the model alone runs elsewhere). The
    matched rounds take turns, the lookup first, until each source has been measured twice (a round
    is measured only where its sequence proposes again); after that one matched round in PROBE_EVERY
    takes the source not preferred. The choice reads past
    rounds only, never the round it proposes for, so the accept rule stays exact."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.tokens = {LOOKUP: 0.0, MODEL: 0.0}
        self.seconds = {LOOKUP: 0.0, MODEL: 0.0}
        self.rounds = {LOOKUP: 0, MODEL: 0}  # rounds measured
        self.chosen = {LOOKUP: 0, MODEL: 0}  # matched rounds given to each
        self._last: tuple[str, int, float] | None = None  # (source, context length, clock) of the last matched round

    def forget_round(self) -> None:
        """A new sequence: the last round's outcome is not this one's to read."""
        self._last = None

    def choose(self, context_length: int, matched: bool) -> str:
        """The source of this round (MODEL where nothing matched), after reading the last matched round."""
        now = self.clock()
        if self._last is not None and context_length >= self._last[1]:  # else: not the sequence it proposed for
            source, length, started = self._last
            self.tokens[source] = DECAY * self.tokens[source] + (context_length - length)
            self.seconds[source] = DECAY * self.seconds[source] + (now - started)
            self.rounds[source] += 1
        self._last = None
        if not matched:
            return MODEL
        if min(self.rounds.values()) < 2:  # until each is measured twice: turns, the lookup first
            source = LOOKUP if self.chosen[LOOKUP] <= self.chosen[MODEL] else MODEL
        else:
            preferred = LOOKUP if self.rate(LOOKUP) >= self.rate(MODEL) else MODEL
            probe = (sum(self.chosen.values()) + 1) % PROBE_EVERY == 0
            source = preferred if not probe else (MODEL if preferred == LOOKUP else LOOKUP)
        self.chosen[source] += 1
        self._last = (source, context_length, now)
        return source

    def rate(self, source: str) -> float:
        """Tokens a second of the source's measured rounds (0 before any)."""
        seconds = self.seconds[source]
        return self.tokens[source] / seconds if seconds > 0 else 0.0


class HybridDrafter:
    """Prompt lookup when the context repeats itself, the draft model otherwise.

    A lookup proposal costs no draft pass: it is a candidate whenever an n-gram of at least the
    lookup's `min_ngram` tokens recurs (greedy), or of at least `sampled_ngram` when sampling. Where
    one does, `choice` (SourceChoice) picks the lookup or the model from what their rounds have
    emitted a second; without one (adaptive=False, an exact generator's: its seeds give one sample,
    so its proposals may not follow the clock) the lookup always proposes. The draft model's cache
    catches up on the tokens it skipped in one multi-token pass. When sampling, a lookup token is
    kept with the target's probability of it, not only when it is the target's choice, so a short
    match loses to the model's proposal (measured on two pairs in docs/performance.md, "The hybrid's
    lookup when sampling"). A sampled_ngram above the lookup's max_ngram is taken as max_ngram.
    Which drafter proposes depends on the context, the settings and past rounds, never on the target's
    verdict on the round proposed, so the acceptance rule stays exact.
    """

    def __init__(self, model_drafter: ModelDrafter, lookup: PromptLookupDrafter, sampled_ngram: int = 3,
                 adaptive: bool = True):
        self.engine = model_drafter.engine
        self.model_drafter = model_drafter
        self.reads_target_features = model_drafter.reads_target_features
        self.lookup = lookup
        self.sampled_ngram = min(max(sampled_ngram, lookup.min_ngram), lookup.max_ngram)
        self.choice = SourceChoice() if adaptive else None

    def prefill(self, context: list[int], limit: int | None = None) -> bool:
        self.lookup.prefill(context)
        if self.choice is not None:
            self.choice.forget_round()
        return self.model_drafter.prefill(context, limit)

    def reset(self) -> None:
        self.lookup.reset()
        self.model_drafter.reset()

    def for_cache(self, cache, target_cache=None) -> "HybridDrafter":
        return HybridDrafter(self.model_drafter.for_cache(cache, target_cache), self.lookup.for_cache(cache),
                             self.sampled_ngram, adaptive=self.choice is not None)

    def with_target(self, target_cache) -> "HybridDrafter":
        self.model_drafter.with_target(target_cache)
        return self

    def lookup_proposal(self, context, num_tokens, sampler, rng):
        """The lookup's (tokens, probabilities) where this round takes them, else None (the model proposes)."""
        min_ngram = None if sampler.greedy else self.sampled_ngram
        tokens, probs = self.lookup.propose(context, num_tokens, sampler, rng, min_ngram=min_ngram)
        if self.choice is not None:
            return (tokens, probs) if self.choice.choose(len(context), bool(tokens)) == LOOKUP else None
        return (tokens, probs) if tokens else None

    def propose(self, context, num_tokens, sampler, rng, min_confidence=0.0):
        found = self.lookup_proposal(context, num_tokens, sampler, rng)
        if found is not None:
            return found
        return self.model_drafter.propose(context, num_tokens, sampler, rng, min_confidence)
