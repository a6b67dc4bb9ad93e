"""Packed passes (runtime/packed.py): several sequences' multi-token passes in one run, each row bit for bit its own pass."""

import numpy as np
import pytest

import specdeploy
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.policy import PassChoice
from specdeploy.runtime.packed import packed_graph

PROMPTS = ["def f(x):", "import os\n", "class A:\n    def __init__(self):", "x = [", "for i in range(10):\n    "]


@pytest.fixture(scope="module")
def int8_bundle(tmp_path_factory, checkpoints):
    from conftest import export_pair

    out = tmp_path_factory.mktemp("packed-int8") / "bundle"
    export_pair(checkpoints("llama"), out, quantize="int8", allow_lossy=True)
    return out


def alone_logits(target, prompt: list[int], tokens: list[int], capacity: int) -> np.ndarray:
    cache = target.new_cache(capacity)
    target.prefill(prompt, cache)
    return np.array(target.run(tokens, cache))


def check_packed_pass(bundle, lists: dict[int, list[int]], features: bool = False, exact: bool = False):
    """Rows `lists` (slot -> tokens) in one packed pass against each alone; the other slots keep their caches."""
    generator = specdeploy.load(bundle, max_batch=4, warm_up=False, exact=exact)
    target, slots = generator.target, generator.slots
    prompts = [generator.codec.encode(p) for p in PROMPTS[:4]]
    expected = {slot: alone_logits(target, prompts[slot], tokens, generator.max_context) for slot, tokens in lists.items()}
    expected_features = {}
    if features:
        for slot, tokens in lists.items():
            cache = target.new_cache(generator.max_context)
            target.prefill(prompts[slot] + tokens, cache)
            expected_features[slot] = cache.features[: cache.length].copy()
    pool = slots[0].target_cache.pool
    for slot, prompt in enumerate(prompts):
        target.prefill(prompt, slots[slot].target_cache)
    idle = {slot: [b[slot, :, : len(prompts[slot])].copy() for b in pool.buffers] for slot in range(4) if slot not in lists}
    calls = target.calls
    caches = [slots[slot].target_cache for slot in lists]
    out = target.run_packed(list(lists.values()), caches)
    assert target.calls == calls + 1  # one pass for every row
    for (slot, tokens), logits in zip(lists.items(), out):
        assert np.array_equal(logits, expected[slot])
        cache = slots[slot].target_cache
        assert cache.length == len(prompts[slot]) + len(tokens) and cache.tokens == prompts[slot] + tokens
        assert int(cache.mask.sum()) == cache.length
        if features:
            assert np.array_equal(cache.features[: cache.length], expected_features[slot])
    for slot, buffers in idle.items():
        cache = slots[slot].target_cache
        assert cache.length == len(prompts[slot]) and int(cache.mask.sum()) == cache.length
        assert all(np.array_equal(b[slot, :, : cache.length], kept) for b, kept in zip(pool.buffers, buffers))
    return generator


def test_verify_rows_of_uneven_lengths_are_bit_equal_to_their_own_passes(agreeing_bundle):
    check_packed_pass(agreeing_bundle, {0: [5, 6, 7], 2: [9, 4], 3: [11, 12, 13, 14, 15]})


def test_a_quantized_targets_single_tokens_and_verify_rows_share_a_pass(int8_bundle):
    """Exact int8: single tokens and verify rows in one pass, each as its own two-or-more-token pass."""
    generator = check_packed_pass(int8_bundle, {0: [5], 1: [6, 7, 8], 3: [9]}, exact=True)
    assert generator.target.min_pass_tokens == 2


def test_a_quantized_targets_single_tokens_alone_in_a_pass_compute_as_their_own_two_token_passes(int8_bundle):
    """int8, every row one token: each row's attention runs a spare query row (packed.py), so that its one
    token takes the several-row kernels a two-token pass alone takes; no token is run twice."""
    generator = check_packed_pass(int8_bundle, {0: [5], 2: [9], 3: [4]}, exact=True)
    assert generator.slots[0].target_cache.pool.packed_pass.spare == 1


def test_an_eagle_targets_feature_rows_land_at_their_positions(eagle_bundle):
    check_packed_pass(eagle_bundle, {1: [5, 6], 2: [7, 8, 9]}, features=True)


