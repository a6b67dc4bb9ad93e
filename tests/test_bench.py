"""`specdeploy bench`: the cost model's math, prompt handling, the context sweep, and a smoke run (no timing assertions)."""

import json

import pytest
from click.testing import CliRunner

from specdeploy.bench import (choose_num_draft, context_sweep, fit_alpha, lengthen_prompts, memory_budget,
                              read_prompts, tokens_per_round)
from specdeploy.bundle import load_manifest
from specdeploy.cli import main
from specdeploy.errors import SpecdeployError


def test_tokens_per_round_and_its_inverse():
    assert tokens_per_round(0.0, 4) == pytest.approx(1.0)
    assert tokens_per_round(1.0, 4) == 5.0
    assert tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    for alpha in (0.1, 0.5, 0.83, 0.97):
        assert fit_alpha(tokens_per_round(alpha, 4), 4) == pytest.approx(alpha, abs=1e-9)


def test_choose_num_draft_follows_the_cost_model():
    assert choose_num_draft(alpha=0.95, cost_ratio=0.02, verify_cost_per_token=0.01) >= 8
    assert choose_num_draft(alpha=0.3, cost_ratio=0.3, verify_cost_per_token=0.05) == 1


def test_read_prompts_json_and_jsonl(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(["x", "y"]))
    (tmp_path / "b.jsonl").write_text('{"prompt": "x"}\n{"prompt": "y"}\n')
    assert read_prompts(tmp_path / "a.json") == read_prompts(tmp_path / "b.jsonl") == ["x", "y"]
    (tmp_path / "c.json").write_text('{"prompt": 1}')
    with pytest.raises(SpecdeployError, match="JSON list"):
        read_prompts(tmp_path / "c.json")


def test_context_sweep_compares_each_length_with_the_first():
    def report(length, target, speculative):
        return {"prompt_tokens": length, "target_only": {"tokens_per_s": target},
                "speculative": {"tokens_per_s": speculative}, "acceptance_rate": 0.5, "mean_accepted_tokens": 2.0,
                "peak_rss_mb": 100.0}

    sweep = context_sweep([report(128, 400.0, 800.0), report(1920, 250.0, 600.0), report(4000, 0.0, 0.0)])
    assert sweep["prompt_tokens"] == 128 and len(sweep["by_prompt_tokens"]) == 3  # the first report leads
    short, long, stalled = sweep["context_sweep"]
    assert (long["target_only_vs_first"], long["speculative_vs_first"]) == (0.625, 0.75)
    assert long["target_only_ms_per_token"] == 4.0 and short["target_only_ms_per_token"] == 2.5
    assert stalled["target_only_ms_per_token"] is None and stalled["target_only_vs_first"] == 0.0


def test_lengthen_prompts_ends_with_each_prompt():
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    out = lengthen_prompts(["abc", "de"], encode, 9)
    assert [len(ids) for ids in out] == [9, 9]
    assert out[0][-3:] == encode("abc") and out[1][-2:] == encode("de")


def test_bench_smoke(agreeing_bundle, tmp_path):
    (tmp_path / "prompts.json").write_text(json.dumps(["def f(x):", "import os\n"]))
    plot = tmp_path / "bench.png"
    runner = CliRunner()
    result = runner.invoke(main, ["bench", str(agreeing_bundle), "--prompts", str(tmp_path / "prompts.json"),
                                  "--max-new-tokens", "12", "-k", "2,4", "--json", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])  # stdout: the report alone
    for key in ("target_only", "speculative", "speedup", "identical_outputs", "acceptance_rate", "mean_accepted_tokens"):
        assert key in report
    assert report["identical_outputs"] is True and report["target_only"]["tokens_per_s"] > 0
    assert report["identical_count"] == report["prompts"]  # every generation counted
    assert [r["num_draft_tokens"] for r in report["by_num_draft_tokens"]] == [2, 4]
    assert plot.stat().st_size > 0
    table = runner.invoke(main, ["bench", str(agreeing_bundle), "--prompts", str(tmp_path / "prompts.json"),
                                 "--max-new-tokens", "8", "--temperature", "0.8", "--prompt-tokens", "40", "-k", "auto",
                                 "--drafter", "model"])
    assert table.exit_code == 0, table.output
    assert "tokens/s" in table.output and "Leviathan bound" in table.output
    assert "target fp32 weights" in table.output and "draft int8 weights" in table.output


