"""A bundle folder on disk: its manifest read and written, every file it lists checked.

A bundle is a folder:

    BUNDLE/specdeploy.json   the manifest (specdeploy.manifest: its dataclasses and rules)
    BUNDLE/target/           the target model's ONNX file(s)
    BUNDLE/draft/            the draft model's ONNX file(s), where the bundle has one
    BUNDLE/tokenizer/        tokenizer.json and its config
    BUNDLE/accept/           the accept step as ONNX graphs (greedy.onnx, sampled.onnx)
    BUNDLE/genai_config.json the same folder as an onnxruntime-genai model (see GenaiSpec)

The export stage writes it, the runtime (or a C++ host) reads it: the manifest first, then each
listed file's place and size (and, asked to, its sha256), then, as each session is created, its
graph's inputs and outputs against the manifest's. The manifest's names are importable from here
too, as every module of the package imports them.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import swap
from .errors import SpecdeployError
from .manifest import (FORMAT_VERSION, FORMAT_VERSIONS, ITEMSIZE, KV_DTYPES, MANIFEST_NAME, MAX_CONTEXT, MAX_MANIFEST_BYTES, MAX_VOCAB,
                       ONNX_TYPES, ROLES, TENSOR_DTYPES, TOKENIZER_HOST_STATUSES, AcceptGraphSpec, AcceptSpec, EagleSpec, FileEntry,
                       GenaiSpec, GgufSpec, HostTokenizerCheck, KVCacheSpec, Manifest, ModelSpec, ParityReport, TensorSpec,
                       TokenizerSpec, format_version_for)
from .manifest_rules import kv_cache_bytes, manifest_from_dict, read_manifest_file, validate_manifest

__all__ = ["FORMAT_VERSION", "FORMAT_VERSIONS", "ITEMSIZE", "KV_DTYPES", "MANIFEST_NAME", "MAX_CONTEXT", "MAX_MANIFEST_BYTES", "MAX_VOCAB",
           "ONNX_TYPES", "ROLES", "TENSOR_DTYPES", "TOKENIZER_HOST_STATUSES", "AcceptGraphSpec", "AcceptSpec", "EagleSpec", "FileEntry",
           "GenaiSpec", "GgufSpec", "HostTokenizerCheck", "KVCacheSpec", "Manifest", "ModelSpec", "ParityReport", "TensorSpec",
           "TokenizerSpec", "check_graph_io", "file_entry", "file_problems", "format_version_for", "kv_cache_bytes", "listed_files",
           "load_manifest", "manifest_from_dict", "read_manifest", "read_manifest_file", "save_manifest", "sha256_file",
           "validate_manifest"]


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


def check_graph_io(spec: ModelSpec, graph_inputs, graph_outputs) -> None:
    """The manifest's tensors against a session's (ONNX Runtime NodeArgs: .name, .type, .shape).

    Called when a session is created, so a manifest that disagrees with its graph fails with one
    line naming the tensor, not later inside a run."""
    listed = {"input": {t.name: t for t in spec.inputs}, "output": {t.name: t for t in spec.outputs}}
    for kind, args in (("input", graph_inputs), ("output", graph_outputs)):
        graph = {arg.name: arg for arg in args}
        for name in graph.keys() - listed[kind].keys():
            if kind == "input":
                raise SpecdeployError(f"bundle does not match its graph: the {spec.role} graph needs the input '{name}', "
                                      "which the manifest does not list")
        for name, tensor in listed[kind].items():
            arg = graph.get(name)
            if arg is None:
                raise SpecdeployError(f"bundle does not match its graph: the {spec.role} graph has no {kind} '{name}'")
            dtype = ONNX_TYPES.get(arg.type, arg.type)
            shape = [d if isinstance(d, int) else None for d in arg.shape]
            mismatch = len(shape) != len(tensor.shape) or any(
                isinstance(m, int) and isinstance(g, int) and m != g for m, g in zip(tensor.shape, shape))
            if dtype != tensor.dtype or mismatch:
                raise SpecdeployError(
                    f"bundle does not match its graph: the {spec.role} {kind} '{name}' is {dtype} {_dims(arg.shape)} "
                    f"in the graph, {tensor.dtype} {_dims(tensor.shape)} in the manifest")


def _dims(shape) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) else "?" for d in shape) + "]"


def read_manifest(bundle_dir: str | Path) -> Manifest:
    """BUNDLE/specdeploy.json, parsed and validated; no other file is read."""
    bundle_dir = Path(bundle_dir)
    # An export interrupted mid-replacement may have left the bundle aside: swap puts it back.
    if not bundle_dir.is_dir() and not swap.recover_missing(bundle_dir):
        raise SpecdeployError(f"bundle not found: {bundle_dir} is not a folder (create one with 'specdeploy export')")
    path = bundle_dir / MANIFEST_NAME
    if not path.is_file():
        raise SpecdeployError(f"not a specdeploy bundle: {path} is missing")
    return read_manifest_file(path)


def listed_files(manifest: Manifest) -> tuple[FileEntry, ...]:
    """Every file the manifest lists: each model, the tokenizer, the accept graphs, the genai configs."""
    extra = [*(manifest.accept.files if manifest.accept else ()), *(manifest.genai.files if manifest.genai else ())]
    return (*(entry for spec in manifest.models for entry in spec.files), *manifest.tokenizer.files, *extra)


def file_problems(bundle_dir: Path, manifest: Manifest, hashes: bool) -> list[str]:
    """What is wrong with the files the manifest lists: outside the bundle, missing, another size, or
    (hashes) another sha256. Empty when the bundle is whole."""
    root = Path(bundle_dir).resolve()
    problems = []
    for entry in listed_files(manifest):
        try:
            path = (root / entry.path).resolve()  # symlinks followed: the file read is the file checked
        except (RuntimeError, OSError) as exc:  # a symlink loop
            problems.append(f"{entry.path} cannot be resolved ({exc})")
            continue
        if not path.is_relative_to(root):
            problems.append(f"{entry.path} resolves to {path}, outside the bundle")  # never opened, never hashed
        elif not path.is_file():
            problems.append(f"{entry.path} is missing")
        elif path.stat().st_size != entry.size:
            problems.append(f"{entry.path} has {path.stat().st_size} bytes, the manifest says {entry.size}")
        elif hashes and sha256_file(path) != entry.sha256:
            problems.append(f"{entry.path} is damaged (its sha256 differs from the manifest's)")
    return problems


def load_manifest(bundle_dir: str | Path, verify: bool = False) -> Manifest:
    """Read and validate `BUNDLE/specdeploy.json` and check every listed file's place and size;
    verify: also re-hash every file (sha256) and compare."""
    manifest = read_manifest(bundle_dir)
    problems = file_problems(Path(bundle_dir), manifest, hashes=verify)
    if problems:
        raise SpecdeployError(f"bundle {bundle_dir} is corrupt: " + "; ".join(problems))
    return manifest
