"""The strict manifest: every field's type and range, paths that stay inside the bundle, the graph
checked against the manifest at session creation, and a fuzzed loader that only ever loads or
raises SpecdeployError."""

import json
import shutil
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdeploy.bundle import MANIFEST_NAME, Manifest, load_manifest, manifest_from_dict
from specdeploy.errors import SpecdeployError


@pytest.fixture(scope="module")
def real_manifest(bundles) -> dict:
    return json.loads((bundles("llama") / MANIFEST_NAME).read_text())


@pytest.fixture
def bundle_copy(bundles, tmp_path) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(bundles("llama"), copy)
    return copy


def _rewrite(bundle: Path, edit) -> None:
    path = bundle / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _set(path: str, value):
    def edit(data):
        *parents, last = path.split(".")
        for key in parents:
            data = data[int(key)] if isinstance(data, list) else data[key]
        if isinstance(data, list):
            data[int(last)] = value
        else:
            data[last] = value
    return edit


BAD_FIELDS = [
    ("max_context", "2048", "'max_context' must be an integer"),
    ("max_context", True, "'max_context' must be an integer"),
    ("max_context", 1, "'max_context' must be in 2.."),
    ("target.max_context", 10**12, "'target.max_context' must be in 2.."),
    ("target.kv_cache.past_key", "past_key_values.key", "must contain exactly one %d"),
    ("target.kv_cache.present_value", "present.%d.%s", "must contain exactly one %d"),
    ("draft.kv_cache.dtype", "float8", "'draft.kv_cache.dtype' must be one of"),
    ("target.num_layers", 0, "'target.num_layers' must be in 1.."),
    ("target.num_layers", 3, "inputs for num_layers 3"),
    ("target.vocab_size", -1, "'target.vocab_size' must be in 1.."),
    ("target.eos_token_ids", [1, 99999], "token id 99999 is outside the vocabulary"),
    ("target.eos_token_ids", "1", "'target.eos_token_ids' must be a list"),
    ("target.inputs.0.shape", [1, "x", None], "'target.inputs[0].shape[2]'"),
    ("target.files.0.sha256", "abc", "must be 64 lowercase hex digits"),
    ("target.files.0.size", -3, "'target.files[0].size' must be in 0.."),
    ("target.dtype", "int8", "'target.dtype' must be one of fp32, fp16"),
    ("target.graph", "magic", "'target.graph' must be one of"),
    ("target.role", "draft", "'target.role' is 'draft'"),
    ("tokenizer", [], "'tokenizer' must be an object"),
    ("target.surprise", 1, "unknown field 'target.surprise'"),
    ("tool_versions.numpy", 2, "'tool_versions.numpy' must be a string"),
]


@pytest.mark.parametrize("field, value, message", BAD_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v, _ in BAD_FIELDS])
def test_bad_field_types_and_ranges_are_refused(real_manifest, field, value, message):
    data = json.loads(json.dumps(real_manifest))
    _set(field, value)(data)
    with pytest.raises(SpecdeployError, match=message.replace("[", r"\[").replace("]", r"\]").replace("..", r"\.\.")):
        manifest_from_dict(data)


def test_kv_caches_beyond_physical_memory_are_refused_before_allocation(real_manifest):
    data = json.loads(json.dumps(real_manifest))
    for key in ("target", "draft"):
        data[key]["max_context"] = 1 << 20
        data[key]["num_layers"] = data[key]["num_layers"]
        data[key]["num_kv_heads"] = 4096
        for tensor in data[key]["inputs"] + data[key]["outputs"]:
            if tensor["name"].startswith(("past", "present")):
                tensor["shape"][1] = 4096
    data["max_context"] = 1 << 20
    tracemalloc.start()
    with pytest.raises(SpecdeployError, match="KV caches for max_context 1048576 need .* GiB, more than"):
        manifest_from_dict(data)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 5 << 20


@pytest.mark.parametrize("field, value, message", [
    ("target.onnx_path", "/etc/passwd", "must be a relative"),
    ("target.onnx_path", "../outside.onnx", "must stay inside the bundle"),
    ("tokenizer.path", "tokenizer/../..", "must stay inside the bundle"),
    ("target.files.0.path", "C:/model.onnx", "must stay inside the bundle"),
    ("target.onnx_path", "target/other.onnx", "is not listed in 'target.files'"),
    ("tokenizer.path", "target", "'target/tokenizer.json' is not listed"),
])
def test_paths_are_relative_and_listed(real_manifest, field, value, message):
    data = json.loads(json.dumps(real_manifest))
    _set(field, value)(data)
    with pytest.raises(SpecdeployError, match=message):
        manifest_from_dict(data)


def test_a_symlink_out_of_the_bundle_is_never_opened(bundle_copy, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the bundle")
    manifest = load_manifest(bundle_copy)
    entry = manifest.tokenizer.files[-1]
    (bundle_copy / entry.path).unlink()
    (bundle_copy / entry.path).symlink_to(secret)
    with pytest.raises(SpecdeployError, match=f"{entry.path} resolves to .*secret.txt, outside the bundle"):
        load_manifest(bundle_copy, verify=True)


def test_graph_disagreeing_with_its_manifest_fails_at_session_creation(bundle_copy):
    from specdeploy.runtime.engine import OrtEngine

    def grow_vocab(data):  # consistent on paper (vocab and logits agree), wrong against the graph
        for key in ("target", "draft"):
            data[key]["vocab_size"] += 16
            next(t for t in data[key]["outputs"] if t["name"] == "logits")["shape"][-1] += 16

    _rewrite(bundle_copy, grow_vocab)
    manifest = load_manifest(bundle_copy)
    with pytest.raises(SpecdeployError, match=r"the target output 'logits' is float32 \[\?, \?, 384\] in the graph, "
                                              r"float32 \[\?, \?, 400\] in the manifest"):
        OrtEngine(bundle_copy / manifest.target.onnx_path, manifest.target)


def test_graph_input_missing_from_the_manifest_is_named(bundle_copy):
    from specdeploy.runtime.engine import OrtEngine

    def drop_mask(data):
        data["target"]["inputs"] = [t for t in data["target"]["inputs"] if t["name"] != "attention_mask"]

    _rewrite(bundle_copy, drop_mask)
    manifest = load_manifest(bundle_copy)
    with pytest.raises(SpecdeployError, match="the target graph needs the input 'attention_mask', which the manifest"):
        OrtEngine(bundle_copy / manifest.target.onnx_path, manifest.target)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=30,
)


def _paths(node, prefix=()):
    """Every (container path) in a JSON tree, for picking a place to mutate."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from _paths(child, prefix + (key,))


def _load_or_refuse(folder: Path, text: str) -> None:
    (folder / MANIFEST_NAME).write_text(text)
    tracemalloc.start()
    try:
        result = load_manifest(folder)
        assert isinstance(result, Manifest)
    except SpecdeployError:
        pass  # the only exception a bad manifest may raise
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB allocated while loading a {len(text)}-byte manifest"


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])


@FUZZ
@given(document=JSON)
def test_fuzz_random_json(bundle_copy, document):
    _load_or_refuse(bundle_copy, json.dumps(document))


@FUZZ
@given(data=st.data())
def test_fuzz_mutated_real_manifest(bundle_copy, real_manifest, data):
    document = json.loads(json.dumps(real_manifest))
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(document) if p]
        path = data.draw(st.sampled_from(paths))
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        action = data.draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = data.draw(JSON)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8))] = data.draw(JSON)
        else:
            parent.append(data.draw(JSON))
    _load_or_refuse(bundle_copy, json.dumps(document))