def test_memory_budget_counts_the_stored_weights_of_each_model(agreeing_bundle):
    """An int8 draft counts its packed bytes, not 4 per parameter; an fp32 target about 4 per parameter."""
    manifest = load_manifest(agreeing_bundle)
    assert manifest.target.quantize == "none" and manifest.draft.quantize == "int8"
    budget = memory_budget(manifest)
    for spec in (manifest.target, manifest.draft):
        on_disk = sum((agreeing_bundle / entry.path).stat().st_size for entry in spec.files)
        assert budget[spec.role]["weights_bytes"] == on_disk
        assert budget[spec.role]["kv_cache_bytes"] == (2 * spec.num_layers * spec.num_kv_heads * spec.head_dim
                                                       * manifest.max_context * 4)
    assert budget["target"]["weights_bytes"] >= 4 * manifest.target.num_parameters
    assert budget["draft"]["weights_bytes"] < 0.6 * 4 * manifest.draft.num_parameters
    assert budget["draft"]["dtype"] == "int8" and budget["target"]["dtype"] == "fp32"
    total = sum(budget[role]["weights_bytes"] + budget[role]["kv_cache_bytes"] for role in ("target", "draft"))
    assert budget["total_mb"] == pytest.approx(total / 2**20)


def test_bench_reports_every_sampling_setting(agreeing_bundle, tmp_path):
    """bench takes --top-k / --top-p / --min-p / --repetition-penalty, reports them, and checks greedy identity
    with a repetition penalty."""
    (tmp_path / "prompts.json").write_text(json.dumps(["def f(x):", "import os\n"]))
    runner = CliRunner()
    base = ["bench", str(agreeing_bundle), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", "10", "--json"]
    greedy = runner.invoke(main, base + ["--repetition-penalty", "1.1"])
    assert greedy.exit_code == 0, greedy.output
    report = json.loads(greedy.output.strip().splitlines()[-1])
    assert report["repetition_penalty"] == 1.1 and report["identical_outputs"] is True
    sampled = runner.invoke(main, base + ["--temperature", "0.8", "--top-k", "50", "--top-p", "0.95", "--min-p", "0.05"])
    assert sampled.exit_code == 0, sampled.output
    report = json.loads(sampled.output.strip().splitlines()[-1])
    assert (report["top_k"], report["top_p"], report["min_p"]) == (50, 0.95, 0.05)
    assert report["speculative"]["time_share"]["other"] < 1 and report["target_only"]["tokens_per_s"] > 0
    table = runner.invoke(main, base[:-1] + ["--temperature", "0.8", "--top-p", "0.95", "--repetition-penalty", "1.1"])
    assert table.exit_code == 0, table.output
    title = " ".join(table.output.split())  # the table wraps its title
    assert "temperature 0.8, top-p 0.95, repetition penalty 1.1" in title


def test_bench_context_sweep_in_one_run(agreeing_bundle, tmp_path):
    (tmp_path / "prompts.json").write_text(json.dumps(["def f(x):", "import os\n"]))
    runner = CliRunner()
    args = ["bench", str(agreeing_bundle), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", "8", "-k", "2"]
    result = runner.invoke(main, args + ["--prompt-tokens", "40,90", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert [r["prompt_tokens"] for r in report["by_prompt_tokens"]] == [40, 90]
    assert report["target_only"] == report["by_prompt_tokens"][0]["target_only"]  # the first length leads
    sweep = report["context_sweep"]  # each row from its own length's run, in the order asked
    assert [row["prompt_tokens"] for row in sweep] == [40, 90]
    assert [row["target_only_tokens_per_s"] for row in sweep] == [
        r["target_only"]["tokens_per_s"] for r in report["by_prompt_tokens"]]
    assert [row["speculative_tokens_per_s"] for row in sweep] == [
        r["speculative"]["tokens_per_s"] for r in report["by_prompt_tokens"]]
    table = runner.invoke(main, args + ["--prompt-tokens", "40,60"])
    assert table.exit_code == 0 and "decode speed against prompt length" in table.output
    for bad in ("40,x", "0", "40,4000"):
        refused = runner.invoke(main, args + ["--prompt-tokens", bad])
        assert refused.exit_code == 2 and "--prompt-tokens" in refused.output, (bad, refused.output)
