"""The generate loop: speculative output equals target-only output, stopping, stats, sampling, bad input."""

import itertools

import numpy as np
import pytest
from scipy import stats as scipy_stats

import specdeploy
from specdeploy.testing import SAMPLED_SETTINGS, exact_continuation_probs
from specdeploy.errors import SpecdeployError
from specdeploy.runtime import sampling
from specdeploy.runtime.sampling import SamplingParams

from conftest import ARCHITECTURES, check_two_token_distribution

PROMPTS = ["def f(x):", "import os\n", "class A:\n    def __init__(self):"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_speculative_equals_target_only(bundles, arch):
    generator = specdeploy.load(bundles(arch))
    for prompt in PROMPTS:
        baseline = generator.generate(prompt, max_new_tokens=24, speculative=False)
        assert len(baseline.token_ids) == 24
        for k in (1, 2, 4, 8):
            out = generator.generate(prompt, max_new_tokens=24, num_draft_tokens=k)
            assert out.token_ids == baseline.token_ids, (arch, prompt, k)
            assert out.text == baseline.text


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
@pytest.mark.parametrize("bundle_name", ["agreeing_bundle", "self_draft_bundle"])
def test_greedy_equivalence_with_accepting_drafts(request, bundle_name, drafter):
    generator = specdeploy.load(request.getfixturevalue(bundle_name), drafter=drafter)
    for prompt in PROMPTS:
        baseline = generator.generate(prompt, max_new_tokens=40, speculative=False)
        for k, confidence in itertools.product((1, 2, 4, 8), (0.0, 0.5)):
            out = generator.generate(prompt, max_new_tokens=40, num_draft_tokens=k, draft_confidence=confidence)
            assert out.token_ids == baseline.token_ids, (prompt, k, confidence)
            assert out.stats.accepted > 0
            if bundle_name == "self_draft_bundle" and drafter == "model":
                assert out.stats.acceptance_rate == 1.0


def test_rounds_that_end_on_eos(agreeing_bundle):
    generator = specdeploy.load(agreeing_bundle)
    baseline = generator.generate(PROMPTS[0], max_new_tokens=30, speculative=False)
    for index in (3, 10, 17):  # make a token the model really emits play EOS, at several depths
        eos = baseline.token_ids[index]
        first = baseline.token_ids.index(eos)
        generator.eos_token_ids = frozenset({eos})
        expected = generator.generate(PROMPTS[0], max_new_tokens=30, speculative=False)
        assert expected.token_ids == baseline.token_ids[: first + 1]
        assert expected.stats.finish_reason == "eos"
        for k in (1, 2, 4, 8):
            out = generator.generate(PROMPTS[0], max_new_tokens=30, num_draft_tokens=k)
            assert out.token_ids == expected.token_ids
            assert out.text == expected.text
            assert out.stats.finish_reason == "eos"


def test_stop_strings_cut_inside_accepted_runs(self_draft_bundle):
    generator = specdeploy.load(self_draft_bundle)
    baseline = generator.generate(PROMPTS[1], max_new_tokens=40, speculative=False)
    text = baseline.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and stop in text
    cut = text[: text.index(stop)]
    for k in (1, 4, 8):
        out = generator.generate(PROMPTS[1], max_new_tokens=40, num_draft_tokens=k, stop=[stop])
        assert out.text == cut
        assert out.stats.finish_reason == "stop"
        assert out.token_ids == baseline.token_ids[: len(out.token_ids)]
        streamed = "".join(generator.stream(PROMPTS[1], max_new_tokens=40, num_draft_tokens=k, stop=[stop]))
        assert streamed == cut


def test_stream_pieces_join_to_the_generated_text(agreeing_bundle):
    generator = specdeploy.load(agreeing_bundle)
    pieces = list(generator.stream(PROMPTS[2], max_new_tokens=32))
    assert len(pieces) > 1
    assert "".join(pieces) == generator.generate(PROMPTS[2], max_new_tokens=32).text


def test_token_id_prompt_and_empty_prompt(agreeing_bundle):
    generator = specdeploy.load(agreeing_bundle)
    ids = generator.codec.encode(PROMPTS[0])
    assert generator.generate(ids, max_new_tokens=8).token_ids == generator.generate(PROMPTS[0], max_new_tokens=8).token_ids
    empty = generator.generate("", max_new_tokens=8)
    assert empty.stats.prompt_tokens == 1  # BOS
    assert empty.token_ids == generator.generate([0], max_new_tokens=8, speculative=False).token_ids


def test_seeded_sampling_is_deterministic(agreeing_bundle):
    generator = specdeploy.load(agreeing_bundle)
    options = dict(max_new_tokens=32, temperature=0.9, top_k=20, top_p=0.95)
    first = generator.generate(PROMPTS[0], seed=5, **options)
    assert generator.generate(PROMPTS[0], seed=5, **options).token_ids == first.token_ids
    others = {tuple(generator.generate(PROMPTS[0], seed=s, **options).token_ids) for s in range(6, 10)}
    assert len(others) > 1


def test_a_generator_switching_settings_matches_fresh_ones(agreeing_bundle):
    """What the drafter sets up per generate call (its sampler, its row buffer) never leaks into the
    next call: a sequence of greedy and sampled calls with growing and shrinking k gives, call by
    call, the tokens a freshly loaded generator gives."""
    calls = [dict(temperature=0.9, num_draft_tokens=4), dict(temperature=0.0, num_draft_tokens=4),
             dict(temperature=0.9, num_draft_tokens=6), dict(temperature=0.7, num_draft_tokens=2),
             dict(temperature=0.9, top_k=20, num_draft_tokens=5), dict(temperature=0.0, num_draft_tokens=8)]
    reused = specdeploy.load(agreeing_bundle, drafter="model")
    for options in calls:
        got = reused.generate(PROMPTS[2], max_new_tokens=24, seed=3, **options).token_ids
        fresh = specdeploy.load(agreeing_bundle, drafter="model")
        assert got == fresh.generate(PROMPTS[2], max_new_tokens=24, seed=3, **options).token_ids, options


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stats_count_what_happened(agreeing_bundle, temperature):
    """The stats against counts taken outside them: the tokens returned, and the target passes seen at the
    engine (the prefill's, then one per round). Every round emits its accepted draft tokens and one token of
    the target's, and a round's draft is sized to the budget, so only an end token cuts a round short."""
    from specdeploy.runtime.engine import PREFILL_CHUNK

    generator = specdeploy.load(agreeing_bundle, warm_up=False)
    passes = []
    run = generator.target.run  # every pass of one sequence goes through it (run_batch of one row included)
    generator.target.run = lambda token_ids, cache, *rest: passes.append(len(token_ids)) or run(token_ids, cache, *rest)
    output = generator.generate(PROMPTS[0], max_new_tokens=48, temperature=temperature, num_draft_tokens=4)
    stats = output.stats
    assert stats.new_tokens == len(output.token_ids) and stats.prompt_tokens == len(generator.codec.encode(PROMPTS[0]))
    prefill_passes = -(-(stats.prompt_tokens - 1) // PREFILL_CHUNK)
    assert len(passes) == prefill_passes + stats.rounds
    assert max(passes[prefill_passes:]) <= 4 + 1  # a round's pass: the pending token and at most k drafts
    if stats.finish_reason == "length":
        assert stats.accepted + stats.rounds == stats.new_tokens == 48
        assert stats.mean_accepted_tokens == pytest.approx(stats.new_tokens / stats.rounds)
    else:
        assert stats.finish_reason == "eos" and output.token_ids[-1] in generator.eos_token_ids
        assert stats.new_tokens <= stats.accepted + stats.rounds
    assert 0 < stats.accepted <= stats.drafted <= 4 * stats.rounds
    assert sum(stats.accepted_by_position) == stats.accepted
    assert all(a >= b for a, b in zip(stats.accepted_by_position, stats.accepted_by_position[1:]))
    assert stats.draft_ms > 0 and stats.target_ms > 0 and stats.tokens_per_s > 0
    assert stats.decode_ms >= stats.draft_ms + stats.target_ms


@pytest.mark.slow
@pytest.mark.parametrize("draft_confidence, sampler, penalty", [(0.0, "c", 1.0), (0.6, "c", 1.0), (0.0, "numpy", 1.0),
                                                                (0.0, "c", 1.3), (0.0, "numpy", 1.3)])
def test_sampled_speculative_matches_the_target_distribution(agreeing_bundle, monkeypatch, draft_confidence, sampler,
                                                             penalty):
    """The first three tokens, over 4,000 seeded k = 2 runs, against the exact target distribution (also when
    drafting stops early on low draft confidence, with NumPy's sampler instead of the C kernel, and with a
    repetition penalty: the second draft row and verify row penalize the first draft token)."""
    if sampler == "numpy":
        monkeypatch.setattr(sampling, "CProcessor", None)
    generator = specdeploy.load(agreeing_bundle)
    params = SamplingParams(temperature=1.0, top_k=3, repetition_penalty=penalty)
    prompt = generator.codec.encode(PROMPTS[0])

    exact = exact_continuation_probs(generator, prompt, params, 3)
    runs = 4000
    counts = dict.fromkeys(exact, 0)
    accepted = 0
    for seed in range(runs):
        out = generator.generate(prompt, max_new_tokens=3, temperature=1.0, top_k=3, seed=seed, num_draft_tokens=2,
                                 draft_confidence=draft_confidence, repetition_penalty=penalty)
        counts[tuple(out.token_ids)] += 1
        accepted += out.stats.accepted
    assert accepted > runs // 4  # the rejection path and the acceptance path both ran
    keys = sorted(exact)
    observed = np.array([counts[key] for key in keys])
    expected = np.array([exact[key] for key in keys], dtype=np.float64) * runs
    assert scipy_stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3


SETTINGS = SAMPLED_SETTINGS


@pytest.mark.slow
@pytest.mark.parametrize("setting, sampler", [(name, "c") for name in SETTINGS]
                         + [("T 0.8", "numpy"), ("T 0.8, top-k 50, top-p 0.95", "numpy"),
                            ("T 0.8, top-p 0.95, repetition penalty 1.1", "numpy"),
                            ("T 0.8, frequency penalty 1.0", "numpy")])
def test_sampling_matches_the_target_distribution_at_every_setting(agreeing_bundle, monkeypatch, setting, sampler):
    """The first two tokens of 4,000 seeded k = 1 runs through the whole speculative loop (draft rows, the
    verify scan with its rejections and bonus tokens, target-only steps), against the exact joint target
    distribution at that setting (cells expected fewer than 5 times pooled); with the C kernel and without."""
    if sampler == "numpy":
        monkeypatch.setattr(sampling, "CProcessor", None)
    generator = specdeploy.load(agreeing_bundle, drafter="model")
    check_two_token_distribution(generator, generator.codec.encode(PROMPTS[1]), SETTINGS[setting], runs=4000,
                                 min_accepted=0.1)


@pytest.mark.parametrize("drafter", ["model", "hybrid", "prompt-lookup"])
def test_greedy_with_a_repetition_penalty_is_target_only_token_for_token(agreeing_bundle, drafter):
    """Greedy + repetition penalty 1.1: speculative output equals target-only output for every k, and both
    are the penalized argmax of the target's logits at every position (HF's rule, computed here alone)."""
    generator = specdeploy.load(agreeing_bundle, drafter=drafter)
    for prompt in PROMPTS:
        ids = generator.codec.encode(prompt)
        baseline = generator.generate(ids, max_new_tokens=24, speculative=False, repetition_penalty=1.1)
        context = list(ids)
        for token in baseline.token_ids:
            logits = generator.target.logits_after(context, generator.target_cache)
            assert token == int(sampling.penalize(logits, np.unique(context), 1.1).argmax())
            context.append(token)
        for k in (1, 2, 4, 8):
            out = generator.generate(ids, max_new_tokens=24, num_draft_tokens=k, repetition_penalty=1.1)
            assert out.token_ids == baseline.token_ids, (prompt, k)
    unpenalized = [generator.generate(p, max_new_tokens=24, speculative=False).token_ids for p in PROMPTS]
    penalized = [generator.generate(p, max_new_tokens=24, speculative=False, repetition_penalty=1.5).token_ids
                 for p in PROMPTS]
    assert unpenalized != penalized  # the penalty does something


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=1e-9), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(num_draft_tokens=33), "num_draft_tokens"),
        (dict(draft_confidence=1.0), "draft_confidence"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_bad_generation_options(agreeing_bundle, options, message):
    generator = specdeploy.load(agreeing_bundle)
    with pytest.raises(SpecdeployError, match=message):
        generator.generate(PROMPTS[0], **options)


def test_context_limit(agreeing_bundle):
    generator = specdeploy.load(agreeing_bundle)
    limit = generator.max_context
    with pytest.raises(SpecdeployError, match="max context"):
        generator.generate([5] * limit)
    near = [5] * (limit - 6)
    baseline = generator.generate(near, max_new_tokens=50, speculative=False)
    assert len(baseline.token_ids) == 6 and baseline.stats.finish_reason == "length" and "max context" in baseline.stats.note
    for k in (1, 4, 8):
        assert generator.generate(near, max_new_tokens=50, num_draft_tokens=k).token_ids == baseline.token_ids


def test_prompt_lookup_drafter_is_lossless(agreeing_bundle):
    model_drafted = specdeploy.load(agreeing_bundle)
    lookup = specdeploy.load(agreeing_bundle, drafter="prompt-lookup")
    for prompt, k in itertools.product(PROMPTS, (2, 4)):
        assert (lookup.generate(prompt, max_new_tokens=40, num_draft_tokens=k).token_ids
                == model_drafted.generate(prompt, max_new_tokens=40, speculative=False).token_ids)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, "7"])
