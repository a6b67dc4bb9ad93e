"""The accept graphs (accept/greedy.onnx, accept/sampled.onnx) against the NumPy reference.

Decisions must be the same for the same uniforms. The graph and NumPy round differently (ONNX Runtime's
softmax against the C kernel's, a float64 CDF against float32 block sums), so where a uniform lies
within float rounding of a boundary (an acceptance test u * draft_p = target_p, a step of a CDF, a
top-p or min-p cut) either answer is right; such cases are recognized one by one, and must be rare.
"""

from __future__ import annotations


import numpy as np
import pytest

from specdeploy.bundle import load_manifest
from specdeploy.runtime.rejection import greedy_accept, rejection_sample
from specdeploy.runtime.sampling import SamplingParams, draw, process_logits

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from specdeploy.export import accept  # noqa: E402  (needs onnx)
from specdeploy.export.graph import OPSET  # noqa: E402  (the fused models' opset)

ROUNDING = 1e-5  # relative: far above float32 softmax differences (~1e-7), far below any real gap
SETTINGS = [
    dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.7),
    dict(temperature=1.0, top_k=1), dict(temperature=0.8, top_k=8), dict(temperature=1.0, top_k=40),
    dict(temperature=1.0, top_p=0.9), dict(temperature=1.3, top_p=0.5), dict(temperature=0.7, top_k=20, top_p=0.8),
    dict(temperature=1.0, min_p=0.1), dict(temperature=1.2, top_k=30, top_p=0.9, min_p=0.05),
]


def session(proto):
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def greedy():
    return session(accept.greedy_graph(OPSET, onnx.TensorProto.FLOAT))


@pytest.fixture(scope="module")
def sampled():
    return session(accept.sampled_graph(OPSET, onnx.TensorProto.FLOAT))


def reference_probs(logits: np.ndarray, settings: dict) -> np.ndarray:
    """logits [n, vocab] -> sampling.py's distributions, the definition the graph is held to."""
    return process_logits(logits, SamplingParams(**settings))


def run_sampled(sampled, target_logits, draft_tokens, draft_probs, uniforms, settings):
    """target_logits [k + 1, vocab], draft_tokens [k], draft_probs [k, vocab], uniforms [k + 1] -> (accepted, next, probs)."""
    feeds = dict(target_logits=target_logits, draft_tokens=np.asarray(draft_tokens, dtype=np.int64),
                 draft_probs=draft_probs.reshape(len(draft_tokens), target_logits.shape[1]),
                 uniforms=np.asarray(uniforms, dtype=np.float64),
                 temperature=np.array(settings["temperature"], np.float32),
                 top_k=np.array(settings.get("top_k", 0), np.int64),
                 top_p=np.array(settings.get("top_p", 1.0), np.float32),
                 min_p=np.array(settings.get("min_p", 0.0), np.float32))
    num_accepted, next_token, target_probs = sampled.run(None, feeds)
    return int(num_accepted), int(next_token), target_probs


def cut_at_boundary(logits_row: np.ndarray, settings: dict, token: int) -> bool:
    """Whether token sits at a top-p or min-p cut of this row (its mass ranked before it, or its probability
    against min_p * max, within rounding), so that either side of the cut is a right answer."""
    probs = reference_probs(logits_row[None], {k: v for k, v in settings.items() if k not in ("top_p", "min_p")})[0]
    order = np.argsort(-probs, kind="stable")
    before = (np.cumsum(probs[order]) - probs[order])[np.flatnonzero(order == token)[0]]
    near_top_p = settings.get("top_p", 1.0) < 1.0 and abs(before - settings["top_p"]) < ROUNDING
    # min_p applies to the top-p distribution: compare the token with the cut there, from both sides' probabilities
    top_p_probs = reference_probs(logits_row[None], {k: v for k, v in settings.items() if k != "min_p"})[0]
    floor = settings.get("min_p", 0.0) * top_p_probs.max()
    near_min_p = floor > 0 and abs(top_p_probs[token] - floor) < ROUNDING * floor
    return near_top_p or near_min_p


def near_cdf_step(weights: np.ndarray, uniform: float, tokens: tuple[int, int]) -> bool:
    """Whether uniform falls, within rounding, on the CDF step between the two tokens (weights [vocab])."""
    cdf = np.cumsum(weights.astype(np.float64))
    point = uniform * cdf[-1]
    low, high = min(tokens), max(tokens)
    return bool(np.all(weights[low + 1 : high] == 0)) and abs(cdf[low] - point) < ROUNDING * cdf[-1]


