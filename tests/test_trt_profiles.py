"""TensorRT settings, checked on the CPU: every optimization profile keeps min <= opt <= max on
every axis whatever the context, and fp16 kernels follow the bundle's dtype."""

import dataclasses

import pytest

from specdeploy.bundle import load_manifest
from specdeploy.runtime.session import SessionConfig, trt_options, trt_profiles


def _parse(profile: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for item in profile.split(","):
        name, dims = item.rsplit(":", 1)
        shapes[name] = tuple(int(d) for d in dims.split("x"))
    return shapes


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # a shared-buffer (fused) target and a concatenating one
@pytest.mark.parametrize("max_context", [2, 5, 33, 64, 65, 256, 511, 512, 513, 2048, 32768])
def test_profiles_are_ordered_on_every_axis(bundles, arch, max_context):
    spec = load_manifest(bundles(arch)).target
    profiles = trt_profiles(spec, max_context)
    low, opt, high = (_parse(profiles[f"trt_profile_{key}_shapes"]) for key in ("min", "opt", "max"))
    assert set(low) == set(opt) == set(high) == set(spec.input_names)
    for name in spec.input_names:
        assert len(low[name]) == len(opt[name]) == len(high[name])
        for axis, (a, b, c) in enumerate(zip(low[name], opt[name], high[name])):
            assert 0 <= a <= b <= c, (name, axis, a, b, c)
    assert high["input_ids"][1] <= max_context  # no pass longer than the context
    if "attention_mask" in high and spec.kv_cache.shared_buffer:
        assert high["attention_mask"][1] == max_context
    elif "attention_mask" in high:  # each point's mask is its past + tokens, the shapes the graph runs
        past = spec.kv_cache.past_key % 0
        for point in (low, opt, high):
            assert point["attention_mask"][1] == point[past][2] + point["input_ids"][1]


def test_fp16_follows_the_bundle_dtype(bundles, tmp_path):
    spec = load_manifest(bundles("llama")).target
    config = SessionConfig(device="tensorrt", trt_cache_dir=str(tmp_path))
    assert spec.dtype == "fp32" and trt_options(config, spec)["trt_fp16_enable"] is False
    assert trt_options(config, dataclasses.replace(spec, dtype="fp16"))["trt_fp16_enable"] is True
    options = trt_options(config, spec)
    assert options["trt_engine_cache_enable"] and options["trt_engine_cache_path"] == str(tmp_path)
    assert "trt_profile_opt_shapes" in options
