"""The hybrid drafter: prompt lookup where the context repeats itself, the draft model otherwise, and
where both could propose, the one whose rounds have emitted more tokens for their cost (SourceChoice)."""

from __future__ import annotations

from .drafters import ModelDrafter, PromptLookupDrafter

# A matched round in PROBE_EVERY goes to the source not preferred, so that its estimate follows the text;
# each source's sums decay by DECAY a round it is measured.
PROBE_EVERY = 8
DECAY = 0.85
# A verify pass's cost over a one-token step, for each token it checks: a fraction of a step (a pass of
# n tokens reads the weights once; measured 0.15-0.2 a token for int4 targets, less for fp32 ones).
VERIFY_TOKEN_COST = 0.1
LOOKUP, MODEL = "lookup", "model"


class SourceChoice:
    """Which source proposes a round where the lookup found a match: the one whose rounds emitted more
    tokens for their cost, in one sequence.

    A round's tokens are the context's growth from its proposal to the next one. Its cost, in target
    steps, is modelled rather than timed, so that the choice, and with it a seed's sample, is the same
    from run to run: 1 + VERIFY_TOKEN_COST a token verified, plus, for the model, `draft_cost` a
    token drafted (its step's cost over the target's: the ratio of their weights' bytes, which a decode
    step reads once; on the Qwen2.5-Coder pair 0.45 against a measured 0.40), and for the lookup a draft
    step each time the model then catches up on the tokens its rounds emitted. Both are measured in
    matched rounds only, where the choice is made. The matched rounds take turns, the lookup first,
    until each source has been measured twice (a round is measured where its sequence proposes
    again); after that one matched round in PROBE_EVERY takes the source not preferred. The choice
    reads past rounds only, never the round it proposes for, so the accept rule stays exact."""

    def __init__(self, draft_cost: float):
        self.draft_cost = draft_cost
        self.forget()

    def forget(self) -> None:
        """A new sequence: nothing of the last one's rounds is this one's."""
        self.tokens = {LOOKUP: 0.0, MODEL: 0.0}
        self.cost = {LOOKUP: 0.0, MODEL: 0.0}
        self.rounds = {LOOKUP: 0, MODEL: 0}  # rounds measured
        self.chosen = {LOOKUP: 0, MODEL: 0}  # matched rounds given to each
        self._last: tuple[str, int, float] | None = None  # (source, context length, cost) of the last matched round
        self._behind = False  # a lookup round since the model last proposed: its cache has tokens to catch up on

    def choose(self, context_length: int, lookup_tokens: int, model_tokens: int) -> str:
        """The source of this round (MODEL where the lookup proposes nothing), after reading the last matched
        round; lookup_tokens and model_tokens are what each would propose."""
        if self._last is not None and context_length >= self._last[1]:  # else: not the sequence it proposed for
            source, length, cost = self._last
            self.tokens[source] = DECAY * self.tokens[source] + (context_length - length)
            self.cost[source] = DECAY * self.cost[source] + cost
            self.rounds[source] += 1
        self._last = None
        if not lookup_tokens:
            return self._model_proposes()
        if min(self.rounds.values()) < 2:  # until each is measured twice: turns, the lookup first
            source = LOOKUP if self.chosen[LOOKUP] <= self.chosen[MODEL] else MODEL
        else:
            preferred = LOOKUP if self.rate(LOOKUP) >= self.rate(MODEL) else MODEL
            probe = (sum(self.chosen.values()) + 1) % PROBE_EVERY == 0
            source = preferred if not probe else (MODEL if preferred == LOOKUP else LOOKUP)
        self.chosen[source] += 1
        drafted = lookup_tokens if source == LOOKUP else model_tokens
        cost = 1.0 + VERIFY_TOKEN_COST * drafted + (self.draft_cost * drafted if source == MODEL else 0.0)
        self._last = (source, context_length, cost)
        if source == LOOKUP:
            self._behind = True
            return LOOKUP
        return self._model_proposes()

    def _model_proposes(self) -> str:
        """The model proposes: a catch-up pass first where lookup rounds left its cache behind, a draft step
        that the lookup's rounds caused and are charged."""
        if self._behind:
            self.cost[LOOKUP] = self.cost[LOOKUP] + self.draft_cost
            self._behind = False
        return MODEL

    def rate(self, source: str) -> float:
        """Tokens a target step of the source's measured rounds (0 before any)."""
        cost = self.cost[source]
        return self.tokens[source] / cost if cost > 0 else 0.0


class HybridDrafter:
    """Prompt lookup when the context repeats itself, the draft model otherwise.

    A lookup proposal costs no draft pass: it is a candidate whenever an n-gram of at least the
    lookup's `min_ngram` tokens recurs (greedy), or of at least `sampled_ngram` when sampling. Where
    one does, `choice` (SourceChoice, one sequence's rounds) picks the lookup or the model from what
    their rounds have emitted for their cost (draft_cost: a draft token's cost over a target step;
    None: the lookup always proposes where it matches). The draft model's cache
    catches up on the tokens it skipped in one multi-token pass. When sampling, a lookup token is
    kept with the target's probability of it, not only when it is the target's choice, so a short
    match loses to the model's proposal (measured on two pairs in docs/performance.md, "The hybrid's
    lookup when sampling"). A sampled_ngram above the lookup's max_ngram is taken as max_ngram.
    Which drafter proposes depends on the context, the settings and past rounds, never on the target's
    verdict on the round proposed, so the acceptance rule stays exact.
    """

    def __init__(self, model_drafter: ModelDrafter, lookup: PromptLookupDrafter, sampled_ngram: int = 3,
                 draft_cost: float | None = None):
        self.engine = model_drafter.engine
        self.model_drafter = model_drafter
        self.reads_target_features = model_drafter.reads_target_features
        self.lookup = lookup
        self.sampled_ngram = min(max(sampled_ngram, lookup.min_ngram), lookup.max_ngram)
        self.choice = SourceChoice(draft_cost) if draft_cost is not None else None

    def prefill(self, context: list[int], limit: int | None = None) -> bool:
        self.lookup.prefill(context)
        if self.choice is not None:
            self.choice.forget()
        return self.model_drafter.prefill(context, limit)

    def reset(self) -> None:
        self.lookup.reset()
        self.model_drafter.reset()

    def for_cache(self, cache, target_cache=None) -> "HybridDrafter":
        return HybridDrafter(self.model_drafter.for_cache(cache, target_cache), self.lookup.for_cache(cache),
                             self.sampled_ngram, self.choice.draft_cost if self.choice is not None else None)

    def with_target(self, target_cache) -> "HybridDrafter":
        self.model_drafter.with_target(target_cache)
        return self

    def lookup_proposal(self, context, num_tokens, sampler, rng):
        """The lookup's (tokens, probabilities) where this round takes them, else None (the model proposes)."""
        min_ngram = None if sampler.greedy else self.sampled_ngram
        tokens, probs = self.lookup.propose(context, num_tokens, sampler, rng, min_ngram=min_ngram)
        if self.choice is not None:
            return (tokens, probs) if self.choice.choose(len(context), len(tokens), num_tokens) == LOOKUP else None
        return (tokens, probs) if tokens else None

    def propose(self, context, num_tokens, sampler, rng, min_confidence=0.0):
        found = self.lookup_proposal(context, num_tokens, sampler, rng)
        if found is not None:
            return found
        return self.model_drafter.propose(context, num_tokens, sampler, rng, min_confidence)
