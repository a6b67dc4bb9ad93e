"""A bundle of the target alone (`export --target` without `--draft`): no draft files, drafted by prompt
lookup, every command works on it, and the output is the target's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

import specdeploy
from specdeploy.bundle import MANIFEST_NAME, listed_files, load_manifest
from specdeploy.cli import main
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.drafters import PromptLookupDrafter

# Text that repeats itself, so that prompt lookup finds n-grams to draft from.
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def bundle(draftless_bundle) -> Path:
    return draftless_bundle


def assert_target_alone(bundle: Path) -> None:
    """No draft model in the manifest or on disk; the format that allows it; genai's target-only config alone."""
    data = json.loads((bundle / MANIFEST_NAME).read_text())
    assert data["draft"] is None and data["format_version"] == 2
    assert not (bundle / "draft").exists()
    manifest = load_manifest(bundle)
    assert manifest.models == (manifest.target,)
    assert not any(entry.path.startswith("draft/") for entry in listed_files(manifest))
    if manifest.genai is not None:
        assert manifest.genai.speculative is None and "no draft model" in manifest.genai.unsupported
        assert not (bundle / "genai_config.json").exists()
        config = json.loads((bundle / manifest.genai.target_only / "genai_config.json").read_text())
        assert "speculative" not in config and "draft" not in config["model"]


def assert_greedy_is_the_targets(generator, prompt, max_new_tokens: int = 40) -> None:
    speculative = generator.generate(prompt, max_new_tokens=max_new_tokens, temperature=0)
    alone = generator.generate(prompt, max_new_tokens=max_new_tokens, temperature=0, speculative=False)
    assert speculative.token_ids == alone.token_ids and len(alone.token_ids) > 0