def test_a_seed_outside_64_bits_is_refused_before_generation(agreeing_bundle, seed):
    generator = specdeploy.load(agreeing_bundle)
    with pytest.raises(specdeploy.SpecdeployError, match="seed must be"):
        generator.generate("def f():", max_new_tokens=2, seed=seed)
    assert generator.generate("def f():", max_new_tokens=2, seed=2**64 - 1).stats.new_tokens == 2


def test_warm_up_leaves_the_output_and_the_caches_as_a_cold_load(agreeing_bundle):
    """load's warm-up runs passes of every kind, then leaves nothing behind: empty caches, no output, and
    the same tokens and pass counts as a generator loaded without it (each k as asked: under "auto" the warm
    generator's timed passes would steer its greedy rows' k, where the cold one has none)."""
    cold = specdeploy.load(agreeing_bundle, warm_up=False, policy="always")
    warm = specdeploy.load(agreeing_bundle, policy="always")
    assert cold.target.calls == cold.drafter.engine.calls == 0
    assert warm.target.calls > 0 and warm.drafter.engine.calls > 0
    for generator in (cold, warm):
        assert generator.target_cache.length == 0 and generator.target_cache.tokens == []
        assert generator.drafter.model_drafter.cache.length == 0 and generator.drafter.model_drafter.cache.tokens == []
    for options in (dict(temperature=0), dict(temperature=0.8, seed=3), dict(speculative=False)):
        expected = cold.generate("def f(x):", max_new_tokens=24, **options)
        got = warm.generate("def f(x):", max_new_tokens=24, **options)
        assert got.token_ids == expected.token_ids
        assert (got.stats.target_calls, got.stats.draft_calls) == (expected.stats.target_calls, expected.stats.draft_calls)
        cold.reset()
        warm.reset()


