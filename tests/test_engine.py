"""Engine pieces that run without a GPU: the one pass (`OrtEngine.run`), KV rollback, the TensorRT
profile strings, provider checks."""

import sys

import numpy as np
import pytest

from specdeploy.bundle import load_manifest
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.engine import OrtEngine
from specdeploy.runtime.session import SessionConfig, providers_for, trt_profiles


def test_trt_profiles_cover_every_input(bundles):
    spec = load_manifest(bundles("qwen2")).target
    profiles = trt_profiles(spec, 256)
    assert set(profiles) == {"trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes"}
    for value in profiles.values():
        entries = dict(item.split(":") for item in value.split(","))
        assert set(entries) == set(spec.input_names)
    maximum = dict(item.split(":") for item in profiles["trt_profile_max_shapes"].split(","))
    assert maximum["attention_mask"] == "1x256"
    # The fused graph's past is the whole preallocated buffer; optimum's past grows to max_context - 1.
    assert spec.kv_cache.shared_buffer
    assert maximum["past_key_values.0.key"] == f"1x{spec.num_kv_heads}x256x{spec.head_dim}"
    draft = load_manifest(bundles("qwen2")).draft  # head_dim 8: too small for the fused graph
    assert not draft.kv_cache.shared_buffer
    maximum = dict(item.split(":") for item in trt_profiles(draft, 256)["trt_profile_max_shapes"].split(","))
    assert maximum["past_key_values.0.key"] == f"1x{draft.num_kv_heads}x255x{draft.head_dim}"


def test_gpu_devices_need_onnxruntime_gpu():
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    for device in ("cuda", "tensorrt"):
        with pytest.raises(SpecdeployError, match="onnxruntime-gpu"):
            providers_for(SessionConfig(device=device))


def test_a_cache_rolls_back_to_the_shared_prefix(bundles):
    bundle = bundles("mistral")
    spec = load_manifest(bundle).target
    engine, other = OrtEngine(bundle / spec.onnx_path, spec), OrtEngine(bundle / spec.onnx_path, spec)
    cache, fresh = engine.new_cache(64), other.new_cache(64)
    context = [5, 9, 13, 40, 41, 42]
    engine.run(context + [7, 8, 9], cache)  # a draft run that will be partly rejected
    logits = engine.logits_after(context + [100], cache)  # diverges after the context: positions 6.. are dropped
    assert cache.length == len(context) + 1 == len(cache.tokens)
    np.testing.assert_allclose(logits, other.logits_after(context + [100], fresh), atol=1e-5)
    with pytest.raises(SpecdeployError, match="max context"):
        engine.run(list(range(70)), cache)


def test_prompt_lookup_finds_the_latest_earlier_ngram():
    from specdeploy.runtime.drafters import PromptLookupDrafter
    from specdeploy.runtime.sampling import Sampler, SamplingParams

    def reference(context, k, max_ngram=3, min_ngram=1):
        for size in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
            pattern = context[-size:]
            for start in range(len(context) - size - 1, -1, -1):
                if context[start : start + size] == pattern:
                    return context[start + size : start + size + k]
        return []

    rng = np.random.default_rng(0)
    drafter = PromptLookupDrafter(vocab_size=8)
    greedy = Sampler(SamplingParams(), vocab=8)
    for length in range(1, 60):  # a new sequence every time: prefill starts its index afresh
        context = [int(t) for t in rng.integers(0, 4, size=length)]
        drafter.prefill(context)
        for k in (1, 4):
            assert drafter.propose(context, k, greedy, rng)[0] == reference(context, k), (context, k)
    for trial in range(20):  # one sequence growing as the generate loop grows it: indexed as it grows
        context = [int(t) for t in rng.integers(0, 4, size=int(rng.integers(1, 5)))]
        drafter.prefill(context)
        while len(context) < 80:
            assert drafter.propose(context, 3, greedy, rng)[0] == reference(context, 3), (trial, context)
            context.extend(int(t) for t in rng.integers(0, 4, size=int(rng.integers(1, 6))))


