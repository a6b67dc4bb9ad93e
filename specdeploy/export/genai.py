"""The bundle as an onnxruntime-genai model folder: its genai_config.json, written from the manifest.

onnxruntime-genai (Python, C, C++, C# and Java APIs; CPU, CUDA, DirectML and ARM builds) loads a folder
that holds a genai_config.json. The fused graph is the graph its model builder emits for the Llama
family (GroupQueryAttention, `past_key_values.%d.key` -> `present.%d.key`, the valid length read from
`attention_mask`), so a config describing it is all genai needs:

    BUNDLE/genai_config.json          model.decoder = target/model.onnx, model.draft = draft/model.onnx,
                                      speculative.max_draft_tokens = K: og.Model(BUNDLE) decodes speculatively
    BUNDLE/target/genai_config.json   the target alone: og.Model(BUNDLE/target)

A bundle without a draft model gets the target-only config alone (no speculative section); the
manifest's genai.unsupported says so.

Field names are those of onnxruntime-genai's src/config.h (0.18), whose parser rejects unknown ones.
Model paths are relative to the config's folder and may not go through '..', hence the target-only
config beside the target's model.onnx. genai reads the tokenizer beside the config, so each folder
gets copies of the tokenizer files.

optimum's graphs run too (position_ids as an input, `present = Concat(past, new)`), but only with
genai's growing cache: `past_present_share_buffer` is one search option for both models, so it is on
only when every model in the config has the fused graph. Model types outside GENAI_MODEL_TYPES get
no config; the manifest says why.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

from ..bundle import FileEntry, GenaiSpec, Manifest, ModelSpec, file_entry

GENAI_CONFIG = "genai_config.json"
MAX_DRAFT_TOKENS = 4  # K, as `specdeploy run` drafts by default
# Transformers model type -> genai's model.type, for the types whose greedy tokens under onnxruntime-genai
# are checked against `specdeploy run`: the fused family and GPT-2 (optimum's graph). genai's "gpt2" is
# the older graph with one combined past per layer; optimum's GPT-2 keeps keys and values apart, which is
# genai's generic "decoder". genai knows more types; others are not claimed. Gemma 3's fused graph keeps
# every layer's cache at the full context and masks the sliding layers itself (GroupQueryAttention's
# local_window_size), so its config has no `sliding_window` block: genai's builder writes one for its
# own graph, whose sliding layers keep window-sized caches, and genai then sizes those caches to the window.
GENAI_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "phi3": "phi3", "gpt2": "decoder",
                     "gemma3_text": "gemma3_text"}

# Every model's session options; intra-op threads are left to ONNX Runtime (one per physical core).
# No CPU arena, as the Python runtime (see SessionConfig).
SESSION_OPTIONS: dict[str, Any] = {
    "log_id": "onnxruntime-genai",
    "inter_op_num_threads": 1,
    "enable_cpu_mem_arena": False,
    "provider_options": [],
}
# The speculative config's draft and target run one after the other, each in a session with its own
# intra-op pool: spinning threads of the idle pool would take the cores the busy one needs, so both
# stop spinning there. A target alone keeps ONNX Runtime's spinning, which is faster for one session.
NO_SPINNING = {"session.intra_op.allow_spinning": "0"}


def write_genai_config(manifest: Manifest, root: Path) -> Manifest:
    """Write the onnxruntime-genai configs the bundle's graphs allow; return the manifest with its genai section.

    root: the bundle folder, already holding the models and the tokenizer the manifest lists."""
    target_problem = _unsupported(manifest.target)
    if target_problem is not None:
        return dataclasses.replace(manifest, genai=GenaiSpec(None, None, MAX_DRAFT_TOKENS, (), target_problem))
    target_only = PurePosixPath(manifest.target.onnx_path).parent.as_posix()  # beside the target's model.onnx
    files = _write(root, root / target_only, _config(manifest, target_only, draft=False), manifest)
    draft_problem = _unsupported(manifest.draft) if manifest.draft is not None else "the bundle has no draft model"
    speculative = None
    if draft_problem is None:
        files += _write(root, root, _config(manifest, ".", draft=True), manifest)
        speculative = "."
    genai = GenaiSpec(speculative=speculative, target_only=target_only, max_draft_tokens=MAX_DRAFT_TOKENS,
                      files=tuple(sorted(files, key=lambda entry: entry.path)),
                      unsupported=None if draft_problem is None else f"{draft_problem}; only the target-only config is written")
    return dataclasses.replace(manifest, genai=genai)


def _unsupported(spec: ModelSpec) -> str | None:
    """Why the bundle describes this model to onnxruntime-genai no further (None: it does)."""
    if spec.kind == "eagle":
        return "the draft is an eagle head over the target's features, which onnxruntime-genai does not run"
    if spec.vocab_ids is not None:
        return "the draft's logits cover a vocabulary subset, which onnxruntime-genai does not widen"
    if spec.role == "target" and not spec.eos_token_ids:
        return "the target states no EOS token, which onnxruntime-genai's config needs"
    if spec.model_type not in GENAI_MODEL_TYPES:
        return (f"the {spec.role}'s model type '{spec.model_type}' is not one specdeploy checks under "
                f"onnxruntime-genai ({', '.join(sorted(GENAI_MODEL_TYPES))})")
    return None


def _config(manifest: Manifest, folder: str, draft: bool) -> dict[str, Any]:
    """genai_config.json for a config that sits in `folder` (relative to the root), with or without the draft."""
    target = manifest.target
    eos = list(target.eos_token_ids)
    model: dict[str, Any] = {
        "type": GENAI_MODEL_TYPES[target.model_type],
        "bos_token_id": target.bos_token_id if target.bos_token_id is not None else eos[0],
        "eos_token_id": eos,
        "pad_token_id": target.pad_token_id if target.pad_token_id is not None else eos[0],
        "vocab_size": target.vocab_size,
        "context_length": manifest.max_context,
        "decoder": _decoder(target, _relative(target.onnx_path, folder), spinning=not draft),
    }
    models = (target, manifest.draft) if draft else (target,)
    shared = all(spec.kv_cache.shared_buffer for spec in models)
    config: dict[str, Any] = {"model": model, "search": _search(manifest.max_context, shared)}
    if draft:
        model["draft"] = _decoder(manifest.draft, _relative(manifest.draft.onnx_path, folder), spinning=False)
        # min_adaptive_k 0 and no cooldown: K drafts every round, as `specdeploy run -k K`.
        config["speculative"] = {"max_draft_tokens": MAX_DRAFT_TOKENS, "min_adaptive_k": 0, "cooldown": False}
    return config


def _decoder(spec: ModelSpec, filename: str, spinning: bool) -> dict[str, Any]:
    """One model.decoder / model.draft block: the graph's file, shapes and I/O names."""
    kv = spec.kv_cache
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if "position_ids" in spec.input_names:  # optimum's graphs; the fused graph derives positions from the mask
        inputs["position_ids"] = "position_ids"
    return {
        "filename": filename,
        "session_options": dict(SESSION_OPTIONS) if spinning else {**SESSION_OPTIONS, **NO_SPINNING},
        "head_size": spec.head_dim,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "inputs": {**inputs, "past_key_names": kv.past_key, "past_value_names": kv.past_value},
        "outputs": {"logits": "logits", "present_key_names": kv.present_key, "present_value_names": kv.present_value},
    }


