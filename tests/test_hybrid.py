"""The hybrid drafter: the model's first token deciding whether the lookup continues its proposal, a copy under
way proposed by the lookup alone, and output that stays the target's, and a seed's sample, whichever proposes."""

import numpy as np
import pytest

import specdeploy
from specdeploy.runtime.draft_rows import DraftRequest, propose_many
from specdeploy.runtime.hybrid import HybridDrafter
from specdeploy.runtime.sampling import Sampler, SamplingParams


def count_offers(drafter: HybridDrafter) -> dict:
    """Wrap the drafter's offer: counts of rounds the lookup proposed alone, offered tokens to follow, or had none."""
    counts = {"alone": 0, "follow": 0, "none": 0}
    offer = drafter.offer

    def counted(*args, **kwargs):
        alone, follow = offer(*args, **kwargs)
        counts["alone" if alone is not None else "follow" if follow else "none"] += 1
        return alone, follow

    drafter.offer = counted
    return counts


def record_agreement(drafter: HybridDrafter) -> list[bool | None]:
    """Wrap the drafter's model's propose: for each proposal, whether its first token was the lookup's offer's
    first (None: no offer)."""
    model, agreed = drafter.model_drafter, []
    propose = model.propose

    def recorded(context, num_tokens, sampler, rng, min_confidence=0.0, follow=()):
        tokens, probs = propose(context, num_tokens, sampler, rng, min_confidence, follow)
        agreed.append(tokens[0] == follow[0] if follow else None)
        return tokens, probs

    model.propose = recorded
    return agreed


def test_the_model_s_first_token_decides_whether_the_lookup_continues(self_draft_bundle):
    """Along the target's own greedy text, where the lookup offers tokens: the proposal is the model's first token
    and the offer's rest where that token is the offer's first (one draft pass, not k), else the model's own."""
    hybrid_generator = specdeploy.load(self_draft_bundle, drafter="hybrid", lookup_ngram=1, warm_up=False)
    model_generator = specdeploy.load(self_draft_bundle, drafter="model", warm_up=False)
    prompt = [5] * 60  # the tiny target repeats a token for a while, then wanders: both branches
    text = prompt + model_generator.generate(prompt, max_new_tokens=40, speculative=False).token_ids
    hybrid, model = hybrid_generator.drafter, model_generator.drafter
    greedy = Sampler(SamplingParams(), hybrid_generator.target.spec.vocab_size)
    rng, branches = np.random.default_rng(0), {"agree": 0, "disagree": 0}
    for end in range(len(prompt), len(text)):
        context = text[:end]
        hybrid.prefill(context[:-1])
        model.prefill(context[:-1])
        offered = hybrid.lookup.propose(context, 4, greedy, rng)[0]
        if not offered:
            continue
        calls = hybrid.engine.calls
        tokens, _ = hybrid.propose(context, 4, greedy, rng)
        own, _ = model.propose(context, 4, greedy, rng)
        if own[0] == offered[0]:
            branches["agree"] += 1
            assert tokens == own[:1] + offered[1:] and hybrid.engine.calls == calls + 1, end
        else:
            branches["disagree"] += 1
            assert tokens == own, end
    assert branches["agree"] >= 3 and branches["disagree"] >= 3, branches


def after_a_match(bundle):
    """A hybrid (1-gram lookup) prefilled for a context whose last token recurs: (drafter, greedy sampler, rng,
    context); the lookup offers 5 6 7 8 9 3 4 after it."""
    generator = specdeploy.load(bundle, lookup_ngram=1, warm_up=False)
    context = [3, 4, 5, 6, 7, 8, 9, 3, 4]
    generator.drafter.prefill(context[:-1])
    return (generator.drafter, Sampler(SamplingParams(), generator.target.spec.vocab_size), np.random.default_rng(0),
            context)


def test_a_copy_under_way_is_proposed_by_the_lookup_alone(bundles):
    """Once the text has kept the whole of the lookup's last offer and a token more, the next match proposes
    the lookup's tokens without a draft pass; an offer kept in part, or a new sequence, starts over."""
    hybrid, greedy, rng, context = after_a_match(bundles("llama"))
    alone, follow = hybrid.offer(context, 2, greedy, rng)
    assert alone is None and follow == [5, 6]
    kept = context + [5, 6, 7]  # the offer whole, and the target's token after it
    calls = hybrid.engine.calls  # the policy cut the model's k to 1: the lookup still offers the request's 2
    assert propose_many([DraftRequest(hybrid, kept, 1, greedy, rng, most=2)]) == [([8, 9], None)]
    assert hybrid.engine.calls == calls
    # [8, 9] offered, 8 kept and 3 the target's: a match again, but the copy is not under way
    assert hybrid.offer(kept + [8, 3], 2, greedy, rng) == (None, [4, 5])
    assert hybrid.offer(context, 2, greedy, rng) == (None, [5, 6])
    hybrid.prefill(context[:-1])  # a new sequence (on this slot): nothing of the last one's offers
    assert hybrid.offer(kept, 2, greedy, rng)[0] is None
    hybrid.offer(context, 2, greedy, rng)
    hybrid.reset()
    assert hybrid.offer(kept, 2, greedy, rng)[0] is None