@pytest.mark.parametrize("penalties", [dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
                                       dict(presence_penalty=-0.5, frequency_penalty=1.2, repetition_penalty=1.1)])
def test_greedy_with_openai_penalties_is_target_only_token_for_token(agreeing_bundle, penalties):
    """Greedy with presence/frequency penalties: speculative output equals target-only output for every k,
    and each token is the argmax of the target's logits less the penalties over the tokens generated
    before it (not the prompt's), computed here from the definition."""
    generator = specdeploy.load(agreeing_bundle)
    params = sampling.SamplingParams(**penalties)
    for prompt in PROMPTS:
        ids = generator.codec.encode(prompt)
        baseline = generator.generate(ids, max_new_tokens=24, speculative=False, **penalties)
        context = list(ids)
        for token in baseline.token_ids:
            logits = generator.target.logits_after(context, generator.target_cache)
            row = sampling.penalize_counts(logits, context[len(ids):], params)
            if params.penalized:
                row = sampling.penalize(row, np.unique(context), params.repetition_penalty)
            assert token == int(row.argmax())
            context.append(token)
        for k in (1, 4):
            out = generator.generate(ids, max_new_tokens=24, num_draft_tokens=k, **penalties)
            assert out.token_ids == baseline.token_ids, (prompt, k)
    for prompt in PROMPTS:  # a strong frequency penalty leaves no token repeated much
        plain = generator.generate(prompt, max_new_tokens=64, speculative=False).token_ids
        penalized = generator.generate(prompt, max_new_tokens=64, speculative=False, frequency_penalty=2.0).token_ids
        assert penalized != plain and max(map(penalized.count, penalized)) < max(map(plain.count, plain))
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3.0)):
        with pytest.raises(SpecdeployError, match="penalty"):
            generator.generate(PROMPTS[0], max_new_tokens=2, **bad)