def test_the_hybrid_drafts_from_shorter_matches_only_when_greedy(bundles):
    """Greedy, a recurring 2-gram is enough for the lookup to offer tokens; sampling, only a recurring 3-gram
    (a lookup token is then kept only with the target's probability of it). Beside a draft model the
    lookup matches 3-grams by default, alone 2-grams."""
    import specdeploy
    from specdeploy.runtime.sampling import Sampler, SamplingParams

    generator = specdeploy.load(bundles("llama"), lookup_ngram=2, warm_up=False)
    hybrid, vocab = generator.drafter, generator.target.spec.vocab_size
    greedy, sampled = Sampler(SamplingParams(), vocab), Sampler(SamplingParams(temperature=0.8), vocab)
    rng = np.random.default_rng(0)
    two_gram = [5, 6, 7, 9, 6, 7]  # "6 7" recurs, no 3-gram does
    three_gram = [5, 6, 7, 9, 5, 6, 7]  # "5 6 7" recurs
    for context, sampler, offered in ((two_gram, greedy, [9, 6]), (two_gram, sampled, []),
                                      (three_gram, sampled, [9, 5]), (three_gram, greedy, [9, 5]),
                                      ([6, 7, 6, 7], greedy, [6, 7]), ([6, 7, 6], sampled, [])):
        hybrid.prefill(context[:-1])
        assert hybrid.offer(context, 2, sampler, rng) == (None, offered), (context, sampler.greedy)
    assert specdeploy.load(bundles("llama"), warm_up=False).drafter.lookup.min_ngram == 3
    assert specdeploy.load(bundles("llama"), drafter="prompt-lookup", warm_up=False).drafter.min_ngram == 2
    with pytest.raises(SpecdeployError, match="lookup_ngram"):  # no n-gram that long is ever matched
        specdeploy.load(bundles("llama"), lookup_ngram=4)


@pytest.mark.parametrize("role", ["target", "draft"])  # fused (shared buffer) and optimum (concat) layouts
def test_chunked_prefill_equals_one_pass(bundles, role):
    from specdeploy.runtime.session import PREFILL_CHUNK

    bundle = bundles("llama")
    spec = load_manifest(bundle).model(role)
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    ids = list(np.random.default_rng(4).integers(2, 300, size=2 * PREFILL_CHUNK + 7))
    whole = engine.run(np.asarray(ids), engine.new_cache(256))
    cache = engine.new_cache(256)
    engine.prefill(ids[:-1], cache)
    assert cache.length == len(ids) - 1 and engine.calls == 1 + 3  # the whole pass, then three chunks
    np.testing.assert_allclose(engine.logits_after(ids, cache), whole[-1], atol=1e-4)


def test_long_catch_up_goes_in_chunks(bundles):
    """logits_after on a context far ahead of the cache (a draft after many prompt-lookup rounds)."""
    from specdeploy.runtime.session import PREFILL_CHUNK

    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    ids = list(np.random.default_rng(5).integers(2, 300, size=2 * PREFILL_CHUNK + 20))
    whole = engine.run(np.asarray(ids), engine.new_cache(256))
    cache = engine.new_cache(256)
    engine.prefill(ids[:10], cache)
    calls = engine.calls
    np.testing.assert_allclose(engine.logits_after(ids, cache), whole[-1], atol=1e-4)
    assert engine.calls - calls == 3 and cache.tokens == ids  # 64 + 64 + 14 (the last one's logits)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # shared-buffer and concat caches
def test_a_failed_pass_leaves_tokens_and_cache_in_step(bundles, arch):
    """A pass that fails inside the session (here ONNX Runtime's own error: an id past the vocabulary, which
    the engine hands on unchecked) leaves the cache's tokens and valid positions agreeing, and the next pass
    computes what a fresh cache does."""
    bundle = bundles(arch)
    spec = load_manifest(bundle).target
    exact = arch == "llama"  # the re-run path (the previous token again) shortens the cache first
    engine = OrtEngine(bundle / spec.onnx_path, spec, exact=exact)
    cache = engine.new_cache(64)
    engine.prefill([5, 9, 13, 40, 50, 51], cache)
    cache.truncate(5)  # a rejection: the concat cache cuts its stale position on the next pass
    assert cache.tokens == [5, 9, 13, 40, 50]
    with pytest.raises(Exception, match="out of data bounds"):
        engine.logits_after([5, 9, 13, 40, 50, spec.vocab_size + 7], cache)
    assert len(cache.tokens) == cache.length == (4 if exact else 5)
    fresh = engine.new_cache(64)
    context = [5, 9, 13, 60, 61]  # diverges before the failed pass: a second cut, of the first cut's copies
    np.testing.assert_allclose(engine.logits_after(context, cache), engine.logits_after(context, fresh), atol=1e-5)


