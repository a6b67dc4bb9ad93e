"""`specdeploy verify --lossless` (specdeploy/lossless.py): its chi-square against scipy's, its verdicts on a
lossless bundle and on outputs made lossy on purpose, and its command line."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from click.testing import CliRunner

import specdeploy
from specdeploy import lossless
from specdeploy.cli import main

FAST = ["--runs", "40", "--max-new-tokens", "6"]


@pytest.mark.parametrize("dof", [1, 2, 3, 7, 26, 99, 1000])
def test_the_chi_square_survival_function_is_scipys(dof):
    stats = pytest.importorskip("scipy.stats")
    for statistic in np.concatenate([np.linspace(0.0, 4 * dof + 60, 97), [1e-9, dof - 1e-6, dof + 2.0, 20 * dof + 400]]):
        expected = stats.chi2.sf(statistic, dof)
        assert lossless.chi_square_survival(float(statistic), dof) == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert lossless.chi_square_survival(float("inf"), dof) == 0.0


def test_the_p_value_is_pearsons_with_impossible_counts_failing():
    stats = pytest.importorskip("scipy.stats")
    observed, expected = [10, 20, 30, 5], [12.0, 18.0, 33.0, 2.0]
    reference = stats.chisquare(observed, np.array(expected) * sum(observed) / sum(expected)).pvalue
    assert lossless.chi_square_p_value(observed, expected) == pytest.approx(reference, rel=1e-9)
    assert lossless.chi_square_p_value([7, 0], [3.0, 0.0]) == 1.0  # an empty impossible cell: one cell to compare
    assert lossless.chi_square_p_value([7, 1], [3.0, 0.0]) == 0.0  # an outcome the target cannot give


def test_a_sampler_that_is_not_the_targets_fails_the_sampled_check(agreeing_bundle, monkeypatch):
    """The same generations made greedy where top-k 3 sampling was asked: the counts pile up on one continuation."""
    generator = specdeploy.load(agreeing_bundle)
    prompt_ids = generator.codec.encode("def f(x):")
    options = dict(temperature=1.0, top_k=3)
    fair = lossless.sampled_continuations(generator, prompt_ids, options, 2, 1, 200)
    assert fair["chi_square_p"] >= lossless.P_VALUE_LIMIT and fair["cells"] > 2 and 0 < fair["acceptance_rate"] < 1
    generate = generator.generate
    monkeypatch.setattr(generator, "generate", lambda ids, **kw: generate(ids, **{**kw, "temperature": 0.0}))
    assert lossless.sampled_continuations(generator, prompt_ids, options, 2, 1, 200)["chi_square_p"] < 1e-6


def test_verify_lossless_passes_a_lossless_bundle(agreeing_bundle, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x):", "class Stack:"]))
    result = CliRunner().invoke(main, ["verify", str(agreeing_bundle), "--lossless", *FAST, "--prompts", str(prompts), "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("ok: ") and "match their sha256" in result.stderr  # stdout holds the JSON alone
    report = json.loads(result.stdout)
    assert report["passed"] and [g["comparisons"] for g in report["greedy"]] == [16, 16]  # 2 prompts x 2 drafters x 4 k
    assert list(report["sampled"]) == ["T 1, top-k 3", *specdeploy.testing.SAMPLED_SETTINGS]
    assert all(check["runs"] == 40 and check["chi_square_p"] >= lossless.P_VALUE_LIMIT for check in report["sampled"].values())


def test_verify_lossless_names_a_greedy_mismatch_and_fails(agreeing_bundle, monkeypatch):
    """A speculative output at k = 8 that differs from target-only's: listed, and exit status 2."""
    load = lossless.load

    def drifting(bundle, **options):
        generator = load(bundle, **options)
        generate = generator.generate

        def generate_drifting(prompt, **kw):
            out = generate(prompt, **kw)
            return types.SimpleNamespace(token_ids=out.token_ids + [0]) if kw.get("num_draft_tokens") == 8 else out
        generator.generate = generate_drifting
        return generator

    monkeypatch.setattr(lossless, "load", drifting)
    monkeypatch.setattr(lossless, "SAMPLED_SETTINGS", {})  # the greedy verdict alone
    result = CliRunner().invoke(main, ["verify", str(agreeing_bundle), "--lossless", *FAST])
    assert result.exit_code == 2, result.output
    assert "greedy, repetition penalty 1.0: 160 speculative runs (20 prompts, drafter model and hybrid" in result.stdout
    assert ": 40 differ" in result.stdout and "differs: drafter model, k 8, prompt " in result.stdout
    assert result.stdout.rstrip().endswith("not lossless: see the checks above")
    assert result.stderr.rstrip().endswith("error: speculative decoding did not give the target's output on this bundle (above)")


def test_a_bundle_without_a_draft_model_is_checked_with_prompt_lookup(agreeing_bundle, monkeypatch):
    """Its only drafter ("model" is refused there, "hybrid" is prompt lookup): the manifest says there is no draft."""
    monkeypatch.setattr(lossless, "load_manifest", lambda bundle: types.SimpleNamespace(draft=None))
    monkeypatch.setattr(lossless, "SAMPLED_SETTINGS", {})
    report = lossless.check_lossless(str(agreeing_bundle), lossless.LosslessConfig(prompts=("def f(x):",), max_new_tokens=6, runs=40))
    assert report["passed"] and [g["drafters"] for g in report["greedy"]] == [["prompt-lookup"]] * 2


@pytest.mark.parametrize("args, message", [
    (["--runs", "5"], "--runs: only with --lossless"),
    (["--json", "--seed", "3"], "--seed, --json: only with --lossless"),
    (["--lossless", "--runs", "0"], "runs must be at least 1"),
])
def test_verify_options_without_lossless_are_one_error_line(args, message):
    result = CliRunner().invoke(main, ["verify", *args])
    assert result.exit_code == 2 and message in result.stderr, result.output