@pytest.mark.parametrize("free, tokens, passes", [(3, 2, 1), (2, 2, 2), (2, 1, 1), (1, 1, 2)])
def test_a_quantized_targets_spare_row_needs_room_past_the_rows_tokens(int8_bundle, free, tokens, passes):
    """A row whose cache has `free` positions left runs `tokens` in a packed pass only if the spare row fits
    too; else every row runs its own pass. The logits are each row's own pass's either way."""
    generator = specdeploy.load(int8_bundle, exact=True, max_batch=2, warm_up=False)
    target, slots = generator.target, generator.slots
    capacity = slots[0].target_cache.capacity
    prompts = [[7 + i % 50 for i in range(capacity - free)], [9, 10, 11, 12]]
    lists = [[5, 6][:tokens], [13, 14][:tokens]]
    expected = [alone_logits(target, prompt, tokens_, capacity) for prompt, tokens_ in zip(prompts, lists)]
    caches = [slot.target_cache for slot in slots]
    for prompt, cache in zip(prompts, caches):
        target.prefill(prompt, cache)
    calls = target.calls
    out = target.run_packed(lists, caches)
    assert target.calls - calls == passes
    assert all(np.array_equal(a, b) for a, b in zip(out, expected))
    assert caches[0].length == capacity - free + tokens and int(caches[0].mask.sum()) == caches[0].length


def test_verify_rows_and_plain_rows_in_passes_of_their_own_give_what_each_gives_alone(int8_bundle):
    """Prompt lookup proposes for the repetitive prompts only: their verify rows share one packed pass and
    the other rows' single tokens another, and every output is its prompt's decoded alone."""
    prompts = ["x = 1\nx = 1\nx = 1\nx = 1\nx =", "def f(x):", "a b a b a b a b a", "class A:\n    def __init__(self):"]
    alone = specdeploy.load(int8_bundle, exact=True, drafter="prompt-lookup")
    expected = [alone.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
    generator = specdeploy.load(int8_bundle, exact=True, max_batch=4, drafter="prompt-lookup", policy="always")
    scheduler = generator.scheduler
    scheduler.policy.choose_passes = lambda verify_rows, plain_rows, tokens: PassChoice(
        1.0, False, verify_rows > 1, plain_rows > 1)
    steps, execute = [], scheduler.runner.execute
    scheduler.runner.execute = lambda plan: steps.append(execute(plan)) or steps[-1]
    outputs = generator.generate_many(prompts, max_new_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in outputs] == expected
    # a round whose plain rows ran apart from its verify rows: two packed passes
    assert any(sum(cost.kind == "packed" for cost in result.passes) == 2 for result in steps)


def test_rows_without_room_run_one_pass_each(agreeing_bundle):
    """Three rows of a four-slot pool run its four-row graph, with the fourth slot as filler (one token at
    its pending position); a filler with no position left sends the given rows one by one, with the same
    logits."""
    generator = specdeploy.load(agreeing_bundle, max_batch=4, warm_up=False)
    target, slots = generator.target, generator.slots
    assert slots[0].target_cache.pool.packed_pass.sizes == [2, 4]
    full = slots[1].target_cache
    target.prefill([7] * generator.max_context, full)
    prompts = [generator.codec.encode(p) for p in PROMPTS[:3]]
    expected = [alone_logits(target, prompt, [5, 6], generator.max_context) for prompt in prompts]
    caches = [slots[i].target_cache for i in (0, 2, 3)]
    for prompt, cache in zip(prompts, caches):
        target.prefill(prompt, cache)
    calls = target.calls
    out = target.run_packed([[5, 6]] * 3, caches)
    assert all(np.array_equal(a, b) for a, b in zip(out, expected)) and target.calls == calls + 3
    assert full.length == generator.max_context


def test_a_graph_without_attention_nodes_has_no_packed_graph(tmp_path):
    from onnx import TensorProto, helper, save

    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["logits"])], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 1])],
                              [helper.make_tensor_value_info("logits", TensorProto.INT64, [1, 1])])
    save(helper.make_model(graph), tmp_path / "model.onnx")
    with pytest.raises(SpecdeployError, match="no attention nodes"):
        packed_graph(tmp_path / "model.onnx", 2)


@pytest.mark.parametrize("policy", ["always", "auto"])
def test_rounds_share_one_packed_pass_and_give_what_each_gives_alone(int8_bundle, policy):
    """Batched int8 target-only and speculative rounds: each output equals its sequence decoded alone, and a
    round of several rows runs the target once."""
    alone = specdeploy.load(int8_bundle, exact=True)
    prompts = PROMPTS[:4]
    generator = specdeploy.load(int8_bundle, exact=True, max_batch=4, policy=policy)
    # a packed pass whenever one can run (the tiny model's per-row passes may cost less, and the policy would see it)
    choose = generator.scheduler.policy.choose_passes  # its cost still steers the auto policy's k
    generator.scheduler.policy.choose_passes = lambda verify_rows, plain_rows, tokens: PassChoice(
        choose(verify_rows, plain_rows, tokens).cost, True, False, False)
    for speculative in (False, True):
        expected = [alone.generate(p, max_new_tokens=24, speculative=speculative, ignore_eos=True).token_ids
                    for p in prompts]
        calls = generator.target.calls
        outputs = generator.generate_many(prompts, max_new_tokens=24, speculative=speculative, ignore_eos=True)
        assert [o.token_ids for o in outputs] == expected
        if not speculative:  # the prompts' prefill chunks in one pass, then one pass per round
            assert generator.target.calls - calls == 1 + 24


