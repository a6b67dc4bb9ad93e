"""The scheduler: sequences decoded together give what each gives alone, whatever joins, leaves or fails."""

import numpy as np
import pytest
from scipy import stats as scipy_stats

import specdeploy
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.session import PREFILL_CHUNK
from specdeploy.runtime.sampling import SamplingParams
from specdeploy.runtime.policy import PassChoice, SpeculationPolicy
from specdeploy.testing import exact_continuation_probs

PROMPTS = ["def f(x):", "import os\n", "class A:\n    def __init__(self):", "x = [", "for i in range(10):\n    "]


@pytest.fixture(scope="module")
def alone(agreeing_bundle):
    return specdeploy.load(agreeing_bundle)


def batched(bundle, policy, drafter="hybrid", max_batch=3):
    return specdeploy.load(bundle, max_batch=max_batch, policy=policy, drafter=drafter)


def test_batched_passes_are_bit_equal_to_single_ones(agreeing_bundle):
    generator = batched(agreeing_bundle, "never", max_batch=4)
    target, slots = generator.target, generator.slots
    prompts = [generator.codec.encode(p) for p in PROMPTS[:3]]
    expected = []
    for prompt in prompts:
        cache = target.new_cache(generator.max_context)
        target.prefill(prompt, cache)
        expected.append([target.run([5], cache)[-1].copy(), target.run([9], cache)[-1].copy()])
    caches = [slots[i].target_cache for i in (0, 2, 3)]  # a gap: slot 1 is idle and must stay untouched
    slots[1].target_cache.reset()
    target.prefill([3, 4, 5], slots[1].target_cache)
    for prompt, cache in zip(prompts, caches):
        target.prefill(prompt, cache)
    first = target.run_batch([5, 5, 5], caches)
    second = target.run_batch([9, 9, 9], caches)
    for row, (one, two) in enumerate(expected):
        assert np.array_equal(first[row], one) and np.array_equal(second[row], two)
        assert caches[row].length == len(prompts[row]) + 2
    assert slots[1].target_cache.length == 3 and slots[1].target_cache.tokens == [3, 4, 5]


@pytest.mark.parametrize("policy", ["always", "never", "auto"])
@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_greedy_batched_equals_alone(agreeing_bundle, alone, policy, drafter):
    generator = batched(agreeing_bundle, policy, drafter)
    expected = [alone.generate(p, max_new_tokens=30, speculative=False).token_ids for p in PROMPTS]
    outputs = generator.generate_many(PROMPTS, max_new_tokens=30)  # 5 prompts on 3 slots: some wait
    assert [o.token_ids for o in outputs] == expected
    plain = generator.generate_many(PROMPTS, max_new_tokens=30, speculative=False)
    assert [o.token_ids for o in plain] == expected


def test_sampled_batched_equals_alone_with_the_same_choices(self_draft_bundle):
    """With an fp32 draft, batched draft passes are bit-equal to single ones: the same seed and the
    same draft lengths (every round the request's k) give the same sample, token for token."""
    alone = specdeploy.load(self_draft_bundle, drafter="model", policy="always")
    for policy, speculative in (("always", True), ("never", False)):
        generator = batched(self_draft_bundle, policy, drafter="model")
        settings = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, speculative=speculative)
        seeds = [11, 12, 13, 14]
        expected = [alone.generate(PROMPTS[i], seed=seed, **settings).token_ids for i, seed in enumerate(seeds)]
        outputs = generator.generate_many(PROMPTS[:4], seeds=seeds, **settings)
        assert [o.token_ids for o in outputs] == expected, policy


def test_an_exact_targets_sampled_row_keeps_its_draft_length_whatever_the_policy_chooses(self_draft_bundle):
    """Exact: the policy limits greedy rows only. With a policy that would run every round target-only, a
    sampled request still drafts its own k, so its seed gives the sample it gives alone, beside greedy
    neighbours."""
    alone = specdeploy.load(self_draft_bundle, drafter="model", exact=True)
    generator = specdeploy.load(self_draft_bundle, max_batch=4, policy="auto", drafter="model", exact=True)
    limits = []
    generator.scheduler.policy.draft_limit = lambda rows, max_k: limits.append(len(rows)) or 0
    sampled = dict(max_new_tokens=24, temperature=0.8, top_p=0.95)
    expected = [alone.generate(PROMPTS[i], seed=seed, **sampled).token_ids for i, seed in ((0, 21), (2, 22))]
    sequences = [generator.new_sequence(PROMPTS[0], streaming=False, seed=21, **sampled),
                 generator.new_sequence(PROMPTS[1], streaming=False, max_new_tokens=24),
                 generator.new_sequence(PROMPTS[2], streaming=False, seed=22, **sampled)]
    for sequence in sequences:
        generator.scheduler.submit(sequence)
    while generator.scheduler.active:
        generator.scheduler.step()
    outputs = [sequence.output() for sequence in sequences]
    assert [outputs[0].token_ids, outputs[2].token_ids] == expected
    assert limits and max(limits) == 1  # asked about the greedy row only
    assert outputs[0].stats.drafted > 0 and outputs[1].stats.drafted == 0
    assert all(output.stats.exact for output in outputs)


