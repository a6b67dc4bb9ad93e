"""The hybrid drafter's choice between prompt lookup and the draft model: the rates it reads, the rounds it
probes, and output that stays the target's whatever it chooses."""

import pytest

import specdeploy
from specdeploy.runtime.hybrid import LOOKUP, MODEL, PROBE_EVERY, SourceChoice

from conftest import check_two_token_distribution

REPEATING = [348, 299, 9, 89, 363, 270, 338, 222, 89, 200] * 3  # ids whose last n-grams recur


class Rounds:
    """Drives a SourceChoice as a sequence would: each round proposes, then emits tokens over some time."""

    def __init__(self):
        self.now, self.length = 0.0, 100
        self.choice = SourceChoice(clock=lambda: self.now)

    def run(self, rounds: int, outcome: dict, matched: bool = True) -> list[str]:
        """outcome: source -> (tokens emitted, seconds) of a round it proposes."""
        chosen = []
        for _ in range(rounds):
            source = self.choice.choose(self.length, matched)
            tokens, seconds = outcome[source]
            self.length, self.now = self.length + tokens, self.now + seconds
            chosen.append(source)
        return chosen


def test_the_first_matched_rounds_alternate_then_the_faster_source_proposes_with_a_probe_of_the_other():
    rounds = Rounds()
    slow_lookup = {LOOKUP: (1, 0.010), MODEL: (3, 0.015)}  # 100 against 200 tokens a second
    chosen = rounds.run(4 + 4 * PROBE_EVERY, slow_lookup)
    assert chosen[:4] == [LOOKUP, MODEL, LOOKUP, MODEL]
    assert chosen[4:].count(LOOKUP) == 4  # one probe in PROBE_EVERY matched rounds
    assert rounds.choice.rate(MODEL) == pytest.approx(200.0) and rounds.choice.rate(LOOKUP) == pytest.approx(100.0)


def test_the_choice_follows_the_text_when_the_lookup_starts_to_pay():
    rounds = Rounds()
    rounds.run(20, {LOOKUP: (1, 0.010), MODEL: (3, 0.015)})
    now_repeating = {LOOKUP: (5, 0.012), MODEL: (3, 0.015)}  # a long repeated span: the lookup's guesses hold
    chosen = rounds.run(6 * PROBE_EVERY, now_repeating)
    assert chosen[-2 * PROBE_EVERY:].count(LOOKUP) == 2 * PROBE_EVERY - 2


def test_rounds_without_a_match_go_to_the_model_and_measure_nothing():
    rounds = Rounds()
    assert rounds.run(5, {MODEL: (2, 0.01)}, matched=False) == [MODEL] * 5
    assert rounds.choice.rounds == rounds.choice.chosen == {LOOKUP: 0, MODEL: 0}


def test_a_new_sequence_reads_nothing_of_the_last_ones_round():
    choice = SourceChoice(clock=lambda: 1.0)
    choice.choose(500, True)
    choice.forget_round()
    choice.choose(10, True)
    assert choice.rounds == {LOOKUP: 0, MODEL: 0}


@pytest.mark.parametrize("prefer", [LOOKUP, MODEL])
def test_greedy_output_is_target_only_whichever_source_the_choice_prefers(agreeing_bundle, prefer):
    """A clock that makes one source's rounds slow: the hybrid proposes from the other, the output unchanged."""
    generator = specdeploy.load(agreeing_bundle, drafter="hybrid", lookup_ngram=1)  # a recurring token is a match
    prompt = list(range(3, 200))  # many tokens the target emits have occurred: many rounds match
    expected = generator.generate(prompt, max_new_tokens=40, speculative=False).token_ids
    choice = generator.slots[0].drafter.choice  # the one slot's drafter
    clock, last = {"now": 0.0}, {"source": None}
    choose = choice.choose

    def choosing(length, matched):  # notes each matched round's source, for the clock
        last["source"] = source = choose(length, matched)
        return source

    def tick():  # the time since the last proposal: long after a round of the source not preferred
        clock["now"] += 0.001 if last["source"] == prefer else 1.0
        return clock["now"]

    choice.choose, choice.clock = choosing, tick
    output = generator.generate(prompt, max_new_tokens=40, num_draft_tokens=3)
    assert output.token_ids == expected
    assert choice.rounds[LOOKUP] >= 2 and choice.rounds[MODEL] >= 2
    assert choice.rate(prefer) > choice.rate(LOOKUP if prefer == MODEL else MODEL)


def test_an_exact_generators_hybrid_takes_the_lookup_whenever_it_matches(agreeing_bundle):
    generator = specdeploy.load(agreeing_bundle, drafter="hybrid", exact=True)
    assert generator.drafter.choice is None and generator.slots[0].drafter.choice is None


def test_sampling_through_the_choice_matches_the_target_distribution(agreeing_bundle):
    """Runs whose rounds the choice gives to either source (it alternates while it measures them), against the
    exact joint distribution of the first two tokens."""
    generator = specdeploy.load(agreeing_bundle, drafter="hybrid")
    choice, chosen = generator.slots[0].drafter.choice, []
    choose = choice.choose
    choice.choose = lambda length, matched: chosen.append(choose(length, matched)) or chosen[-1]
    check_two_token_distribution(generator, REPEATING, {"temperature": 0.8}, runs=3000, min_accepted=0.05)
    assert chosen.count(LOOKUP) > 300 and chosen.count(MODEL) > 300
