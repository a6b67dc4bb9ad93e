"""The hybrid drafter's choice between prompt lookup and the draft model: the rates it reads, the rounds it
probes, and output that stays the target's, and a seed's sample, whatever it chooses."""

import pytest

import specdeploy
from specdeploy.runtime.hybrid import LOOKUP, MODEL, PROBE_EVERY, VERIFY_TOKEN_COST, SourceChoice

def run_rounds(choice: SourceChoice, rounds: int, emitted: dict, proposed: dict, start: int = 100) -> tuple[list, int]:
    """Drive a choice as one sequence would: each round proposes (proposed: source -> tokens it would draft),
    then its context grows by emitted[source]. Returns the sources chosen and the context length."""
    chosen, length = [], start
    for _ in range(rounds):
        source = choice.choose(length, proposed[LOOKUP], proposed[MODEL])
        length += emitted[source]
        chosen.append(source)
    return chosen, length


def test_the_first_matched_rounds_take_turns_then_the_cheaper_source_proposes_with_a_probe_of_the_other():
    choice = SourceChoice(draft_cost=0.4)
    chosen, _ = run_rounds(choice, 4 + 4 * PROBE_EVERY, {LOOKUP: 1, MODEL: 3}, {LOOKUP: 2, MODEL: 4})
    assert chosen[:4] == [LOOKUP, MODEL, LOOKUP, MODEL]
    assert chosen[4:].count(LOOKUP) == 4  # one probe in PROBE_EVERY matched rounds
    # tokens over modelled cost: the model's rounds 3 / (1 + 4c + 4 * 0.4); the lookup's 1 / (1 + 2c) and the
    # draft's catch-ups after them
    assert choice.rate(MODEL) == pytest.approx(3 / (1 + 4 * VERIFY_TOKEN_COST + 1.6))
    assert choice.rate(LOOKUP) < 1 / (1 + 2 * VERIFY_TOKEN_COST)


def test_the_models_catch_up_after_lookup_rounds_is_charged_to_the_lookup():
    """Two lookup rounds in a row, then the model proposes (where nothing matched): one catch-up pass, a draft
    step, on the lookup's account."""
    choice = SourceChoice(draft_cost=0.5)
    choice.chosen[MODEL] = 1  # its turn taken: the next matched rounds go to the lookup
    assert choice.choose(100, 2, 4) == LOOKUP
    assert choice.choose(103, 2, 4) == LOOKUP
    assert choice.choose(105, 0, 4) == MODEL
    lookup_round = 1 + 2 * VERIFY_TOKEN_COST
    assert choice.rate(LOOKUP) == pytest.approx((0.85 * 3 + 2) / (0.85 * lookup_round + lookup_round + 0.5))
    before = choice.rate(LOOKUP)
    assert choice.choose(106, 0, 4) == MODEL and choice.rate(LOOKUP) == before  # caught up: nothing more to charge


def test_a_costly_draft_loses_to_a_lookup_that_keeps_fewer_tokens():
    """The same acceptance as above, a draft as costly as the target (the model drafting for itself)."""
    choice = SourceChoice(draft_cost=1.0)
    chosen, _ = run_rounds(choice, 4 + 2 * PROBE_EVERY, {LOOKUP: 2, MODEL: 3}, {LOOKUP: 2, MODEL: 4})
    assert chosen[4:].count(MODEL) == 2


def test_the_choice_follows_the_text_when_the_lookup_starts_to_pay():
    choice = SourceChoice(draft_cost=0.4)
    _, length = run_rounds(choice, 20, {LOOKUP: 1, MODEL: 3}, {LOOKUP: 4, MODEL: 4})
    chosen, _ = run_rounds(choice, 6 * PROBE_EVERY, {LOOKUP: 5, MODEL: 3}, {LOOKUP: 4, MODEL: 4}, start=length)
    assert chosen[-2 * PROBE_EVERY:].count(LOOKUP) == 2 * PROBE_EVERY - 2


