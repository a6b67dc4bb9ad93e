"""The bundle manifest (`specdeploy.json`): the contract between export and runtime.

A bundle is a folder:

    BUNDLE/specdeploy.json   this manifest
    BUNDLE/target/           the target model's ONNX file(s)
    BUNDLE/draft/            the draft model's ONNX file(s)
    BUNDLE/tokenizer/        tokenizer.json and its config
    BUNDLE/genai_config.json the same folder as an onnxruntime-genai model (see GenaiSpec)
    BUNDLE/accept/           the accept step as ONNX graphs (greedy.onnx, sampled.onnx)

The export stage writes it, the runtime (or a C++ host) reads it. Nothing here
imports torch, transformers or onnx.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import SpecdeployError

FORMAT_VERSION = 1
MANIFEST_NAME = "specdeploy.json"
ROLES = ("target", "draft")


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the bundle root, '/'-separated
    sha256: str
    size: int


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64", "float32", "float16"
    shape: tuple[int | str, ...]  # ints are fixed, strings are dynamic axes


@dataclass(frozen=True)
class KVCacheSpec:
    """How past/present tensors are named and laid out (onnxruntime-genai's templates)."""

    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"
    layout: str = "batch,kv_heads,sequence,head_dim"
    dtype: str = "float32"
    # False (optimum's graphs): present = past + new positions, a new tensor every pass.
    # True (the fused graphs): past is a preallocated [batch, kv_heads, max_context, head_dim]
    # buffer, each present output must be bound to its past input's buffer, and the graph writes
    # the new positions in place; `attention_mask` (ones over past + new) gives the valid length
    # (the graph reads its sum: a buffer-wide mask, ones then zeros, gives the same logits).
    shared_buffer: bool = False


@dataclass(frozen=True)
class ParityReport:
    """ONNX Runtime against PyTorch on the same tokens, measured at export time."""

    prefill_tokens: int
    past_tokens: int
    verify_tokens: int
    prefill_max_abs_diff: float
    verify_max_abs_diff: float  # k + 1 tokens on top of a past, against a no-cache PyTorch run
    prefill_greedy_agreement: float
    verify_greedy_agreement: float
    check: str  # "max_abs_diff" (fp32) or "greedy_agreement" (fp16 / quantized)
    tolerance: float
    passed: bool


@dataclass(frozen=True)
class ModelSpec:
    role: str
    onnx_path: str  # relative to the bundle root
    files: tuple[FileEntry, ...]
    source: str
    architecture: str
    model_type: str
    num_parameters: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    dtype: str  # weights: "fp32" | "fp16"
    quantize: str  # "none" | "int8" | "int4"
    max_context: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    kv_cache: KVCacheSpec
    parity: ParityReport
    graph: str = "optimum"  # "fused" (GroupQueryAttention, in-place KV) or "optimum" (optimum's export)
    attention_window: int | None = None  # each query attends to its last this-many positions (None: all)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)


@dataclass(frozen=True)
class TokenizerSpec:
    path: str  # folder relative to the bundle root
    files: tuple[FileEntry, ...]
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None


@dataclass(frozen=True)
class GenaiSpec:
    """The bundle as an onnxruntime-genai model folder: `og.Model(BUNDLE / folder)` loads each variant written.

    Every folder holds a genai_config.json (its model paths relative to it, never through '..') and copies of
    the tokenizer files, where onnxruntime-genai looks for them."""

    speculative: str | None  # folder of the target + draft config, relative to the root ("." is the root); None: not written
    target_only: str | None  # folder of the target-only config; None: not written
    max_draft_tokens: int  # the config's speculative.max_draft_tokens (K)
    files: tuple[FileEntry, ...]  # the configs and tokenizer copies written for it
    unsupported: str | None = None  # why a variant is missing (None: both are written)


@dataclass(frozen=True)
class AcceptGraphSpec:
    path: str  # relative to the bundle root
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class AcceptSpec:
    """The accept step as ONNX graphs (`specdeploy/export/accept.py` states the rule): the verify pass's
    target logits and the draft tokens (sampled: also the draft's probabilities, k + 1 uniforms and the
    settings) -> num_accepted and next_token."""

    opset: int
    processing: tuple[str, ...]  # the sampling settings the sampled graph takes, in the order it applies them
    greedy: AcceptGraphSpec
    sampled: AcceptGraphSpec
    files: tuple[FileEntry, ...]


@dataclass(frozen=True)
class Manifest:
    format_version: int
    specdeploy_version: str
    created: str
    max_context: int
    target: ModelSpec
    draft: ModelSpec
    tokenizer: TokenizerSpec
    export_options: dict[str, Any] = field(default_factory=dict)
    tool_versions: dict[str, str] = field(default_factory=dict)
    genai: GenaiSpec | None = None  # None: exported before bundles carried an onnxruntime-genai config
    accept: AcceptSpec | None = None  # bundles written before the accept graphs have none

    def model(self, role: str) -> ModelSpec:
        return self.target if role == "target" else self.draft

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (tuples become lists), exactly what specdeploy.json holds."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def sha256_file(path: Path) -> str:
    import hashlib  # here, not at the top: it maps libcrypto (3 MB resident) that a runtime never needs

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(root: Path, path: Path) -> FileEntry:
    return FileEntry(path=path.relative_to(root).as_posix(), sha256=sha256_file(path), size=path.stat().st_size)


def save_manifest(manifest: Manifest, bundle_dir: Path) -> Path:
    path = Path(bundle_dir) / MANIFEST_NAME
    path.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    return path


def _build(cls, data: dict[str, Any]):
    """Dataclass from a dict, recursing into the nested dataclasses above."""
    kwargs = {}
    for item in dataclasses.fields(cls):
        if item.name not in data:
            if item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING:
                raise SpecdeployError(f"manifest: '{cls.__name__}' lacks the field '{item.name}'")
            continue
        value = data[item.name]
        if item.name == "files":
            value = tuple(_build(FileEntry, v) for v in value)
        elif item.name in ("inputs", "outputs"):
            value = tuple(_build(TensorSpec, {**v, "shape": tuple(v["shape"])}) for v in value)
        elif item.name == "kv_cache":
            value = _build(KVCacheSpec, value)
        elif item.name == "parity":
            value = _build(ParityReport, value)
        elif item.name in ("target", "draft"):
            value = _build(ModelSpec, value)
        elif item.name == "tokenizer":
            value = _build(TokenizerSpec, value)
        elif item.name == "genai" and value is not None:
            value = _build(GenaiSpec, value)
        elif item.name == "accept" and value is not None:
            value = _build(AcceptSpec, {**value, "processing": tuple(value["processing"])})
        elif item.name in ("greedy", "sampled"):
            value = _build(AcceptGraphSpec, value)
        elif item.name == "eos_token_ids":
            value = tuple(value)
        kwargs[item.name] = value
    return cls(**kwargs)


def manifest_from_dict(data: dict[str, Any]) -> Manifest:
    if not isinstance(data, dict):
        raise SpecdeployError("manifest: expected a JSON object")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise SpecdeployError(
            f"manifest format_version {version!r} is not supported (this specdeploy reads {FORMAT_VERSION}); "
            "re-export the bundle with this version"
        )
    try:
        manifest = _build(Manifest, data)
    except (TypeError, AttributeError, KeyError) as exc:
        raise SpecdeployError(f"manifest is malformed: {exc}") from None
    validate_manifest(manifest)
    return manifest


def validate_manifest(manifest: Manifest) -> None:
    """Cross-field checks a runtime relies on; fail with a message a user can act on."""
    target, draft = manifest.target, manifest.draft
    if target.vocab_size != draft.vocab_size:
        raise SpecdeployError(f"manifest: target vocab_size {target.vocab_size} != draft vocab_size {draft.vocab_size}")
    for spec in (target, draft):
        names = spec.input_names
        for needed in ("input_ids", spec.kv_cache.past_key % 0):
            if needed not in names:
                raise SpecdeployError(f"manifest: the {spec.role} model lacks the input '{needed}'")
        if "logits" not in {t.name for t in spec.outputs}:
            raise SpecdeployError(f"manifest: the {spec.role} model lacks the output 'logits'")
        if spec.max_context < manifest.max_context:
            raise SpecdeployError(f"manifest: the {spec.role} model's max_context is below the bundle's")


def load_manifest(bundle_dir: str | Path, verify_checksums: bool = False) -> Manifest:
    """Read and validate `BUNDLE/specdeploy.json`; optionally check every file's size and sha256."""
    bundle_dir = Path(bundle_dir)
    if not bundle_dir.is_dir():
        raise SpecdeployError(f"bundle not found: {bundle_dir} is not a folder (create one with 'specdeploy export')")
    path = bundle_dir / MANIFEST_NAME
    if not path.is_file():
        raise SpecdeployError(f"not a specdeploy bundle: {path} is missing")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecdeployError(f"manifest {path} is not valid JSON: {exc}") from None
    manifest = manifest_from_dict(data)
    entries = [*manifest.target.files, *manifest.draft.files, *manifest.tokenizer.files,
               *(manifest.genai.files if manifest.genai else ()),
               *(manifest.accept.files if manifest.accept is not None else ())]
    for entry in entries:
        file_path = bundle_dir / entry.path
        if not file_path.is_file():
            raise SpecdeployError(f"bundle is incomplete: {entry.path} is listed in the manifest but missing")
        if file_path.stat().st_size != entry.size:
            raise SpecdeployError(f"bundle is corrupt: {entry.path} has {file_path.stat().st_size} bytes, manifest says {entry.size}")
        if verify_checksums and sha256_file(file_path) != entry.sha256:
            raise SpecdeployError(f"bundle is corrupt: the sha256 of {entry.path} does not match the manifest")
    return manifest