def test_a_stream_keeps_the_pieces_decoded_while_another_call_ran(agreeing_bundle):
    """A generate call made while a stream is open steps the stream's sequence too (one scheduler): the
    pieces decoded then must still come out of the stream, even when its sequence ended meanwhile."""
    generator = specdeploy.load(agreeing_bundle, warm_up=False)
    expected = generator.generate(PROMPTS[0], max_new_tokens=30).text
    stream = generator.stream(PROMPTS[0], max_new_tokens=30)
    pieces = [next(stream), next(stream)]
    generator.generate(PROMPTS[1], max_new_tokens=20)  # runs the open stream's sequence to its end first
    pieces += list(stream)
    assert stream.output.text == expected
    assert "".join(pieces) == expected


def test_a_stop_token_s_text_is_the_same_in_generate_and_stream(agreeing_bundle):
    """stop_token_ids end generation as EOS does: generate's text, stream's pieces and generate with a stop
    string (that never matches) must agree on whether the stop token's text is part of the text."""
    generator = specdeploy.load(agreeing_bundle, warm_up=False)
    stop_token = generator.generate(PROMPTS[0], max_new_tokens=30).token_ids[5]
    assert stop_token not in generator.codec.added_token_ids()  # an ordinary token, with text of its own
    plain = generator.generate(PROMPTS[0], max_new_tokens=30, stop_token_ids=[stop_token])
    assert plain.stats.finish_reason == "eos"
    streamed = "".join(generator.stream(PROMPTS[0], max_new_tokens=30, stop_token_ids=[stop_token]))
    with_stop = generator.generate(PROMPTS[0], max_new_tokens=30, stop_token_ids=[stop_token], stop=["\x00never"])
    assert plain.text == streamed == with_stop.text