def test_long_passes_take_any_integer_ids(bundles):
    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    ids = np.random.default_rng(6).integers(2, 300, size=100)
    expected = engine.run(ids, engine.new_cache(128))
    cache = engine.new_cache(128)
    np.testing.assert_allclose(engine.run(ids.astype(np.int32), cache), expected, atol=1e-6)
    assert cache.tokens == ids.tolist() and all(type(token) is int for token in cache.tokens)


def test_cache_capacity_and_gpu_checks(bundles, monkeypatch):
    import onnxruntime as ort

    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    with pytest.raises(SpecdeployError, match="exceeds the target's max context"):
        engine.new_cache(spec.max_context + 1)
    # An fp32 fused graph on a GPU device is refused (ONNX Runtime's CUDA GroupQueryAttention is fp16/bf16).
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(SpecdeployError, match="fp32 fused graph"):
        OrtEngine(bundle / spec.onnx_path, spec, SessionConfig(device="cuda"))


def test_scratch_logits_are_the_same_numbers_and_last_one_pass(bundles):
    """scratch_logits: run writes one engine-owned buffer (the generate loop's passes): the numbers of a
    fresh array, valid until the next pass; long passes and ordinary engines get fresh arrays."""
    from specdeploy.runtime.engine import SCRATCH_ROWS

    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    scratching = OrtEngine(bundle / spec.onnx_path, spec, scratch_logits=True)
    ids = [int(i) for i in np.random.default_rng(7).integers(2, 300, size=20)]
    fresh_cache, scratch_cache = engine.new_cache(64), scratching.new_cache(64)
    fresh = [engine.run(ids[:12], fresh_cache)] + [engine.run([token], fresh_cache) for token in ids[12:15]]
    assert not any(np.shares_memory(a, b) for i, a in enumerate(fresh) for b in fresh[i + 1 :])
    scratch = [scratching.run(ids[:12], scratch_cache)]
    np.testing.assert_array_equal(scratch[0], fresh[0])
    for step, token in enumerate(ids[12:15], start=1):
        scratch.append(scratching.run([token], scratch_cache))
        np.testing.assert_array_equal(scratch[-1], fresh[step])
    assert np.shares_memory(scratch[0], scratch[1]) and np.shares_memory(scratch[1], scratch[3])
    long_ids = [int(i) for i in np.random.default_rng(8).integers(2, 300, size=SCRATCH_ROWS + 1)]
    long_pass = scratching.run(long_ids, scratching.new_cache(SCRATCH_ROWS + 1))
    assert not np.shares_memory(long_pass, scratch[0])


@pytest.mark.parametrize("role", ["target", "draft"])  # the short path is the fused graphs' (shared buffer)
def test_one_token_steps_give_the_numbers_of_ordinary_passes(bundles, role):
    """A one-token run right after another on the same cache takes the short path (nothing rebound): the
    numbers of a plain pass, whatever pass came before it (a multi-token pass rebinds the ids and logits;
    the next step then takes the long way once)."""
    bundle = bundles("llama")
    spec = load_manifest(bundle).model(role)
    engine = OrtEngine(bundle / spec.onnx_path, spec, scratch_logits=True)
    plain = OrtEngine(bundle / spec.onnx_path, spec)
    stepped, extended = engine.new_cache(64), plain.new_cache(64)
    ids = [int(i) for i in np.random.default_rng(3).integers(2, 300, size=16)]
    engine.prefill(ids[:5], stepped)
    plain.prefill(ids[:5], extended)
    for position in range(5, 16):
        if position == 10:  # a catch-up of two tokens between steps
            got, expected = engine.run(ids[10:12], stepped)[-1], plain.run(ids[10:12], extended)[-1]
        elif position == 11:
            continue
        else:
            got, expected = engine.run([ids[position]], stepped)[0], plain.run([ids[position]], extended)[-1]
        np.testing.assert_array_equal(got, expected)
    assert engine.takes_short_path(stepped) is spec.kv_cache.shared_buffer  # the short path was there to take
    assert stepped.tokens == extended.tokens == ids and stepped.length == 16
    full = engine.new_cache(18)
    engine.prefill(ids, full)
    engine.run([7], full)
    engine.run([8], full)  # the short path, up to the last position
    with pytest.raises(SpecdeployError, match="max context"):
        engine.run([9], full)
    assert full.length == len(full.tokens) == 18


