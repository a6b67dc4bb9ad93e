"""Logits processing and draws: the NumPy definition (Hugging Face's semantics for every setting, and
nothing faster inside it), the C kernel (sampling.CProcessor) held to it (the same supports, the same
probabilities to float rounding, the same draws from the same uniforms), and one-line errors for bad
buffers. tests/test_c_kernel.py runs the kernel's own C driver."""

import numpy as np
import pytest
from scipy import stats

from specdeploy.runtime import sampling
from specdeploy.runtime.sampling import (PenaltyContext, Sampler, SamplingParams, draw, penalize, process_logits,
                                         process_row, residual_draw)
from specdeploy.testing import SAMPLED_SETTINGS

fast = sampling.CProcessor
needs_c = pytest.mark.skipif(fast is None, reason="the C kernel was not built (test_the_c_kernel_was_built says so)")

# Every setting the runtime has a path for: the benchmarked ones, and combinations of them.
SETTINGS = {
    **{name: SamplingParams(**options) for name, options in SAMPLED_SETTINGS.items()},
    "penalty": SamplingParams(temperature=1.3, repetition_penalty=0.8),
    "top_k_min_p_penalty": SamplingParams(temperature=0.6, top_k=7, min_p=0.2, repetition_penalty=1.5),
    "top_p_min_p": SamplingParams(temperature=0.9, top_p=0.8, min_p=0.1),
    "everything": SamplingParams(temperature=1.1, top_k=300, top_p=0.7, min_p=0.01, repetition_penalty=1.2),
}


def numpy_only(monkeypatch):
    monkeypatch.setattr(sampling, "CProcessor", None)


FLUSHED = 2e-38  # the kernel's weights are 0 below e^-87 of the top one (no pass meets a denormal)


def assert_same_row(ours, reference, message=""):
    """The kernel's row [vocab] is the definition's: the same support (but for the weights it flushes to zero)
    and the same probabilities to float rounding."""
    assert not ours[reference == 0].any(), message
    assert (reference[(ours == 0) & (reference > 0)] < FLUSHED).all(), message
    np.testing.assert_allclose(ours, reference, rtol=3e-6, atol=1e-30, err_msg=message)


class NoKernel:
    """Stands in for the C kernel's processor: any use of it fails the test."""

    def __call__(self, *args):
        raise AssertionError("the NumPy definition made a C kernel processor")

    def __getattr__(self, name):
        raise AssertionError(f"the NumPy definition called the C kernel ({name})")


