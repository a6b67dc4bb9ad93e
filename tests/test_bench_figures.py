"""`specdeploy bench`'s figures: acceptance by draft position, the fitted acceptance, tokens per round and
the cost model's bound, counted as the docs define them; and its -k option."""

import json
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

import specdeploy
from specdeploy.bench import BenchConfig, run_bench
from specdeploy.cli import main
from specdeploy.defaults import bundle_to_run

PROMPT = "def f(x):"


def _bench_json(bundle, tmp_path, *args) -> dict:
    (tmp_path / "prompts.json").write_text(json.dumps([PROMPT]))
    result = CliRunner().invoke(main, ["bench", str(bundle), "--prompts", str(tmp_path / "prompts.json"), "--json",
                                       *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def _positions_row(output: str) -> list[float]:
    line = next(line for line in output.splitlines() if "accepted by position" in line)
    return [float(value) for value in re.findall(r"\d+\.\d\d", line)]


def test_a_draft_that_is_never_rejected_reads_full_acceptance_at_every_position(self_draft_bundle, tmp_path):
    """Draft == target: every drafted token is kept. The last round of a 12-token run drafts 1 token (the
    budget allows no more), which is not a rejection of positions 2..4: each position's rate reads 1.00
    and the fitted per-token acceptance is 1."""
    (tmp_path / "prompts.json").write_text(json.dumps([PROMPT]))
    args = ["bench", str(self_draft_bundle), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", "12",
            "-k", "4", "--drafter", "model"]
    table = CliRunner().invoke(main, args)
    assert table.exit_code == 0, table.output
    report = _bench_json(self_draft_bundle, tmp_path, *args[4:])
    row = report["by_num_draft_tokens"][0]
    assert row["identical_outputs"] is True
    assert row["acceptance_rate"] == 1.0  # every drafted token kept
    assert _positions_row(table.output) == [1.0, 1.0, 1.0, 1.0]
    assert row["fitted_alpha"] == pytest.approx(1.0, abs=0.01)


def test_a_position_no_round_drafted_is_not_reported_as_rejected(tmp_path):
    """4 new tokens at k = 4: no round can draft a 4th token (the first drafts 3, the budget's most), so the
    4th position was never tested; reading it as 0.00 (every round rejected it) is wrong."""
    (tmp_path / "prompts.json").write_text(json.dumps([PROMPT]))
    table = CliRunner().invoke(main, ["bench", "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", "4",
                                      "-k", "4", "--drafter", "model"])
    assert table.exit_code == 0, table.output
    assert len(_positions_row(table.output)) < 4 or _positions_row(table.output)[3] != 0.0


@pytest.fixture(scope="module")
def demo_generator():
    return specdeploy.load(str(bundle_to_run()), policy="always")


def test_tokens_per_round_and_the_bound_count_only_tokens_the_run_produced(demo_generator):
    """A run that ends at a stop token (as every --chat run ends at its end of turn) inside a round: the
    drafts kept after the stop token are never output. Tokens per round is new tokens over rounds, and the
    bound is target-only ONNX Runtime time per token over speculative ONNX Runtime time per token
    (docs/performance.md), with the tokens the run produced."""
    stop = demo_generator.generate(PROMPT, max_new_tokens=64, speculative=False).token_ids[5]
    config = BenchConfig(prompts=(PROMPT,), max_new_tokens=64, num_draft_tokens=(4,), stop_token_ids=(stop,))
    report = run_bench(demo_generator, config)
    row, base = report["by_num_draft_tokens"][0], report["target_only"]
    spec = row["speculative"]
    assert row["identical_outputs"] is True and spec["new_tokens"] == base["new_tokens"] < 64  # ended at the stop token
    assert row["mean_accepted_tokens"] == pytest.approx(spec["new_tokens"] / spec["rounds"])
    target_only_per_token = base["target_ms"] / base["new_tokens"]
    speculative_per_token = (spec["draft_ms"] + spec["target_ms"]) / spec["new_tokens"]
    assert row["leviathan_bound"] == pytest.approx(target_only_per_token / speculative_per_token, rel=1e-6)


def test_a_repeated_draft_length_is_benched_once(tmp_path):
    """-k 4,4 names one k: one column, each prompt's speculative run once per k (not twice into one total)."""
    report = _bench_json(bundle_to_run(), tmp_path, "--max-new-tokens", "4", "-k", "4,4")
    assert [row["num_draft_tokens"] for row in report["by_num_draft_tokens"]] == [4]
    assert report["speculative"]["runs"] == report["target_only"]["runs"]


def _bench_process(tmp_path, *args) -> dict:
    (tmp_path / "prompts.json").write_text(json.dumps([PROMPT]))
    result = subprocess.run([sys.executable, "-m", "specdeploy", "bench", "--prompts", str(tmp_path / "prompts.json"),
                             "--max-new-tokens", "4", "--json", *args], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_peak_memory_is_the_same_with_or_without_a_plot(tmp_path):
    """The peak RSS bench reports is the decoding's, held against the bundle's floor: asking for a plot
    (drawn after the runs) must not add the plotting library's memory to it."""
    without = _bench_process(tmp_path)["peak_rss_mb"]
    with_plot = _bench_process(tmp_path, "--plot", str(tmp_path / "k.png"))["peak_rss_mb"]
    assert with_plot < without + 8, (without, with_plot)


def test_prompt_tokens_below_a_prompts_own_length_is_refused(tmp_path):
    """--prompt-tokens lengthens every prompt to N tokens; a prompt already longer than N is not N tokens
    long, so a report titled "N-token prompts" would be wrong: one error line instead."""
    (tmp_path / "prompts.json").write_text(json.dumps([PROMPT]))  # 5 tokens with the demo tokenizer's BOS
    result = CliRunner().invoke(main, ["bench", "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", "2",
                                       "--prompt-tokens", "2", "--json"])
    assert result.exit_code == 2 and "--prompt-tokens" in result.output, result.output