def test_one_engine_serves_caches_in_turn(bundles):
    """A server's shape: one loaded engine, several caches (requests) in turn, each pass after another
    cache's; every cache gets the numbers it would get on an engine of its own."""
    bundle = bundles("llama")
    for spec in load_manifest(bundle).target, load_manifest(bundle).draft:  # shared-buffer and concat
        shared = OrtEngine(bundle / spec.onnx_path, spec, scratch_logits=True)
        rng = np.random.default_rng(10)
        contexts = [[int(t) for t in rng.integers(2, 300, size=n)] for n in (7, 12)]
        caches = [shared.new_cache(64) for _ in contexts]
        own = [OrtEngine(bundle / spec.onnx_path, spec) for _ in contexts]
        own_caches = [engine.new_cache(64) for engine in own]
        for step in range(6):
            for index, context in enumerate(contexts):
                got = shared.logits_after(context, caches[index]).copy()
                np.testing.assert_array_equal(got, own[index].logits_after(context, own_caches[index]))
                context.append(int(got.argmax()) if step != 3 else 5)
            for cache in caches[0], own_caches[0]:  # one request rolls back while the other goes on
                cache.truncate(cache.length - 2)
        assert [cache.tokens for cache in caches] == [cache.tokens for cache in own_caches]
        assert caches[1].tokens == contexts[1][:-1] and caches[0].tokens == contexts[0][:-3]


def test_a_layout_the_runtime_does_not_bind_is_refused(bundles):
    import dataclasses

    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    other = dataclasses.replace(spec, kv_cache=dataclasses.replace(spec.kv_cache, layout="batch,sequence,kv_heads,head_dim"))
    with pytest.raises(SpecdeployError, match="layout"):
        OrtEngine(bundle / spec.onnx_path, other)


def test_truncate_to_prefix_compares_only_what_an_appended_context_added(bundles):
    """A context list that only grew since the last call is compared from where they agreed; any other
    list (a copy with an earlier token changed) is compared from the start, and the cache rolls back."""
    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    engine, other = OrtEngine(bundle / spec.onnx_path, spec), OrtEngine(bundle / spec.onnx_path, spec)
    cache, fresh = engine.new_cache(64), other.new_cache(64)
    context = [5, 9, 13, 40, 41, 42]
    engine.logits_after(context, cache)
    engine.run([7, 8], cache)  # drafts, one of them rejected below
    context += [7, 99]
    assert cache.truncate_to_prefix(context, min_rest=1) == [99] and cache.length == 7
    changed = list(context)
    changed[2] = 14
    np.testing.assert_allclose(engine.logits_after(changed, cache), other.logits_after(changed, fresh), atol=1e-5)
    assert cache.tokens == changed[:-1] + [changed[-1]] and cache.length == len(changed)


def test_the_full_width_mask_gives_the_logits_of_a_context_wide_one(bundles):
    """On the CPU a shared-buffer cache binds one capacity-wide mask (ones, then zeros) and writes it in place;
    the logits must be bit for bit those of the mask exactly as wide as the context, the graph's plain
    contract: prefill from empty, chunks, single steps, a rollback and a verify-sized pass."""
    import onnxruntime as ort

    from specdeploy.runtime.kv_cache import ort_value

    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    cache = engine.new_cache(64)
    assert cache.mask is not None and cache.mask.shape == (1, 64)
    session = ort.InferenceSession(str(bundle / spec.onnx_path), providers=["CPUExecutionProvider"])
    buffers = [np.zeros((1, spec.num_kv_heads, 64, spec.head_dim), np.float32) for _ in range(2 * spec.num_layers)]
    values = [ort_value(b, "cpu") for b in buffers]
    binding = session.io_binding()
    kv = spec.kv_cache  # the manifest's templates name each layer's inputs and outputs
    past = [name for i in range(spec.num_layers) for name in (kv.past_key % i, kv.past_value % i)]
    present = [name for i in range(spec.num_layers) for name in (kv.present_key % i, kv.present_value % i)]
    length = 0
    ids = [int(i) for i in np.random.default_rng(9).integers(2, 300, size=40)]
    for step in (ids[:20], [ids[20]], [ids[21]], ids[22:27], "rollback", [ids[30]], ids[31:36]):
        if step == "rollback":
            cache.truncate(21)
            length = 21
            continue
        got = engine.run(step, cache)
        total = length + len(step)
        keep = [np.array([step], np.int64), np.ones((1, total), np.int64)]
        binding.bind_cpu_input("input_ids", keep[0])
        binding.bind_cpu_input("attention_mask", keep[1])
        binding.bind_output("logits", "cpu")  # first: get_outputs() lists outputs in binding order
        for name, value in zip(past, values):
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(present, values):
            binding.bind_ortvalue_output(name, value)
        session.run_with_iobinding(binding)
        expected = binding.get_outputs()[0].numpy()[0]
        np.testing.assert_array_equal(got, expected)
        assert cache.mask[0].tolist() == [1] * total + [0] * (64 - total)
        length = total