def test_a_prefill_chunk_and_single_tokens_share_a_packed_pass(int8_bundle):
    """int8: a 40-token chunk beside one- and two-token rows, packed on one token axis (no padding), each
    row bit for bit its own pass."""
    check_packed_pass(int8_bundle, {0: [7 + i % 50 for i in range(40)], 1: [5], 3: [9, 10]}, exact=True)


def test_a_pass_computes_the_logits_each_row_wants_only(agreeing_bundle):
    """wanted: each row's last positions (none for a prefill chunk); the cache takes every token either way."""
    generator = specdeploy.load(agreeing_bundle, max_batch=4, warm_up=False)
    target, slots = generator.target, generator.slots
    prompts = [generator.codec.encode(p) for p in PROMPTS[:3]]
    lists = [[7 + i for i in range(20)], [5, 6, 7], [8, 9]]
    expected = [alone_logits(target, prompt, tokens, generator.max_context) for prompt, tokens in zip(prompts, lists)]
    caches = [slots[i].target_cache for i in range(3)]
    for prompt, cache in zip(prompts, caches):
        target.prefill(prompt, cache)
    calls = target.calls
    out = target.run_packed(lists, caches, wanted=[0, 1, 2])
    assert target.calls == calls + 1
    assert [len(logits) for logits in out] == [0, 1, 2]
    assert np.array_equal(out[1], expected[1][-1:]) and np.array_equal(out[2], expected[2])
    assert [cache.length for cache in caches] == [len(p) + len(t) for p, t in zip(prompts, lists)]


@pytest.mark.parametrize("bundle, speculative", [("int8_bundle", False), ("int8_bundle", True), ("agreeing_bundle", True)])
def test_a_long_prompt_rides_in_the_rounds_of_the_rows_decoding_beside_it(bundle, speculative, request):
    """A prompt of three chunks joins a decoding row: each chunk rides in that iteration's packed pass (one
    target pass per iteration, where it decodes target-only), and both outputs are what each gives alone."""
    from specdeploy.runtime.session import PREFILL_CHUNK

    path = request.getfixturevalue(bundle)
    exact = bundle == "int8_bundle"  # its packed graphs' spare row keeps batched rows bit for bit their own passes
    alone = specdeploy.load(path, exact=exact)
    generator = specdeploy.load(path, max_batch=2, policy="always", exact=exact)
    scheduler, target = generator.scheduler, generator.target
    long_prompt = [7 + i % 50 for i in range(2 * PREFILL_CHUNK + 10)]
    config = dict(max_new_tokens=30, speculative=speculative, ignore_eos=True)
    first = generator.new_sequence("def f(x):", streaming=False, **config)
    scheduler.submit(first)
    while not first.new_tokens:
        scheduler.step()
    late = generator.new_sequence(long_prompt, streaming=False, **config)
    scheduler.submit(late)
    steps, calls = 0, target.calls
    while not late.target_started or late.target_prefilling:
        scheduler.step()
        steps += 1
    assert steps == 3 and late.slot.target_cache.length == len(long_prompt) - 1 and not first.finished
    if not speculative:
        assert target.calls - calls == 3  # the decoding row's round and a chunk, in one pass each time
    while scheduler.active:
        scheduler.step()
    assert first.new_tokens == alone.generate("def f(x):", **config).token_ids
    assert late.new_tokens == alone.generate(long_prompt, **config).token_ids


def test_a_round_that_raises_fails_the_prompts_riding_in_it(int8_bundle):
    """An error out of a round before its packed pass: the prompt whose chunk was to ride in it fails (its
    prompt would be cut), and the scheduler goes on with the other sequences."""
    from specdeploy.runtime.session import PREFILL_CHUNK

    generator = specdeploy.load(int8_bundle, exact=True, max_batch=2, policy="always")
    scheduler = generator.scheduler
    config = dict(max_new_tokens=8, speculative=False, ignore_eos=True)
    first = generator.new_sequence("def f(x):", streaming=False, **config)
    scheduler.submit(first)
    while not first.new_tokens:
        scheduler.step()
    late = generator.new_sequence([7 + i % 50 for i in range(PREFILL_CHUNK + 10)], streaming=False, **config)
    scheduler.submit(late)
    choose = scheduler.policy.choose_passes  # asked in the step, before its packed pass
    scheduler.policy.choose_passes = lambda *counts: (_ for _ in ()).throw(RuntimeError("bookkeeping"))
    with pytest.raises(RuntimeError):
        scheduler.step()
    assert late.finished and late.output().stats.finish_reason == "error" and not first.finished
    scheduler.policy.choose_passes = choose
    while scheduler.active:
        scheduler.step()
    assert first.new_tokens == specdeploy.load(int8_bundle, exact=True).generate("def f(x):", **config).token_ids