def test_a_stop_string_before_an_incomplete_character_at_the_end_is_not_returned():
    """Byte-level vocabularies (GPT-2's " \\xe2\\x80", the start of " \u2014") hold tokens that end inside a
    UTF-8 character: TextStream holds their text back, and when generation ends there, finish() appends it
    without looking for the stop strings in it."""
    from specdeploy.runtime.text import TextStream

    pieces = {0: b"x", 1: b"b\xe2\x80"}  # token 1: an ASCII character, then two bytes of a three-byte one

    class ByteCodec:
        byte_tokens = frozenset()  # no byte-fallback pieces

        def decode(self, ids):
            return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    text = TextStream(ByteCodec(), stop=("b",))
    shown = text.push(0) + text.push(1)
    assert not text.stopped
    shown += text.finish()  # generation ended here (max_new_tokens)
    assert "b" not in shown and "b" not in text.text


def test_a_stream_holds_back_exactly_the_longest_tail_that_begins_a_stop_string():
    """Text that may yet complete a stop string is not shown: after each token, what push has handed out is the
    text less its longest tail that is a proper prefix of some stop string (against that definition on random
    texts and stops, one character a token, until a stop string ends the text)."""
    import random

    from specdeploy.runtime.text import TextStream

    class CharCodec:  # token i is character i
        byte_tokens = frozenset()

        def decode(self, ids):
            return "".join(map(chr, ids))

    def definition(text, stops):
        return max([size for stop in stops for size in range(1, min(len(stop) - 1, len(text)) + 1)
                    if text.endswith(stop[:size])], default=0)

    rng, checked = random.Random(0), 0
    for _ in range(3000):
        stops = tuple("".join(rng.choice("ab c") for _ in range(rng.randint(1, 10))) for _ in range(rng.randint(1, 4)))
        stream, shown = TextStream(CharCodec(), stop=stops), ""
        for character in "".join(rng.choice("ab c") for _ in range(rng.randint(0, 25))):
            shown += stream.push(ord(character))
            if stream.stopped:
                break
            held = definition(stream.text, stops)
            assert shown == stream.text[: len(stream.text) - held], (stream.text, stops)
            checked += held > 0
    assert checked > 10_000  # the random texts end in a stop's beginning often enough to test the tails


@pytest.mark.parametrize("options", [dict(stop=["a", 5]), dict(stop=[b"x"]), dict(max_new_tokens="5"),
                                     dict(max_new_tokens=2.5), dict(num_draft_tokens=2.0), dict(temperature="0.5"),
                                     dict(top_p=None), dict(repetition_penalty=None), dict(draft_confidence="x")])
