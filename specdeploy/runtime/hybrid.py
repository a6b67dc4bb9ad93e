"""The hybrid drafter: the draft model, and prompt lookup continuing its proposal where the context repeats
itself and the model agrees.

Where the lookup finds a match, the draft model's first token decides the round (DraftRow's `follow`): the
lookup's first token, and the round proposes the lookup's tokens after it, with no more draft steps; another
token, and the model drafts on as it would alone. A match is a guess, and the model's first step, which a model
round takes anyway, is what tells a guess that pays from one that does not, without statistics to gather or
rounds to spend on probes. Where the text kept the whole of the lookup's last offer (a copy under way), the next
match proposes the lookup's tokens without that step. On the Qwen2.5-Coder pair the rule kept as many tokens a
target step as the better of the lookup and the model in every prompt class measured, where choosing between
them from their past rounds lost 4-8% to the model (docs/performance.md, "The Qwen2.5-Coder pair")."""

from __future__ import annotations

from .drafters import ModelDrafter, PromptLookupDrafter


class HybridDrafter:
    """The draft model, and prompt lookup continuing its proposal where its first token agrees with the lookup's.

    A lookup proposal is a candidate whenever an n-gram of at least the lookup's `min_ngram` tokens recurs
    (greedy), or of at least `sampled_ngram` when sampling (a lookup token is then kept with the target's
    probability of it, not only when it is the target's choice, so a short match is kept less often:
    docs/performance.md, "The hybrid's shortest match"; a sampled_ngram above the lookup's
    max_ngram is taken as max_ngram). The lookup offers up to the request's k (`most`: its tokens cost no
    draft step) where the policy cut the model's to fewer. The draft model's cache catches up on the
    tokens it did not draft in one multi-token pass. Which tokens are proposed depends on the context, the
    settings, the drafted tokens before them and past rounds, never on the target's verdict on the round
    proposed, and each position's row is the distribution its token was drawn from (the model's, or one-hot
    for a lookup token), so the acceptance rule stays exact."""

    def __init__(self, model_drafter: ModelDrafter, lookup: PromptLookupDrafter, sampled_ngram: int = 3):
        self.engine = model_drafter.engine
        self.model_drafter = model_drafter
        self.reads_target_features = model_drafter.reads_target_features
        self.lookup = lookup
        self.sampled_ngram = min(max(sampled_ngram, lookup.min_ngram), lookup.max_ngram)
        self._offer: tuple[int, list[int]] | None = None  # (context length, tokens) of the lookup's last offer

    def prefill(self, context: list[int], limit: int | None = None) -> bool:
        self.lookup.prefill(context)
        self._offer = None
        return self.model_drafter.prefill(context, limit)

    def reset(self) -> None:
        self.lookup.reset()
        self.model_drafter.reset()
        self._offer = None

    def for_cache(self, cache, target_cache=None) -> "HybridDrafter":
        return HybridDrafter(self.model_drafter.for_cache(cache, target_cache), self.lookup.for_cache(cache),
                             self.sampled_ngram)

    def with_target(self, target_cache) -> "HybridDrafter":
        self.model_drafter.with_target(target_cache)
        return self

    def offer(self, context, num_tokens, sampler, rng, most=None):
        """The lookup's part in this round: ((tokens, probabilities), []) where it proposes alone (the text
        kept the whole of its last offer), else (None, follow): the tokens the model's first draft token must
        match for the lookup to continue the proposal (empty: no match). The model would propose num_tokens;
        the lookup offers up to `most` (None: num_tokens) where that is more."""
        min_ngram = None if sampler.greedy else self.sampled_ngram
        tokens, probs = self.lookup.propose(context, max(num_tokens, most or 0), sampler, rng, min_ngram=min_ngram)
        copying = self._copying(context)
        self._offer = (len(context), list(tokens)) if tokens else None
        if tokens and copying:
            return (tokens, probs), []
        return None, tokens

    def _copying(self, context: list[int]) -> bool:
        """Whether the context after the lookup's last offer is that offer whole, and a token more: every token
        of it kept (a model that disagreed would have put another first)."""
        if self._offer is None:
            return False
        length, tokens = self._offer
        return len(context) > length + len(tokens) and context[length : length + len(tokens)] == tokens

    def propose(self, context, num_tokens, sampler, rng, min_confidence=0.0, most=None):
        alone, follow = self.offer(context, num_tokens, sampler, rng, most)
        if alone is not None:
            return alone
        return self.model_drafter.propose(context, num_tokens, sampler, rng, min_confidence, follow)