def test_without_exact_the_policy_chooses_a_sampled_rows_draft_length_too(self_draft_bundle):
    """Not exact (the default): the policy limits a batch's sampled rows as it does greedy ones."""
    generator = specdeploy.load(self_draft_bundle, max_batch=3, policy="auto", drafter="model")
    assert not generator.exact and not generator.scheduler.policy.exact
    limits = []
    generator.scheduler.policy.draft_limit = lambda rows, max_k: limits.append(len(rows)) or 0
    outputs = generator.generate_many(PROMPTS[:3], max_new_tokens=12, temperature=0.8, seeds=[0, 1, 2])
    assert limits and max(limits) == 3
    assert all(output.stats.drafted == 0 and not output.stats.exact for output in outputs)


def test_a_sequence_joining_mid_flight(agreeing_bundle, alone):
    generator = batched(agreeing_bundle, "always")
    scheduler = generator.scheduler
    first = generator.new_sequence(PROMPTS[0], streaming=True, max_new_tokens=40)
    scheduler.submit(first)
    for _ in range(3):
        scheduler.step()
    assert first.new_tokens and not first.finished
    late = generator.new_sequence(PROMPTS[1], streaming=True, max_new_tokens=40)
    scheduler.submit(late)
    while scheduler.active:
        scheduler.step()
    assert first.new_tokens == alone.generate(PROMPTS[0], max_new_tokens=40).token_ids
    assert late.new_tokens == alone.generate(PROMPTS[1], max_new_tokens=40).token_ids
    assert first.output().text == alone.generate(PROMPTS[0], max_new_tokens=40).text
    assert "".join(first.take_pieces()) == first.output().text  # nobody took them: they wait, whole
    assert first.take_pieces() == []


@pytest.mark.parametrize("order", range(4))
def test_every_forced_interleaving_gives_the_same_outputs(agreeing_bundle, alone, order):
    """Sequences join at different iterations (a seeded schedule), with different k and settings."""
    rng = np.random.default_rng(order)
    generator = batched(agreeing_bundle, "auto", max_batch=2)
    scheduler = generator.scheduler
    requests = [(PROMPTS[i], dict(max_new_tokens=int(rng.integers(5, 30)), num_draft_tokens=int(rng.integers(1, 6)),
                                  speculative=bool(rng.integers(0, 2))))
                for i in rng.permutation(len(PROMPTS))]
    sequences, pending = [], list(requests)
    while pending or scheduler.active:
        if pending and rng.random() < 0.5:
            prompt, settings = pending.pop(0)
            sequence = generator.new_sequence(prompt, streaming=False, **settings)
            scheduler.submit(sequence)
            sequences.append((sequence, prompt, settings))
        if scheduler.active:
            scheduler.step()
    for sequence, prompt, settings in sequences:
        expected = alone.generate(prompt, **{**settings, "speculative": False})
        assert sequence.new_tokens == expected.token_ids, settings


def test_cancelled_mid_prefill(long_bundle, checkpoints):
    generator = specdeploy.load(long_bundle, max_batch=2)
    scheduler = generator.scheduler
    long_prompt = list(range(2, 2 + 3 * PREFILL_CHUNK + 5))
    settings = dict(max_new_tokens=8)
    victim = generator.new_sequence(long_prompt, streaming=True, **settings)
    other = generator.new_sequence("def f(x):", streaming=True, **settings)
    scheduler.submit(victim)
    scheduler.submit(other)
    scheduler.step()  # one chunk of the long prompt; the short one is prefilled and decoding
    assert not victim.prefilled and victim.slot.target_cache.length == PREFILL_CHUNK
    scheduler.cancel(victim)
    assert victim.finished and victim.output().stats.finish_reason == "interrupted" and victim.new_tokens == []
    while scheduler.active:
        scheduler.step()
    assert other.output().token_ids == specdeploy.load(long_bundle).generate("def f(x):", max_new_tokens=8).token_ids
    assert len(scheduler.free) == 2  # both slots back


