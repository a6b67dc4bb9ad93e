"""Engine pieces that run without a GPU: KV rollback, the TensorRT profile strings, provider checks."""

import numpy as np
import pytest

from specdeploy.bundle import load_manifest
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.engine import CachedModel, OrtEngine, SessionConfig, providers_for, trt_profiles


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


def test_cached_model_rolls_back_to_the_shared_prefix(bundles):
    bundle = bundles("mistral")
    spec = load_manifest(bundle).target
    model = CachedModel(OrtEngine(bundle / spec.onnx_path, spec), 64)
    fresh = CachedModel(OrtEngine(bundle / spec.onnx_path, spec), 64)
    context = [5, 9, 13, 40, 41, 42]
    model.extend(context + [7, 8, 9])  # a draft run that will be partly rejected
    logits = model.logits_after(context + [100])  # diverges after the context: positions 6.. are dropped
    assert model.cache.length == len(context) + 1 == len(model.tokens)
    np.testing.assert_allclose(logits, fresh.logits_after(context + [100]), atol=1e-5)
    with pytest.raises(SpecdeployError, match="max context"):
        model.extend(list(range(70)))


def test_prompt_lookup_finds_the_latest_earlier_ngram():
    from specdeploy.runtime.drafters import PromptLookupDrafter
    from specdeploy.runtime.sampling import SamplingParams

    def reference(context, k, max_ngram=3, min_ngram=1):
        for size in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
            pattern = context[-size:]
            for start in range(len(context) - size - 1, -1, -1):
                if context[start : start + size] == pattern:
                    return context[start + size : start + size + k]
        return []

    rng = np.random.default_rng(0)
    drafter = PromptLookupDrafter(vocab_size=8)
    greedy = SamplingParams()
    for length in range(1, 60):  # a new list every call: indexed afresh
        context = [int(t) for t in rng.integers(0, 4, size=length)]
        for k in (1, 4):
            assert drafter.propose(context, k, greedy, rng)[0] == reference(context, k), (context, k)
    for trial in range(20):  # one list growing as the generate loop grows it: indexed as it grows
        context = [int(t) for t in rng.integers(0, 4, size=int(rng.integers(1, 5)))]
        drafter.prefill(context)
        while len(context) < 80:
            assert drafter.propose(context, 3, greedy, rng)[0] == reference(context, 3), (trial, context)
            context.extend(int(t) for t in rng.integers(0, 4, size=int(rng.integers(1, 6))))


@pytest.mark.parametrize("role", ["target", "draft"])  # fused (shared buffer) and optimum (concat) layouts
def test_chunked_prefill_equals_one_pass(bundles, role):
    from specdeploy.runtime.engine import PREFILL_CHUNK

    bundle = bundles("llama")
    spec = load_manifest(bundle).model(role)
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    ids = list(np.random.default_rng(4).integers(2, 300, size=2 * PREFILL_CHUNK + 7))
    whole = engine.forward(np.asarray(ids), engine.new_cache(256))
    model = CachedModel(engine, 256)
    model.prefill(ids[:-1])
    assert model.cache.length == len(ids) - 1 and engine.calls == 1 + 3  # the whole pass, then three chunks
    np.testing.assert_allclose(model.logits_after(ids), whole[-1], atol=1e-4)


def test_long_catch_up_goes_in_chunks(bundles):
    """logits_after on a context far ahead of the cache (a draft after many prompt-lookup rounds)."""
    from specdeploy.runtime.engine import PREFILL_CHUNK

    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    ids = list(np.random.default_rng(5).integers(2, 300, size=2 * PREFILL_CHUNK + 20))
    whole = engine.forward(np.asarray(ids), engine.new_cache(256))
    model = CachedModel(engine, 256)
    model.prefill(ids[:10])
    calls = engine.calls
    np.testing.assert_allclose(model.logits_after(ids), whole[-1], atol=1e-4)
    assert engine.calls - calls == 3 and model.tokens == ids  # 64 + 64 + 14 (the last one's logits)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # shared-buffer and concat caches