def test_a_sampled_row_follows_the_lookup_past_its_own_k(bundles):
    """A row whose k is 1 proposes the lookup's four tokens where its first token agrees: the model's row for the
    first, one-hot rows for the rest; where it disagrees, its own one token."""
    generator = specdeploy.load(bundles("llama"), drafter="model", warm_up=False)
    model, vocab = generator.drafter, generator.target.spec.vocab_size
    sampler, rng = Sampler(SamplingParams(temperature=1.0, top_k=1), vocab), np.random.default_rng(0)
    context = [3, 4, 5, 6, 7]
    model.prefill(context[:-1])
    first = model.propose(context, 1, sampler, rng)[0]  # top-k 1: the draft's argmax
    tokens, probs = model.propose(context, 1, sampler, rng, follow=first + [9, 10, 11])
    assert tokens == first + [9, 10, 11] and probs.shape == (4, vocab)
    assert (probs[np.arange(1, 4), [9, 10, 11]] == 1.0).all() and (probs[1:].sum(axis=1) == 1.0).all()
    tokens, probs = model.propose(context, 1, sampler, rng, follow=[(first[0] + 1) % vocab, 9, 10])
    assert tokens == first and probs.shape == (1, vocab)


def test_the_lookup_offers_up_to_the_request_s_k(bundles):
    """The model's k may be cut by the policy; the lookup's tokens cost no draft step and go up to `most`."""
    hybrid, greedy, rng, context = after_a_match(bundles("llama"))
    assert hybrid.offer(context, 1, greedy, rng, most=4) == (None, [5, 6, 7, 8])
    assert hybrid.offer(context, 1, greedy, rng) == (None, [5])


def test_greedy_output_is_target_only_through_every_kind_of_round(agreeing_bundle):
    """Rounds the lookup proposes alone, rounds it continues the model's first token, and model rounds: the
    output is the target's alone."""
    generator = specdeploy.load(agreeing_bundle, drafter="hybrid", lookup_ngram=1)
    prompt = [7] * 60  # the tiny target loops on a token for a while, then wanders
    expected = generator.generate(prompt, max_new_tokens=60, speculative=False).token_ids
    counts, agreed = count_offers(generator.slots[0].drafter), record_agreement(generator.slots[0].drafter)
    assert generator.generate(prompt, max_new_tokens=60, num_draft_tokens=3).token_ids == expected
    assert counts["alone"] >= 2 and agreed.count(True) >= 2 and agreed.count(False) >= 2, (counts, agreed)


def test_a_seed_gives_one_sample_through_the_hybrid(agreeing_bundle):
    """Which source proposes reads the sequence's own context only: the same seed gives the same sample."""
    generator = specdeploy.load(agreeing_bundle, drafter="hybrid", lookup_ngram=1)
    generator.slots[0].drafter.sampled_ngram = 1  # a recurring token is a match when sampling too
    agreed = record_agreement(generator.slots[0].drafter)
    prompt = [100] * 40 + [367, 100] * 2
    first = [generator.generate(prompt, max_new_tokens=30, temperature=0.8, seed=seed).token_ids for seed in range(4)]
    assert [generator.generate(prompt, max_new_tokens=30, temperature=0.8, seed=seed).token_ids
            for seed in range(4)] == first
    assert agreed.count(True) >= 2 and agreed.count(False) >= 2, agreed


@pytest.mark.parametrize("length, k", [(3, 2), (4, 1)])
def test_sampling_through_the_hybrid_matches_the_target_distribution(agreeing_bundle, length, k):
    """Runs of three tokens, two drafts a round (the model's sampled first token and the lookup's one-hot row
    after it where they agree), and of four, one draft a round (a kept offer: the lookup alone next), against
    the exact joint distribution of the tokens (top-k 3)."""
    from specdeploy.lossless import sampled_continuations

    generator = specdeploy.load(agreeing_bundle, drafter="hybrid", lookup_ngram=1)
    drafter = generator.slots[0].drafter
    drafter.sampled_ngram = 1  # a recurring token is a match when sampling too
    counts, agreed = count_offers(drafter), record_agreement(drafter)
    prompt = [100] * 40 + [367, 100] * 2  # the lookup offers 367 100, which the tiny target draws 0.42, 0.47
    result = sampled_continuations(generator, prompt, {"temperature": 1.0, "top_k": 3}, length, k, 3000)
    assert 150 < result["accepted"] < 0.95 * result["drafted"] and result["cells"] >= 11
    assert result["chi_square_p"] > 1e-3
    assert agreed.count(True) > 300 and agreed.count(False) > 300, agreed.count(True)
    assert counts["alone"] > (300 if length == 4 else -1), counts