def test_an_error_fails_its_sequence_only(agreeing_bundle, alone, monkeypatch):
    generator = batched(agreeing_bundle, "never")
    scheduler = generator.scheduler
    settings = dict(max_new_tokens=12, speculative=False)
    doomed, fine = (generator.new_sequence(p, streaming=False, **settings) for p in PROMPTS[:2])
    calls = {"n": 0}
    original = type(doomed).sample_target

    def flaky(self, logits):
        if self is doomed:
            calls["n"] += 1
            raise RuntimeError("bookkeeping broke")
        return original(self, logits)

    monkeypatch.setattr(type(doomed), "sample_target", flaky)
    scheduler.submit(doomed)
    scheduler.submit(fine)
    while scheduler.active:
        scheduler.step()
    assert doomed.finish_reason == "error" and isinstance(doomed.error, RuntimeError) and calls["n"] == 1
    assert fine.new_tokens == alone.generate(PROMPTS[1], max_new_tokens=12, speculative=False).token_ids
    monkeypatch.undo()
    with pytest.raises(RuntimeError):  # generate raises what failed its sequence
        monkeypatch.setattr(type(doomed), "sample_target", lambda self, logits: (_ for _ in ()).throw(RuntimeError("x")))
        generator.generate(PROMPTS[0], max_new_tokens=4, speculative=False)
    monkeypatch.undo()
    assert generator.generate(PROMPTS[0], max_new_tokens=4, speculative=False).token_ids  # and the loop goes on


@pytest.mark.parametrize("part, where", [("sampler", "sync"), ("sampler", "sample"), ("drafter", "step_features"),
                                         ("drafter", "widen")])
def test_a_failure_at_a_rows_round_start_or_in_its_drafting_fails_that_row_alone(self_draft_bundle, part, where):
    """Two sampled rows draft together; one row's sampler raises as its round starts (sync) or as it picks its
    first draft token in the batched drafting (sample), or its drafter as it readies a batched step's input
    (step_features) or its logits (widen): that sequence fails, the other is what it is alone."""
    alone = specdeploy.load(self_draft_bundle, drafter="model", policy="always")
    settings = dict(max_new_tokens=16, temperature=0.8, seed=5)
    expected = alone.generate(PROMPTS[1], **settings).token_ids
    generator = batched(self_draft_bundle, "always", drafter="model")
    doomed, fine = (generator.new_sequence(p, streaming=False, **settings) for p in PROMPTS[:2])
    scheduler = generator.scheduler
    scheduler.submit(doomed)
    scheduler.submit(fine)
    while not (doomed.prefilled and fine.prefilled):
        scheduler.step()

    def broken(*args, **kwargs):
        raise RuntimeError(f"{where} broke")

    setattr(getattr(doomed, part), where, broken)
    while scheduler.active:
        scheduler.step()
    assert doomed.finish_reason == "error" and str(doomed.error) == f"{where} broke"
    assert fine.finish_reason == "length" and fine.new_tokens == expected