def test_export_of_one_model_writes_no_draft(bundle, checkpoints, tmp_path):
    assert_target_alone(bundle)
    assert load_manifest(bundle).accept is not None  # the accept graphs read the target's logits alone
    target = checkpoints("llama")["target"]
    result = CliRunner().invoke(main, ["export", "--target", str(target), "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(tmp_path / "b")
    assert_target_alone(tmp_path / "b")
    assert load_manifest(tmp_path / "b").target.source == str(target)


def test_greedy_equals_target_only_decoding_and_sampling_runs(bundle):
    generator = specdeploy.load(bundle)  # the default drafter, hybrid, drafts by prompt lookup here
    assert isinstance(generator.drafter, PromptLookupDrafter)
    assert_greedy_is_the_targets(generator, PROMPT)
    assert generator.generate(PROMPT, max_new_tokens=40).stats.drafted > 0  # the repeated text was drafted from
    assert_greedy_is_the_targets(generator, "import os\n")
    sampled = generator.generate(PROMPT, max_new_tokens=24, temperature=0.8, top_p=0.95, seed=3)
    assert len(sampled.token_ids) > 0
    assert sampled.token_ids == generator.generate(PROMPT, max_new_tokens=24, temperature=0.8, top_p=0.95,
                                                   seed=3).token_ids
    lookup = specdeploy.load(bundle, drafter="prompt-lookup")
    assert lookup.generate(PROMPT, max_new_tokens=24).token_ids == generator.generate(PROMPT, max_new_tokens=24).token_ids


def test_the_model_drafter_is_refused_in_one_line(bundle):
    with pytest.raises(SpecdeployError, match="has no draft model, so drafter 'model' cannot run") as caught:
        specdeploy.load(bundle, drafter="model")
    assert "\n" not in str(caught.value)
    result = CliRunner().invoke(main, ["run", str(bundle), "--prompt", "x", "--drafter", "model"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1


def test_run_and_chat_on_it(bundle, tmp_path):
    result = CliRunner().invoke(main, ["run", str(bundle), "--prompt", PROMPT, "--max-new-tokens", "16", "--json"])
    assert result.exit_code == 0, result.output
    expected = specdeploy.load(bundle).generate(PROMPT, max_new_tokens=16, speculative=False)
    assert json.loads(result.stdout.strip().splitlines()[-1])["token_ids"] == expected.token_ids
    copy = tmp_path / "chat"
    shutil.copytree(bundle, copy)
    (copy / "tokenizer" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    chat = CliRunner().invoke(main, ["chat", str(copy), "--max-new-tokens", "8"], input="def f(x):\n/exit\n")
    assert chat.exit_code == 0, chat.output
    reply = specdeploy.load(copy).generate(messages=[{"role": "user", "content": "def f(x):"}], max_new_tokens=8,
                                           speculative=False).text
    assert chat.stdout == (reply if reply.endswith("\n") else reply + "\n")


def test_inspect_shows_no_draft(bundle):
    result = CliRunner().invoke(main, ["inspect", str(bundle)])
    assert result.exit_code == 0, result.output
    assert "draft (none)" in result.stdout and "draft:  none" in result.stdout
    assert "prompt lookup" in result.stdout
    assert all(len(line) <= 80 for line in result.stdout.splitlines())
    as_json = CliRunner().invoke(main, ["inspect", str(bundle), "--json"])
    assert json.loads(as_json.stdout)["draft"] is None
    verify = CliRunner().invoke(main, ["verify", str(bundle)])
    assert verify.exit_code == 0, verify.output


def test_bench_compares_prompt_lookup_with_the_target_alone(bundle, tmp_path):
    (tmp_path / "prompts.json").write_text(json.dumps([PROMPT, "import os\n"]))
    result = CliRunner().invoke(main, ["bench", str(bundle), "--prompts", str(tmp_path / "prompts.json"),
                                       "--max-new-tokens", "12", "-k", "2,4", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["identical_outputs"] is True and report["drafter"] == "prompt-lookup"
    assert "draft" not in report["memory_budget"] and report["memory_budget"]["total_mb"] > 0
    table = CliRunner().invoke(main, ["bench", str(bundle), "--prompts", str(tmp_path / "prompts.json"),
                                      "--max-new-tokens", "8", "--temperature", "0.8"])
    assert table.exit_code == 0, table.output
    assert "target fp32 weights" in table.output and "draft " not in table.output.split("peak RSS")[-1]


def test_serve_answers_a_request(bundle):
    from test_serve import LiveServer

    from specdeploy.serve import ServeConfig

    live = LiveServer(ServeConfig(bundle=str(bundle), model_name="tiny"))
    try:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
        answer = httpx.post(live.url + "/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        expected = specdeploy.load(bundle).generate(PROMPT, max_new_tokens=16, speculative=False)
        assert answer.json()["choices"][0]["text"] == expected.text
    finally:
        live.close()


def test_a_format_1_manifest_must_have_a_draft(bundle, tmp_path):
    """format_version 1 promises a draft to the hosts that read it: a null one there is refused, by name."""
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    data = json.loads((copy / MANIFEST_NAME).read_text())
    data["format_version"] = 1
    (copy / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(SpecdeployError, match="'draft' is null, which format_version 1 does not allow"):
        load_manifest(copy)


def test_only_a_draft_or_a_draft_option_without_one_is_one_error_line(tmp_path, checkpoints):
    runner = CliRunner()
    alone = runner.invoke(main, ["export", "--draft", str(checkpoints("llama")["draft"]), "--out", str(tmp_path / "x")])
    assert alone.exit_code == 2 and alone.stdout == ""
    assert alone.stderr.strip().splitlines() == [("error: --draft needs --target: pass --target (with or without "
                                                  "--draft), or neither (to export the embedded demo pair)")]
    window = runner.invoke(main, ["export", "--target", str(checkpoints("llama")["target"]), "--out", str(tmp_path / "y"),
                                  "--draft-window", "64"])
    assert window.exit_code == 2 and len(window.stderr.strip().splitlines()) == 1
    assert "--draft-window describes the draft model, and no --draft was given" in window.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_gguf_exports_alone(tmp_path):
    pytest.importorskip("gguf")
    from test_gguf_blocks import ARCH_TYPES, write_quantized_gguf

    from specdeploy.export import ExportConfig, export_bundle

    path = write_quantized_gguf(tmp_path / "llama.gguf", "llama", ARCH_TYPES["llama"])
    manifest = export_bundle(ExportConfig(target=str(path), draft=None, out=str(tmp_path / "bundle")))
    assert manifest.draft is None and manifest.target.quantize == "gguf"
    assert_target_alone(tmp_path / "bundle")
    generator = specdeploy.load(tmp_path / "bundle", exact=True)  # a quantized target's one-token steps round otherwise
    assert_greedy_is_the_targets(generator, PROMPT, max_new_tokens=24)
    chat = generator.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=8, temperature=0.7, seed=1)
    assert chat.stats.new_tokens >= 1


def test_serve_refuses_the_model_drafter_before_listening(bundle):
    result = CliRunner().invoke(main, ["serve", str(bundle), "--port", "0", "--drafter", "model"])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        f"error: the bundle {bundle} has no draft model, so drafter 'model' cannot run: use 'hybrid' or "
        "'prompt-lookup' (both draft by prompt lookup here), or export it again with --draft"]