def explain_difference(case, got: tuple[int, int], expected: tuple[int, int]) -> bool:
    """Whether graph and NumPy differ only because a uniform lies on a boundary (True), or really (False)."""
    target_logits, drafts, draft_probs, uniforms, settings = case
    target_probs = reference_probs(target_logits, settings)
    k = len(drafts)
    for position in range(min(got[0], expected[0], k - 1) + 1):  # the tests both scans made
        test = uniforms[position] * draft_probs[position, drafts[position]]
        target_p = target_probs[position, drafts[position]]
        if abs(test - target_p) < ROUNDING * max(target_p, 1e-30):
            return True  # an acceptance test tied within rounding: what follows may differ
    if got[0] != expected[0]:
        return False
    weights = target_probs[got[0]]
    if got[0] < k:
        residual = np.maximum(weights - draft_probs[got[0]], 0)
        weights = residual if residual.sum() > 0 else weights
    return near_cdf_step(weights, uniforms[k], (got[1], expected[1]))


def random_case(rng, vocab: int, settings: dict, seed: int):
    """A round: target logits [k + 1, vocab], a draft that agrees partly with its tokens drawn from its
    distribution, and the k + 1 uniforms default_rng(seed) gives first (as the NumPy scan takes them)."""
    k = int(rng.integers(0, 7))
    scale = float(rng.choice([1.0, 3.0, 6.0]))
    target_logits = (scale * rng.standard_normal((k + 1, vocab))).astype(np.float32)
    draft_logits = (target_logits[:k] + float(rng.choice([0.1, 1.0, 3.0])) * rng.standard_normal((k, vocab))).astype(np.float32)
    draft_probs = reference_probs(draft_logits, settings) if k else np.zeros((0, vocab), np.float32)
    drafts = [draw(row, rng.random()) for row in draft_probs]
    return target_logits, drafts, draft_probs, np.random.default_rng(seed).random(k + 1), settings


def test_greedy_graph_matches_greedy_accept(greedy):
    rng = np.random.default_rng(0)
    for trial in range(600):
        k, vocab = int(rng.integers(0, 9)), int(rng.choice([2, 17, 384]))
        logits = (3 * rng.standard_normal((k + 1, vocab))).astype(np.float32)
        agree = int(rng.integers(0, k + 1))  # the draft matches the argmax up to here, then guesses
        drafts = [int(row.argmax()) if i < agree else int(rng.integers(vocab)) for i, row in enumerate(logits[:k])]
        num_accepted, next_token = greedy.run(None, dict(target_logits=logits, draft_tokens=np.array(drafts, np.int64)))
        assert (int(num_accepted), int(next_token)) == greedy_accept(drafts, logits), trial


def test_greedy_graph_takes_the_first_of_tied_maxima_as_numpy(greedy):
    logits = np.zeros((3, 10), np.float32)
    logits[:, [2, 7]] = 5.0
    assert [int(x) for x in greedy.run(None, dict(target_logits=logits, draft_tokens=np.array([2, 7], np.int64)))] == [1, 2]
    assert [int(x) for x in greedy.run(None, dict(target_logits=logits, draft_tokens=np.array([2, 2], np.int64)))] == [2, 2]


def test_greedy_graph_on_float16_logits():
    graph = session(accept.greedy_graph(OPSET, onnx.TensorProto.FLOAT16))
    logits = np.random.default_rng(1).standard_normal((4, 50)).astype(np.float16)
    drafts = [int(logits[0].argmax()), int(logits[1].argmin()), 0]
    num_accepted, next_token = graph.run(None, dict(target_logits=logits, draft_tokens=np.array(drafts, np.int64)))
    assert (int(num_accepted), int(next_token)) == (1, int(logits[1].argmax()))


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sampled_graph_matches_the_numpy_scan(sampled, settings):
    rng = np.random.default_rng(sorted(SETTINGS, key=str).index(settings))
    trials, on_a_boundary, paths = 400, 0, set()
    for trial in range(trials):
        case = random_case(rng, int(rng.choice([16, 100, 384])), settings, seed=trial)
        target_logits, drafts, draft_probs, _, _ = case
        num_accepted, next_token, target_probs = run_sampled(sampled, *case)
        expected = reference_probs(target_logits, settings)
        cut = [(row, token) for row in range(len(expected))
               for token in np.flatnonzero((expected[row] > 0) != (target_probs[row] > 0))]
        if cut:  # the graph kept or dropped a token NumPy did not: only at a cut within rounding
            assert all(cut_at_boundary(target_logits[row], settings, token) for row, token in cut), (trial, cut)
            on_a_boundary += 1
            continue
        np.testing.assert_allclose(target_probs, expected, rtol=2e-5, atol=1e-7)
        reference = rejection_sample(drafts, draft_probs, expected, np.random.default_rng(trial).random(len(drafts) + 1))
        if (num_accepted, next_token) != reference:
            assert explain_difference(case, (num_accepted, next_token), reference), (trial, num_accepted, next_token, reference)
            on_a_boundary += 1
        paths.add("bonus" if num_accepted == len(drafts) else "recovered")
    assert on_a_boundary <= trials // 50
    assert paths == {"bonus", "recovered"}


