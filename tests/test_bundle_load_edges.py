"""The bundle as a user receives it, checked at load: on copies of the shipped demo bundle (no export, no
torch). Each bad bundle must end as one SpecdeployError (Python) or one `error:` line (CLI) naming the
problem, never as an error from deep inside ONNX Runtime or the standard library, and a load never deletes
what it did not restore."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import specdeploy
from specdeploy.bundle import MANIFEST_NAME, TensorSpec, load_manifest
from specdeploy.defaults import SHIPPED_BUNDLE
from specdeploy.errors import SpecdeployError


@pytest.fixture
def bundle_copy(tmp_path) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(SHIPPED_BUNDLE, copy)
    return copy


def _edit_manifest(bundle: Path, edit) -> None:
    path = bundle / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def _cli(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "specdeploy", *args], capture_output=True, text=True, env=env)


def _flip_byte(path: Path, offset: int, mask: int = 0x40) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def test_a_max_context_beyond_the_fused_graphs_rotary_tables_is_refused_at_load(bundle_copy):
    """The fused graphs' cos_cache/sin_cache hold max_context rows (export/fused.py). A manifest whose
    max_context exceeds them loaded, and the first pass failed inside GroupQueryAttention with ONNX Runtime's
    RuntimeError ('cos_cache dimension 0 shall not be less than total_sequence_length')."""
    def grow(data):
        for where in (data, data["target"], data["draft"]):
            where["max_context"] = 8192  # the graphs' tables hold 2048 positions

    _edit_manifest(bundle_copy, grow)
    with pytest.raises(SpecdeployError, match=r"max_context|rotary|cos_cache|positions"):
        specdeploy.load(bundle_copy, warm_up=False)


def test_verify_names_every_damaged_file_when_one_also_points_outside_the_bundle(bundle_copy, tmp_path):
    """file_problems returned at the first listed file outside the bundle, dropping every damaged file
    found before it and never looking at those after it."""
    manifest = load_manifest(bundle_copy)
    target_weights = bundle_copy / max(manifest.target.files, key=lambda f: f.size).path
    draft_weights = bundle_copy / max(manifest.draft.files, key=lambda f: f.size).path
    _flip_byte(target_weights, 100)  # same sizes: only the hashes can tell
    _flip_byte(draft_weights, 100)
    outside = tmp_path / "outside.jinja"
    template = bundle_copy / "tokenizer" / "chat_template.jinja"
    outside.write_bytes(template.read_bytes())
    template.unlink()
    template.symlink_to(outside)

    result = _cli("verify", str(bundle_copy))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    for damaged in (target_weights, draft_weights):
        assert f"{damaged.relative_to(bundle_copy).as_posix()} is damaged" in lines[0]
    assert "tokenizer/chat_template.jinja resolves to" in lines[0]


def test_a_symlink_loop_in_a_bundle_is_a_specdeploy_error(bundle_copy):
    """Path.resolve() raises RuntimeError('Symlink loop ...') on a loop: load_manifest let it through, so
    specdeploy.load raised RuntimeError and the CLI printed 'error: RuntimeError: Symlink loop ...'."""
    template = bundle_copy / "tokenizer" / "chat_template.jinja"
    template.unlink()
    template.symlink_to(template.name)  # points at itself
    with pytest.raises(SpecdeployError, match="chat_template.jinja"):
        load_manifest(bundle_copy)


def test_a_chat_template_that_is_not_utf8_is_a_specdeploy_error_naming_the_file(bundle_copy):
    """A same-size damaged chat_template.jinja passes the size check; load_chat_template read it with
    read_text() outside any try, so specdeploy.load raised UnicodeDecodeError and the CLI printed
    'error: UnicodeDecodeError: ...' without naming the file."""
    _flip_byte(bundle_copy / "tokenizer" / "chat_template.jinja", 10, mask=0x80)
    with pytest.raises(SpecdeployError, match="chat_template.jinja"):
        specdeploy.load(bundle_copy, warm_up=False)
    result = _cli("inspect", str(bundle_copy))
    assert result.returncode == 2 and "UnicodeDecodeError" not in result.stderr
    assert "chat_template.jinja" in result.stderr


def _strict(constant):
    raise ValueError(f"{constant} is not JSON")


def test_inspect_json_prints_only_json_when_a_manifest_number_overflows(bundle_copy):
    """json.loads reads 1e999 as float('inf') (parse_constant only sees the literal Infinity/NaN), the
    range checks let it through (parity figures are unbounded above), and `inspect --json` then printed
    `Infinity`, which no JSON parser reads."""
    path = bundle_copy / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["target"]["parity"]["prefill_max_abs_diff"] = "__OVERFLOW__"
    path.write_text(json.dumps(data, indent=2).replace('"__OVERFLOW__"', "1e999"))

    result = _cli("inspect", "--json", str(bundle_copy))
    if result.returncode == 0:
        json.loads(result.stdout, parse_constant=_strict)  # strict JSON, or refused below
    else:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "1e999" in lines[0]


@pytest.mark.parametrize("occupant", ["file", "dangling symlink"])
def test_a_load_never_deletes_the_old_bundle_of_an_interrupted_replacement(tmp_path, occupant):
    """An export interrupted between its two renames leaves NAME missing and the old bundle at
    .NAME.old-*. When something that is not a folder is at NAME, read_manifest's recovery did not restore
    the old bundle but clean_leftovers deleted it anyway (a file at NAME), or os.rename raised
    NotADirectoryError (a dangling symlink). A load may put the old bundle back; it must never delete it."""
    old = tmp_path / ".live.old-20260101000000000000"
    shutil.copytree(SHIPPED_BUNDLE, old)
    live = tmp_path / "live"
    if occupant == "file":
        live.write_text("")
    else:
        live.symlink_to(tmp_path / "nowhere")
    with pytest.raises(SpecdeployError):
        load_manifest(live)
    assert (old / MANIFEST_NAME).is_file(), "the only copy of the old bundle was deleted by a load"


def test_tensorrt_profiles_cover_an_eagle_drafts_feature_input():
    """trt_profiles treats every input but input_ids, position_ids and attention_mask as a 4-D past and
    reads shape[3]: an eagle draft's feature input hidden_states [batch, sequence, F] raised IndexError,
    so load(eagle_bundle, device='tensorrt') failed with 'tuple index out of range'."""
    from specdeploy.runtime.session import trt_profiles

    draft = load_manifest(SHIPPED_BUNDLE).draft
    feature = TensorSpec("hidden_states", "float32", ("batch_size", "sequence_length", 320))
    eagle_like = dataclasses.replace(draft, inputs=(draft.inputs[0], feature, *draft.inputs[1:]))
    profiles = trt_profiles(eagle_like, 2048)
    for key in ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes"):
        entry = next(item for item in profiles[key].split(",") if item.startswith("hidden_states:"))
        dims = entry.split(":")[1].split("x")
        assert len(dims) == 3 and dims[0] == "1" and dims[2] == "320", entry


def test_a_weights_file_the_manifest_leaves_out_is_refused_at_load(bundle_copy):
    """The manifest had to list only each model's .onnx: one that left out model.onnx.data loaded and verified
    ('ok'), its weights never size- or hash-checked. Every file a graph reads must be listed."""
    def drop(data):
        data["target"]["files"] = [f for f in data["target"]["files"] if not f["path"].endswith(".onnx.data")]

    _edit_manifest(bundle_copy, drop)
    with pytest.raises(SpecdeployError, match=r"target/model\.onnx\.data.*does not list"):
        specdeploy.load(bundle_copy, warm_up=False)