def test_a_failed_pass_leaves_tokens_and_cache_in_step(bundles, monkeypatch, arch):
    bundle = bundles(arch)
    spec = load_manifest(bundle).target
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    model = CachedModel(engine, 64, min_pass_tokens=2)  # the re-run path shortens the cache first
    model.prefill([5, 9, 13, 40, 50, 51])
    model.cache.truncate(5)  # a rejection: the concat cache cuts its stale position on the next pass
    del model.tokens[5:]
    real_run = engine._run

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.logits_after([5, 9, 13, 40, 50, 41])
    assert len(model.tokens) == model.cache.length == 4
    monkeypatch.setattr(engine, "_run", real_run)
    fresh = CachedModel(engine, 64)
    context = [5, 9, 13, 60, 61]  # diverges before the failed pass: a second cut, of the first cut's copies
    np.testing.assert_allclose(model.logits_after(context), fresh.logits_after(context), atol=1e-5)


def test_long_passes_take_any_integer_ids(bundles):
    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    ids = np.random.default_rng(6).integers(2, 300, size=100)
    expected = engine.forward(ids, engine.new_cache(128))
    np.testing.assert_allclose(engine.forward(ids.astype(np.int32), engine.new_cache(128)), expected, atol=1e-6)


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
    """forward(scratch=True) writes one engine-owned buffer (the generate loop's passes): the numbers of a
    fresh array, valid until the next scratch pass; long passes and ordinary callers get fresh arrays."""
    from specdeploy.runtime.engine import SCRATCH_ROWS

    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    ids = [int(i) for i in np.random.default_rng(7).integers(2, 300, size=20)]
    fresh_cache, scratch_cache = engine.new_cache(64), engine.new_cache(64)
    fresh = [engine.forward(ids[:12], fresh_cache)] + [engine.forward([token], fresh_cache) for token in ids[12:15]]
    assert not any(np.shares_memory(a, b) for i, a in enumerate(fresh) for b in fresh[i + 1 :])
    scratch = [engine.forward(ids[:12], scratch_cache, scratch=True)]
    np.testing.assert_array_equal(scratch[0], fresh[0])
    for step, token in enumerate(ids[12:15], start=1):
        scratch.append(engine.forward([token], scratch_cache, scratch=True))
        np.testing.assert_array_equal(scratch[-1], fresh[step])
    assert np.shares_memory(scratch[0], scratch[1]) and np.shares_memory(scratch[1], scratch[3])
    long_ids = [int(i) for i in np.random.default_rng(8).integers(2, 300, size=SCRATCH_ROWS + 1)]
    long_pass = engine.forward(long_ids, engine.new_cache(SCRATCH_ROWS + 1), scratch=True)
    assert not np.shares_memory(long_pass, scratch[0])


def test_step_is_a_one_token_extend(bundles):
    """CachedModel.step (the draft loop's short path) gives extend([token])[-1]'s numbers, whatever pass came
    before it (a multi-token pass rebinds the ids and logits; step then takes the long way once)."""
    bundle = bundles("llama")
    spec = load_manifest(bundle).draft
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    stepped = CachedModel(engine, 64, scratch_logits=True)
    extended = CachedModel(OrtEngine(bundle / spec.onnx_path, spec), 64)
    ids = [int(i) for i in np.random.default_rng(3).integers(2, 300, size=16)]
    stepped.prefill(ids[:5])
    extended.prefill(ids[:5])
    for position in range(5, 16):
        if position == 10:  # a catch-up of two tokens between steps
            got, expected = stepped.extend(ids[10:12])[-1], extended.extend(ids[10:12])[-1]
        elif position == 11:
            continue
        else:
            got, expected = stepped.step(ids[position]), extended.extend([ids[position]])[-1]
        np.testing.assert_array_equal(got, expected)
    assert stepped.tokens == extended.tokens == ids and stepped.cache.length == 16
    full = CachedModel(engine, 18, scratch_logits=True)
    full.prefill(ids)
    full.step(7)
    full.step(8)  # the short path, up to the last position
    with pytest.raises(SpecdeployError, match="max context"):
        full.step(9)
    assert full.cache.length == len(full.tokens) == 18