def test_sampled_graph_exact_cases(sampled):
    vocab, rng = 32, np.random.default_rng(3)
    logits = (3 * rng.standard_normal((4, vocab))).astype(np.float32)
    settings = dict(temperature=1.0)
    probs = reference_probs(logits, settings)
    drafts = [int(row.argmax()) for row in probs[:3]]
    # the draft's distribution is the target's: every token is accepted (u * p < p), the bonus from row 3
    num_accepted, next_token, _ = run_sampled(sampled, logits, drafts, probs[:3], [0.99, 0.5, 0.0, 0.3], settings)
    assert (num_accepted, next_token) == (3, draw(probs[3], 0.3))
    # a draft token the target gives no probability (top_k=1 keeps the argmax only): rejected at once,
    # recovered from the residual, which is the target's argmax
    wrong = [int(probs[0].argmin())] + drafts[1:]
    one_hot_draft = np.eye(vocab, dtype=np.float32)[wrong]
    num_accepted, next_token, _ = run_sampled(sampled, logits, wrong, one_hot_draft, [0.0, 0.0, 0.0, 0.7], dict(temperature=1.0, top_k=1))
    assert (num_accepted, next_token) == (0, int(logits[0].argmax()))
    # no draft tokens: one plain draw from row 0
    num_accepted, next_token, _ = run_sampled(sampled, logits[:1], [], np.zeros((0, vocab), np.float32), [0.42], settings)
    assert (num_accepted, next_token) == (0, draw(probs[0], 0.42))


def test_min_p_follows_the_numpy_sampler(sampled):
    logits = (3 * np.random.default_rng(5).standard_normal((2, 64))).astype(np.float32)
    settings = dict(temperature=1.0, top_p=0.95, min_p=0.2)
    _, _, target_probs = run_sampled(sampled, logits, [0], np.eye(64, dtype=np.float32)[[0]], [0.5, 0.5], settings)
    np.testing.assert_allclose(target_probs, process_logits(logits, SamplingParams(**settings)), rtol=2e-5, atol=1e-7)


def test_export_writes_the_accept_graphs_into_the_manifest(agreeing_bundle, bundles):
    for bundle in (agreeing_bundle, bundles("gpt2")):  # the fused graph's opset, and optimum's
        manifest = load_manifest(bundle, verify=True)
        spec = manifest.accept
        assert spec.opset == accept.model_opset(bundle / manifest.target.onnx_path)
        assert spec.processing == accept.PROCESSING
        assert [f.path for f in spec.files] == ["accept/greedy.onnx", "accept/sampled.onnx"]
        assert (spec.greedy.path, spec.sampled.path) == ("accept/greedy.onnx", "accept/sampled.onnx")
        assert [t.name for t in spec.greedy.inputs] == ["target_logits", "draft_tokens"]
        assert [t.name for t in spec.sampled.inputs] == ["target_logits", "draft_tokens", "draft_probs", "uniforms",
                                                         "temperature", "top_k", "top_p", "min_p"]
        assert [t.name for t in spec.sampled.outputs] == ["num_accepted", "next_token", "target_probs"]
        assert spec.sampled.inputs[0].shape == ("num_positions", "vocab")
        assert onnx.load(str(bundle / spec.greedy.path)).opset_import[0].version == spec.opset