def test_rounds_without_a_match_go_to_the_model_and_measure_nothing():
    choice = SourceChoice(draft_cost=0.4)
    chosen, _ = run_rounds(choice, 5, {MODEL: 2}, {LOOKUP: 0, MODEL: 4})
    assert chosen == [MODEL] * 5
    assert choice.rounds == choice.chosen == {LOOKUP: 0, MODEL: 0}


def test_a_new_sequence_starts_afresh():
    choice = SourceChoice(draft_cost=0.4)
    run_rounds(choice, 10, {LOOKUP: 1, MODEL: 3}, {LOOKUP: 2, MODEL: 4})
    choice.forget()
    assert choice.rounds == choice.chosen == {LOOKUP: 0, MODEL: 0} and choice.rate(MODEL) == 0.0
    assert choice.choose(10, 2, 4) == LOOKUP


def test_the_draft_cost_is_the_weights_ratio(agreeing_bundle, self_draft_bundle):
    """Each slot's hybrid reads its draft's cost from the manifest: the draft's weight bytes over the target's."""
    from specdeploy.bundle import load_manifest

    for bundle in (agreeing_bundle, self_draft_bundle):
        manifest = load_manifest(bundle)
        ratio = sum(e.size for e in manifest.draft.files) / sum(e.size for e in manifest.target.files)
        generator = specdeploy.load(bundle, drafter="hybrid", warm_up=False)
        assert generator.slots[0].drafter.choice.draft_cost == pytest.approx(ratio)


def test_greedy_output_is_target_only_whichever_source_proposes(agreeing_bundle):
    """A draft priced as free and one priced as ten target steps: the hybrid proposes mostly from the model,
    then mostly by lookup, the output unchanged."""
    generator = specdeploy.load(agreeing_bundle, drafter="hybrid", lookup_ngram=1)  # a recurring token is a match
    prompt = list(range(3, 200))  # many tokens the target emits have occurred: many rounds match
    expected = generator.generate(prompt, max_new_tokens=40, speculative=False).token_ids
    choice = generator.slots[0].drafter.choice  # the one slot's drafter
    given = {}
    for draft_cost in (0.0, 10.0):
        choice.draft_cost = draft_cost
        output = generator.generate(prompt, max_new_tokens=40, num_draft_tokens=3)
        assert output.token_ids == expected
        given[draft_cost] = dict(choice.chosen)
    assert given[0.0][MODEL] > given[0.0][LOOKUP] >= 2 and given[10.0][LOOKUP] > given[10.0][MODEL] >= 2


def test_a_seed_gives_one_sample_through_the_choice(agreeing_bundle):
    """The choice reads the sequence's own rounds only: the same seed gives the same sample, run after run."""
    generator = specdeploy.load(agreeing_bundle, drafter="hybrid", lookup_ngram=1)
    prompt = list(range(3, 200))
    first = [generator.generate(prompt, max_new_tokens=30, temperature=0.8, seed=seed).token_ids for seed in range(4)]
    assert [generator.generate(prompt, max_new_tokens=30, temperature=0.8, seed=seed).token_ids
            for seed in range(4)] == first


def test_sampling_through_the_choice_matches_the_target_distribution(agreeing_bundle):
    """Three-token runs (top-k 3: 27 continuations) whose rounds the choice gives to either source (turns, the
    lookup first, in each run), against the exact joint distribution of the three tokens."""
    from specdeploy.lossless import sampled_continuations

    generator = specdeploy.load(agreeing_bundle, drafter="hybrid", lookup_ngram=1)
    drafter = generator.slots[0].drafter
    drafter.sampled_ngram = 1  # a recurring token is a match when sampling too
    choice, chosen = drafter.choice, []
    choose = choice.choose
    choice.choose = lambda *args: chosen.append(choose(*args)) or chosen[-1]
    result = sampled_continuations(generator, list(range(3, 200)), {"temperature": 1.0, "top_k": 3}, 3, 1, 3000)
    assert 150 < result["accepted"] < 0.95 * result["drafted"] and result["cells"] >= 11
    assert result["chi_square_p"] > 1e-3
    assert chosen.count(LOOKUP) > 300 and chosen.count(MODEL) > 300
