"""The manifest: round trip, validation, checksums and `specdeploy inspect`."""

import dataclasses
import json
import shutil

import pytest
from click.testing import CliRunner


from specdeploy.bundle import MANIFEST_NAME, load_manifest, manifest_from_dict, save_manifest
from specdeploy.cli import main
from specdeploy.errors import SpecdeployError


@pytest.fixture
def bundle_copy(bundles, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), copy)
    return copy


def test_manifest_round_trip(bundles, tmp_path):
    manifest = load_manifest(bundles("llama"))
    assert manifest_from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest
    save_manifest(manifest, tmp_path)
    assert json.loads((tmp_path / MANIFEST_NAME).read_text()) == manifest.to_dict()


def test_manifest_records_everything_a_host_needs(bundles):
    data = json.loads((bundles("qwen2") / MANIFEST_NAME).read_text())
    assert data["format_version"] == 1
    target = data["target"]
    for key in ("files", "architecture", "num_layers", "num_kv_heads", "head_dim", "vocab_size", "dtype", "max_context",
                "inputs", "outputs", "bos_token_id", "eos_token_ids", "pad_token_id", "source", "parity", "kv_cache"):
        assert key in target, key
    assert target["files"][0]["sha256"] and target["files"][0]["size"] > 0
    assert any("max_abs_diff" in key for key in target["parity"])
    past = next(i for i in target["inputs"] if i["name"] == "past_key_values.0.key")
    assert past["shape"][1] == target["num_kv_heads"] and past["shape"][3] == target["head_dim"]
    assert isinstance(past["shape"][2], str)  # a dynamic axis, named
    assert data["export_options"]["dtype"] == "fp32" and "optimum-onnx" in data["tool_versions"]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda d: d.update(format_version=3), r"format_version 3 is not supported \(this specdeploy reads 1 and 2\)"),
        (lambda d: d.pop("target"), "'target' is missing"),
        (lambda d: d["draft"].update(vocab_size=7), "vocab_size"),
        (lambda d: d["target"]["files"][0].update(size=1), "corrupt"),
        (lambda d: d["target"]["files"][-1].update(path="target/gone.onnx.data"), "missing"),
    ],
)
def test_bad_manifests_are_refused(bundle_copy, corrupt, message):
    path = bundle_copy / MANIFEST_NAME
    data = json.loads(path.read_text())
    corrupt(data)
    path.write_text(json.dumps(data))
    with pytest.raises(SpecdeployError, match=message):
        load_manifest(bundle_copy)


def test_checksums_catch_changed_files(bundle_copy):
    manifest = load_manifest(bundle_copy)
    tokenizer = bundle_copy / manifest.tokenizer.files[0].path
    content = bytearray(tokenizer.read_bytes())
    content[10] ^= 1
    tokenizer.write_bytes(bytes(content))
    load_manifest(bundle_copy)  # same size: only the checksum tells
    with pytest.raises(SpecdeployError, match="sha256"):
        load_manifest(bundle_copy, verify=True)


def test_not_json_and_not_a_bundle(tmp_path):
    with pytest.raises(SpecdeployError, match="not a folder"):
        load_manifest(tmp_path / "absent")
    with pytest.raises(SpecdeployError, match="missing"):
        load_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(SpecdeployError, match="not valid JSON"):
        load_manifest(tmp_path)


def test_inspect(bundles):
    runner = CliRunner()
    result = runner.invoke(main, ["inspect", str(bundles("llama")), "--verify"])
    assert result.exit_code == 0, result.output
    assert "LlamaForCausalLM" in result.output and "parity" in result.output
    result = runner.invoke(main, ["inspect", str(bundles("llama")), "--json"])
    assert json.loads(result.output)["format_version"] == 1
    result = runner.invoke(main, ["inspect", "/nonexistent/bundle"])
    assert result.exit_code != 0 and "error: bundle not found" in result.output


def test_dataclasses_are_frozen(bundles):
    manifest = load_manifest(bundles("llama"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        manifest.max_context = 5