def _search(max_context: int, shared_buffer: bool) -> dict[str, Any]:
    """Greedy defaults a caller overrides per request; a caller who turns sampling on gets top_k 50, as
    genai's model builder writes for a model without sampling defaults (top_k 1 kept it greedy).

    shared_buffer: every model has the fused graph, so the KV cache can be one max_length buffer per
    layer written in place (optimum's graph concatenates, and genai then grows the cache instead)."""
    return {
        "do_sample": False,
        "max_length": max_context,
        "min_length": 0,
        "num_beams": 1,
        "num_return_sequences": 1,
        "past_present_share_buffer": shared_buffer,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_k": 50,
        "top_p": 1.0,
    }


def _relative(path: str, folder: str) -> str:
    """A root-relative model path as seen from folder (a parent of it: genai refuses '..')."""
    if folder == ".":
        return path
    prefix = folder.rstrip("/") + "/"
    assert path.startswith(prefix), f"{path} is not under {folder}"
    return path[len(prefix):]


def _write(root: Path, folder: Path, config: dict[str, Any], manifest: Manifest) -> list[FileEntry]:
    """genai_config.json and copies of the tokenizer files into folder; their manifest entries."""
    path = folder / GENAI_CONFIG
    path.write_text(json.dumps(config, indent=2) + "\n")
    entries = [file_entry(root, path)]
    for entry in manifest.tokenizer.files:  # a copy has its source's bytes: its hash and size are known
        copy = folder / Path(entry.path).name
        shutil.copy2(root / entry.path, copy)
        entries.append(dataclasses.replace(entry, path=copy.relative_to(root).as_posix()))
    return entries