def test_a_truncated_cache_is_compared_again(bundles):
    """truncate_to_prefix compares tokens: a cache truncated by hand (its tokens with it) and extended
    with other tokens is found to diverge from the context it held before."""
    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    engine = OrtEngine(bundle / spec.onnx_path, spec, scratch_logits=True)
    other = OrtEngine(bundle / spec.onnx_path, spec)
    cache, fresh = engine.new_cache(64), other.new_cache(64)
    context = [5, 9, 13, 40, 50, 51]
    engine.prefill(context, cache)
    engine.prefill(context, cache)
    cache.truncate(3)
    assert cache.tokens == context[:3]
    engine.run([77, 78], cache)
    engine.run([79], cache)
    np.testing.assert_allclose(engine.logits_after(context, cache), other.logits_after(list(context), fresh), atol=1e-5)
    assert cache.tokens == context


def test_allow_spinning_is_set_for_per_session_pools_only():
    """The shared pool ignores a session's spinning setting, so the options say nothing about it there."""
    import subprocess
    import sys
    import textwrap

    from specdeploy.runtime.session import session_options

    for spinning in (False, True):
        options = session_options(SessionConfig(allow_spinning=spinning))
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == ("1" if spinning else "0")
    script = textwrap.dedent("""
        from specdeploy.runtime.session import SessionConfig, session_options
        options = session_options(SessionConfig(shared_threads=True, allow_spinning=True))
        try:
            options.get_session_config_entry("session.intra_op.allow_spinning")
        except RuntimeError:
            print("absent")
    """)  # in a subprocess: the shared pool, once made, is the process's for good
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "absent"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident memory is read from Linux's smaps")
def test_a_caches_memory_grows_with_the_positions_written():
    """A written position maps its own pages only, not 2 MiB ones (NumPy asks for huge pages on large arrays)."""
    from specdeploy.runtime.kv_cache import KVSlots

    slots = KVSlots(num_layers=2, num_kv_heads=4, head_dim=64, dtype=np.float32, capacity=8192, slots=4)
    size = sum(buffer.nbytes for buffer in slots.buffers)  # 4 slots x 2 layers x 2 x 4 heads x 2 MiB = 128 MiB
    before = _resident_bytes()
    for buffer in slots.buffers:
        buffer[:, :, 0] = 1.0  # position 0 of every slot, head and layer
    assert _resident_bytes() - before < size / 16


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_exact_needs_a_cache_written_in_place(bundles):
    """An exact target runs a single token again beside the previous one, which a concatenating graph could
    only do by copying its whole cache each step: refused, saying what to export instead."""
    bundle = bundles("gpt2")
    spec = load_manifest(bundle).target
    with pytest.raises(SpecdeployError, match="fused"):
        OrtEngine(bundle / spec.onnx_path, spec, exact=True)
    assert OrtEngine(bundle / spec.onnx_path, spec).min_pass_tokens == 1
    from click.testing import CliRunner

    from specdeploy.cli import main

    served = CliRunner().invoke(main, ["serve", str(bundle), "--port", "0", "--exact"])  # refused before it listens
    assert served.exit_code == 2 and served.stderr.startswith("error: exact decoding needs a target graph")