def test_sampled_batched_is_distributed_as_the_target(agreeing_bundle):
    """Chi-square over the first two tokens of sequences sampled in batches, under the auto policy."""
    generator = batched(agreeing_bundle, "auto", max_batch=4)
    settings = dict(temperature=0.8, top_k=50)
    prompt_ids = generator.codec.encode(PROMPTS[0])
    exact = exact_continuation_probs(generator, prompt_ids, SamplingParams(**settings), 2)
    generator.reset()
    trials = 2000
    outputs = generator.generate_many([prompt_ids] * trials, seeds=list(range(trials)), max_new_tokens=2, **settings)
    counts: dict[tuple[int, ...], int] = {}
    for output in outputs:
        key = tuple(output.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    keys = sorted(exact, key=exact.get, reverse=True)
    common = [key for key in keys if exact[key] * trials >= 5]
    observed = [counts.get(key, 0) for key in common] + [trials - sum(counts.get(key, 0) for key in common)]
    expected = [exact[key] * trials for key in common] + [trials * (1 - sum(exact[key] for key in common))]
    assert scipy_stats.chisquare(observed, expected).pvalue > 1e-3


def test_the_policy_speculates_where_it_pays():
    policy = SpeculationPolicy("auto")
    policy.target_ms.update({1: 10.0, 8: 14.0})
    policy.verify_ms.update({k + 1: 10.0 + 1.5 * k for k in range(1, 5)})
    policy.draft_ms.update({1: 1.5, 8: 2.5})

    def Row():  # acceptance 0.8 so far: 20 rounds kept all 4 drafts, 5 kept none
        return FakeRow([(4, 4)] * 20 + [(4, 0)] * 5)

    assert policy.draft_limit([Row()], 4) == 4  # alone on an fp32 target: the request's own k
    assert policy.draft_limit([FakeRow([(4, 0)] * 40)], 4) == 4
    policy.choose_alone = True  # a rounded target: the choice, but never a target-only round (not exact)
    assert policy.draft_limit([Row()], 4) > 0 and policy.draft_limit([FakeRow([(4, 0)] * 40)], 4) == 1
    assert policy.draft_limit([Row(), Row()], 4) > 0  # two rows: ~3.4 tokens each per verify pass still pay
    assert policy.draft_limit([Row() for _ in range(8)], 4) == 0  # 8 verify passes lose to one batched step
    assert SpeculationPolicy("always").draft_limit([Row() for _ in range(8)], 4) == 4
    assert SpeculationPolicy("never").draft_limit([Row()], 4) == 0
    with pytest.raises(SpecdeployError, match="unknown speculation policy 'sometimes'"):
        SpeculationPolicy("sometimes")


def test_the_policy_probes_with_one_draft_after_a_run_of_target_only_rounds():
    """Rows that never draft never measure their acceptance: a stale, low estimate must not keep them
    target-only for good."""
    from specdeploy.runtime.policy import PROBE_EVERY

    policy = SpeculationPolicy("auto")
    policy.target_ms.update({8: 14.0})
    policy.verify_ms.update({k + 1: 10.0 + 1.5 * k for k in range(1, 5)})
    policy.draft_ms.update({8: 2.5})
    rows = [FakeRow([(4, 4)] * 20 + [(4, 0)] * 5) for _ in range(8)]
    limits = [policy.draft_limit(rows, 4) for _ in range(2 * (PROBE_EVERY + 1))]
    assert limits == ([0] * PROBE_EVERY + [1]) * 2
    assert SpeculationPolicy("never").draft_limit(rows, 4) == 0


def test_draft_steps_are_timed_without_the_catch_ups_before_them(agreeing_bundle):
    """A row whose draft cache lags (after target-only rounds) catches up alone; the policy's cost of a
    batched draft step must not carry that pass, or one catch-up keeps the rows target-only."""
    from specdeploy.runtime.draft_rows import DraftRequest, propose_many

    generator = specdeploy.load(agreeing_bundle, max_batch=4, drafter="model")
    slots = generator.scheduler.slots
    contexts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    drafters = [slots[0].drafter, slots[1].drafter]
    for drafter, context in zip(drafters, contexts):
        drafter.prefill(context[:-1])
    contexts[0] += [15, 16, 17]  # the first row's cache lacks three tokens: it catches up alone
    engine = drafters[0].engine
    sampler = generator.new_sequence(contexts[0], temperature=0).sampler
    calls = engine.calls
    steps = []
    requests = [DraftRequest(d, c, 3, sampler, np.random.default_rng(0)) for d, c in zip(drafters, contexts)]
    proposals = propose_many(requests, steps)
    assert [len(tokens) for tokens, _ in proposals] == [3, 3]
    # the first row's catch-up gives its first draft position; the second row's pending token then runs
    # alone, and both rows step together for the next positions: each batched step timed, the catch-up not
    assert engine.calls - calls == 1 + len(steps)
    assert [rows for rows, _ in steps] == [1, 2, 2]
    assert all(seconds > 0 for _, seconds in steps)


def test_a_rounds_rows_share_one_packed_pass_where_that_costs_less():
    """A packed pass costs the tokens it runs (every row's, and a filler token per idle row): one verify row of 5
    tokens beside 7 target-only rows is a 12-token pass, cheaper than its own pass plus a packed pass of
    the 7; an fp32 target's plain rows never join one."""
    policy = SpeculationPolicy("auto")
    policy.packed_sizes, policy.single_packed = [2, 4, 8], True
    policy.verify_ms.update({2: 10.0, 5: 16.0})
    policy.target_ms.update({7: 70.0, 8: 80.0})  # a quantized target's batched step: a pass per row
    for size, scale in ((2, 1.0), (4, 1.6), (8, 2.8)):
        policy.packed_ms[size] = {size: 8.0 * scale, 2 * size: 10.0 * scale, 5 * size: 20.0 * scale}
    assert policy.choose_passes(1, 7, 5) == PassChoice(pytest.approx(28.0), True, False, False)
    assert policy.packed_cost(7, 7) == pytest.approx(22.4)  # 7 tokens and a filler's: the 8-token pass
    assert policy.packed_cost(3, 6) == pytest.approx(16.0)  # 6 and a filler's, beside 8 and 4 measured: 8's cost
    assert policy.choose_passes(0, 8, 1).plain_shared  # target-only: one packed pass
    policy.single_packed = False  # an fp32 target's plain rows never join a packed pass: one batched step
    assert policy.choose_passes(1, 7, 5) == PassChoice(pytest.approx(86.0), False, False, False)
    assert policy.choose_passes(3, 0, 5).verify_shared  # the verify rows in one packed pass
    policy.packed_ms[4][20] = 100.0  # a packed pass dearer than a pass per row: one each
    assert policy.choose_passes(3, 0, 5) == PassChoice(pytest.approx(48.0), False, False, False)


def test_the_policy_counts_each_rounds_time_outside_the_engines():
    """A target-only round pays its Python (sampling, bookkeeping) per token; a speculative round shares it."""
    policy = SpeculationPolicy("auto")
    policy.target_ms.update({8: 14.0})
    policy.verify_ms.update({k + 1: 10.0 + 1.5 * k for k in range(1, 5)})
    policy.draft_ms.update({8: 2.5})

    def Row():  # acceptance 0.8 so far: 20 rounds kept all 4 drafts, 5 kept none
        return FakeRow([(4, 4)] * 20 + [(4, 0)] * 5)

    rows = [Row() for _ in range(8)]
    assert policy.draft_limit(rows, 4) == 0  # engines alone: one batched step beats 8 verify passes
    policy.observe(policy.outside_ms["target"], 8, 40.0)  # 8 tokens per 54 ms, against ~27 per 138 ms
    assert policy.draft_limit(rows, 4) == 4
    policy.observe(policy.outside_ms["speculative"], 8, 400.0)
    assert policy.draft_limit(rows, 4) == 0


def test_the_scheduler_measures_its_rounds_outside_the_engines(agreeing_bundle):
    generator = specdeploy.load(agreeing_bundle, max_batch=4, policy="always")  # both kinds of round, whatever the costs
    policy = generator.scheduler.policy
    generator.generate_many(["def f(x):", "class A:"], max_new_tokens=12, temperature=0)
    generator.generate_many(["def f(x):", "class A:"], max_new_tokens=12, temperature=0, speculative=False)
    for kind in ("target", "speculative"):
        assert policy.outside_ms[kind].get(2, 0.0) > 0.0, (kind, policy.outside_ms)


def test_bad_batch_settings(agreeing_bundle):
    with pytest.raises(SpecdeployError, match="max_batch"):
        specdeploy.load(agreeing_bundle, max_batch=0)
    generator = batched(agreeing_bundle, "always", max_batch=2)
    with pytest.raises(SpecdeployError, match="one seed per prompt"):
        generator.generate_many(PROMPTS[:2], seeds=[1])


def test_sequences_with_one_prompt_prefill_it_once(agreeing_bundle, alone):
    generator = batched(agreeing_bundle, "always", max_batch=4)
    prompt = generator.codec.encode("class A:\n    def __init__(self):\n" * 6)  # > one prefill chunk
    assert len(prompt) > PREFILL_CHUNK
    generator.reset()
    target_calls = generator.target.calls
    outputs = generator.generate_many([prompt] * 4, seeds=[1, 2, 3, 4], max_new_tokens=1, speculative=False,
                                      temperature=0.8)
    chunks = -(-(len(prompt) - 1) // PREFILL_CHUNK)
    assert generator.target.calls - target_calls == chunks + 1  # one prefill, then one batched step of 4 rows
    for seed, output in zip((1, 2, 3, 4), outputs):
        assert output.token_ids == alone.generate(prompt, seed=seed, max_new_tokens=1, speculative=False,
                                                  temperature=0.8).token_ids
    greedy = generator.generate_many([prompt] * 3, max_new_tokens=20)
    assert all(o.token_ids == alone.generate(prompt, max_new_tokens=20, speculative=False).token_ids for o in greedy)


def test_caches_outside_one_pool_are_stepped_one_by_one_with_their_own_logits(agreeing_bundle):
    """run_batch over caches it cannot batch (no shared pool) runs one pass each and keeps each row's logits."""
    generator = specdeploy.load(agreeing_bundle)
    target = generator.target
    prompts = [generator.codec.encode(p) for p in PROMPTS[:3]]
    caches, expected = [], []
    for prompt in prompts:
        alone = target.new_cache(generator.max_context)
        target.prefill(prompt, alone)
        expected.append(target.run([5], alone)[-1].copy())
        cache = target.new_cache(generator.max_context)
        target.prefill(prompt, cache)
        caches.append(cache)
    logits = target.run_batch([5, 5, 5], caches)
    for row, one in zip(logits, expected):
        assert np.array_equal(row, one)


def test_only_an_exact_target_runs_its_single_tokens_beside_the_previous_one(agreeing_bundle):
    """exact=True: every target pass runs two tokens or more (fp32 too: its one-token kernels round
    differently in the last bits), the draft's as it likes. Not exact: one token a step."""
    fast, exact = specdeploy.load(agreeing_bundle), specdeploy.load(agreeing_bundle, exact=True)
    assert fast.target.min_pass_tokens == 1 and not fast.exact
    assert exact.target.min_pass_tokens == 2 and exact.exact and exact.drafter.model_drafter.engine.min_pass_tokens == 1
    # an fp32 target's lone greedy row takes the policy's k only when exact (its passes timed at load for it)
    assert exact.scheduler.policy.exact and exact.scheduler.policy.draft_ms and not fast.scheduler.policy.draft_ms
    for prompt in PROMPTS[:3]:  # the same bits: target-only steps and verify passes of every k
        plain = exact.generate(prompt, max_new_tokens=20, speculative=False, logprobs=0)
        for k in (1, 4):
            output = exact.generate(prompt, max_new_tokens=20, num_draft_tokens=k, logprobs=0)
            assert output.stats.exact and output.token_ids == plain.token_ids
            assert [e.logprob for e in output.logprobs] == [e.logprob for e in plain.logprobs]


def test_a_lone_greedy_row_of_an_exact_target_takes_the_policys_choice():
    """An exact target's passes agree bit for bit whatever their length, so the policy picks a lone greedy
    row's k as it does a batch's: none for a draft that never agrees, the request's k for one that mostly
    does."""
    policy = SpeculationPolicy("auto")
    policy.exact = policy.choose_alone = True
    policy.target_ms[1] = 10.0  # a quantized target's step runs two tokens: a short verify pass costs as much
    policy.verify_ms.update({k + 1: 10.0 + 1.5 * (k - 1) for k in range(1, 5)})
    policy.draft_ms[1] = 1.0
    assert policy.draft_limit([FakeRow([(4, 0)] * 40)], 4) == 0
    assert policy.draft_limit([FakeRow([(1, 1)] * 30 + [(1, 0)] * 70)], 4) == 1  # 0.3 at the first position pays at k = 1
    assert policy.draft_limit([FakeRow([(4, 4)] * 20 + [(4, 0)] * 5)], 4) == 4


@pytest.fixture(scope="module")
def int8_bundle(tmp_path_factory, checkpoints):
    from conftest import export_pair

    out = tmp_path_factory.mktemp("int8") / "bundle"
    export_pair(checkpoints("llama"), out, quantize="int8", allow_lossy=True)
    return out


def test_a_lone_greedy_row_of_a_quantized_target_keeps_its_output_at_any_draft_length(int8_bundle):
    """The policy's k for a lone greedy row of an int8 target, whatever it is from round to round
    (target-only rounds included), leaves the output that of target-only decoding."""
    generator = specdeploy.load(int8_bundle, drafter="model", exact=True)
    policy = generator.scheduler.policy
    # timed at load: a lone row's own rounds never time a batched draft step (propose_many runs it alone)
    assert policy.mode == "auto" and policy.exact and policy.draft_ms and set(policy.verify_ms) >= {2, 3, 4, 5}
    expected = [generator.generate(p, max_new_tokens=30, speculative=False).token_ids for p in PROMPTS[:3]]
    choices, asked = iter([0, 3, 1, 0, 0, 4, 2] * 30), []
    policy.draft_limit = lambda rows, max_k: asked.append(len(rows)) or next(choices)
    outputs = [generator.generate(p, max_new_tokens=30) for p in PROMPTS[:3]]
    assert [o.token_ids for o in outputs] == expected
    assert asked and set(asked) == {1}
    stats = outputs[0].stats  # rounds of 1 to 4 drafts: fewer reach the later positions
    assert stats.drafted_by_position[0] == stats.draft_rounds > stats.drafted_by_position[3]
    assert all(kept <= drafted for kept, drafted in zip(stats.accepted_by_position, stats.drafted_by_position))
    before = len(asked)
    generator.generate(PROMPTS[0], max_new_tokens=10, temperature=0.8, seed=3)
    assert len(asked) == before  # a sampled row keeps its request's k: its seed's sample depends on it


def test_a_lone_greedy_row_of_a_target_that_is_not_exact_keeps_its_text_at_any_draft_length_of_one_or_more(int8_bundle):
    """Not exact: the policy gives a lone greedy row 1 to k drafts (no target-only round, whose one-token pass
    rounds unlike a verify pass); verify passes of every length agree bit for bit, so the text is the one the
    request's own k gives, whatever the choices."""
    generator = specdeploy.load(int8_bundle, drafter="model")
    policy = generator.scheduler.policy
    assert not policy.exact and policy.draft_ms  # timed at load
    policy.draft_limit = lambda rows, max_k: max_k
    expected = [generator.generate(p, max_new_tokens=30).token_ids for p in PROMPTS[:3]]
    choices = iter([3, 1, 1, 4, 2] * 40)
    policy.draft_limit = lambda rows, max_k: next(choices)
    assert [generator.generate(p, max_new_tokens=30).token_ids for p in PROMPTS[:3]] == expected


def test_a_lone_sampled_row_of_a_target_that_is_not_exact_takes_the_policys_draft_length(int8_bundle):
    """Not exact: a lone sampled row drafts what the policy chooses, not its request's k (exact keeps its k)."""
    generator = specdeploy.load(int8_bundle, drafter="model")
    policy = generator.scheduler.policy
    policy.draft_limit = lambda rows, max_k: 1
    output = generator.generate(PROMPTS[0], max_new_tokens=12, temperature=0.8, seed=3, num_draft_tokens=4)
    stats = output.stats
    assert stats.draft_rounds and stats.drafted == stats.draft_rounds  # one draft a round


def test_an_exact_quantized_target_keeps_its_two_token_steps_under_batching(int8_bundle):
    """An exact int8 target runs single tokens beside the previous one (min_pass_tokens 2); batched target-only
    rounds must keep that arithmetic, so greedy outputs equal decoding each prompt alone."""
    out = int8_bundle
    alone = specdeploy.load(out, exact=True)
    assert alone.target.min_pass_tokens == 2
    expected = [alone.generate(p, max_new_tokens=20, speculative=False).token_ids for p in PROMPTS[:3]]
    generator = specdeploy.load(out, max_batch=3, policy="never", exact=True)
    assert [o.token_ids for o in generator.generate_many(PROMPTS[:3], max_new_tokens=20, speculative=False)] == expected


def iid_tokens(acceptance: float, k: int) -> float:
    """Tokens a round of k drafts emits when each draft is kept with probability `acceptance` (Leviathan et al.
    2023): 1 + a + ... + a^k."""
    return sum(acceptance**j for j in range(k + 1))


def expects_more_than(row, k: int, tokens: float, prior: float) -> bool:
    """Whether the auto policy expects a round of k drafts to emit more than `tokens` tokens for this lone row:
    a target-only round emits 1 token a millisecond, k drafts cost `tokens` ms a round and every other draft
    length far more, so it drafts k exactly when it expects more than `tokens` (prior: its acceptance)."""
    policy = SpeculationPolicy("auto")
    policy.exact = policy.choose_alone = True  # a lone row that may take target-only rounds too
    policy.acceptance = prior
    policy.target_ms = {1: 1.0}
    policy.verify_ms = {**{n: 1e9 for n in range(2, k + 1)}, k + 1: tokens}
    return policy.draft_limit([row], k) == k


def expects_about(row, k: int, tokens: float, tolerance: float, prior: float) -> bool:
    return expects_more_than(row, k, tokens - tolerance, prior) and not expects_more_than(row, k, tokens + tolerance, prior)


def test_a_rows_expected_tokens_come_from_its_own_rounds():
    """Acceptance comes in runs: a row whose rounds accepted all 4 drafts or none (rate 0.5) emits
    1 + 2 = 3 tokens a round at k = 4, where the i.i.d. formula says 1.94; at k = 2 its rounds would
    have accepted min(j, 2). Rounds of one draft say nothing of a fourth: the row's rate fills in.
    Read through the auto policy's choice between drafting k and target-only rounds (expects_more_than)."""
    runs = FakeRow([(4, 4)] * 500 + [(4, 0)] * 500)
    assert expects_about(runs, 4, 3.0, 0.03, prior=0.5)
    assert expects_about(runs, 2, 2.0, 0.02, prior=0.5)
    assert expects_about(FakeRow([]), 4, iid_tokens(0.6, 4), 1e-6, prior=0.6)  # no rounds: the prior
    ones = FakeRow([(1, 1)] * 800 + [(1, 0)] * 200)  # kept 80% of single drafts: four drafts keep more than one
    assert expects_about(ones, 4, iid_tokens(0.8, 4), 0.05, prior=0.5)


class FakeRow:
    """What the policy reads of a sequence, from its rounds: (drafted, accepted) each, as Sequence.record_round keeps them."""

    def __init__(self, rounds: list[tuple[int, int]]):
        self.reached, self.kept, self.ended_at = [0] * 5, [0] * 5, [0] * 5
        for drafted, accepted in rounds:
            for position in range(1, min(drafted, accepted + 1) + 1):
                self.reached[position] += 1
                self.kept[position] += position <= accepted
            self.ended_at[accepted] += 1
        self.stats = type("S", (), {"drafted": sum(drafted for drafted, _ in rounds)})()



def _draft_growth(scheduler, sequences) -> list[list[int]]:
    """Step until every sequence finishes; each sequence's draft cache growth per iteration while it prefilled."""
    growth: list[list[int]] = [[] for _ in sequences]
    while scheduler.active:
        before = [(s.prefilled, s.slot.drafter.cache.length if s.slot else 0) for s in sequences]
        scheduler.step()
        for grown, s, (prefilled, length) in zip(growth, sequences, before):
            if not prefilled and s.slot is not None:
                grown.append(s.slot.drafter.cache.length - length)
    return growth


def test_a_long_prompts_draft_prefill_spreads_over_iterations(long_bundle):
    """The draft's prefill keeps pace with the target's chunks, then runs DRAFT_PREFILL_TOKENS an iteration
    (a second sequence with the same prompt copies the target's positions, not the draft's), so no
    iteration runs a whole long prompt through the draft beside the rows decoding; outputs are unchanged."""
    from specdeploy.runtime.sequence import DRAFT_PREFILL_TOKENS

    generator = specdeploy.load(long_bundle, max_batch=3, drafter="model", policy="always")
    scheduler = generator.scheduler
    settings = dict(max_new_tokens=8)
    short = generator.new_sequence("def f(x):", streaming=False, **settings)
    scheduler.submit(short)
    scheduler.step()
    long_prompt = [2 + (i * 7) % 50 for i in range(3 * DRAFT_PREFILL_TOKENS + 5)]
    first, second = (generator.new_sequence(long_prompt, streaming=False, **settings) for _ in range(2))
    scheduler.submit(first)
    scheduler.submit(second)
    growth = _draft_growth(scheduler, [first, second])
    assert max(growth[0]) <= PREFILL_CHUNK and len([g for g in growth[0] if g]) > 3 * DRAFT_PREFILL_TOKENS // PREFILL_CHUNK
    assert max(growth[1]) == DRAFT_PREFILL_TOKENS and len([g for g in growth[1] if g]) == 4
    alone = specdeploy.load(long_bundle, drafter="model")
    expected = alone.generate(long_prompt, max_new_tokens=8).token_ids
    assert first.new_tokens == second.new_tokens == expected
    assert short.new_tokens == alone.generate("def f(x):", max_new_tokens=8).token_ids


SHARED = "def f(x):\n    return x + 1\n\nclass A:\n    def __init__(self):\n        self.v = 0\n"


@pytest.fixture(scope="module")
def fresh_int8(int8_bundle):
    generator = specdeploy.load(int8_bundle, exact=True)

    def run(prompt, **settings):
        generator.reset()  # a fresh generator's output: no earlier request's positions in its cache
        return generator.generate(prompt, **settings)

    return run


def _joined_beside(bundle, first_prompt, first_settings, second_prompt, second_settings):
    """second_prompt joins while first_prompt's sequence decodes in the other slot; returns second's output."""
    generator = specdeploy.load(bundle, max_batch=2, policy="always", exact=True)
    scheduler = generator.scheduler
    first = generator.new_sequence(first_prompt, streaming=False, **first_settings)
    scheduler.submit(first)
    while len(first.new_tokens) < 22:
        scheduler.step()
    second = generator.new_sequence(second_prompt, streaming=False, **second_settings)
    scheduler.submit(second)
    while scheduler.active:
        scheduler.step()
    assert first.slot is not second.slot
    return second.output()


def _logprobs(output):
    return [(entry.token_id, entry.logprob) for entry in output.logprobs]


def test_a_rounded_target_gives_a_prompt_one_prefill_token_past_a_neighbours_cache_its_logprobs_alone(int8_bundle, fresh_int8):
    """The neighbour's cache holds all but the last of the prompt's prefill positions: that last one
    runs as a pass of its own, and alone inside the prompt's chunk: a rounded target's passes compute
    each position with the same bits whatever their length (an fp32 target's one-token passes round
    differently in the last bits: docs/runtime.md)."""
    codec = specdeploy.load(int8_bundle, warm_up=False).codec
    shared = codec.encode(SHARED)
    settings = dict(max_new_tokens=20, logprobs=0, speculative=False)
    expected = fresh_int8(shared + [9, 11], **settings)
    output = _joined_beside(int8_bundle, shared + [7], dict(max_new_tokens=30), shared + [9, 11], settings)
    assert output.token_ids == expected.token_ids
    assert _logprobs(output) == _logprobs(expected)


def test_a_rounded_target_gives_a_prompt_over_a_neighbours_target_only_tokens_its_logprobs_alone(int8_bundle, fresh_int8):
    """The neighbour decoded target-only: positions copied from its cache hold what a prefill of them
    alone computes (a rounded target's steps are passes of two tokens)."""
    codec = specdeploy.load(int8_bundle, warm_up=False).codec
    shared = codec.encode(SHARED)
    neighbour = dict(max_new_tokens=30, speculative=False)
    prompt = shared + fresh_int8(shared, **neighbour).token_ids[:20] + [5]
    settings = dict(max_new_tokens=20, logprobs=0, speculative=False)
    expected = fresh_int8(prompt, **settings)
    output = _joined_beside(int8_bundle, shared, neighbour, prompt, settings)
    assert output.token_ids == expected.token_ids
    assert _logprobs(output) == _logprobs(expected)


def test_the_scheduler_asks_each_sequence_whether_it_was_cancelled_once_a_step(agreeing_bundle):
    """cancelled() is asked once a step, waiting or running: a waiting sequence that turns cancelled never
    takes a slot; a running one ends before its next round and frees its slot in that step."""
    generator = batched(agreeing_bundle, "always", max_batch=1)
    asked, flags = {"first": 0, "second": 0}, {"first": False, "second": False}

    def cancelled(name):
        def ask():
            asked[name] += 1
            return flags[name]
        return ask

    first = generator.new_sequence("def f(x):", cancelled=cancelled("first"), max_new_tokens=40, ignore_eos=True)
    second = generator.new_sequence("class A:", cancelled=cancelled("second"), max_new_tokens=4, ignore_eos=True)
    scheduler = generator.scheduler
    scheduler.submit(first)
    scheduler.submit(second)  # one slot: it waits
    steps = 0
    while not first.new_tokens:
        scheduler.step()
        steps += 1
    assert asked == {"first": steps, "second": steps}
    flags["second"] = True
    assert scheduler.step() == [second] and second.slot is None and second.finish_reason == "cancelled"
    flags["first"] = True
    tokens = len(first.new_tokens)
    assert scheduler.step() == [first] and len(first.new_tokens) == tokens and not scheduler.active
    assert first.output().stats.finish_reason == "interrupted"
