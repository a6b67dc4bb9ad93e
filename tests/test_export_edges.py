"""Export at its edges: a folder that appears at --out while the export runs, a checkpoint without an EOS,
a broken generation_config.json, a model longer than a bundle holds, another bundle's work folder beside
this one's, and NaN in a manifest."""

import json
import shutil
from pathlib import Path

import pytest

from specdeploy import swap
from specdeploy.bundle import MANIFEST_NAME, MAX_CONTEXT, load_manifest, manifest_from_dict
from specdeploy.errors import SpecdeployError

from conftest import BOS, EOS, VOCAB, export_pair


def _copy_pair(pair: dict, root: Path) -> dict:
    copies = {}
    for role, source in pair.items():
        copies[role] = root / role
        shutil.copytree(source, copies[role])
    return copies


def _drop(folder: Path, name: str, keys) -> None:
    data = json.loads((folder / name).read_text())
    for key in keys:
        data.pop(key, None)
    (folder / name).write_text(json.dumps(data))


def test_out_created_during_the_export_is_never_replaced(checkpoints, tmp_path):
    """--out did not exist when checked, and no --force: a folder that appears there while the export
    runs (the user's, another tool's) must not be exchanged into the work folder and deleted. It appears
    when the export reports its write stage, after the check and before the swap."""
    from specdeploy.export import ExportConfig, export_bundle

    pair, out = checkpoints("llama"), tmp_path / "bundle"

    def someone_writes_out(stage, detail):
        if stage == "write" and not out.exists():
            out.mkdir()
            (out / "notes.txt").write_text("my notes")

    with pytest.raises(SpecdeployError, match="--out"):
        export_bundle(ExportConfig(target=str(pair["target"]), draft=str(pair["draft"]), out=str(out)), someone_writes_out)
    assert (out / "notes.txt").read_text() == "my notes"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_checkpoint_with_bos_but_no_eos_or_pad_exports(checkpoints, tmp_path):
    """A base model that states a BOS token but no EOS and no pad exports (the runtime runs models without an
    EOS: conftest's long_bundle); onnxruntime-genai's config, which needs an EOS, is left out and the manifest
    says why."""
    pair = _copy_pair(checkpoints("llama"), tmp_path)
    for folder in pair.values():
        _drop(folder, "config.json", ("eos_token_id", "pad_token_id"))
        _drop(folder, "generation_config.json", ("eos_token_id", "pad_token_id"))
        _drop(folder, "tokenizer_config.json", ("eos_token", "pad_token"))
        _drop(folder, "special_tokens_map.json", ("eos_token", "pad_token"))
    manifest = export_pair(pair, tmp_path / "bundle")
    assert manifest.target.eos_token_ids == () and load_manifest(tmp_path / "bundle", verify=True)
    assert manifest.genai.target_only is None and "no EOS" in manifest.genai.unsupported


def test_broken_generation_config_is_one_error_naming_the_file(checkpoints, tmp_path):
    pair = _copy_pair(checkpoints("llama"), tmp_path)
    (pair["target"] / "generation_config.json").write_text("{not json")
    with pytest.raises(SpecdeployError, match="generation_config.json"):
        export_pair(pair, tmp_path / "bundle")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "target"]


def test_model_context_beyond_the_manifest_limit(tokenizer_dir, tmp_path):
    """max_position_embeddings above MAX_CONTEXT (2**20; e.g. Gradient's Llama-3 4194k): the default
    --max-context must give a loadable bundle, or an upfront error that says to pass --max-context --
    not a full export that ends in the manifest's own range check."""
    import torch
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * MAX_CONTEXT,
                            bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS, tie_word_embeddings=False)
    torch.manual_seed(0)
    folder = tmp_path / "long"
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    try:
        manifest = export_pair({"target": folder, "draft": folder}, tmp_path / "bundle", draft_quantize="none")
    except SpecdeployError as exc:
        assert "--max-context" in str(exc), str(exc)
    else:
        assert manifest.max_context <= MAX_CONTEXT


def test_cleaning_leftovers_spares_another_bundles_work_folder(tmp_path):
    """An export to 'm' (or a load of a missing 'm') deletes only m's own leftovers: '.m.old-1.partial-x'
    is the live work folder of an export to the bundle 'm.old-1'."""
    other = tmp_path / ".m.old-1.partial-abc"
    (other / "bundle").mkdir(parents=True)
    (other / "bundle" / "model.onnx").write_text("being written")
    with swap.bundle_lock(tmp_path / "m"):
        swap.clean_leftovers(tmp_path / "m")
    assert (other / "bundle" / "model.onnx").is_file()


def test_nan_in_bounded_manifest_fields_is_refused(bundles, tmp_path):
    """Python's json reads NaN; a range check (0..1, >= 0) must not let it through."""
    copy = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), copy)
    data = json.loads((copy / MANIFEST_NAME).read_text())
    data["target"]["parity"]["prefill_greedy_agreement"] = float("nan")
    data["target"]["parity"]["tolerance"] = float("nan")
    with pytest.raises(SpecdeployError, match="parity"):  # the range check, on the values themselves
        manifest_from_dict(data)
    (copy / MANIFEST_NAME).write_text(json.dumps(data))  # as NaN, which is not JSON
    with pytest.raises(SpecdeployError, match="NaN is not a JSON number"):
        load_manifest(copy)


@pytest.mark.parametrize("frequencies", ['["not", "an", "object"]', '{"ids": ["x"], "counts": [1]}'])
def test_a_draft_vocab_file_with_bad_frequencies_is_one_error(tmp_path, frequencies):
    from specdeploy.export.draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab

    (tmp_path / DRAFT_VOCAB_FILE).write_text('{"ids": [1, 2], "counts": [5, 3], "vocab_size": 10, '
                                             f'"frequencies": {frequencies}}}')
    with pytest.raises(SpecdeployError, match=DRAFT_VOCAB_FILE):
        read_draft_vocab(tmp_path)
