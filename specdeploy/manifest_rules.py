"""Reading a manifest: every field's type and range (manifest.py's dataclasses), then the cross-field rules a
runtime relies on (the models agree with each other, with the tokenizer and with their own KV templates), and
whether the KV caches fit this machine. Nothing here touches any file but the manifest's own.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .errors import SpecdeployError
from .manifest import (FORMAT_VERSIONS, ITEMSIZE, MAX_MANIFEST_BYTES, ROLES, Manifest, ModelSpec, TensorSpec,
                       format_version_for)
from .schema import build


def manifest_from_dict(data: Any) -> Manifest:
    """The manifest from parsed JSON: every field's type and range, then the cross-field rules."""
    if not isinstance(data, dict):
        raise SpecdeployError("manifest: expected a JSON object")
    version = data.get("format_version")
    if version not in FORMAT_VERSIONS or isinstance(version, bool):
        readable = " and ".join(str(v) for v in FORMAT_VERSIONS)
        raise SpecdeployError(
            f"manifest format_version {version!r} is not supported (this specdeploy reads {readable}); "
            "re-export the bundle with this version"
        )
    if data.get("draft", {}) is None and version < format_version_for(has_draft=False):
        raise SpecdeployError(f"manifest: 'draft' is null, which format_version {version} does not allow "
                              f"(a bundle without a draft is format_version {format_version_for(has_draft=False)})")
    manifest = build(Manifest, data, "")
    validate_manifest(manifest)
    return manifest


def validate_manifest(manifest: Manifest) -> None:
    """Cross-field checks a runtime relies on; fail with a message a user can act on."""
    target, draft, tokenizer = manifest.target, manifest.draft, manifest.tokenizer
    for role in ROLES:
        spec = manifest.model(role)
        if spec is not None and spec.role != role:
            raise SpecdeployError(f"manifest: '{role}.role' is '{spec.role}'")
    if draft is not None and target.vocab_size != draft.vocab_size:
        raise SpecdeployError(f"manifest: target vocab_size {target.vocab_size} != draft vocab_size {draft.vocab_size}")
    if tokenizer.vocab_size > target.vocab_size:
        raise SpecdeployError(f"manifest: the tokenizer's {tokenizer.vocab_size} tokens exceed the models' vocab_size {target.vocab_size}")
    _check_token_ids("tokenizer", tokenizer, target.vocab_size)
    if f"{tokenizer.path}/tokenizer.json" not in {f.path for f in tokenizer.files}:
        raise SpecdeployError(f"manifest: '{tokenizer.path}/tokenizer.json' is not listed in 'tokenizer.files'")
    for spec in manifest.models:
        _check_model(spec)
        if spec.max_context < manifest.max_context:
            raise SpecdeployError(f"manifest: the {spec.role} model's max_context is below the bundle's")
    if draft is not None:
        _check_eagle_pair(target, draft)
    if manifest.accept is not None:
        listed = {f.path for f in manifest.accept.files}
        for graph in (manifest.accept.greedy, manifest.accept.sampled):
            if graph.path not in listed:
                raise SpecdeployError(f"manifest: the accept graph {graph.path} is not listed in 'accept.files'")
    check_kv_memory(manifest)


