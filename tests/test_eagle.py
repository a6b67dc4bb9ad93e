"""Distilled drafts end to end: an eagle head over the target's features and a model draft over a
vocabulary subset, through export, the manifest and the runtime; lossless at greedy (alone and
batched) and at every sampled setting, against the target alone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import specdeploy
from specdeploy.bundle import load_manifest, manifest_from_dict
from specdeploy.cli import main
from specdeploy.errors import SpecdeployError
from specdeploy.export.draft_vocab import choose_vocab
from specdeploy.runtime.drafters import read_vocab_ids
from specdeploy.runtime.sampling import Sampler
from specdeploy.testing import SAMPLED_SETTINGS

from conftest import DISTILLED_VOCAB, VOCAB, check_two_token_distribution

PROMPTS = ["def wrap(text, width):\n    ", "import bisect\n\nclass ", "    return [line for line in", "x"]


def test_the_eagle_manifest_states_the_contract(eagle_bundle):
    manifest = load_manifest(eagle_bundle)
    draft, target = manifest.draft, manifest.target
    assert draft.kind == "eagle" and draft.eagle.feature_size == target.hidden_size
    assert draft.eagle.target_feature in {t.name for t in target.outputs}
    assert draft.eagle.feature_input in draft.input_names
    assert draft.eagle.feature_output in {t.name for t in draft.outputs}
    assert draft.eagle.trained["step"] == 150
    assert draft.parity.check == "max_abs_diff" and draft.parity.passed  # the graph's math, to fp32 rounding
    assert draft.vocab_subset == DISTILLED_VOCAB and draft.vocab_size == VOCAB
    ids = read_vocab_ids(eagle_bundle / draft.vocab_ids, VOCAB, DISTILLED_VOCAB)
    distilled = json.loads(Path(draft.source, "draft_vocab.json").read_text())
    assert ids.tolist() == sorted(distilled["ids"])
    assert draft.vocab_source["counts"] == "draft_vocab.json" and 0 < draft.vocab_source["coverage"] <= 1
    assert manifest.genai.speculative is None and "eagle" in manifest.genai.unsupported
    assert manifest.genai.target_only is not None


def test_manifest_rules_for_draft_kinds(eagle_bundle):
    data = load_manifest(eagle_bundle).to_dict()

    def refused(change, message):
        copy = json.loads(json.dumps(data))
        change(copy)
        with pytest.raises(SpecdeployError, match=message):
            manifest_from_dict(copy)

    refused(lambda m: m["draft"].__setitem__("eagle", None), "kind 'eagle' but 'eagle' is missing")
    refused(lambda m: m["draft"].__setitem__("vocab_subset", None), "one of 'vocab_ids' and 'vocab_subset'")
    refused(lambda m: m["target"].__setitem__("kind", "eagle"), "describe the draft")
    refused(lambda m: m["target"].__setitem__("vocab_source", {"counts": "text"}), "without a vocabulary subset")
    refused(lambda m: m["target"].__setitem__("outputs", [t for t in m["target"]["outputs"] if t["name"] != "hidden_states"]),
            "which the target lacks")
    refused(lambda m: m["draft"].__setitem__("vocab_subset", 100), "logits shape")

    def narrow_draft_input(m):
        tensor = next(t for t in m["draft"]["inputs"] if t["name"] == "hidden_states")
        tensor["shape"] = tensor["shape"][:2] + [tensor["shape"][2] // 2]

    refused(narrow_draft_input, "the eagle draft's feature input 'hidden_states' is float32")

    def half_target_output(m):
        next(t for t in m["target"]["outputs"] if t["name"] == "hidden_states")["dtype"] = "float16"

    refused(half_target_output, "the target's feature output 'hidden_states' is float16")


@pytest.mark.parametrize("name", ["eagle_bundle", "subset_bundle"])
@pytest.mark.parametrize("drafter, max_batch", [("model", 1), ("hybrid", 1), ("model", 3)])
def test_greedy_output_is_the_target_alone(request, name, drafter, max_batch):
    bundle = request.getfixturevalue(name)
    alone = specdeploy.load(bundle, drafter="prompt-lookup")
    generator = specdeploy.load(bundle, drafter=drafter, max_batch=max_batch, policy="always")
    prompts = [alone.codec.encode(p) for p in PROMPTS]
    expected = [alone.generate(ids, max_new_tokens=48, speculative=False).token_ids for ids in prompts]
    outputs = generator.generate_many(prompts, max_new_tokens=48, num_draft_tokens=4)
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.stats.accepted for o in outputs) > 0  # the draft's proposals were verified and kept


def test_the_head_catches_up_after_lookup_and_target_only_rounds(eagle_bundle):
    """Rounds the head does not draft (prompt lookup, a limit of 0) still leave the target's features for it."""
    generator = specdeploy.load(eagle_bundle, drafter="hybrid", lookup_ngram=1)
    alone = specdeploy.load(eagle_bundle, drafter="prompt-lookup")
    ids = generator.codec.encode("def f(x):\n    return x\n\ndef f(x):\n    return x\n\ndef g(")
    expected = alone.generate(ids, max_new_tokens=64, speculative=False).token_ids
    out = generator.generate(ids, max_new_tokens=64, num_draft_tokens=3)
    assert out.token_ids == expected
    again = generator.generate(ids[:-2], max_new_tokens=64, num_draft_tokens=3)  # a shorter prompt on the same slot
    assert again.token_ids == alone.generate(ids[:-2], max_new_tokens=64, speculative=False).token_ids


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SAMPLED_SETTINGS))
def test_eagle_sampling_matches_the_target_distribution_at_every_setting(eagle_bundle, setting):
    _check_distribution(eagle_bundle, setting)


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SAMPLED_SETTINGS))
def test_subset_sampling_matches_the_target_distribution_at_every_setting(subset_bundle, setting):
    _check_distribution(subset_bundle, setting)


