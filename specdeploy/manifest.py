"""The bundle manifest (`specdeploy.json`) as data: its dataclasses and each field's rules.

The contract between export and runtime. Parsing it is one strict step: every field's type and
range (the annotations and `schema` metadata below), then the cross-field rules
(manifest_rules.py), all before a model is opened or a buffer allocated. `specdeploy.bundle` checks
the folder around it (the files the manifest lists, their sizes and sha256). Nothing here imports
torch, transformers or onnx.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .schema import bounded, one_of, relative_path, sha256_hex, template

# 1: a target and a draft. 2: the draft may be null, a bundle of the target alone (the runtime drafts by
# prompt lookup). Export writes the lowest version that describes the bundle, so every bundle with a
# draft stays readable by hosts that read 1, and such a host refuses a draft-less bundle by its version.
FORMAT_VERSIONS = (1, 2)
FORMAT_VERSION = FORMAT_VERSIONS[-1]  # the newest this specdeploy reads and writes
MANIFEST_NAME = "specdeploy.json"


def format_version_for(has_draft: bool) -> int:
    """The format_version a bundle is written with: 1 with a draft model, 2 without one."""
    return FORMAT_VERSIONS[0] if has_draft else FORMAT_VERSIONS[1]


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
class GgufSpec:
    """A model whose weights are a GGUF file's, its quantized blocks kept as they are (`quantize: gguf`): MatMulNBits
    and GatherBlockQuantized hold llama.cpp's own values (docs/bundle.md states the mapping)."""

    file: str  # the .gguf file's name (`source` has its path at export)
    size: int = bounded(0)
    sha256: str = sha256_hex()  # of the whole file: which weights these are
    kept: dict[str, int] = field(default_factory=dict)  # GGUF type -> tensors kept as their own blocks
    dequantized: dict[str, str] = field(default_factory=dict)  # GGUF tensor -> its type, stored as float32 (no exact form)


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
    quantize: str = one_of("none", "int8", "int4", "gguf")  # gguf: a GGUF file's own blocks (see `gguf`)
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
    # free-form: where the counts that chose vocab_ids came from (export's draft_vocab.py): "counts" is
    # "draft_vocab.json" (a distilled draft's data) or "text" ("files" counted with the target's tokenizer),
    # with "counted_tokens" and "coverage" (the share of them inside the subset); empty: not recorded
    vocab_source: dict[str, Any] = field(default_factory=dict)
    gguf: GgufSpec | None = None  # the GGUF file whose blocks these weights are (quantize gguf)

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
    format_version: int = one_of(*FORMAT_VERSIONS)
    specdeploy_version: str
    created: str
    max_context: int = bounded(2, MAX_CONTEXT)
    target: ModelSpec
    draft: ModelSpec | None  # None (format_version 2): no draft model, the runtime drafts by prompt lookup
    tokenizer: TokenizerSpec
    export_options: dict[str, Any] = field(default_factory=dict)  # free-form: what the export was asked
    tool_versions: dict[str, str] = field(default_factory=dict)  # free-form: package -> version
    genai: GenaiSpec | None = None  # None: no onnxruntime-genai config written (or an older bundle)
    accept: AcceptSpec | None = None  # None: bundles written before the accept graphs

    def model(self, role: str) -> ModelSpec | None:
        return self.target if role == "target" else self.draft

    @property
    def models(self) -> tuple[ModelSpec, ...]:
        """The models the bundle holds: the target, then the draft where it has one."""
        return (self.target,) if self.draft is None else (self.target, self.draft)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (tuples become lists), exactly what specdeploy.json holds."""
        return json.loads(json.dumps(dataclasses.asdict(self)))
