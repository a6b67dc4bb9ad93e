"""Integrity: `specdeploy verify` re-hashes every file and names the damaged ones; sizes are always
checked at load, hashes with --verify / verify=True."""

import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

import specdeploy
from specdeploy.bundle import load_manifest
from specdeploy.cli import main
from specdeploy.errors import SpecdeployError


@pytest.fixture
def bundle_copy(bundles, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), copy)
    return copy


def _flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x40
    path.write_bytes(bytes(data))


def _weights(bundle):
    manifest = load_manifest(bundle)
    return bundle / max(manifest.target.files, key=lambda f: f.size).path


def test_verify_a_whole_bundle(bundle_copy):
    result = CliRunner().invoke(main, ["verify", str(bundle_copy)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok: ") and "match their sha256" in result.output


def test_verify_names_every_damaged_file(bundle_copy):
    weights = _weights(bundle_copy)
    _flip_byte(weights)  # same size: only the hash can tell
    tokenizer = bundle_copy / "tokenizer" / "tokenizer.json"
    _flip_byte(tokenizer, 5)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "specdeploy", "verify", str(bundle_copy)], capture_output=True,
                            text=True, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: bundle")
    relative = weights.relative_to(bundle_copy).as_posix()
    assert f"{relative} is damaged" in lines[0] and "tokenizer/tokenizer.json is damaged" in lines[0]


def test_sizes_are_always_checked_hashes_on_request(bundle_copy):
    weights = _weights(bundle_copy)
    _flip_byte(weights)
    load_manifest(bundle_copy)  # same size: passes the always-on check
    with pytest.raises(SpecdeployError, match="is damaged"):
        specdeploy.load(bundle_copy, verify=True)
    runner = CliRunner()
    result = runner.invoke(main, ["run", str(bundle_copy), "--prompt", "x", "--max-new-tokens", "2", "--verify"])
    assert result.exit_code == 2 and "is damaged" in result.output
    result = runner.invoke(main, ["bench", str(bundle_copy), "--max-new-tokens", "2", "--verify"])
    assert result.exit_code == 2 and "is damaged" in result.output
    with open(weights, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(SpecdeployError, match="bytes, the manifest says"):
        specdeploy.load(bundle_copy)
    weights.unlink()
    result = runner.invoke(main, ["run", str(bundle_copy), "--prompt", "x"])
    assert result.exit_code == 2 and "is missing" in result.output
