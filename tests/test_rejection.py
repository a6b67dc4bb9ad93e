"""The rejection sampler and logits processing: exact cases, then distributions over 100k+ trials."""

import numpy as np
import pytest
from scipy import stats

from specdeploy.runtime.rejection import greedy_accept, rejection_sample
from specdeploy.runtime.sampling import SamplingParams, process_logits, sample_tokens


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
    vocab, k, batch = 6, 4, 2000
    target = rng.dirichlet(np.ones(vocab), size=(batch, k + 1))  # [batch, k + 1, vocab]
    draft = target[:, :k].copy()
    drafts = np.stack([sample_tokens(draft[:, i], rng.random(batch)) for i in range(k)], axis=1)  # [batch, k]
    accepted, _ = rejection_sample(drafts, draft, target, rng)
    assert (accepted == k).all()


def test_rejection_at_first_position_draws_from_residual():
    # The draft is certain of token 0, which the target never emits: always rejected at position 0,
    # and the recovered token comes from the target with token 0 removed.
    rng = np.random.default_rng(1)
    batch = 20000
    draft = np.broadcast_to(np.array([[1.0, 0, 0, 0], [1.0, 0, 0, 0]]), (batch, 2, 4))
    target = np.broadcast_to(np.array([[0.0, 0.5, 0.3, 0.2]] * 3), (batch, 3, 4))
    accepted, tokens = rejection_sample(np.zeros((batch, 2), dtype=np.int64), draft, target, rng)
    assert (accepted == 0).all()
    assert not (tokens == 0).any()
    frequencies = np.bincount(tokens, minlength=4) / batch
    np.testing.assert_allclose(frequencies, [0, 0.5, 0.3, 0.2], atol=0.015)


def test_token_with_zero_target_probability_is_never_emitted():
    rng = np.random.default_rng(2)
    vocab, k, batch = 8, 3, 50000
    target = rng.dirichlet(np.ones(vocab), size=(batch, k + 1))
    target[..., 5] = 0.0
    target /= target.sum(-1, keepdims=True)
    draft = rng.dirichlet(np.ones(vocab), size=(batch, k))  # puts mass on token 5 too
    drafts = np.stack([sample_tokens(draft[:, i], rng.random(batch)) for i in range(k)], axis=1)
    accepted, tokens = rejection_sample(drafts, draft, target, rng)
    emitted_drafts = drafts[np.arange(k)[None, :] < accepted[:, None]]
    assert not (emitted_drafts == 5).any()
    assert not (tokens == 5).any()


def test_seeded_determinism():
    rng = np.random.default_rng(3)
    target = rng.dirichlet(np.ones(10), size=(64, 5))
    draft = rng.dirichlet(np.ones(10), size=(64, 4))
    drafts = rng.integers(0, 10, size=(64, 4))
    first = rejection_sample(drafts, draft, target, np.random.default_rng(42))
    second = rejection_sample(drafts, draft, target, np.random.default_rng(42))
    np.testing.assert_array_equal(first[0], second[0])
    np.testing.assert_array_equal(first[1], second[1])


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
    """Over 400k rounds, the token emitted at every position (accepted, recovered or bonus) ~ target_probs.

    Chi-square at every position; total variation < 0.01 where at least 100k rounds reach the position
    (deeper positions see fewer rounds, and their sampling noise alone exceeds 0.01)."""
    rng = np.random.default_rng({"close": 10, "far": 11, "missing_mass": 12}[case])
    vocab, k, batch = 12, 3, 400_000
    target, draft = _target_and_draft(case, rng, vocab, k)
    drafts = np.stack([sample_tokens(np.broadcast_to(draft[i], (batch, vocab)), rng.random(batch)) for i in range(k)], axis=1)
    accepted, next_tokens = rejection_sample(
        drafts, np.broadcast_to(draft, (batch, k, vocab)), np.broadcast_to(target, (batch, k + 1, vocab)), rng
    )
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
        if reached.sum() >= 100_000:
            assert total_variation < 0.01, (position, total_variation)


def test_the_naive_rule_is_not_distribution_preserving():
    """Why the exact rule matters: 'keep x if target >= draft, else resample from target' is biased."""
    rng = np.random.default_rng(5)
    batch = 200_000
    target = np.array([0.6, 0.4])
    draft = np.array([0.2, 0.8])
    drafts = sample_tokens(np.broadcast_to(draft, (batch, 2)), rng.random(batch))
    naive = np.where(target[drafts] >= draft[drafts], drafts, sample_tokens(np.broadcast_to(target, (batch, 2)), rng.random(batch)))
    exact_accepted, exact_next = rejection_sample(
        drafts[:, None], np.broadcast_to(draft, (batch, 1, 2)), np.broadcast_to(target, (batch, 2, 2)), rng
    )
    exact = np.where(exact_accepted > 0, drafts, exact_next)
    assert abs(np.mean(exact == 0) - 0.6) < 0.005
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


def test_sample_tokens_matches_probabilities():
    rng = np.random.default_rng(6)
    probs = np.array([0.1, 0.0, 0.6, 0.3])
    draws = sample_tokens(np.broadcast_to(probs, (100_000, 4)), rng.random(100_000))
    assert not (draws == 1).any()
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 100_000, probs, atol=0.006)


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


def test_lazy_rejection_sampler_equals_the_batched_one():
    """The runtime's one-sequence sampler returns exactly what rejection_sample returns from the same generator state,
    and never forms target rows past the first rejection."""
    from specdeploy.runtime.rejection import rejection_sample_lazy

    rng = np.random.default_rng(12)
    for trial in range(3000):
        vocab, k = int(rng.integers(2, 9)), int(rng.integers(1, 6))
        target = rng.dirichlet(np.full(vocab, 0.5), size=k + 1).astype(np.float32)
        if trial % 3 == 0:  # prompt lookup: one-hot drafts
            tokens = rng.integers(0, vocab, size=k)
            draft = np.zeros((k, vocab))
            draft[np.arange(k), tokens] = 1.0
        else:
            draft = rng.dirichlet(np.full(vocab, 0.5), size=k).astype(np.float32)
            if trial % 7 == 0:
                draft[0] = target[0]  # zero residual mass at a rejection
            tokens = np.array([rng.choice(vocab, p=row / row.sum()) for row in draft])
        seed = int(rng.integers(1 << 30))
        expected = rejection_sample(tokens[None], draft[None], target[None], np.random.default_rng(seed))
        formed = []

        def row(i):
            formed.append(i)
            return target[i]

        got = rejection_sample_lazy(list(tokens), draft, row, np.random.default_rng(seed))
        assert got == (int(expected[0][0]), int(expected[1][0]))
        assert formed == list(range(got[0] + 1))


def test_one_row_and_many_rows_give_the_same_bits():
    """Target-only sampling forms one row at a time, the verify scan too; batched callers get the same numbers."""
    logits = (np.random.default_rng(11).normal(size=(4, 8192)) * 3).astype(np.float32)
    params = SamplingParams(temperature=0.8)
    rows = np.stack([process_logits(logits[i : i + 1], params)[0] for i in range(4)])
    np.testing.assert_array_equal(process_logits(logits, params), rows)