def _check_token_ids(where: str, spec, vocab_size: int) -> None:
    ids = [*spec.eos_token_ids, *(t for t in (spec.bos_token_id, spec.pad_token_id) if t is not None)]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise SpecdeployError(f"manifest: {where} token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


def _check_model(spec: ModelSpec) -> None:
    """One model's inputs, outputs and KV templates against its own numbers."""
    where = spec.role
    _check_token_ids(where, spec, spec.vocab_size)
    if spec.onnx_path not in {f.path for f in spec.files}:
        raise SpecdeployError(f"manifest: '{where}.onnx_path' {spec.onnx_path} is not listed in '{where}.files'")
    inputs = {t.name: t for t in spec.inputs}
    outputs = {t.name: t for t in spec.outputs}
    if len(inputs) != len(spec.inputs) or len(outputs) != len(spec.outputs):
        raise SpecdeployError(f"manifest: the {where} model lists a tensor name twice")
    kv = spec.kv_cache
    if "input_ids" not in inputs:
        raise SpecdeployError(f"manifest: the {where} model lacks the input 'input_ids'")
    if "logits" not in outputs:
        raise SpecdeployError(f"manifest: the {where} model lacks the output 'logits'")
    _check_draft_fields(spec, inputs, outputs)
    logits = outputs["logits"].shape
    columns = spec.vocab_subset or spec.vocab_size
    if len(logits) != 3 or (isinstance(logits[-1], int) and logits[-1] != columns):
        raise SpecdeployError(f"manifest: the {where} logits shape {list(logits)} disagrees with its {columns} columns "
                              "(vocab_size, or vocab_subset)")
    past_keys = sum(1 for name in inputs if _matches(kv.past_key, name))
    if past_keys != spec.num_layers:
        raise SpecdeployError(f"manifest: the {where} model has {past_keys} '{kv.past_key}' inputs for num_layers {spec.num_layers}")
    for layer in range(spec.num_layers):
        for names, template_ in ((inputs, kv.past_key), (inputs, kv.past_value), (outputs, kv.present_key),
                                 (outputs, kv.present_value)):
            tensor = names.get(template_ % layer)
            if tensor is None:
                raise SpecdeployError(f"manifest: the {where} model lacks '{template_ % layer}'")
            _check_kv_tensor(spec, tensor)
    if spec.graph == "fused" and not kv.shared_buffer:
        raise SpecdeployError(f"manifest: the {where} model is a fused graph without a shared-buffer KV cache")


def _check_draft_fields(spec: ModelSpec, inputs: dict, outputs: dict) -> None:
    """kind, eagle and the vocabulary subset: each with what it needs, and on the draft only."""
    where = spec.role
    if spec.role == "target" and (spec.kind != "model" or spec.eagle or spec.vocab_ids):
        raise SpecdeployError("manifest: 'kind', 'eagle' and 'vocab_ids' describe the draft; the target must not set them")
    if (spec.vocab_ids is None) != (spec.vocab_subset is None):
        raise SpecdeployError(f"manifest: the {where} sets one of 'vocab_ids' and 'vocab_subset' without the other")
    if spec.vocab_source and spec.vocab_ids is None:
        raise SpecdeployError(f"manifest: the {where} sets 'vocab_source' without a vocabulary subset ('vocab_ids')")
    if spec.vocab_ids is not None:
        if spec.vocab_ids not in {f.path for f in spec.files}:
            raise SpecdeployError(f"manifest: '{where}.vocab_ids' {spec.vocab_ids} is not listed in '{where}.files'")
        if spec.vocab_subset > spec.vocab_size:
            raise SpecdeployError(f"manifest: the {where}'s vocab_subset {spec.vocab_subset} exceeds vocab_size {spec.vocab_size}")
    if (spec.kind == "eagle") != (spec.eagle is not None):
        raise SpecdeployError(f"manifest: the {where} is of kind '{spec.kind}' but 'eagle' is "
                              f"{'missing' if spec.eagle is None else 'set'}")
    if spec.eagle is not None:
        for names, name, kind in ((inputs, spec.eagle.feature_input, "input"), (outputs, spec.eagle.feature_output, "output")):
            if name not in names:
                raise SpecdeployError(f"manifest: the eagle draft lacks its feature {kind} '{name}'")
            _check_feature_tensor(names[name], spec.eagle.feature_size, f"the eagle draft's feature {kind}")
        if spec.graph != "fused":
            raise SpecdeployError("manifest: an eagle draft must be a fused graph")


def _check_eagle_pair(target: ModelSpec, draft: ModelSpec) -> None:
    if draft.eagle is None:
        return
    feature = next((t for t in target.outputs if t.name == draft.eagle.target_feature), None)
    if feature is None:
        raise SpecdeployError(f"manifest: the eagle draft reads the target's output '{draft.eagle.target_feature}', "
                              "which the target lacks")
    if target.graph != "fused" or feature.shape[-1] != draft.eagle.feature_size:
        raise SpecdeployError(f"manifest: the target's '{feature.name}' {list(feature.shape)} is not the eagle draft's "
                              f"[batch, sequence, {draft.eagle.feature_size}] from a fused graph")
    _check_feature_tensor(feature, draft.eagle.feature_size, "the target's feature output")


def _check_feature_tensor(tensor: TensorSpec, width: int, what: str) -> None:
    """Feature rows are float32 [batch, sequence, width] (the runtime's feature buffers are float32)."""
    if tensor.dtype != "float32" or len(tensor.shape) != 3 or tensor.shape[-1] != width:
        raise SpecdeployError(f"manifest: {what} '{tensor.name}' is {tensor.dtype} {list(tensor.shape)}, not float32 "
                              f"[batch, sequence, {width}]")


def _matches(template_: str, name: str) -> bool:
    head, tail = template_.split("%d")
    middle = name[len(head) : len(name) - len(tail)] if len(name) > len(head) + len(tail) else ""
    return name.startswith(head) and name.endswith(tail) and middle.isdigit()


def _check_kv_tensor(spec: ModelSpec, tensor: TensorSpec) -> None:
    shape = tensor.shape
    expected = {1: spec.num_kv_heads, 3: spec.head_dim}
    if len(shape) != 4 or any(isinstance(shape[i], int) and shape[i] != n for i, n in expected.items()):
        raise SpecdeployError(f"manifest: the {spec.role} tensor '{tensor.name}' has shape {list(shape)}, not "
                              f"[batch, {spec.num_kv_heads} kv_heads, sequence, {spec.head_dim} head_dim]")
    if tensor.dtype != spec.kv_cache.dtype:
        raise SpecdeployError(f"manifest: the {spec.role} tensor '{tensor.name}' is {tensor.dtype}, the KV cache {spec.kv_cache.dtype}")


def kv_cache_bytes(manifest: Manifest) -> int:
    """Every model's KV cache at the bundle's max context (the runtime preallocates them)."""
    return sum(2 * m.num_layers * m.num_kv_heads * m.head_dim * manifest.max_context * ITEMSIZE[m.kv_cache.dtype]
               for m in manifest.models)


def check_kv_memory(manifest: Manifest, slots: int = 1) -> None:
    """The KV caches of `slots` sequences (a load's max_batch) fit in this machine's memory."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX: no limit known
        return
    needed = slots * kv_cache_bytes(manifest)
    if needed > physical:
        whose = f"max_batch {slots}: the KV caches" if slots > 1 else "manifest: KV caches"
        raise SpecdeployError(f"{whose} for max_context {manifest.max_context} need {needed / 2**30:.1f} GiB, "
                              f"more than this machine's {physical / 2**30:.1f} GiB")


def _not_json(name: str):
    """NaN and Infinity, which Python's json reads and JSON has not (nor other hosts' parsers)."""
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    """A JSON number as a float; one too large for a float (1e999 reads as inf) is refused as NaN is."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of a float's range")
    return value


def read_manifest_file(path: Path) -> Manifest:
    """One specdeploy.json, parsed and validated (a size limit first: it is read whole)."""
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise SpecdeployError(f"manifest {path} has {size} bytes; a manifest is at most {MAX_MANIFEST_BYTES}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_not_json, parse_float=_finite)
    except UnicodeDecodeError as exc:
        raise SpecdeployError(f"manifest {path} is not UTF-8 (byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:
        raise SpecdeployError(f"manifest {path} is not valid JSON: {str(exc)[:200]}") from None
    return manifest_from_dict(data)