def rows(rng, vocab: int, count: int) -> np.ndarray:
    """Logits [count, vocab]: flat and peaked rows, rows with ties (quantized values) and a row of equal values."""
    scales = np.array([1.0, 3.0, 8.0] * (count // 3 + 1))[:count, None]
    logits = (rng.normal(size=(count, vocab)) * scales).astype(np.float32)
    logits[1::4] = np.round(logits[1::4])  # many ties, at the top-k and top-p boundaries too
    logits[-1] = 2.0
    return logits


def sampler_with_context(params, vocab, rng, length=40, prompt_length=10):
    """A sampler synced to a random context whose first prompt_length tokens are the prompt (the
    presence and frequency penalties count the rest)."""
    sampler = Sampler(params, vocab, prompt_length=prompt_length)
    context = [int(t) for t in rng.integers(0, vocab, size=length)]
    sampler.sync(context)
    return sampler, context


def test_the_c_kernel_was_built():
    """pip builds it whenever a C compiler is present (CI has one); without it sampling is ~3x slower."""
    assert fast is not None, "the C kernel (sampling.CProcessor) is missing: reinstall with a C compiler (pip install -e .)"


@pytest.mark.parametrize("vocab", [1, 5, 63, 64, 65, 1000, 8192, 50257])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@needs_c
def test_c_softmax_equals_numpy_to_rounding(vocab, temperature):
    rng = np.random.default_rng(vocab)
    logits = (rng.normal(size=(3, vocab)) * 4).astype(np.float32)
    logits[1, rng.integers(0, vocab, size=vocab // 2)] = -np.inf  # what top-k masking leaves
    logits[1, 0] = 3.0
    logits[2] = 1e4  # all equal, large: exp(0) everywhere
    params = SamplingParams(temperature=temperature)
    sampler = Sampler(params, vocab)
    ours = np.stack([sampler.distribution(row, np.empty(vocab, np.float32)) for row in logits])
    reference = process_logits(logits, params)
    for row, expected in zip(ours, reference):
        assert_same_row(row, expected)
    assert np.all(ours[1][logits[1] == -np.inf] == 0)
    np.testing.assert_allclose(ours.sum(axis=1, dtype=np.float64), 1.0, rtol=1e-5)


def test_the_definition_calls_no_kernel(monkeypatch):
    """process_logits, draw and residual_draw are plain NumPy even where the kernel was built: with the
    extension replaced by an object that fails on any use, every setting still computes."""
    from specdeploy.runtime.rejection import rejection_sample

    monkeypatch.setattr(sampling, "CProcessor", NoKernel())
    rng = np.random.default_rng(3)
    logits = rows(rng, 300, 3)
    for params in SETTINGS.values():
        probs = process_logits(logits, params, [[1, 2, 3]] * 3)
        assert np.isclose(probs.sum(axis=1), 1.0, rtol=1e-5).all()
        tokens = [draw(row, 0.3) for row in probs[:2]]
        assert rejection_sample(tokens, probs[:2], probs, np.array([0.5, 0.9, 0.2]))[0] >= 0
        assert probs[0, residual_draw(probs[0], probs[1], 0.7)] > 0



@needs_c
@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("vocab", [5, 63, 64, 1000, 2000, 8192])
def test_c_rows_equal_the_definition(name, vocab):
    """The kernel's row (sparse for top-k / top-p) is process_row's, penalty context and drafted extras
    included: the same support, the same probabilities to float rounding."""
    params, rng = SETTINGS[name], np.random.default_rng(vocab)
    sampler, context = sampler_with_context(params, vocab, rng)
    for trial, logits in enumerate(rows(rng, vocab, 12)):
        extras = [int(t) for t in rng.integers(0, vocab, size=trial % 4)] + ([context[0]] if trial % 2 else [])
        ours = sampler.distribution(logits, np.empty(vocab, np.float32), extras)
        reference = process_logits(logits[None], params, [context + extras], [context[10:] + extras])[0]
        assert_same_row(ours, reference, f"{name} trial {trial}")


@needs_c
def test_c_top_p_within_an_ulp_of_one_keeps_the_whole_row():
    """top_p = 1 - 2**-52 is valid; rounding can carry the cut's bucket scan down to an empty lowest bucket,
    where the cut must still come from the row (not from scratch left by an earlier row): every token stays,
    as in NumPy, up to the last one at the rounding of the cut."""
    params = SamplingParams(temperature=0.3, top_p=1 - 2**-52)
    for seed in range(40):
        rng = np.random.default_rng(seed)
        logits = rng.normal(size=int(rng.integers(200, 3000))).astype(np.float32)
        sampler = Sampler(params, logits.size)
        peaked = np.zeros(logits.size, np.float32)
        peaked[3] = 50.0
        sampler.distribution(peaked, np.empty(logits.size, np.float32))  # leaves its cut in the scratch
        ours = sampler.distribution(logits, np.empty(logits.size, np.float32))
        reference = process_row(logits, params, np.empty(logits.size, np.float32))
        assert np.count_nonzero(ours) >= np.count_nonzero(reference) - 1, f"seed {seed}"


@needs_c
@pytest.mark.parametrize("vocab", [17, 1000, 8192])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # NumPy's -3e38 - 3e38: -inf, weight 0
def test_c_top_k_selects_the_kth_largest_at_every_k(vocab):
    """The kernel's k-th largest logit (its selection runs on the floats' order as integers): k from 1 to
    vocab - 1 around the chunk count, on rows of signed zeros, -inf, negative-only, huge, tied and denormal logits."""
    rng = np.random.default_rng(vocab + 7)
    chunks = -(-vocab // 16)
    special = [
        np.where(rng.random(vocab) < 0.5, np.float32(0.0), np.float32(-0.0)),  # +0.0 and -0.0 only
        np.where(rng.random(vocab) < 0.3, np.float32(-np.inf), rng.normal(size=vocab).astype(np.float32)),
        -np.abs(rng.normal(size=vocab)).astype(np.float32) - 100.0,  # every logit negative
        (rng.normal(size=vocab) * 1e30).astype(np.float32),  # huge magnitudes, both signs
        np.round(rng.normal(size=vocab)).astype(np.float32),  # few distinct values: ties everywhere
        rng.choice(np.array([1e-45, -1e-45, 1e-39, -1e-39, 0.0, -0.0, 3e38, -3e38, -np.inf], dtype=np.float32),
                   size=vocab),  # denormals, zeros, the largest floats
    ]
    special[0][rng.integers(0, vocab)] = 1.0  # one maximum above the zeros
    for k in sorted({1, 2, 3, 7, 50, chunks - 1, chunks, chunks + 1, vocab // 2, vocab - 1} - {0} & set(range(1, vocab))):
        params = SamplingParams(temperature=1.0, top_k=k)
        sampler = Sampler(params, vocab)
        for index, logits in enumerate(special):
            ours = sampler.distribution(logits, np.empty(vocab, np.float32))
            reference = process_row(logits, params, np.empty(vocab, np.float32))
            np.testing.assert_array_equal(ours > 0, reference > 0, err_msg=f"k={k} row {index}")
            assert_same_row(ours, reference, f"k={k} row {index}")


@pytest.mark.parametrize("name", SETTINGS)
def test_processing_follows_hugging_face(name):
    """process_logits gives the distribution transformers' own processors give (repetition penalty, then
    temperature, top-k, top-p, min-p), on the context's tokens."""
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    params, rng, vocab = SETTINGS[name], np.random.default_rng(22), 1000
    processors = LogitsProcessorList()
    if params.penalized:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        processors.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        processors.append(MinPLogitsWarper(params.min_p))
    for scale in (1.0, 3.0, 8.0):
        logits = (rng.normal(size=(1, vocab)) * scale).astype(np.float32)
        context = rng.integers(0, vocab, size=(1, 80))
        expected = torch.softmax(processors(torch.from_numpy(context), torch.from_numpy(logits.copy())), dim=-1).numpy()
        ours = process_logits(logits, params, [context[0]])
        np.testing.assert_array_equal(ours > 0, expected > 0)
        np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-9)


def test_penalty_is_hugging_faces():
    logits = np.array([2.0, -2.0, 0.5, -0.5, 3.0], np.float32)
    np.testing.assert_array_equal(penalize(logits, np.array([0, 1, 3]), 2.0), [1.0, -4.0, 0.5, -1.0, 3.0])
    assert penalize(logits, np.array([], np.int64), 2.0).tolist() == logits.tolist()
    # min-p keeps tokens at least min_p times as likely as the top one: here 0.5 / 0.25 / 0.125 / 0.125.
    probs = process_logits(np.log(np.array([[0.5, 0.25, 0.125, 0.125]])), SamplingParams(temperature=1.0, min_p=0.3))
    np.testing.assert_allclose(probs, [[2 / 3, 1 / 3, 0, 0]], rtol=1e-6)


def test_penalty_context_follows_the_context():
    """PenaltyContext reads only what a context list gained since the last sync; another list is read afresh."""
    rng = np.random.default_rng(23)
    penalty = PenaltyContext(50)
    context = [int(t) for t in rng.integers(0, 50, size=5)]
    for _ in range(20):
        penalty.sync(context)
        assert sorted(penalty.ids.tolist()) == sorted(set(context))
        assert penalty.mask.nonzero()[0].tolist() == sorted(set(context))
        context.extend(int(t) for t in rng.integers(0, 50, size=int(rng.integers(0, 4))))
    other = [3, 3, 4]
    penalty.sync(other)
    assert sorted(penalty.ids.tolist()) == [3, 4]
    assert sorted(penalty.with_extras([4, 7, 7, 9]).tolist()) == [3, 4, 7, 9]


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("use_c", [True, False])
def test_sampling_a_row_forms_the_distribution_the_verify_scan_forms(monkeypatch, name, use_c):
    """Target-only sampling (Sampler.sample) and the verify scan (Sampler.distribution) agree bit for bit,
    with the kernel and without it."""
    if not use_c:
        numpy_only(monkeypatch)
    params, rng, vocab = SETTINGS[name], np.random.default_rng(24), 8192
    sampler, context = sampler_with_context(params, vocab, rng)
    for logits in rows(rng, vocab, 4):
        drawn_from = np.empty(vocab, np.float32)
        token = sampler.sample(logits, float(rng.random()), drawn_from, [5])
        np.testing.assert_array_equal(drawn_from, sampler.distribution(logits, np.empty(vocab, np.float32), [5]))
        assert drawn_from[token] > 0


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("use_c", [True, False])
def test_a_sampled_row_draws_the_inverse_cdf(monkeypatch, name, use_c):
    """The token a uniform draws is the inverse CDF of the row's distribution at it (the kernel sums in
    another order: only a uniform within rounding of a boundary may land on the neighbouring token)."""
    if not use_c:
        numpy_only(monkeypatch)
    params, rng, vocab = SETTINGS[name], np.random.default_rng(25), 700
    sampler, _ = sampler_with_context(params, vocab, rng)
    for logits in rows(rng, vocab, 6):
        out = np.empty(vocab, np.float32)
        for uniform in np.concatenate([rng.random(60), [0.0, 1.0 - 1e-16]]):
            token = sampler.sample(logits, float(uniform), out)
            cdf = np.cumsum(out, dtype=np.float64)
            expected = min(int(np.searchsorted(cdf, uniform * cdf[-1], side="right")), int(np.flatnonzero(out)[-1]))
            assert out[token] > 0
            if token != expected:
                assert abs(cdf[min(token, expected)] - uniform * cdf[-1]) <= 1e-6 * cdf[-1]


@pytest.mark.parametrize("name", ["T 0.8", "T 0.8, top-k 50, top-p 0.95", "T 0.8, min-p 0.05",
                                  "T 0.8, top-p 0.95, repetition penalty 1.1"])
@pytest.mark.parametrize("use_c", [True, False])
def test_sampled_tokens_follow_the_distribution(monkeypatch, name, use_c):
    if not use_c:
        numpy_only(monkeypatch)
    params = SETTINGS[name]
    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0] + [-30.0] * 59 + [1.5] + [-3.0] * 60, dtype=np.float32)  # block edges
    sampler = Sampler(params, logits.size)
    sampler.sync([0, 6])
    rng = np.random.default_rng(26)
    out = np.empty_like(logits)
    counts = np.bincount([sampler.sample(logits, rng.random(), out) for _ in range(30_000)], minlength=logits.size)
    expected = process_logits(logits[None], params, [[0, 6]])[0].astype(np.float64)
    big = expected > 1e-4
    assert counts[~big].sum() <= 5
    assert stats.chisquare(counts[big], expected[big] / expected[big].sum() * counts[big].sum()).pvalue > 1e-3


@pytest.mark.parametrize("use_c", [True, False])
def test_greedy_with_a_penalty_is_the_penalized_argmax(monkeypatch, use_c):
    """argmax: np.argmax of the penalized row (the first of equal maxima), extras penalized once each."""
    if not use_c:
        numpy_only(monkeypatch)
    rng = np.random.default_rng(27)
    vocab = 300
    sampler, context = sampler_with_context(SamplingParams(repetition_penalty=1.3), vocab, rng)
    for trial in range(300):
        logits = rng.normal(size=vocab).astype(np.float32)
        if trial % 3 == 0:
            logits = np.round(logits)  # ties
        extras = [int(t) for t in rng.integers(0, vocab, size=trial % 5)]
        if extras:
            extras.append(extras[0])  # a repeat is penalized once
        expected = int(penalize(logits, np.unique(context + extras), 1.3).argmax())
        assert sampler.argmax(logits, extras) == expected
    assert Sampler(SamplingParams(), vocab).argmax(logits) == int(logits.argmax())


def test_residual_draw_follows_the_residual():
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




def processor(top_k=5, penalty=1.0, inverse_temperature=1.0):
    return fast(inverse_temperature, top_k, 1.0, 0.0, penalty)


PENALTY = (np.array([3]), np.zeros(64, np.uint8))  # ids, mask: a context of token 3


@needs_c
@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda x, out: processor().sample(x.astype(np.float64), out, 0.5, None, None, ()), TypeError, "float32"),
        (lambda x, out: processor().sample(x, out[::2], 0.5, None, None, ()), TypeError, "contiguous"),
        (lambda x, out: processor().sample(x, x.reshape(2, -1), 0.5, None, None, ()), TypeError, "1-D"),
        (lambda x, out: processor().sample(x, out[:7], 0.5, None, None, ()), ValueError, "length"),
        (lambda x, out: processor().sample(x, out, 1.0, None, None, ()), ValueError, r"\[0, 1\)"),
        (lambda x, out: processor().sample(x, x, 0.5, None, None, ()), ValueError, "overlaps"),
        (lambda x, out: processor().sample(x[:32], x[16:48], None, None, None, ()), ValueError, "overlaps"),
        (lambda x, out: processor().sample(x, out), TypeError, "sample"),
        (lambda x, out: fast(1.0, 5, 1.5, 0.0, 1.0), ValueError, "top_p"),
        (lambda x, out: fast(1.0, 5, 1.0, 0.0, 0.0), ValueError, "repetition_penalty"),
        (lambda x, out: processor(inverse_temperature=0.0).sample(x, out, 0.5, None, None, ()), ValueError, "greedy"),
        (lambda x, out: processor(penalty=1.2).sample(x, out, 0.5, np.array([64]), np.zeros(64, np.uint8), ()),
         ValueError, "vocabulary"),
        (lambda x, out: processor(penalty=1.2).sample(x, out, 0.5, np.array([3]), None, ()), ValueError, "mask"),
        (lambda x, out: processor(penalty=1.2).sample(x, out, 0.5, np.array([3], np.int32), np.zeros(64, np.uint8), ()),
         TypeError, "8-byte"),
        (lambda x, out: processor(penalty=1.2).sample(x, out, 0.5, *PENALTY, [64]), ValueError, "vocabulary"),
        (lambda x, out: processor(penalty=1.2).sample(x, out, 0.5, *PENALTY, [-1]), ValueError, "vocabulary"),
        (lambda x, out: processor(penalty=1.2).argmax(x, *PENALTY, list(range(65))), ValueError, "at most 64"),
    ],
)
def test_c_kernel_rejects_bad_buffers(call, error, message):
    logits, out = np.ones(64, np.float32), np.empty(64, np.float32)
    with pytest.raises(error, match=message):
        call(logits, out)
    read_only = np.empty(64, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        processor().sample(logits, read_only, None, None, None, ())


@needs_c
def test_the_penalty_context_must_not_overlap_the_output():
    """The kernel reads the context's ids and mask while it writes out: a caller's out that shares their
    memory is refused, not read half-written."""
    memory = np.zeros(64 * 4, np.uint8)
    out, mask = memory.view(np.float32), memory[:64]
    with pytest.raises(ValueError, match="overlaps"):
        processor(penalty=1.2).sample(np.ones(64, np.float32), out, 0.5, np.array([3]), mask, ())


@needs_c
def test_kernel_arguments_are_checked_not_worked_around():
    """With the kernel, a row it cannot write to is an error, not a silent detour through NumPy; logits of
    another dtype or layout are the caller's to give and go to the kernel as float32 rows."""
    sampler = Sampler(SETTINGS["T 0.8"], 64)
    logits = np.random.default_rng(4).normal(size=64).astype(np.float32)
    with pytest.raises(TypeError, match="out must be"):
        sampler.distribution(logits, np.empty(64, np.float64))
    with pytest.raises(TypeError, match="out must be"):
        sampler.sample(logits, 0.5, np.empty(128, np.float32)[::2])
    out = np.empty(64, np.float32)
    assert sampler.sample(logits.astype(np.float64), 0.5, out) == sampler.sample(logits, 0.5, out)


@needs_c
def test_processors_keep_their_own_scratch():
    """Rows formed by processors of different settings, interleaved, are the rows each forms alone: the
    scratch is per processor (tests/c runs the same check on threads)."""
    rng, vocab = np.random.default_rng(6), 3000
    logits = rows(rng, vocab, 12)
    names = list(SETTINGS)
    alone = {name: [Sampler(SETTINGS[name], vocab).distribution(row, np.empty(vocab, np.float32)) for row in logits]
             for name in names}
    samplers = {name: Sampler(SETTINGS[name], vocab) for name in names}
    for index, row in enumerate(logits):
        for name in names[index % len(names):] + names[: index % len(names)]:
            np.testing.assert_array_equal(samplers[name].distribution(row, np.empty(vocab, np.float32)),
                                          alone[name][index], err_msg=name)


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("use_c", [True, False])
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NumPy's inf - inf: the NaN is the point
def test_nan_logits_give_no_token(monkeypatch, name, use_c):
    """A row with a NaN or an infinity anywhere has no distribution: sampling raises rather than return a
    token, at every setting (the C draw reads the exponentials before they are normalized)."""
    if not use_c:
        numpy_only(monkeypatch)
    params = SETTINGS[name]
    sampler = Sampler(params, 100)
    sampler.sync([1, 2])
    for position, value in ((0, np.nan), (7, np.nan), (99, np.nan), (7, np.inf)):
        logits = np.zeros(100, np.float32)
        logits[position] = value
        with pytest.raises(ValueError, match="no positive entry"):
            sampler.sample(logits, 0.5, np.empty_like(logits))


@pytest.mark.parametrize("name", ["T 0.8", "top_k_min_p_penalty"])
def test_float64_and_strided_logits_draw_the_same_tokens(name):
    params = SETTINGS[name]
    logits = (np.random.default_rng(15).normal(size=(2, 300)) * 3).astype(np.float32)
    sampler, _ = sampler_with_context(params, 300, np.random.default_rng(16))
    out = np.empty(300, np.float32)
    reference = [sampler.sample(logits[0], np.random.default_rng(seed).random(), out, [4]) for seed in range(50)]
    for variant in (logits[0].astype(np.float64), logits.T.copy().T[0]):
        assert [sampler.sample(variant, np.random.default_rng(seed).random(), out, [4]) for seed in range(50)] == reference


@pytest.mark.parametrize("use_c", [True, False])
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_top_p_with_min_p_one_still_keeps_the_most_likely_token(monkeypatch, use_c):
    """min_p = 1 (validated) keeps the most likely token; top_p always keeps at least one. Two logits one
    float apart have the same float32 exponential, so top-p's tie rule (lower id) keeps token 0 while min-p
    (on the scaled logits) keeps token 1 only: the intersection must not be empty (HF ranks top-p by logit
    and keeps token 1; the row is a valid one and sampling must not raise)."""
    if not use_c:
        numpy_only(monkeypatch)
    elif fast is None:
        pytest.skip("the C kernel was not built")
    logits = np.array([0.1, np.nextafter(np.float32(0.1), np.float32(1.0))], np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.5, min_p=1.0)
    out = np.empty(2, np.float32)
    token = Sampler(params, 2).sample(logits, 0.5, out)
    assert token == 1 and out.tolist() == [0.0, 1.0]


@needs_c
def test_c_top_p_cut_between_near_ties_keeps_the_definitions_token():
    """Tokens 1 and 2 differ by one float (token 2 is the more likely); NumPy's exponentials order them,
    the kernel's exp (~2 ulp) ties them and its tie rule keeps token 1: the support differs from
    process_row's (and from the exact one) at an ordinary top_p, far from any rounding of the cut's mass."""
    logits = np.array([0.0, -0.5525608, np.nextafter(np.float32(-0.5525608), np.float32(0.0))], np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.6)  # the cut keeps token 0 and one of 1, 2
    reference = process_row(logits, params, np.empty(3, np.float32))
    assert reference[1] == 0 and reference[2] > 0  # the definition keeps the larger logit here
    ours = Sampler(params, 3).distribution(logits, np.empty(3, np.float32))
    assert_same_row(ours, reference)


def test_top_p_near_one_never_readmits_tokens_top_k_removed():
    """Token 9 is the 10th most likely, so top_k=9 removes it. With top_p one double below 1 (a valid
    value), the nucleus's float64 sums (the total, pairwise; the sorted cumulative sum, sequential) differ
    by rounding so that top_p * total exceeds the whole top-k mass: the removed token, whose weight is 0
    in the nucleus's weights, then passes the nucleus test and its logit is restored."""
    logits = np.full(10, -36.8, np.float32)
    logits[8] = 0.0
    logits[9] = -37.5
    params = SamplingParams(temperature=1.0, top_k=9, top_p=float(np.nextafter(1.0, 0.0)))
    reference = process_row(logits, params, np.empty(10, np.float32))
    assert reference[9] == 0.0, "the NumPy definition kept a token outside the top-k"
    if sampling.CProcessor is not None:
        ours = Sampler(params, 10).distribution(logits, np.empty(10, np.float32))
        np.testing.assert_array_equal(ours > 0, reference > 0)


def test_draw_cuts_a_large_vocabulary_at_the_exact_token():
    """Equal weights over Gemma 3's 262,144 tokens: a uniform u draws token floor(u * vocab). The block sums'
    running total was float32, which drifted by several tokens' mass across the vocabulary (u = 0.59 drew
    token 154,633 for 154,630); they are float64, as the C kernel's are."""
    vocab = 262_144
    weights = np.full(vocab, 0.1, np.float32)
    for u in np.random.default_rng(0).random(200):
        if abs(u * vocab - round(u * vocab)) > 1e-3:  # not at a boundary, where rounding may go either way
            assert draw(weights, float(u)) == int(u * vocab), u


def test_openai_penalties_follow_their_formula():
    """OpenAI's definition: logit - frequency_penalty * count - presence_penalty * (count > 0), the count
    taken over the generated tokens; computed here by hand, not through the module's own helpers."""
    logits = np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32)
    generated = [2, 2, 2, 3]  # token 2 three times, token 3 once, tokens 0, 1, 4 never
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    expected = np.array([1.0, 2.0, 3.0 - 0.5 - 0.75, 4.0 - 0.5 - 0.25, 5.0], np.float32)
    np.testing.assert_allclose(sampling.penalize_counts(logits, generated, params), expected, rtol=1e-6)
    # The generate loop's own path (Sampler: counts over the context after the prompt, then one row).
    sampler = sampling.Sampler(params, len(logits), prompt_length=2)
    sampler.sync([4, 4, *generated])  # the prompt's two 4s are not counted
    np.testing.assert_allclose(sampler.counted_rows(logits[None], [])[0], expected, rtol=1e-6)
    # Each alone: presence once per token seen, frequency per occurrence.
    presence = SamplingParams(temperature=1.0, presence_penalty=1.5)
    np.testing.assert_allclose(sampling.penalize_counts(logits, generated, presence),
                               [1.0, 2.0, 1.5, 2.5, 5.0], rtol=1e-6)
    frequency = SamplingParams(temperature=1.0, frequency_penalty=0.7)
    np.testing.assert_allclose(sampling.penalize_counts(logits, generated, frequency),
                               [1.0, 2.0, 3.0 - 2.1, 4.0 - 0.7, 5.0], rtol=1e-6)
