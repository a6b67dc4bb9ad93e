"""The bundle manifest (`specdeploy.json`) as data: its dataclasses, field rules and cross-field rules.

The contract between export and runtime. Parsing it is one strict step: every field's type and
range (the annotations and `schema` metadata below), then the cross-field rules, all before a
model is opened or a buffer allocated. `specdeploy.bundle` checks the folder around it (the files
the manifest lists, their sizes and sha256). Nothing here imports torch, transformers or onnx, nor
touches any file but the manifest's own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import SpecdeployError
from .schema import bounded, build, one_of, relative_path, sha256_hex, template

FORMAT_VERSION = 1
MANIFEST_NAME = "specdeploy.json"
ROLES = ("target", "draft")
MAX_MANIFEST_BYTES = 16 << 20  # a real manifest is a few tens of KB; refuse to parse anything near this
MAX_CONTEXT = 1 << 20  # positions; the KV-memory check below is the real limit on a given machine
MAX_VOCAB = 1 << 24
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "bool")
KV_DTYPES = ("float32", "float16")
ITEMSIZE = {"float32": 4, "float16": 2}
ONNX_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
              "tensor(double)": "float64", "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool"}


@dataclass(frozen=True)
class FileEntry:
    path: str = relative_path()  # relative to the bundle root, '/'-separated
    sha256: str = sha256_hex()
    size: int = bounded(0)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str = one_of(*TENSOR_DTYPES)  # numpy dtype name
    shape: tuple[int | str, ...]  # ints are fixed, strings are dynamic axes


@dataclass(frozen=True)
class KVCacheSpec:
    """How past/present tensors are named and laid out (onnxruntime-genai's templates)."""

    past_key: str = template(default="past_key_values.%d.key")
    past_value: str = template(default="past_key_values.%d.value")
    present_key: str = template(default="present.%d.key")
    present_value: str = template(default="present.%d.value")
    layout: str = one_of("batch,kv_heads,sequence,head_dim", default="batch,kv_heads,sequence,head_dim")
    dtype: str = one_of(*KV_DTYPES, default="float32")
    # False (optimum's graphs): present = past + new positions, a new tensor every pass.
    # True (the fused graphs): past is a preallocated [batch, kv_heads, max_context, head_dim]
    # buffer, each present output must be bound to its past input's buffer, and the graph writes
    # the new positions in place; `attention_mask` (ones over past + new) gives the valid length
    # (the graph reads its sum: a buffer-wide mask, ones then zeros, gives the same logits).
    shared_buffer: bool = False


@dataclass(frozen=True)
class ParityReport:
    """ONNX Runtime against PyTorch on the same tokens, measured at export time."""

    prefill_tokens: int = bounded(0)
    past_tokens: int = bounded(0)
    verify_tokens: int = bounded(0)
    prefill_max_abs_diff: float
    verify_max_abs_diff: float  # k + 1 tokens on top of a past, against a no-cache PyTorch run
    prefill_greedy_agreement: float = bounded(0, 1)
    verify_greedy_agreement: float = bounded(0, 1)
    check: str = one_of("max_abs_diff", "greedy_agreement", "pending")  # fp32 / fp16 or quantized
    tolerance: float = bounded(0)
    passed: bool


DRAFT_KINDS = ("model", "eagle")


@dataclass(frozen=True)
class EagleSpec:
    """An EAGLE-style draft: a head over the target's features (docs/distill.md states its math).

    The target's graph returns, for every position of every pass, the input of its final norm
    (`target_feature`). A draft step at position p reads `feature_input` (the target's feature at p
    for an accepted position, the head's own prediction for one it drafted) with input_ids the token
    at p + 1, on its own KV cache, and returns its predicted feature at p + 1 (`feature_output`)
    and the logits read from it through the target's final norm and LM head, whose weights the draft
    graph holds a copy of (rows `vocab_ids` only, when set)."""

    feature_size: int = bounded(1, 1 << 20)
    target_feature: str = "hidden_states"
    feature_input: str = "hidden_states"
    feature_output: str = "next_hidden_states"
    shares_lm_head: bool = True  # the logits come from copies of the target's final norm and head rows
    trained: dict[str, Any] = field(default_factory=dict)  # free-form: distill.json's summary of the training run


@dataclass(frozen=True)
class ModelSpec:
    role: str = one_of(*ROLES)
    onnx_path: str = relative_path()  # relative to the bundle root; listed in files
    files: tuple[FileEntry, ...]
    source: str
    architecture: str
    model_type: str
    num_parameters: int = bounded(0)
    num_layers: int = bounded(1, 4096)
    num_attention_heads: int = bounded(0, 1 << 16)  # 0: the checkpoint's config did not say
    num_kv_heads: int = bounded(1, 1 << 16)
    head_dim: int = bounded(1, 1 << 16)
    hidden_size: int = bounded(0, 1 << 20)
    vocab_size: int = bounded(1, MAX_VOCAB)
    dtype: str = one_of("fp32", "fp16")  # weights
    quantize: str = one_of("none", "int8", "int4")
    max_context: int = bounded(2, MAX_CONTEXT)
    bos_token_id: int | None = bounded(0, MAX_VOCAB)
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None = bounded(0, MAX_VOCAB)
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    kv_cache: KVCacheSpec
    parity: ParityReport
    # "fused" (GroupQueryAttention, in-place KV) or "optimum" (optimum's export)
    graph: str = one_of("fused", "optimum", default="optimum")
    # each query attends to its last this-many positions (None: all)
    attention_window: int | None = bounded(1, MAX_CONTEXT, default=None)
    # The draft only. model: a causal LM over tokens; eagle: a head over the target's features (see EagleSpec).
    kind: str = one_of(*DRAFT_KINDS, default="model")
    eagle: EagleSpec | None = None
    # The draft's logits cover these token ids only (FR-Spec's frequent tokens): column i is token ids[i].
    # A JSON file listed in files ({"ids": [...], ...}); None: the whole vocabulary. The runtime gives
    # every other token probability zero, so the draft never proposes one; the accept rule is unchanged.
    vocab_ids: str | None = relative_path(default=None)
    vocab_subset: int | None = bounded(1, MAX_VOCAB, default=None)  # len(ids): the logits' last axis

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)