@pytest.mark.slow
def test_sampled_graph_over_real_models_keeps_the_target_distribution(agreeing_bundle):
    """End to end: the draft model samples k tokens, the target verifies them, the bundle's sampled graph
    accepts; the first token of the round is distributed as the target's own processed distribution."""
    from scipy.stats import chisquare

    from specdeploy import load

    settings, k, trials = dict(temperature=1.0, top_k=50, top_p=0.95), 2, 20000
    generator = load(agreeing_bundle, drafter="model")
    manifest = load_manifest(agreeing_bundle)
    graph = ort.InferenceSession(str(agreeing_bundle / manifest.accept.sampled.path), providers=["CPUExecutionProvider"])
    target, target_cache = generator.target, generator.target_cache
    draft, draft_cache = generator.drafter.engine, generator.drafter.cache
    prompt = generator.codec.encode("def fibonacci(n):\n    ")
    exact = reference_probs(target.logits_after(prompt, target_cache)[None].copy(), settings)[0]  # [vocab]
    draft_rows: dict[tuple, np.ndarray] = {}  # draft prefix -> the draft's distribution after it
    target_rows: dict[tuple, np.ndarray] = {}  # draft tokens -> the verify pass's logits [k + 1, vocab]
    rng, firsts, accepted_any = np.random.default_rng(0), [], 0
    for _ in range(trials):
        drafts, draft_probs = [], []
        for _ in range(k):
            key = tuple(drafts)
            if key not in draft_rows:
                draft_rows[key] = reference_probs(draft.logits_after(prompt + drafts, draft_cache)[None].copy(), settings)[0]
            draft_probs.append(draft_rows[key])
            drafts.append(draw(draft_rows[key], rng.random()))
        key = tuple(drafts)
        if key not in target_rows:
            target_rows[key] = target.run(target_cache.truncate_to_prefix(prompt, min_rest=1) + drafts, target_cache)[-(k + 1):].copy()
        num_accepted, next_token, _ = run_sampled(graph, target_rows[key], drafts, np.stack(draft_probs),
                                                  rng.random(k + 1), settings)
        firsts.append(drafts[0] if num_accepted > 0 else next_token)
        accepted_any += num_accepted > 0
    assert 0.1 * trials < accepted_any < 0.9 * trials  # both the accepted and the recovered path carry weight
    observed = np.bincount(firsts, minlength=len(exact))
    assert observed[exact == 0].sum() == 0  # never a token top-k / top-p removed
    support = np.flatnonzero(exact * trials >= 5)
    rest = np.setdiff1d(np.flatnonzero(exact), support)  # rare tokens, pooled into one bin
    counts = np.append(observed[support], observed[rest].sum()) if len(rest) else observed[support]
    expected = (np.append(exact[support], exact[rest].sum()) if len(rest) else exact[support]).astype(np.float64)
    assert chisquare(counts, expected / expected.sum() * trials).pvalue > 1e-3


def test_sampled_graph_top_p_support_and_draw_match_numpy_on_a_128k_vocabulary():
    """top-p over Llama 3's vocabulary: the graph must keep the tokens process_logits keeps and draw the
    same token for the same uniform (docs/hosts.md: differences only within rounding, at most 2%)."""
    graph = ort.InferenceSession(accept.sampled_graph(OPSET, onnx.TensorProto.FLOAT).SerializeToString(),
                                 providers=["CPUExecutionProvider"])
    rng, vocab, rows = np.random.default_rng(3), 128256, 20
    settings = dict(temperature=1.0, top_p=0.95)
    support_differs = token_differs = 0
    for _ in range(rows):
        logits = rng.standard_normal((1, vocab)).astype(np.float32)
        uniform = rng.random(1)
        _, next_token, probs = graph.run(None, dict(
            target_logits=logits, draft_tokens=np.zeros(0, np.int64), draft_probs=np.zeros((0, vocab), np.float32),
            uniforms=uniform, temperature=np.array(1.0, np.float32), top_k=np.array(0, np.int64),
            top_p=np.array(settings["top_p"], np.float32), min_p=np.array(0.0, np.float32)))
        expected = process_logits(logits, SamplingParams(**settings))
        support_differs += bool(np.any((probs > 0) != (expected > 0)))
        token_differs += int(next_token) != draw(expected[0], float(uniform[0]))
    assert support_differs <= 1, f"the top-p cut differs from NumPy's in {support_differs} of {rows} rows"
    assert token_differs <= 1, f"the drawn token differs from NumPy's in {token_differs} of {rows} rows"
