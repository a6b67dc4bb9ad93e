"""The sampler's C kernel (_fastsample) against the NumPy code that defines it: same numbers to float
rounding, same draws, the same distributions, and one-line errors for bad buffers."""

import numpy as np
import pytest
from scipy import stats

from specdeploy.runtime import sampling
from specdeploy.runtime.sampling import SamplingParams, distribution, draw, process_logits, residual_draw, row_sampler

fast = sampling._fastsample


def numpy_only(monkeypatch):
    monkeypatch.setattr(sampling, "_fastsample", None)


def test_the_c_kernel_was_built():
    """pip builds it whenever a C compiler is present (CI has one); without it sampling is ~3x slower."""
    assert fast is not None, "specdeploy.runtime._fastsample is missing: reinstall with a C compiler (pip install -e .)"


@pytest.mark.parametrize("vocab", [1, 5, 63, 64, 65, 1000, 8192, 50257])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_c_softmax_equals_numpy_to_rounding(monkeypatch, vocab, temperature):
    rng = np.random.default_rng(vocab)
    logits = (rng.normal(size=(3, vocab)) * 4).astype(np.float32)
    logits[1, rng.integers(0, vocab, size=vocab // 2)] = -np.inf  # what top-k masking leaves
    logits[1, 0] = 3.0
    logits[2] = 1e4  # all equal, large: exp(0) everywhere
    params = SamplingParams(temperature=temperature)
    ours = process_logits(logits, params)
    numpy_only(monkeypatch)
    reference = process_logits(logits, params)
    np.testing.assert_allclose(ours, reference, rtol=3e-6, atol=1e-30)
    assert np.all(ours[1][logits[1] == -np.inf] == 0)
    np.testing.assert_allclose(ours.sum(axis=1, dtype=np.float64), 1.0, rtol=1e-5)


def test_sampling_a_row_forms_the_same_distribution_as_the_verify_scan():
    """Target-only sampling (row_sampler) and the verify scan (distribution) must agree bit for bit."""
    logits = (np.random.default_rng(3).normal(size=8192) * 3).astype(np.float32)
    params = SamplingParams(temperature=0.8)
    drawn_from = np.empty_like(logits)
    row_sampler(params, logits.size)(logits, np.random.default_rng(0).random(), drawn_from)
    np.testing.assert_array_equal(drawn_from, distribution(logits, params, np.empty_like(logits)))
    np.testing.assert_array_equal(drawn_from, process_logits(logits[None], params)[0])


@pytest.mark.parametrize("vocab", [5, 64, 200, 8192])
def test_c_draw_is_the_numpy_inverse_cdf(monkeypatch, vocab):
    rng = np.random.default_rng(vocab + 1)
    weights = (rng.random(vocab) ** 8).astype(np.float32)
    weights[rng.integers(0, vocab, size=vocab // 3)] = 0.0
    weights[-1] = 0.0
    uniforms = np.concatenate([rng.random(2000), [0.0, 1.0 - 1e-16]])
    ours = [draw(weights, float(u)) for u in uniforms]
    numpy_only(monkeypatch)
    reference = [draw(weights, float(u)) for u in uniforms]
    assert all(weights[token] > 0 for token in ours)
    cdf = np.cumsum(weights, dtype=np.float64)
    for token, expected, u in zip(ours, reference, uniforms):
        if token != expected:  # summation order differs: only a uniform within rounding of a boundary
            assert abs(cdf[min(token, expected)] - u * cdf[-1]) <= 1e-6 * cdf[-1]


@pytest.mark.parametrize("use_c", [True, False])
def test_row_sampler_follows_the_softmax(monkeypatch, use_c):
    if not use_c:
        numpy_only(monkeypatch)
    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0] + [-30.0] * 59 + [1.5], dtype=np.float32)  # crosses a block edge
    params = SamplingParams(temperature=0.7)
    rng = np.random.default_rng(4)
    out = np.empty_like(logits)
    sample = row_sampler(params, logits.size)
    counts = np.bincount([sample(logits, rng.random(), out) for _ in range(40_000)], minlength=logits.size)
    expected = process_logits(logits[None], params)[0].astype(np.float64)
    big = expected > 1e-4
    assert counts[~big].sum() <= 5
    assert stats.chisquare(counts[big], expected[big] / expected[big].sum() * counts[big].sum()).pvalue > 1e-3


@pytest.mark.parametrize("use_c", [True, False])
def test_residual_draw_follows_the_residual(monkeypatch, use_c):
    if not use_c:
        numpy_only(monkeypatch)
    target = np.array([0.4, 0.1, 0.3, 0.0, 0.2] * 20, dtype=np.float32) / 20
    draft = np.array([0.1, 0.3, 0.3, 0.1, 0.2] * 20, dtype=np.float32) / 20
    rng = np.random.default_rng(5)
    counts = np.bincount([residual_draw(target, draft, rng.random()) for _ in range(20_000)], minlength=100)
    residual = np.maximum(target.astype(np.float64) - draft, 0.0)
    assert counts[residual == 0].sum() == 0
    support = residual > 0
    assert stats.chisquare(counts[support], residual[support] / residual.sum() * 20_000).pvalue > 1e-3
    # Equal rows leave no residual: the draw falls back to the target row.
    assert {residual_draw(target, target.copy(), u) for u in rng.random(200)} <= set(np.flatnonzero(target))


@pytest.mark.skipif(fast is None, reason="the C kernel was not built (test_the_c_kernel_was_built says so)")
@pytest.mark.parametrize(
    "call, error",
    [
        (lambda x, out: fast.softmax(x.astype(np.float64), out, 1.0), TypeError),
        (lambda x, out: fast.softmax(x, out[:5], 1.0), ValueError),
        (lambda x, out: fast.softmax(x, out, 0.0), ValueError),
        (lambda x, out: fast.softmax(x, out, float("inf")), ValueError),
        (lambda x, out: fast.softmax(x, out, 1.0, 1.0), ValueError),
        (lambda x, out: fast.softmax(x, out[::2], 1.0), TypeError),
        (lambda x, out: fast.softmax(x, x.reshape(2, -1), 1.0), TypeError),
        (lambda x, out: fast.draw(np.zeros(8, np.float32), 0.5), ValueError),
        (lambda x, out: fast.residual_draw(x, out[:7], 0.5), ValueError),
        (lambda x, out: fast.softmax(x), TypeError),
    ],
)
def test_c_kernel_rejects_bad_buffers(call, error):
    logits, out = np.ones(64, np.float32), np.empty(64, np.float32)
    with pytest.raises(error):
        call(logits, out)
    read_only = np.empty(64, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(TypeError):
        fast.softmax(logits, read_only, 1.0)


@pytest.mark.skipif(fast is None, reason="the C kernel was not built (test_the_c_kernel_was_built says so)")
def test_c_verify_returns_what_the_python_scan_returns():
    """verify() is rejection_sample_lazy over distribution() in one call: same tokens from the same generator
    state, on model and one-hot (prompt lookup) drafts, early and late rejections, zero residual mass."""
    from specdeploy.runtime.rejection import rejection_sample_lazy

    rng = np.random.default_rng(13)
    for trial in range(1500):
        vocab, k = int(rng.choice([5, 64, 300, 1000])), int(rng.integers(1, 6))
        params = SamplingParams(temperature=float(rng.choice([0.5, 0.8, 1.3])))
        target_logits = (rng.normal(size=(k + 1, vocab)) * 2).astype(np.float32)
        if trial % 3 == 0:  # prompt lookup: one-hot rows on tokens the target likes or not
            tokens = [int(t) for t in rng.integers(0, vocab, size=k)]
            draft_probs = np.zeros((k, vocab), dtype=np.float32)
            draft_probs[np.arange(k), tokens] = 1.0
        else:
            draft_logits = target_logits[:k] + (rng.normal(size=(k, vocab)) * 0.5).astype(np.float32)
            if trial % 5 == 0:
                draft_logits[0] = target_logits[0]  # equal rows: no residual mass if rejected
            draft_probs = process_logits(draft_logits, params)
            tokens = [draw(row, rng.random()) for row in draft_probs]
        seed = int(rng.integers(1 << 30))
        scanned = np.zeros((k + 1, vocab), dtype=np.float32)
        expected = rejection_sample_lazy(tokens, draft_probs, lambda i: distribution(target_logits[i], params, scanned[i]),
                                         np.random.default_rng(seed))
        formed = np.zeros((k + 1, vocab), dtype=np.float32)
        uniforms = np.random.default_rng(seed).random(k + 1)
        got = fast.verify(tokens, draft_probs, target_logits, 1.0 / params.temperature, uniforms, formed)
        assert got == expected, trial
        np.testing.assert_array_equal(formed[: got[0] + 1], scanned[: got[0] + 1])


def test_sampled_verifier_gives_float64_and_strided_rows_the_same_tokens():
    """Rows the C scan cannot take (float64, strided) go to the Python scan with the uniforms already
    drawn for it: the same tokens, and the generator left where the C path leaves it."""
    from specdeploy.runtime.rejection import sampled_verifier

    rng = np.random.default_rng(15)
    params, vocab, k = SamplingParams(temperature=0.8), 300, 4
    verify = sampled_verifier(params, vocab)
    for trial in range(200):
        target_logits = (rng.normal(size=(k + 1, vocab)) * 2).astype(np.float32)
        draft_probs = process_logits(target_logits[:k] + (rng.normal(size=(k, vocab)) * 0.5).astype(np.float32), params)
        tokens = [draw(row, rng.random()) for row in draft_probs]
        seed = int(rng.integers(1 << 30))
        runs = []
        for drafts, logits in ((draft_probs, target_logits),  # the C scan, where it was built
                               (draft_probs.astype(np.float64), target_logits),
                               (draft_probs, np.repeat(target_logits, 2, axis=1)[:, ::2])):  # strided
            generator = np.random.default_rng(seed)
            runs.append((verify(tokens, drafts, logits, generator, np.zeros((k + 1, vocab), np.float32)),
                         generator.random()))
        assert runs[1] == runs[0] and runs[2] == runs[0], trial


@pytest.mark.skipif(fast is None, reason="the C kernel was not built (test_the_c_kernel_was_built says so)")
def test_c_verify_takes_any_int_sequence_and_survives_a_list_changed_mid_call():
    vocab, k = 64, 3
    rng = np.random.default_rng(14)
    target_logits = rng.normal(size=(k + 1, vocab)).astype(np.float32)
    draft_probs = process_logits(rng.normal(size=(k, vocab)).astype(np.float32), SamplingParams(temperature=1.0))
    uniforms = rng.random(k + 1)
    expected = fast.verify([3, 5, 7], draft_probs, target_logits, 1.0, uniforms, np.empty((k + 1, vocab), np.float32))
    for ids in ((3, 5, 7), np.array([3, 5, 7]), [np.int64(3), np.int64(5), np.int64(7)]):
        assert fast.verify(ids, draft_probs, target_logits, 1.0, uniforms, np.empty((k + 1, vocab), np.float32)) == expected
    tokens = [3, 5, 7]

    class ShrinksTheList:  # converting an argument may run Python code
        def __float__(self):
            tokens.clear()
            return 1.0

    got = fast.verify(tokens, draft_probs, target_logits, ShrinksTheList(), uniforms, np.empty((k + 1, vocab), np.float32))
    assert got == expected  # the ids were read before anything else
    with pytest.raises(ValueError, match="vocabulary"):
        fast.verify([3, 5, vocab], draft_probs, target_logits, 1.0, uniforms, np.empty((k + 1, vocab), np.float32))


@pytest.mark.parametrize("use_c", [True, False])
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NumPy's inf - inf: the NaN is the point
def test_nan_logits_give_nan_probabilities_and_no_token(monkeypatch, use_c):
    """A row with a NaN or an infinity anywhere has no distribution: NaN probabilities, and sampling raises
    rather than return a token (the C draw reads the exponentials before they are normalized)."""
    if not use_c:
        monkeypatch.setattr(sampling, "_fastsample", None)
    params = SamplingParams(temperature=1.0)
    for position, value in ((0, np.nan), (7, np.nan), (99, np.nan), (7, np.inf)):
        logits = np.zeros(100, np.float32)
        logits[position] = value
        probs = distribution(logits, params, np.empty_like(logits))
        assert np.isnan(probs).any()
        with pytest.raises(ValueError, match="no positive entry"):
            row_sampler(params, 100)(logits, 0.5, np.empty_like(logits))


def test_row_sampler_takes_float64_and_strided_logits_the_same_way():
    logits = (np.random.default_rng(15).normal(size=(2, 300)) * 3).astype(np.float32)
    params = SamplingParams(temperature=0.9)
    sample = row_sampler(params, 300)
    out = np.empty(300, np.float32)
    reference = [sample(logits[0], np.random.default_rng(seed).random(), out) for seed in range(50)]
    for variant in (logits[0].astype(np.float64), logits.T.copy().T[0]):
        assert [sample(variant, np.random.default_rng(seed).random(), out) for seed in range(50)] == reference


def test_block_generator_gives_default_rngs_numbers():
    """BlockGenerator draws uniforms ahead in blocks; in any mix of call shapes, across block edges, it returns
    exactly what np.random.default_rng(seed) would."""
    from specdeploy.runtime.sampling import UNIFORM_BLOCK, BlockGenerator

    for seed in range(5):
        ours, plain, shapes = BlockGenerator(seed), np.random.default_rng(seed), np.random.default_rng(50 + seed)
        got, expected = [], []
        for _ in range(400):
            kind = int(shapes.integers(0, 4))
            size = None if kind == 0 else int(shapes.integers(1, UNIFORM_BLOCK + 40)) if kind == 1 else (1, 3)
            a, b = ours.random(size), plain.random(size)
            assert type(a) is type(b) and np.shape(a) == np.shape(b)
            got += np.ravel(a).tolist()
            expected += np.ravel(b).tolist()
        assert got == expected
    assert BlockGenerator(3).random(5, dtype=np.float32).dtype == np.float32
    np.testing.assert_array_equal(BlockGenerator(3).random(4, dtype="float64"), np.random.default_rng(3).random(4))
    for bad in (-1, (2, -1), 2.0):
        ours = BlockGenerator(3)
        with pytest.raises((ValueError, TypeError)):
            ours.random(bad)
        assert ours.random() == np.random.default_rng(3).random()  # nothing was taken