TOKENIZER_HOST_STATUSES = ("ok", "repaired", "unsupported", "not checked")


@dataclass(frozen=True)
class HostTokenizerCheck:
    """How one host's tokenizer library read the bundle's tokenizer.json at export, against HF tokenizers
    (specdeploy/export/tokenizer_hosts.py): the same ids for a fixed sample of text, the same text back."""

    # ok: read alike; repaired: read alike once export rewrote tokenizer.json (reason says how);
    # unsupported: reads it differently (reason: the first difference); not checked: not installed at export
    status: str = one_of(*TOKENIZER_HOST_STATUSES)
    reason: str | None = None
    version: str | None = None  # the host's tokenizer library at export (onnxruntime-genai, @huggingface/tokenizers)
    samples: int = bounded(0, default=0)  # texts compared


@dataclass(frozen=True)
class TokenizerSpec:
    path: str = relative_path()  # folder relative to the bundle root; its tokenizer.json is listed in files
    files: tuple[FileEntry, ...]
    vocab_size: int = bounded(1, MAX_VOCAB)
    bos_token_id: int | None = bounded(0, MAX_VOCAB)
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None = bounded(0, MAX_VOCAB)
    # host ("genai", "node") -> how it read tokenizer.json at export; empty: an older bundle, never checked
    hosts: dict[str, HostTokenizerCheck] = field(default_factory=dict)


