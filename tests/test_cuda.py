"""The CUDA path on a real GPU: fp16 fused bundles on ONNX Runtime's CUDAExecutionProvider.

Skipped where this onnxruntime has no CUDA provider or no GPU answers (every CI machine);
scripts/gpu_check.py runs them on a device machine with onnxruntime-gpu. The tiny models come from
the same fixtures as the CPU tests, exported fp16 here."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

import specdeploy
from specdeploy.runtime.sampling import SamplingParams
from specdeploy.testing import exact_continuation_probs

PROMPTS = ["def f(x):", "import os\n", "class A:\n    def __init__(self):", "x = [", "for i in range(10):\n    "]


def _cuda_ready() -> str | None:
    """Why the CUDA tests cannot run here (None: they can)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (onnxruntime-gpu runs these)"
    return None


pytestmark = pytest.mark.skipif(_cuda_ready() is not None, reason=str(_cuda_ready()))


def _record(name: str, value) -> None:
    """A figure the device script collects into its JSON ($SPECDEPLOY_GPU_RECORD, one JSON object a line)."""
    path = os.environ.get("SPECDEPLOY_GPU_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"test": name, "value": value}) + "\n")


@pytest.fixture(scope="module")
def fp16_pair(tmp_path_factory, checkpoints) -> Path:
    from conftest import export_pair

    out = tmp_path_factory.mktemp("cuda-fp16") / "bundle"
    export_pair(checkpoints("llama"), out, dtype="fp16")
    return out


@pytest.fixture(scope="module")
def on_gpu(fp16_pair):
    return specdeploy.load(fp16_pair, device="cuda", drafter="model", exact=True)


def test_an_fp16_bundle_loads_on_cuda_with_its_caches_on_the_device(on_gpu):
    """Both sessions take the CUDA provider first, and the KV caches are OrtValues in GPU memory that the
    passes write in place: a generation leaves the same buffers, on the device, holding its positions."""
    for engine in (on_gpu.target, on_gpu.drafter.engine):
        assert engine.session.get_providers()[0] == "CUDAExecutionProvider"
    cache = on_gpu.target_cache
    before = [value.data_ptr() for value in cache.tensors]
    assert all(value.device_name().lower() == "cuda" for value in cache.tensors)
    output = on_gpu.generate(PROMPTS[0], max_new_tokens=24)
    assert len(output.token_ids) == 24
    assert [value.data_ptr() for value in cache.tensors] == before  # written in place, never reallocated
    assert cache.length >= output.stats.prompt_tokens + 23


def test_greedy_speculative_text_equals_target_only_on_the_gpu(on_gpu):
    for prompt in PROMPTS:
        expected = on_gpu.generate(prompt, max_new_tokens=40, speculative=False).token_ids
        for k in (1, 4):
            assert on_gpu.generate(prompt, max_new_tokens=40, num_draft_tokens=k).token_ids == expected


def test_greedy_agreement_with_the_cpu_fp32_bundle_is_stated(on_gpu, bundles):
    """fp16 on the GPU against the fp32 bundle of the same checkpoints on the CPU: the share of greedy
    tokens that agree before the first difference, over the prompts (recorded; fp16 rounding may split
    near-ties, so no threshold beyond a sane floor)."""
    cpu = specdeploy.load(bundles("llama"), drafter="model")
    agreed = total = 0
    for prompt in PROMPTS:
        gpu_ids = on_gpu.generate(prompt, max_new_tokens=40, speculative=False).token_ids
        cpu_ids = cpu.generate(prompt, max_new_tokens=40, speculative=False).token_ids
        first = next((i for i, (a, b) in enumerate(zip(gpu_ids, cpu_ids)) if a != b), min(len(gpu_ids), len(cpu_ids)))
        agreed, total = agreed + first, total + max(len(gpu_ids), len(cpu_ids))
    _record("greedy_prefix_agreement_gpu_fp16_vs_cpu_fp32", agreed / total)
    assert agreed / total > 0.5


def test_sampled_output_on_the_gpu_is_distributed_as_the_target(on_gpu):
    """Chi-square over the first two sampled tokens against the target's exact distribution, computed by the
    same GPU engine."""
    settings = dict(temperature=0.8, top_k=50)
    prompt_ids = on_gpu.codec.encode(PROMPTS[0])
    exact = exact_continuation_probs(on_gpu, prompt_ids, SamplingParams(**settings), 2)
    on_gpu.reset()
    trials = 1000
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(trials):
        key = tuple(on_gpu.generate(prompt_ids, seed=seed, max_new_tokens=2, **settings).token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    common = [key for key in sorted(exact, key=exact.get, reverse=True) if exact[key] * trials >= 5]
    observed = [counts.get(key, 0) for key in common] + [trials - sum(counts.get(key, 0) for key in common)]
    expected = [exact[key] * trials for key in common] + [trials * (1 - sum(exact[key] for key in common))]
    pvalue = scipy_stats.chisquare(observed, expected).pvalue
    _record("chi_square_pvalue_gpu", pvalue)
    assert pvalue > 1e-3


def test_only_logits_come_to_the_host_each_pass(on_gpu):
    """A pass binds the caches' device buffers as both past and present: what comes back to NumPy is the
    logits alone ([tokens, vocab] float32), so a verify pass of k + 1 tokens returns k + 1 rows."""
    cache = on_gpu.target.new_cache(64)
    ids = on_gpu.codec.encode(PROMPTS[2])
    on_gpu.target.prefill(ids[:-1], cache)
    logits = on_gpu.target.run([ids[-1], 5, 6, 7, 8], cache)
    assert isinstance(logits, np.ndarray) and logits.shape == (5, on_gpu.target.spec.vocab_size)
    assert all(value.device_name().lower() == "cuda" for value in cache.tensors)