def test_a_badly_typed_option_raises_specdeploy_error(agreeing_bundle, options):
    generator = specdeploy.load(agreeing_bundle, warm_up=False)
    with pytest.raises(SpecdeployError):
        generator.generate(PROMPTS[0], **{"max_new_tokens": 4, **options})


@pytest.mark.parametrize("prompt", [5, ["a"], [[1, 2]]])
def test_a_badly_typed_prompt_raises_specdeploy_error(agreeing_bundle, prompt):
    generator = specdeploy.load(agreeing_bundle, warm_up=False)
    with pytest.raises(SpecdeployError):
        generator.generate(prompt, max_new_tokens=2)


def test_seeds_that_are_not_a_list_raise_specdeploy_error(agreeing_bundle):
    generator = specdeploy.load(agreeing_bundle, warm_up=False)
    with pytest.raises(SpecdeployError):
        generator.generate_many(PROMPTS[:2], seeds=5, max_new_tokens=2, temperature=1.0)


def test_two_streams_read_side_by_side_give_their_whole_text(agreeing_bundle):
    """With max_batch=2, reading two streams in turn steps both sequences in each stream's steps: a stream
    whose sequence ended during the other's step must still yield the pieces decoded meanwhile."""
    import itertools

    generator = specdeploy.load(agreeing_bundle, warm_up=False, max_batch=2)
    expected = [generator.generate(prompt, max_new_tokens=20).text for prompt in PROMPTS[:2]]
    streams = [generator.stream(prompt, max_new_tokens=20) for prompt in PROMPTS[:2]]
    got = ["", ""]
    for pair in itertools.zip_longest(*streams):
        for index, piece in enumerate(pair):
            got[index] += piece or ""
    assert got == expected


def test_an_unknown_policy_raises_specdeploy_error(agreeing_bundle):
    with pytest.raises(SpecdeployError, match="policy"):
        specdeploy.load(agreeing_bundle, warm_up=False, policy="bogus")


@pytest.mark.parametrize("options", [dict(max_batch="2"), dict(max_batch=2.0), dict(lookup_ngram="2")])
def test_a_badly_typed_load_argument_raises_specdeploy_error(agreeing_bundle, options):
    with pytest.raises(SpecdeployError):
        specdeploy.load(agreeing_bundle, warm_up=False, **options)


def test_a_zero_dimensional_array_prompt_raises_specdeploy_error(agreeing_bundle):
    generator = specdeploy.load(agreeing_bundle, warm_up=False)
    with pytest.raises(SpecdeployError):
        generator.generate(np.array(5), max_new_tokens=2)


@pytest.mark.parametrize("options", [dict(stop_token_ids=0), dict(stop=False)])
def test_a_falsy_badly_typed_stop_option_is_refused_as_a_truthy_one_is(agreeing_bundle, options):
    """stop_token_ids=5 and stop=5 raise SpecdeployError; 0 and False were dropped without a word."""
    generator = specdeploy.load(agreeing_bundle, warm_up=False)
    name = next(iter(options))
    with pytest.raises(SpecdeployError):
        generator.generate("def f(x):", max_new_tokens=4, **{name: 5})
    with pytest.raises(SpecdeployError):
        generator.generate("def f(x):", max_new_tokens=4, **options)


def test_the_earliest_of_several_stop_strings_completed_by_one_token_ends_the_text():
    """Two stop strings completed by the same multi-character token: the text ends before the one that
    comes first in the text, whatever their order in the list (as OpenAI's stop does)."""
    from specdeploy.runtime.text import TextStream

    pieces = {0: "xx", 1: "abcd", 2: "zz"}

    class Codec:
        byte_tokens = frozenset()

        def decode(self, ids):
            return "".join(pieces[i] for i in ids)

    for stops in (("cd", "ab"), ("ab", "cd")):
        stream = TextStream(Codec(), stop=stops)
        shown = stream.push(0) + stream.push(1)
        assert stream.stopped
        shown += stream.finish()
        assert shown == "xx" and stream.text == "xx", stops


def test_tokens_per_round_counts_the_tokens_the_run_produced():
    """A round cut short by an EOS or a stop kept draft tokens the output never shows: tokens per round is
    new_tokens / rounds, the definition bench and serve use too."""
    from specdeploy.runtime.config import GenerationStats

    stats = GenerationStats(new_tokens=5, rounds=2, accepted=6, drafted=8)
    assert stats.mean_accepted_tokens == 2.5 and stats.to_dict()["mean_accepted_tokens"] == 2.5
