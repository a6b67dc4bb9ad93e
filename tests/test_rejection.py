"""The accept rule: the reference (exact cases, distributions over many rounds), the C kernel that must
return its tokens from the same uniforms at every sampling setting (but where float rounding decides),
and the accept step the loop calls."""

import numpy as np
import pytest
from scipy import stats

from specdeploy.runtime import sampling
from specdeploy.runtime.rejection import accept, greedy_accept, rejection_sample
from specdeploy.runtime.sampling import Sampler, SamplingParams, draw, process_logits

from test_sampling import SETTINGS, assert_same_row, needs_c, rows


def one_hot(index, vocab=5):
    row = np.zeros(vocab)
    row[index] = 1.0
    return row


def test_greedy_full_accept_gives_bonus():
    logits = np.stack([one_hot(t) for t in (2, 3, 4, 0)])  # [k + 1, vocab]
    assert greedy_accept(np.array([2, 3, 4]), logits) == (3, 0)


def test_greedy_first_mismatch_corrects():
    logits = np.stack([one_hot(t) for t in (2, 3, 4, 0)])
    assert greedy_accept(np.array([1, 3, 4]), logits) == (0, 2)
    assert greedy_accept(np.array([2, 3, 1]), logits) == (2, 4)


def test_full_accept_plus_bonus_when_draft_equals_target():
    rng = np.random.default_rng(0)
    vocab, k = 6, 4
    for _ in range(500):
        target = rng.dirichlet(np.ones(vocab), size=k + 1)  # [k + 1, vocab]
        draft = target[:k].copy()
        drafts = [draw(row, rng.random()) for row in draft]
        accepted, bonus = rejection_sample(drafts, draft, target, rng.random(k + 1))
        assert accepted == k and target[k, bonus] > 0


def test_perfect_match_early_mismatch_and_no_draft():
    """One-hot rows make every case exact: the draft token the target is certain of is accepted, one it
    rules out is rejected and the recovered token is the target's; with no draft the bonus is row 0's."""
    target = np.stack([one_hot(t) for t in (2, 3, 4, 0)])  # [k + 1, vocab]
    draft = np.stack([one_hot(t) for t in (2, 3, 4)])
    uniforms = np.full(4, 0.5)
    assert rejection_sample([2, 3, 4], draft, target, uniforms) == (3, 0)
    draft[1] = one_hot(1)
    assert rejection_sample([2, 1, 4], draft, target, uniforms) == (1, 3)
    assert rejection_sample([], draft[:0], target, uniforms[:1]) == (0, 2)


def test_rejection_at_first_position_draws_from_residual():
    # The draft is certain of token 0, which the target never emits: always rejected at position 0,
    # and the recovered token comes from the target with token 0 removed.
    rng = np.random.default_rng(1)
    draft = np.array([[1.0, 0, 0, 0], [1.0, 0, 0, 0]])
    target = np.array([[0.0, 0.5, 0.3, 0.2]] * 3)
    results = [rejection_sample([0, 0], draft, target, rng.random(3)) for _ in range(20_000)]
    assert all(accepted == 0 for accepted, _ in results)
    frequencies = np.bincount([token for _, token in results], minlength=4) / len(results)
    np.testing.assert_allclose(frequencies, [0, 0.5, 0.3, 0.2], atol=0.015)


def test_token_with_zero_target_probability_is_never_emitted():
    rng = np.random.default_rng(2)
    vocab, k = 8, 3
    for _ in range(5000):
        target = rng.dirichlet(np.ones(vocab), size=k + 1)
        target[..., 5] = 0.0
        target /= target.sum(-1, keepdims=True)
        draft = rng.dirichlet(np.ones(vocab), size=k)  # puts mass on token 5 too
        drafts = [draw(row, rng.random()) for row in draft]
        accepted, token = rejection_sample(drafts, draft, target, rng.random(k + 1))
        assert 5 not in drafts[:accepted] and token != 5