def test_sync_compares_only_what_an_appended_context_added(bundles, monkeypatch):
    """A context list that only grew since the last sync is compared from where they agreed; any other
    list (a copy with an earlier token changed) is compared from the start, and the cache rolls back."""
    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    model = CachedModel(OrtEngine(bundle / spec.onnx_path, spec), 64)
    fresh = CachedModel(OrtEngine(bundle / spec.onnx_path, spec), 64)
    context = [5, 9, 13, 40, 41, 42]
    model.logits_after(context)
    model.extend([7, 8])  # drafts, one of them rejected below
    context += [7, 99]
    assert model.uncached(context) == [99] and model.cache.length == 7
    changed = list(context)
    changed[2] = 14
    np.testing.assert_allclose(model.logits_after(changed), fresh.logits_after(changed), atol=1e-5)
    assert model.tokens == changed[:-1] + [changed[-1]] and model.cache.length == len(changed)


def test_the_full_width_mask_gives_the_logits_of_a_context_wide_one(bundles):
    """On the CPU a shared-buffer cache binds one capacity-wide mask (ones, then zeros) and writes it in place;
    the logits must be bit for bit those of the mask exactly as wide as the context, the graph's plain
    contract: prefill from empty, chunks, single steps, a rollback and a verify-sized pass."""
    import onnxruntime as ort

    from specdeploy.runtime.kv_cache import _ortvalue

    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    cache = engine.new_cache(64)
    assert cache.mask is not None and cache.mask.shape == (1, 64)
    session = ort.InferenceSession(str(bundle / spec.onnx_path), providers=["CPUExecutionProvider"])
    buffers = [np.zeros((1, spec.num_kv_heads, 64, spec.head_dim), np.float32) for _ in range(2 * spec.num_layers)]
    values = [_ortvalue(b, "cpu") for b in buffers]
    binding = session.io_binding()._iobinding
    past, present = engine._past_names, engine._output_names[1:]
    length = 0
    ids = [int(i) for i in np.random.default_rng(9).integers(2, 300, size=40)]
    for step in (ids[:20], [ids[20]], [ids[21]], ids[22:27], "rollback", [ids[30]], ids[31:36]):
        if step == "rollback":
            cache.truncate(21)
            length = 21
            continue
        got = engine.forward(step, cache)
        total = length + len(step)
        keep = [np.array([step], np.int64), np.ones((1, total), np.int64)]
        binding.bind_input("input_ids", keep[0])
        binding.bind_input("attention_mask", keep[1])
        binding.bind_output("logits", engine._cpu)  # first: get_outputs() lists outputs in binding order
        for name, value in zip(past, values):
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(present, values):
            binding.bind_ortvalue_output(name, value)
        session._sess.run_with_iobinding(binding, None)
        expected = binding.get_outputs()[0].numpy()[0]
        np.testing.assert_array_equal(got, expected)
        assert cache.mask[0].tolist() == [1] * total + [0] * (64 - total)
        length = total


def test_tokens_shortened_by_hand_are_compared_again(bundles):
    """The sync skips what an appended context already agreed with; tokens cut by hand (and the cache with
    them) and extended with other tokens lower that mark, so the next sync finds the divergence."""
    bundle = bundles("llama")
    spec = load_manifest(bundle).target
    model = CachedModel(OrtEngine(bundle / spec.onnx_path, spec), 64, scratch_logits=True)
    fresh = CachedModel(OrtEngine(bundle / spec.onnx_path, spec), 64)
    context = [5, 9, 13, 40, 50, 51]
    model.prefill(context)
    model.prefill(context)
    model.cache.truncate(3)
    del model.tokens[3:]
    model.extend([77, 78])
    model.step(79)
    np.testing.assert_allclose(model.logits_after(context), fresh.logits_after(list(context)), atol=1e-5)
    assert model.tokens == context