def _check_distribution(bundle, setting: str) -> None:
    """Draft rows widened from the subset (an eagle head's, a model draft's), rejections, bonus tokens. The
    model draft agrees with its target so well (min-p: 98% of rounds) that a few dozen rejections are all
    a run holds; they still take the residual path."""
    generator = specdeploy.load(bundle, drafter="model")
    check_two_token_distribution(generator, generator.codec.encode(PROMPTS[0]), SAMPLED_SETTINGS[setting], runs=3000,
                                 max_accepted=0.995)


def test_a_subset_draft_never_proposes_outside_it(subset_bundle):
    generator = specdeploy.load(subset_bundle, drafter="model")
    ids = read_vocab_ids(subset_bundle / generator.manifest.draft.vocab_ids, VOCAB, DISTILLED_VOCAB)
    drafter = generator.drafter
    context = generator.codec.encode(PROMPTS[0])
    generator.target.prefill(context[:-1], generator.target_cache)
    drafter.prefill(context[:-1])
    sampler = Sampler(specdeploy.GenerationConfig(temperature=1.5).sampling, VOCAB)
    rng = np.random.default_rng(0)
    for _ in range(20):
        tokens, probs = drafter.propose(context, 4, sampler, rng)
        assert set(tokens) <= set(ids.tolist())
        outside = np.setdiff1d(np.arange(VOCAB), ids)
        assert np.all(probs[:, outside] == 0) and np.allclose(probs.sum(-1), 1, atol=1e-5)


def test_export_chooses_the_most_frequent_tokens(distilled_drafts, tmp_path):
    folder = distilled_drafts["model"]
    vocab = json.loads((folder / "draft_vocab.json").read_text())
    chosen = choose_vocab(folder, 64, VOCAB).ids
    assert len(chosen) == 64 and list(chosen) == sorted(chosen)
    assert set(vocab["always"]) <= set(chosen.tolist())
    counts = dict(zip(vocab["ids"], vocab["counts"]))
    kept = min(counts[i] for i in chosen.tolist() if i not in vocab["always"])
    assert all(counts[i] <= kept for i in set(vocab["ids"]) - set(chosen.tolist()))
    assert choose_vocab(folder, 0, VOCAB) is None
    assert len(choose_vocab(folder, None, VOCAB).ids) == DISTILLED_VOCAB
    with pytest.raises(SpecdeployError, match="distilled over 192 tokens"):
        choose_vocab(folder, 300, VOCAB)
    # an eagle head's rows are the target's: it may take more than it was distilled over, by every token's count
    eagle = json.loads((distilled_drafts["eagle"] / "draft_vocab.json").read_text())
    counts = dict(zip(eagle["frequencies"]["ids"], eagle["frequencies"]["counts"]))
    assert DISTILLED_VOCAB < len(counts) <= VOCAB
    wider = choose_vocab(distilled_drafts["eagle"], len(counts) - 1, VOCAB, eagle=True).ids.tolist()
    assert len(wider) == len(counts) - 1 and set(eagle["always"]) <= set(wider)
    dropped = set(counts) - set(wider) - set(eagle["always"])
    assert all(counts[i] <= min(counts[j] for j in wider if j in counts) for i in dropped)
    assert choose_vocab(distilled_drafts["eagle"], VOCAB, VOCAB, eagle=True).ids.tolist() == list(range(VOCAB))
    with pytest.raises(SpecdeployError, match=f"the vocabulary has {VOCAB} tokens"):
        choose_vocab(distilled_drafts["eagle"], VOCAB + 1, VOCAB, eagle=True)


