"""The checks export trusts: the parity verdict on non-finite logits, and what weight-only quantization covers."""

from __future__ import annotations

import types

import numpy as np
import pytest

from specdeploy.export import parity


def _fp32_target():
    return types.SimpleNamespace(dtype="fp32", quantize="none", role="target")


@pytest.mark.parametrize("bad_rows", ["one_logit", "every_logit"])
def test_fp32_parity_fails_when_the_verify_pass_gives_nan(bad_rows):
    """A graph whose k + 1-token pass on a past returns NaN logits must fail the fp32 check, as a NaN
    prefill does (the figure is kept as NaN by Agreement; the verdict must not drop it)."""
    reference = np.random.default_rng(0).standard_normal((5, 40)).astype(np.float32)
    prefill, verify = parity.Agreement(), parity.Agreement()
    prefill.add(reference + 1e-5, reference)  # a prefill within tolerance
    broken = reference.copy()
    if bad_rows == "one_logit":
        broken[2, 7] = np.nan
    else:
        broken[:] = np.nan
    verify.add(broken, reference)
    assert np.isnan(verify.max_abs_diff)
    report = parity.verdict(_fp32_target(), prefill, verify, prefill_tokens=5, verify_tokens=5)
    assert report.check == "max_abs_diff"
    assert not report.passed


def test_fp32_parity_fails_when_the_prefill_gives_nan():
    """The same NaN in the prefill fails the check (the other order of the two figures)."""
    reference = np.random.default_rng(1).standard_normal((5, 40)).astype(np.float32)
    prefill, verify = parity.Agreement(), parity.Agreement()
    broken = reference.copy()
    broken[0, 0] = np.nan
    prefill.add(broken, reference)
    verify.add(reference, reference)
    assert not parity.verdict(_fp32_target(), prefill, verify, prefill_tokens=5, verify_tokens=5).passed


def test_int8_gpt2_export_quantizes_every_matrix(checkpoints, tmp_path):
    """README: 'int8 and int4 quantize every matrix, the embedding and a tied head included'. GPT-2's graph
    (optimum's) holds its projections in Gemm nodes and reads its tied head through a Transpose of the
    embedding table: none of those may stay fp32 in an int8 bundle, and the bundle must be smaller than fp32."""
    import onnx

    from conftest import export_pair

    pair = checkpoints("gpt2")
    out = tmp_path / "int8"
    manifest = export_pair(pair, out, quantize="int8", draft_quantize="int8", allow_lossy=True)
    target = manifest.target
    assert target.quantize == "int8"
    graph = onnx.load(out / target.onnx_path, load_external_data=False).graph
    initializers = {t.name: t for t in graph.initializer}
    fp32_matrices = sorted({name for node in graph.node if node.op_type in ("MatMul", "Gemm", "Transpose")
                            for name in node.input if name in initializers
                            and initializers[name].data_type == onnx.TensorProto.FLOAT
                            and len(initializers[name].dims) == 2})
    assert fp32_matrices == []
    data_bytes = sum(f.size for f in target.files if f.path.endswith(".data"))
    assert data_bytes < 0.5 * 4 * target.num_parameters  # int8 weights: about a quarter of fp32's bytes


@pytest.mark.parametrize("pass_name", ["prefill", "verify"])
def test_fp32_parity_fails_on_a_finite_logit_difference_past_the_tolerance(pass_name):
    """The fp32 check is max |onnx - reference| <= 1e-3: a graph whose logits are all 0.01 off (finite,
    argmax unchanged) must fail it, in either pass, and the figure must be that difference; a graph
    within rounding must pass."""
    reference = np.random.default_rng(0).standard_normal((5, 40)).astype(np.float32)
    prefill, verify = parity.Agreement(), parity.Agreement()
    off = {"prefill": prefill, "verify": verify}[pass_name]
    close = verify if off is prefill else prefill
    off.add(reference + np.float32(0.01), reference)
    close.add(reference + np.float32(1e-6), reference)
    assert off.max_abs_diff == pytest.approx(0.01, rel=1e-3)
    assert off.greedy_agreement == 1.0  # only the logit figure can tell
    report = parity.verdict(_fp32_target(), prefill, verify, prefill_tokens=5, verify_tokens=5)
    assert report.check == "max_abs_diff" and not report.passed
    within = parity.Agreement()
    within.add(reference + np.float32(1e-5), reference)
    assert parity.verdict(_fp32_target(), within, within, prefill_tokens=5, verify_tokens=5).passed
