"""examples/node/host.mjs: a Node.js host on onnxruntime-node prints `specdeploy run --temperature 0`'s text.

The host reads nothing but the bundle's manifest, so these tests hold the manifest's contract (names,
shapes, the shared-buffer and growing KV caches, mask and rollback, the accept graph) to the Python
runtime's behaviour on the fused and the optimum graphs, fp32 and fp16, and the demo pair.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parents[1] / "examples" / "node"
PROMPTS = ("def fibonacci(n):\n", "class Stack:\n    def push(self, item):\n        ")
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def fp16_bundle(tmp_path_factory, trained_pair):
    """fp16 fused graphs: float16 logits and KV buffers, and the target's two-token minimum pass."""
    from conftest import export_pair

    out = tmp_path_factory.mktemp("fp16") / "bundle"
    export_pair(trained_pair, out, dtype="fp16")
    return out


def run_node(node, bundle, prompt: str, max_new_tokens, tmp_path) -> subprocess.CompletedProcess:
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(prompt)
    return subprocess.run([node, str(NODE_DIR / "host.mjs"), str(bundle), str(prompt_file), str(max_new_tokens)],
                          capture_output=True, text=True)


def python_greedy(bundle, prompt: str, max_new_tokens: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "specdeploy", "run", str(bundle), "--prompt", "-", "--temperature", "0",
                             "--max-new-tokens", str(max_new_tokens), "--json"],
                            input=prompt, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def assert_same_text(node, bundle, tmp_path, prompts=PROMPTS):
    for prompt in prompts:
        expected = python_greedy(bundle, prompt, MAX_NEW_TOKENS)
        result = run_node(node, bundle, prompt, MAX_NEW_TOKENS, tmp_path)
        assert result.returncode == 0, result.stderr
        assert expected["token_ids"], "the comparison needs generated tokens"
        assert result.stdout == expected["text"], (prompt, result.stderr)
        assert f"{len(expected['token_ids'])} tokens in" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_node_host_prints_the_python_greedy_text(node, bundles, arch, tmp_path):
    """llama: fused graphs, KV buffers shared between past and present; gpt2: optimum's growing pasts."""
    assert_same_text(node, bundles(arch), tmp_path)


@pytest.mark.slow
def test_node_host_on_the_demo_pair(node, demo_bundle, tmp_path):
    assert_same_text(node, demo_bundle, tmp_path)


@pytest.mark.slow
def test_node_host_on_fp16_graphs(node, fp16_bundle, tmp_path):
    assert_same_text(node, fp16_bundle, tmp_path, prompts=PROMPTS[:1])


def test_node_host_edge_lengths(node, bundles, tmp_path):
    bundle = bundles("llama")
    assert run_node(node, bundle, "def f(x):", 0, tmp_path).stdout == ""
    # an empty prompt starts from BOS, as in the Python runtime
    assert run_node(node, bundle, "", 6, tmp_path).stdout == python_greedy(bundle, "", 6)["text"]


def test_node_host_bad_input_is_one_error_line(node, bundles, tmp_path):
    bundle = bundles("llama")
    stale = tmp_path / "stale"
    shutil.copytree(bundle, stale)
    manifest = json.loads((stale / "specdeploy.json").read_text())
    manifest.pop("accept")
    (stale / "specdeploy.json").write_text(json.dumps(manifest))
    truncated = tmp_path / "truncated"
    shutil.copytree(bundle, truncated)
    with open(truncated / "accept" / "greedy.onnx", "ab") as handle:
        handle.write(b"\0")
    cases = [(tmp_path / "missing", "x", 4, "not a specdeploy bundle"),
             (truncated, "x", 4, "bundle is corrupt: accept/greedy.onnx has"),
             (bundle, "x", "four", "MAX_NEW_TOKENS must be a whole number"),
             (stale, "x", 4, "no accept graphs; re-export"),
             (bundle, "x " * 400, 4, "max context")]
    for folder, prompt, max_new_tokens, message in cases:
        result = run_node(node, folder, prompt, max_new_tokens, tmp_path)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.startswith("error: ") and message in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.slow
def test_node_host_runs_an_eagle_bundle_with_the_target_alone(node, eagle_bundle, tmp_path):
    assert_same_text(node, eagle_bundle, tmp_path, prompts=PROMPTS[:1])
    result = run_node(node, eagle_bundle, PROMPTS[0], 4, tmp_path)
    assert "the draft is an eagle head, which this host does not run; decoding with the target alone" in result.stderr


def test_node_host_runs_a_bundle_without_a_draft_with_the_target_alone(node, draftless_bundle, tmp_path):
    assert_same_text(node, draftless_bundle, tmp_path, prompts=PROMPTS[:1])
    result = run_node(node, draftless_bundle, PROMPTS[0], 4, tmp_path)
    assert "the bundle has no draft model; decoding with the target alone" in result.stderr


def test_node_host_zero_new_tokens_is_an_empty_completion(node, bundles, tmp_path):
    """MAX_NEW_TOKENS 0 is allowed ('a whole number >= 0'): an empty completion and exit 0, not an error."""
    result = run_node(node, bundles("llama"), "def f(x):", 0, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and "0 tokens in" in result.stderr


def with_bos_post_processor(bundle: Path, out: Path) -> Path:
    """A copy of bundle whose tokenizer.json prepends <s> (id 0) to every encoding, as Llama's tokenizers do."""
    shutil.copytree(bundle, out)
    tokenizer_json = out / "tokenizer" / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    data["post_processor"] = {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}}
    tokenizer_json.write_text(json.dumps(data))
    manifest = json.loads((out / "specdeploy.json").read_text())
    raw = tokenizer_json.read_bytes()
    for entry in manifest["tokenizer"]["files"]:
        if entry["path"] == "tokenizer/tokenizer.json":
            entry.update(size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    (out / "specdeploy.json").write_text(json.dumps(manifest, indent=2))
    return out


def test_node_host_keeps_one_bos_when_the_prompt_starts_with_it(node, bundles, tmp_path):
    """A prompt that starts with the BOS text (a rendered template) keeps that BOS only, as TextCodec.encode:
    the tokenizer's post-processor would put a second one in front, and the models see other ids."""
    bundle = with_bos_post_processor(bundles("llama"), tmp_path / "bos-bundle")
    prompt = "<s>def f(x):\n"
    expected = python_greedy(bundle, prompt, 16)
    assert expected["stats"]["prompt_tokens"] == 7  # <s> once
    result = run_node(node, bundle, prompt, 16, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected["text"]


def test_node_host_decodes_without_cleaning_up_spaces(node, tokenizer_dir, tmp_path):
    """host.mjs prints tokenizer.decode(ids, {skip_special_tokens: true}); @huggingface/tokenizers then applies
    transformers' clean_up_tokenization (" ," -> ",", " 's" -> "'s", ...) unless tokenizer_config.json says
    false (its default is true, also without a config), while the Python runtime's `tokenizers` never does."""
    from specdeploy.export.tokenizer_readers import read_node, read_reference

    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["clean_up_tokenization_spaces"] = True  # as in GPT-2-era checkpoints; absent reads the same in JS
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    samples = ("name = 'spam'\nprint(a , b) .\n",)
    reference = read_reference(json.loads((folder / "tokenizer.json").read_text()), samples)
    assert read_node(folder, samples, reference.ids, NODE_DIR).texts == reference.texts