def test_a_distilled_draft_is_ranked_by_its_own_counts_only(trained_pair, distilled_drafts, tmp_path):
    """--draft-vocab-text counts tokens for a draft without draft_vocab.json (test_draft_vocab.py); a distilled
    folder's head was trained over its own file's ids, so a text sample is refused in one line."""
    text = tmp_path / "traffic.txt"
    text.write_text("def f(x):\n    return x\n")
    result = CliRunner().invoke(main, ["export", "--target", str(trained_pair["target"]), "--draft",
                                       str(distilled_drafts["model"]), "--out", str(tmp_path / "b"), "--draft-vocab", "100",
                                       "--draft-vocab-text", str(text)])
    assert result.exit_code == 2 and result.output.count("error:") == 1
    assert "already holds the counts" in result.output and not (tmp_path / "b").exists()


def test_an_eagle_head_needs_its_own_target(distilled_drafts, checkpoints, tmp_path):
    other = checkpoints("qwen2")["target"]  # another width: the head cannot read its features
    config = json.loads((other / "config.json").read_text())
    head = json.loads((distilled_drafts["eagle"] / "config.json").read_text())["specdeploy_draft"]
    assert config["hidden_size"] == head["target_hidden_size"]  # same width, other model type and weights
    result = CliRunner().invoke(main, ["export", "--target", str(other), "--draft", str(distilled_drafts["eagle"]),
                                       "--out", str(tmp_path / "b")])
    assert result.exit_code == 2 and "distilled for a llama target" in result.output
    assert not (tmp_path / "b").exists()


def test_an_eagle_bundle_with_a_changed_head_width_is_refused(eagle_bundle, tmp_path):
    manifest = load_manifest(eagle_bundle)
    bad = dataclasses.replace(manifest, draft=dataclasses.replace(
        manifest.draft, eagle=dataclasses.replace(manifest.draft.eagle, feature_size=7)))
    with pytest.raises(SpecdeployError, match=r"\[batch, sequence, 7\]"):
        manifest_from_dict(bad.to_dict())


def test_batched_target_steps_keep_each_rows_features(eagle_bundle):
    """A batched target-only pass writes each row's feature at its own position, as a pass alone does."""
    from specdeploy.runtime import OrtEngine, SessionConfig

    manifest = load_manifest(eagle_bundle)
    engine = OrtEngine(eagle_bundle / manifest.target.onnx_path, manifest.target, SessionConfig(),
                       features=manifest.draft.eagle.target_feature)
    pool = engine.new_slots(3, 64)
    prompts = [[5, 9, 33, 40], [7, 7], [100, 3, 2, 8, 19, 21]]
    for prompt, cache in zip(prompts, pool.caches):
        engine.run(prompt, cache)
    engine.run_batch([11, 12], [pool.caches[0], pool.caches[2]])  # row 1 is not given: it keeps its length
    assert [c.length for c in pool.caches] == [5, 2, 7]
    for prompt, token, cache in ((prompts[0], 11, pool.caches[0]), (prompts[2], 12, pool.caches[2])):
        alone = engine.new_cache(64)
        engine.run(prompt + [token], alone)
        np.testing.assert_allclose(cache.features[: cache.length], alone.features[: alone.length], atol=1e-4)