@dataclass(frozen=True)
class GenaiSpec:
    """The bundle as an onnxruntime-genai model folder: `og.Model(BUNDLE / folder)` loads each variant written.

    Every folder holds a genai_config.json (its model paths relative to it, never through '..') and copies of
    the tokenizer files, where onnxruntime-genai looks for them."""

    speculative: str | None  # folder of the target + draft config, relative to the root ("." is the root); None: not written
    target_only: str | None  # folder of the target-only config; None: not written
    max_draft_tokens: int = bounded(1, 64)  # the config's speculative.max_draft_tokens (K)
    files: tuple[FileEntry, ...]  # the configs and tokenizer copies written for it
    unsupported: str | None = None  # why a variant is missing (None: both are written)


@dataclass(frozen=True)
class AcceptGraphSpec:
    path: str = relative_path()  # relative to the bundle root; listed in the accept section's files
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class AcceptSpec:
    """The accept step as ONNX graphs (`specdeploy/export/accept.py` states the rule): the verify pass's
    target logits and the draft tokens (sampled: also the draft's probabilities, k + 1 uniforms and the
    settings) -> num_accepted and next_token."""

    opset: int = bounded(1, 1000)
    processing: tuple[str, ...]  # the sampling settings the sampled graph takes, in the order it applies them
    greedy: AcceptGraphSpec
    sampled: AcceptGraphSpec
    files: tuple[FileEntry, ...]


@dataclass(frozen=True)
class Manifest:
    format_version: int = one_of(FORMAT_VERSION)
    specdeploy_version: str
    created: str
    max_context: int = bounded(2, MAX_CONTEXT)
    target: ModelSpec
    draft: ModelSpec
    tokenizer: TokenizerSpec
    export_options: dict[str, Any] = field(default_factory=dict)  # free-form: what the export was asked
    tool_versions: dict[str, str] = field(default_factory=dict)  # free-form: package -> version
    genai: GenaiSpec | None = None  # None: no onnxruntime-genai config written (or an older bundle)
    accept: AcceptSpec | None = None  # None: bundles written before the accept graphs

    def model(self, role: str) -> ModelSpec:
        return self.target if role == "target" else self.draft

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (tuples become lists), exactly what specdeploy.json holds."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def manifest_from_dict(data: Any) -> Manifest:
    """The manifest from parsed JSON: every field's type and range, then the cross-field rules."""
    if not isinstance(data, dict):
        raise SpecdeployError("manifest: expected a JSON object")
    version = data.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise SpecdeployError(
            f"manifest format_version {version!r} is not supported (this specdeploy reads {FORMAT_VERSION}); "
            "re-export the bundle with this version"
        )
    manifest = build(Manifest, data, "")
    validate_manifest(manifest)
    return manifest


def validate_manifest(manifest: Manifest) -> None:
    """Cross-field checks a runtime relies on; fail with a message a user can act on."""
    target, draft, tokenizer = manifest.target, manifest.draft, manifest.tokenizer
    for role in ROLES:
        if manifest.model(role).role != role:
            raise SpecdeployError(f"manifest: '{role}.role' is '{manifest.model(role).role}'")
    if target.vocab_size != draft.vocab_size:
        raise SpecdeployError(f"manifest: target vocab_size {target.vocab_size} != draft vocab_size {draft.vocab_size}")
    if tokenizer.vocab_size > target.vocab_size:
        raise SpecdeployError(f"manifest: the tokenizer's {tokenizer.vocab_size} tokens exceed the models' vocab_size {target.vocab_size}")
    _check_token_ids("tokenizer", tokenizer, target.vocab_size)
    if f"{tokenizer.path}/tokenizer.json" not in {f.path for f in tokenizer.files}:
        raise SpecdeployError(f"manifest: '{tokenizer.path}/tokenizer.json' is not listed in 'tokenizer.files'")
    for spec in (target, draft):
        _check_model(spec)
        if spec.max_context < manifest.max_context:
            raise SpecdeployError(f"manifest: the {spec.role} model's max_context is below the bundle's")
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
    """Both models' KV caches at the bundle's max context (the runtime preallocates them)."""
    return sum(2 * m.num_layers * m.num_kv_heads * m.head_dim * manifest.max_context * ITEMSIZE[m.kv_cache.dtype]
               for m in (manifest.target, manifest.draft))


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
