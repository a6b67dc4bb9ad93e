"""The bundle as an onnxruntime-genai model folder: og.Model(bundle) gives `specdeploy run`'s greedy tokens.

Both sides start from the same prompt ids (genai's tokenizer must encode the prompt as ours does) and
may generate the same number of new tokens. Both stop at an end-of-sequence token: `specdeploy run`
lists it last in its token ids, genai leaves it out of the sequence (neither shows it in the text).
"""

import functools
import json
import os
import subprocess
import sys

import pytest

from conftest import ARCHITECTURES

from specdeploy.bundle import load_manifest

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[hosts]' in the specdeploy clone)")

PROMPTS = ("def f(x):\n    return", "import os\n\n\nclass ")
MAX_NEW_TOKENS = 32


@functools.cache
def specdeploy_run(bundle, prompt: str, *flags: str, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """`specdeploy run --temperature 0 --json`, the prompt on standard input (exact, trailing newlines included).
    Greedy and deterministic, so each command runs once: the genai and C++ host tests compare with the same runs
    (callers only read the result)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "specdeploy", "run", str(bundle), "--prompt", "-", "--temperature", "0",
         "--max-new-tokens", str(max_new_tokens), "--json", *flags],
        input=prompt, capture_output=True, text=True, env=env, check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def prompt_ids(bundle, prompt: str) -> list[int]:
    """The ids specdeploy feeds the models (its TextCodec: the tokenizer's own special tokens)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(bundle / "tokenizer" / "tokenizer.json")).encode(prompt, add_special_tokens=True).ids


def without_eos(bundle, token_ids: list[int]) -> list[int]:
    """`specdeploy run`'s token ids as genai reports them: a final end-of-sequence token left out."""
    if token_ids and token_ids[-1] in load_manifest(bundle).target.eos_token_ids:
        return token_ids[:-1]
    return token_ids


def genai_greedy(model, ids: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[list[int], dict]:
    """Greedy tokens after ids and genai's speculative statistics."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + max_new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    while not generator.is_done():
        generator.generate_next_token()
    tokens = [int(t) for t in generator.get_sequence(0)][len(ids):]
    return tokens, generator.get_speculative_stats()


def assert_matches_specdeploy_run(bundle, folder, flags: tuple[str, ...], speculative: bool):
    model = og.Model(str(folder))
    tokenizer = og.Tokenizer(model)
    for prompt in PROMPTS:
        ids = prompt_ids(bundle, prompt)
        assert [int(t) for t in tokenizer.encode(prompt)] == ids
        ours = specdeploy_run(bundle, prompt, *flags)
        tokens, stats = genai_greedy(model, ids)
        assert tokens == without_eos(bundle, ours["token_ids"]), f"prompt {prompt!r}"
        if "\ufffd" not in ours["text"]:  # random weights emit broken UTF-8, which decoders replace differently
            assert tokenizer.decode(tokens) == ours["text"]
        assert (stats["draft_tokens_proposed"] > 0) == speculative


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_genai_speculative_greedy_equals_specdeploy_run(bundles, arch):
    bundle = bundles(arch)
    assert_matches_specdeploy_run(bundle, bundle, (), speculative=True)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_genai_target_only_greedy_equals_specdeploy_run(bundles, arch):
    bundle = bundles(arch)
    genai = load_manifest(bundle).genai
    assert_matches_specdeploy_run(bundle, bundle / genai.target_only, ("--no-speculative",), speculative=False)


@pytest.mark.slow
def test_genai_runs_the_demo_pair_both_ways(demo_bundle):
    manifest = load_manifest(demo_bundle)
    assert manifest.draft.quantize == "int8"
    for prompt in PROMPTS:  # a trained pair writes valid text: the decoded text is compared on every prompt
        assert "\ufffd" not in specdeploy_run(demo_bundle, prompt)["text"]
    assert_matches_specdeploy_run(demo_bundle, demo_bundle, (), speculative=True)
    assert_matches_specdeploy_run(demo_bundle, demo_bundle / manifest.genai.target_only, ("--no-speculative",),
                                  speculative=False)


def test_genai_samples_when_a_caller_asks_for_sampling_alone(demo_bundle):
    """The config's search defaults are greedy, with top_k 50 for a caller who turns sampling on (genai's
    model builder's default): top_k 1 made `do_sample=True` greedy. Sampling at T 1 over the demo pair's
    4k vocabulary with different seeds gives different continuations."""
    model = og.Model(str(demo_bundle / load_manifest(demo_bundle).genai.target_only))
    ids = prompt_ids(demo_bundle, PROMPTS[0])
    continuations = set()
    for seed in range(4):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + 24, do_sample=True, random_seed=seed)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        continuations.add(tuple(int(t) for t in generator.get_sequence(0))[len(ids):])
    assert len(continuations) > 1, continuations


def test_manifest_records_the_genai_folders(bundles):
    bundle = bundles("llama")
    manifest = load_manifest(bundle, verify=True)  # the configs and tokenizer copies are checksummed too
    genai = manifest.genai
    assert (genai.speculative, genai.target_only, genai.unsupported) == (".", "target", None)
    listed = {entry.path for entry in genai.files}
    for folder in (genai.speculative, genai.target_only):
        prefix = "" if folder == "." else f"{folder}/"
        assert {f"{prefix}genai_config.json", f"{prefix}tokenizer.json"} <= listed
    config = json.loads((bundle / "genai_config.json").read_text())
    assert config["model"]["decoder"]["filename"] == manifest.target.onnx_path
    assert config["model"]["draft"]["filename"] == manifest.draft.onnx_path
    assert config["model"]["draft"]["num_hidden_layers"] == manifest.draft.num_layers
    assert config["speculative"]["max_draft_tokens"] == genai.max_draft_tokens
    assert config["model"]["eos_token_id"] == list(manifest.target.eos_token_ids)
    target_only = json.loads((bundle / "target" / "genai_config.json").read_text())
    assert "draft" not in target_only["model"] and "speculative" not in target_only
    assert target_only["model"]["decoder"]["filename"] == "model.onnx"


def test_shared_cache_only_when_every_model_has_the_fused_graph(bundles, demo_bundle):
    for bundle in (bundles("llama"), bundles("gpt2"), demo_bundle):
        manifest = load_manifest(bundle)
        for folder, specs in (("target", (manifest.target,)), (".", (manifest.target, manifest.draft))):
            config = json.loads((bundle / folder / "genai_config.json").read_text())
            fused = all(spec.graph == "fused" for spec in specs)
            assert config["search"]["past_present_share_buffer"] == fused
            assert ("position_ids" in config["model"]["decoder"]["inputs"]) == (manifest.target.graph == "optimum")


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_model_type_genai_is_not_checked_on_gets_no_config(bundles, tmp_path, role):
    import dataclasses
    import shutil

    from specdeploy.export.genai import write_genai_config

    bundle = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), bundle)
    manifest = load_manifest(bundle)
    for entry in manifest.genai.files:  # back to a bundle without genai's files
        (bundle / entry.path).unlink()
    unknown = dataclasses.replace(manifest.model(role), model_type="falcon")
    genai = write_genai_config(dataclasses.replace(manifest, **{role: unknown}), bundle).genai
    assert "'falcon'" in genai.unsupported and genai.speculative is None
    assert not (bundle / "genai_config.json").exists()
    if role == "target":
        assert genai.target_only is None and genai.files == ()
        assert not (bundle / "target" / "genai_config.json").exists()
    else:  # the target alone still runs
        assert genai.target_only == "target" and "target-only" in genai.unsupported
        assert (bundle / "target" / "genai_config.json").is_file()


@pytest.mark.slow
def test_genai_runs_an_fp16_bundle(tmp_path):
    from specdeploy.defaults import demo_checkpoints
    from specdeploy.export import ExportConfig, export_bundle

    target, draft = demo_checkpoints()
    bundle = tmp_path / "bundle"
    export_bundle(ExportConfig(target=target, draft=draft, out=str(bundle), dtype="fp16"))
    assert load_manifest(bundle).genai.speculative == "."
    assert_matches_specdeploy_run(bundle, bundle, (), speculative=True)


def test_genai_runs_a_bundle_without_a_draft_from_its_target_only_config(draftless_bundle):
    """The target-only config is the one written (no speculative section); its greedy tokens are `run`'s, which
    drafts such a bundle by prompt lookup."""
    genai = load_manifest(draftless_bundle).genai
    assert genai.speculative is None and not (draftless_bundle / "genai_config.json").exists()
    assert_matches_specdeploy_run(draftless_bundle, draftless_bundle / genai.target_only, (), speculative=False)