def test_the_accept_step_is_seeded():
    rng = np.random.default_rng(3)
    vocab, k = 300, 4
    sampler = Sampler(SamplingParams(temperature=0.9, top_k=20), vocab)
    logits = rng.normal(size=(k + 1, vocab)).astype(np.float32)
    draft = process_logits(logits[:k] + 0.3, sampler.params)
    drafts = [draw(row, rng.random()) for row in draft]
    runs = [accept(sampler, drafts, draft, logits, np.random.default_rng(seed), np.empty((k + 1, vocab), np.float32))
            for seed in (42, 42, 43, 44, 45)]
    assert runs[0] == runs[1] and len(set(runs)) > 1


def _target_and_draft(case: str, rng, vocab: int, k: int):
    target = rng.dirichlet(np.full(vocab, 0.7), size=k + 1)  # [k + 1, vocab]
    if case == "close":
        draft = 0.8 * target[:k] + 0.2 * rng.dirichlet(np.ones(vocab), size=k)
    elif case == "far":
        draft = rng.dirichlet(np.full(vocab, 0.3), size=k)
    else:  # "missing mass": the draft never proposes half of the tokens the target can emit
        draft = target[:k].copy()
        draft[:, : vocab // 2] = 0.0
        draft /= draft.sum(-1, keepdims=True)
    return target, draft


@pytest.mark.parametrize("case", ["close", "far", "missing_mass"])
def test_emitted_tokens_follow_the_target_distribution(case):
    """Over 60k rounds of the reference, the token emitted at every position (accepted, recovered or bonus)
    ~ target_probs: chi-square at every position; total variation < 0.015 where 40k rounds reach it."""
    rng = np.random.default_rng({"close": 10, "far": 11, "missing_mass": 12}[case])
    vocab, k, rounds = 12, 3, 60_000
    target, draft = _target_and_draft(case, rng, vocab, k)
    draft_uniforms, uniforms = rng.random((rounds, k)), rng.random((rounds, k + 1))
    draft_cdf = np.cumsum(draft, axis=-1)
    drafts = np.stack([np.minimum((draft_cdf[i] <= draft_uniforms[:, i, None] * draft_cdf[i, -1]).sum(-1),
                                  np.flatnonzero(draft[i])[-1]) for i in range(k)], axis=1)  # [rounds, k]
    results = [rejection_sample(drafts[r].tolist(), draft, target, uniforms[r]) for r in range(rounds)]
    accepted = np.array([a for a, _ in results])
    next_tokens = np.array([t for _, t in results])
    for position in range(k + 1):
        reached = accepted >= position  # rounds that emit a token at this position
        emitted = np.where(accepted[reached] > position, drafts[reached, min(position, k - 1)], next_tokens[reached])
        observed = np.bincount(emitted, minlength=vocab)
        expected = target[position] * reached.sum()
        support = expected > 0
        assert observed[~support].sum() == 0
        p_value = stats.chisquare(observed[support], expected[support]).pvalue
        total_variation = 0.5 * np.abs(observed / reached.sum() - target[position]).sum()
        assert p_value > 1e-3, (position, p_value)
        if reached.sum() >= 40_000:
            assert total_variation < 0.015, (position, total_variation)


def test_the_naive_rule_is_not_distribution_preserving():
    """Why the exact rule matters: 'keep x if target >= draft, else resample from target' is biased."""
    rng = np.random.default_rng(5)
    rounds = 40_000
    target = np.array([0.6, 0.4])
    draft = np.array([0.2, 0.8])
    drafts = (rng.random(rounds) >= draft[0]).astype(int)
    naive = np.where(target[drafts] >= draft[drafts], drafts, (rng.random(rounds) >= target[0]).astype(int))
    uniforms = rng.random((rounds, 2))
    exact = [drafts[r] if accepted else token for r in range(rounds)
             for accepted, token in [rejection_sample([drafts[r]], draft[None], np.stack([target, target]), uniforms[r])]]
    assert abs(np.mean(np.array(exact) == 0) - 0.6) < 0.012  # 5 standard deviations; the naive rule is 0.08 off
    assert abs(np.mean(naive == 0) - 0.6) > 0.05


def test_process_logits_temperature_top_k_top_p():
    logits = np.log(np.array([[0.5, 0.25, 0.15, 0.1]]))
    np.testing.assert_allclose(process_logits(logits, SamplingParams(temperature=1.0)), [[0.5, 0.25, 0.15, 0.1]])
    np.testing.assert_allclose(process_logits(logits, SamplingParams(temperature=1.0, top_k=2)), [[2 / 3, 1 / 3, 0, 0]])
    # top_p 0.7: 0.5 alone is short of 0.7, 0.5 + 0.25 reaches it.
    np.testing.assert_allclose(process_logits(logits, SamplingParams(temperature=1.0, top_p=0.7)), [[2 / 3, 1 / 3, 0, 0]])
    np.testing.assert_allclose(process_logits(logits, SamplingParams(temperature=1.0, top_p=0.5)), [[1, 0, 0, 0]])
    sharp = process_logits(logits, SamplingParams(temperature=0.5))
    expected = np.array([0.5, 0.25, 0.15, 0.1]) ** 2
    np.testing.assert_allclose(sharp[0], expected / expected.sum(), rtol=1e-6)  # float32


def test_min_p_and_the_penalty_small_cases():
    logits = np.log(np.array([[0.5, 0.25, 0.15, 0.1]]))
    # min-p 0.4: tokens at least 0.2 likely (0.4 * 0.5) stay.
    np.testing.assert_allclose(process_logits(logits, SamplingParams(temperature=1.0, min_p=0.4)), [[2 / 3, 1 / 3, 0, 0]],
                               rtol=1e-6)
    # A penalty of 2 on token 0 (logit log 0.5 < 0: multiplied) makes it as likely as 0.25 ** 2 / ... .
    penalized = process_logits(logits, SamplingParams(temperature=1.0, repetition_penalty=2.0), [[0, 0]])
    expected = np.array([0.25, 0.25, 0.15, 0.1])
    np.testing.assert_allclose(penalized[0], expected / expected.sum(), rtol=1e-6)


def test_top_p_with_few_candidates_matches_a_full_sort():
    rng = np.random.default_rng(8)
    for scale, top_p in ((0.5, 0.9), (3.0, 0.95), (8.0, 0.5), (0.1, 0.99)):
        logits = (rng.normal(size=(3, 5000)) * scale).astype(np.float32)
        ours = process_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
        full = process_logits(logits, SamplingParams(temperature=1.0))
        for row, reference in zip(ours, full):
            order = np.argsort(-reference, kind="stable")
            keep = order[(np.cumsum(reference[order]) - reference[order]) < top_p]
            expected = np.zeros_like(reference)
            expected[keep] = reference[keep] / reference[keep].sum()
            np.testing.assert_allclose(row, expected, rtol=1e-5, atol=1e-9)


def test_blocked_draw_is_the_inverse_cdf():
    """The two-level draw picks exactly the token a full cumulative sum would, on any vocabulary size."""
    from specdeploy.runtime.sampling import draw

    rng = np.random.default_rng(9)
    for vocab in (5, 64, 200, 8192):
        weights = rng.random(vocab) ** 8  # uneven, some near zero
        weights[rng.integers(0, vocab, size=vocab // 3)] = 0.0
        weights[-1] = 0.0  # mass must never land on an empty tail
        cdf = np.cumsum(weights)
        for u in np.concatenate([rng.random(300), [0.0, 1.0 - 1e-16]]):
            token = draw(weights, float(u))
            assert weights[token] > 0
            expected = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), int(np.flatnonzero(weights)[-1]))
            # Summation order differs between the two; only a draw within rounding of a boundary may differ.
            if token != expected:
                assert abs(cdf[min(token, expected)] - u * cdf[-1]) <= 1e-9 * cdf[-1]


def test_blocked_draw_follows_the_distribution():
    from specdeploy.runtime.sampling import draw

    rng = np.random.default_rng(10)
    probs = np.zeros(300)
    probs[[0, 63, 64, 150, 299]] = [0.1, 0.2, 0.3, 0.15, 0.25]  # block edges and the ragged tail
    counts = np.bincount([draw(probs, u) for u in rng.random(40_000)], minlength=300)
    assert counts.sum() == counts[[0, 63, 64, 150, 299]].sum()
    assert stats.chisquare(counts[[0, 63, 64, 150, 299]], 40_000 * probs[[0, 63, 64, 150, 299]]).pvalue > 1e-3


ROUNDING = 1e-5  # relative: where the kernel's float32 rows and the reference's may disagree


def decided_by_rounding(got, expected, tokens, draft_probs, target_probs, uniforms) -> bool:
    """Whether the kernel's round and the reference's differ only because a uniform lies within rounding of
    a boundary: an acceptance test tied, or the final draw at a step of its CDF, or a residual of rounding."""
    k = len(tokens)
    for position in range(min(got[0], expected[0], k - 1) + 1):  # the tests both scans made
        test = uniforms[position] * draft_probs[position, tokens[position]]
        target = target_probs[position, tokens[position]]
        if abs(test - target) <= ROUNDING * max(target, 1e-30):
            return True
    if got[0] != expected[0]:
        return False
    weights = target_probs[got[0]].astype(np.float64)
    if got[0] < k:
        residual = np.maximum(weights - draft_probs[got[0]], 0.0)
        if residual.sum() <= ROUNDING:  # the rows are equal up to rounding: which residual is empty is rounding's
            return True
        weights = residual
    cdf = np.cumsum(weights)
    return abs(cdf[min(got[1], expected[1])] - uniforms[k] * cdf[-1]) <= ROUNDING * cdf[-1]


@needs_c
@pytest.mark.parametrize("name", SETTINGS)
def test_c_verify_returns_what_the_reference_returns(name):
    """Processor.verify is rejection_sample over the processed rows in one call, at every setting: the same
    tokens from the same uniforms (a round rounding decides may differ, and few do), on model and one-hot
    (prompt lookup) drafts, early and late rejections, zero residual mass; the rows it formed are the
    reference's to rounding, and it formed none past the scan."""
    params, rng, trials, decided = SETTINGS[name], np.random.default_rng(13), 300, 0
    for trial in range(trials):
        vocab, k = int(rng.choice([5, 64, 300, 1000])), int(rng.integers(1, 6))
        sampler = Sampler(params, vocab)
        context = [int(t) for t in rng.integers(0, vocab, size=30)]
        sampler.sync(context)
        target_logits = rows(rng, vocab, k + 1)
        if trial % 3 == 0:  # prompt lookup: one-hot rows on tokens the target likes or not
            tokens = [int(t) for t in rng.integers(0, vocab, size=k)]
            draft_probs = np.zeros((k, vocab), dtype=np.float32)
            draft_probs[np.arange(k), tokens] = 1.0
        else:
            draft_logits = target_logits[:k] + (rng.normal(size=(k, vocab)) * 0.5).astype(np.float32)
            if trial % 5 == 0:
                draft_logits[0] = target_logits[0]  # equal rows: no residual mass if rejected
            draft_probs, tokens = np.empty((k, vocab), np.float32), []
            for i in range(k):
                tokens.append(sampler.sample(draft_logits[i], float(rng.random()), draft_probs[i], tokens))
        target_probs = process_logits(target_logits, params, [context + tokens[:i] for i in range(k + 1)])
        uniforms = rng.random(k + 1)
        expected = rejection_sample(tokens, draft_probs, target_probs, uniforms)
        formed = np.full((k + 1, vocab), -1.0, dtype=np.float32)
        ids, mask = sampler.penalty_args()
        got = sampler.kernel.verify(tokens, draft_probs, target_logits, uniforms, formed, ids, mask)
        if got != expected:
            assert decided_by_rounding(got, expected, tokens, draft_probs, target_probs, uniforms), (trial, got, expected)
            decided += 1
        for position in range(got[0] + 1):
            assert_same_row(formed[position], target_probs[position], f"trial {trial} row {position}")
        assert (formed[got[0] + 1 :] == -1.0).all()
    assert decided <= trials // 50


@needs_c
def test_c_verify_refuses_overlapping_rows():
    """target_probs is written while the scan reads the draft's rows and the target's logits: a buffer that
    shares memory with either is refused before anything is written."""
    vocab, k = 64, 2
    kernel = Sampler(SamplingParams(temperature=1.0), vocab).kernel
    rng = np.random.default_rng(16)
    logits = rng.normal(size=(k + 1, vocab)).astype(np.float32)
    draft_probs = process_logits(logits[:k], SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="overlaps"):
        kernel.verify([1, 2], draft_probs, logits, rng.random(k + 1), logits, None, None)
    shared = np.zeros((k + 1, vocab), np.float32)
    shared[:k] = draft_probs
    with pytest.raises(ValueError, match="overlaps"):
        kernel.verify([1, 2], shared[:k], logits, rng.random(k + 1), shared, None, None)
    np.testing.assert_array_equal(shared[:k], draft_probs)


@pytest.mark.parametrize("name", ["T 0.8", "T 0.8, top-k 50, top-p 0.95", "T 0.8, top-p 0.95, repetition penalty 1.1"])
def test_accept_gives_float64_and_strided_rows_the_same_tokens(monkeypatch, name):
    """Rows that are not float32 C-contiguous (float64, strided) go to the C scan as float32 rows: the same
    tokens, and the generator left where the C path leaves it; without a kernel the reference runs on the
    same uniforms, forming rows on demand."""
    params, rng, vocab, k = SETTINGS[name], np.random.default_rng(15), 300, 4
    for trial in range(60):
        sampler = Sampler(params, vocab)
        sampler.sync([int(t) for t in rng.integers(0, vocab, size=20)])
        target_logits = (rng.normal(size=(k + 1, vocab)) * 2).astype(np.float32)
        draft_probs, tokens = np.empty((k, vocab), np.float32), []
        for i in range(k):
            tokens.append(sampler.sample(target_logits[i] + 0.3 * rng.normal(size=vocab).astype(np.float32),
                                         float(rng.random()), draft_probs[i], tokens))
        seed = int(rng.integers(1 << 30))
        runs = []
        for drafts, logits in ((draft_probs, target_logits),  # the C scan, where it was built
                               (draft_probs.astype(np.float64), target_logits),
                               (draft_probs, np.repeat(target_logits, 2, axis=1)[:, ::2])):  # strided
            generator = np.random.default_rng(seed)
            runs.append((accept(sampler, tokens, drafts, logits, generator, np.zeros((k + 1, vocab), np.float32)),
                         generator.random()))
        assert runs[1] == runs[0] and runs[2] == runs[0], trial
    with monkeypatch.context() as patch:
        patch.setattr(sampling, "CProcessor", None)
        sampler = Sampler(params, vocab)
        assert sampler.kernel is None
        sampler.sync([1, 2, 3])
        probs = np.full((k + 1, vocab), -1.0, np.float32)
        num_accepted, _ = accept(sampler, tokens, draft_probs, target_logits, np.random.default_rng(1), probs)
        assert (probs[: num_accepted + 1] >= 0).all() and (probs[num_accepted + 1 :] == -1.0).all()  # rows on demand


@needs_c
def test_c_verify_takes_any_int_sequence_and_rejects_bad_ids():
    vocab, k = 64, 3
    rng = np.random.default_rng(14)
    kernel = sampling.CProcessor(1.0, 0, 1.0, 0.0, 1.0)
    target_logits = rng.normal(size=(k + 1, vocab)).astype(np.float32)
    draft_probs = process_logits(rng.normal(size=(k, vocab)).astype(np.float32), SamplingParams(temperature=1.0))
    uniforms = rng.random(k + 1)

    def verify(ids):
        return kernel.verify(ids, draft_probs, target_logits, uniforms, np.empty((k + 1, vocab), np.float32), None, None)

    expected = verify([3, 5, 7])
    for ids in ((3, 5, 7), np.array([3, 5, 7]), [np.int64(3), np.int64(5), np.int64(7)]):
        assert verify(ids) == expected
    with pytest.raises(ValueError, match="vocabulary"):
        verify([3, 5, vocab])
    with pytest.raises(ValueError, match="empty"):
        verify([])


@needs_c
def test_accept_refuses_a_target_buffer_the_kernel_cannot_write():
    """A float64 target_probs is a caller's bug: the kernel says so instead of the reference running silently."""
    params, vocab = SETTINGS["T 0.8"], 64
    sampler = Sampler(params, vocab)
    logits = np.random.default_rng(17).normal(size=(2, vocab)).astype(np.float32)
    draft_probs = process_logits(logits[:1], params)
    with pytest.raises(TypeError, match="target_probs must be"):
        accept(sampler, [3], draft_probs, logits, np.random.default_rng(0), np.empty((2, vocab), np.float64))