@pytest.mark.parametrize("name", ["eagle_bundle", "subset_bundle"])
def test_batched_draft_steps_propose_what_a_sequence_alone_does(request, name):
    """Rows of a batch step their drafts together (the eagle head with each row's own feature); each row's
    proposals, and so its acceptance, are those it makes alone."""
    bundle = request.getfixturevalue(name)
    alone = specdeploy.load(bundle, drafter="model", policy="always")  # k = 4 every round, as the batch
    batched = specdeploy.load(bundle, drafter="model", max_batch=3, policy="always")
    prompts = [alone.codec.encode(p) for p in PROMPTS[:3]]
    singles = [alone.generate(ids, max_new_tokens=40, num_draft_tokens=4) for ids in prompts]
    together = batched.generate_many(prompts, max_new_tokens=40, num_draft_tokens=4)
    assert [o.token_ids for o in together] == [o.token_ids for o in singles]
    assert [o.stats.accepted_by_position for o in together] == [o.stats.accepted_by_position for o in singles]


def test_a_long_prompts_head_prefill_keeps_pace_with_the_targets_chunks(eagle_bundle):
    """A prompt of several chunks joining a decoding row: the head prefills as far as the target's cache
    holds features each iteration (its chunk rides in the packed pass after the head's step), never the
    whole prompt at once, and the outputs are those each gives alone."""
    from specdeploy.runtime.session import PREFILL_CHUNK

    alone = specdeploy.load(eagle_bundle, drafter="model")
    generator = specdeploy.load(eagle_bundle, drafter="model", max_batch=2, policy="always")
    scheduler = generator.scheduler
    settings = dict(max_new_tokens=24, num_draft_tokens=4)
    short = generator.new_sequence(PROMPTS[3], streaming=False, **settings)
    scheduler.submit(short)
    scheduler.step()
    long_ids = (alone.codec.encode("".join(PROMPTS[:3]) + "\n") * 8)[: 3 * PREFILL_CHUNK + 20]
    late = generator.new_sequence(long_ids, streaming=False, **settings)
    scheduler.submit(late)
    growth = []
    while scheduler.active:
        before = late.slot.drafter.cache.length if late.slot else 0
        prefilling = not late.prefilled
        scheduler.step()
        if prefilling:
            growth.append(late.slot.drafter.cache.length - before)
            assert late.slot.drafter.cache.length <= late.slot.target_cache.length
    assert max(growth) <= PREFILL_CHUNK and len(growth) >= 4
    assert late.new_tokens == alone.generate(long_ids, max_new_tokens=24, num_draft_tokens=4).token_ids
    assert short.new_tokens == alone.generate(PROMPTS[3], max_new_tokens=24, num_draft_tokens=4).token_ids


def test_inspect_names_the_draft_kind_and_its_vocabulary(eagle_bundle):
    result = CliRunner().invoke(main, ["inspect", str(eagle_bundle)])
    assert result.exit_code == 0
    assert "EagleHead (eagle)" in result.output and f"proposes from {DISTILLED_VOCAB}" in result.output


@pytest.mark.parametrize("option", [["--dtype", "fp16"], ["--draft-window", "64"]])
def test_an_eagle_export_refuses_what_its_features_cannot_take(trained_pair, distilled_drafts, tmp_path, option):
    result = CliRunner().invoke(main, ["export", "--target", str(trained_pair["target"]), "--draft",
                                       str(distilled_drafts["eagle"]), "--out", str(tmp_path / "b"), *option])
    assert result.exit_code == 2 and "an eagle draft exports with --dtype fp32 and no --draft-window" in result.output
    assert not (tmp_path / "b").exists()


def test_an_eagle_heads_entries_are_not_reused_for_a_prompt_with_another_first_token(eagle_bundle):
    """A KV slot that ran [a] + body keeps the eagle head's entries for body's tokens; a prompt [b] + body
    on that slot must not reuse them: entry i is the head over the target's feature i, which depends on
    the first token too. The sample must be the one a fresh generator gives."""
    generator = specdeploy.load(eagle_bundle, drafter="model")
    body = generator.codec.encode("class A:\n    def __init__(self):\n        self.x = 1\n")
    settings = dict(max_new_tokens=30, temperature=1.0, seed=3)
    fresh = generator.generate([7] + body, **settings)
    generator.reset()
    generator.generate([5] + body, **settings)  # the slot's head cache now holds entries for body's tokens
    assert generator.generate([7] + body, **settings).token_ids == fresh.token_ids
