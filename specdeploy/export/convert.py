"""PyTorch -> ONNX with optimum, saving with external weights, fp16 with onnxruntime's converter (quantization: quantize.py)."""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

from ..bundle import ONNX_TYPES, KVCacheSpec, TensorSpec
from ..errors import SpecdeployError

TASK = "text-generation-with-past"
ONNX_NAME = "model.onnx"
# Above this size the protobuf 2 GB limit needs the weights beside the graph.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


def quiet_export_logs() -> None:
    """Tracer warnings and per-node quantizer logs drown the progress display."""
    warnings.filterwarnings("ignore")
    for name in ("onnxruntime.quantization", "optimum", "transformers", "torch.onnx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()


def release_freed_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the system (glibc's malloc_trim).

    Parsing a GGUF, dequantizing it and reading large tokenizers leave many small freed blocks that
    the allocator keeps for reuse; without this they stay resident for the rest of the export, under
    the peaks that come later (docs/performance.md)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    library = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(library).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to hand back this way
        pass


def load_torch_model(path: Path, role: str, trust_remote_code: bool):
    """The checkpoint in fp32, eager, as PyTorch sees it: the reference for parity."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        raise SpecdeployError(f"--{role} {path}: cannot load the weights: {str(exc).splitlines()[0]}") from None
    return model.eval()


def export_onnx(model, out_dir: Path, opset: int | None = None) -> Path:
    """One graph that serves prefill, single-token decode and k+1-token verify (logits at every position)."""
    from optimum.exporters.onnx import onnx_export_from_model

    raw = out_dir / "optimum"
    try:
        # slim: onnxslim folds the shape bookkeeping, most of the graph's nodes (fewer nodes, faster steps).
        onnx_export_from_model(model, output=raw, task=TASK, opset=opset, do_validation=False, slim=True)
    except Exception as exc:
        raise SpecdeployError(f"optimum could not export {type(model).__name__}: {str(exc).splitlines()[0]}") from None
    for name in (ONNX_NAME, ONNX_NAME + "_data"):
        if (raw / name).exists():
            shutil.move(str(raw / name), out_dir / name)
    shutil.rmtree(raw)
    return out_dir / ONNX_NAME


def weights_path(path: Path) -> Path:
    """Where a model's weights go (path + '.data'), cleared of any earlier data file.

    Cleared because onnx appends to an existing data file; optimum's own name (model.onnx_data)
    goes too."""
    for stale in (path.with_name(path.name + ".data"), path.with_name(path.name + "_data")):
        if stale.exists():
            stale.unlink()
    return path.with_name(path.name + ".data")


def save_model(model_proto, path: Path) -> None:
    """The graph in path, every weight in path + '.data' beside it (one file, 64-byte aligned offsets).

    ONNX Runtime memory-maps external weights and, once it has prepacked them for its kernels, lets
    the mapping go: a model loads in less resident memory this way than with the weights inside
    the protobuf (which is parsed, copied, then prepacked)."""
    import onnx

    data = weights_path(path)
    onnx.save_model(model_proto, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    data.chmod(0o644)  # onnx creates it owner-only; a bundle is for others to read


def externalize(path: Path) -> None:
    """Rewrite an exported model with its weights in one external data file (see save_model)."""
    import onnx

    save_model(onnx.load(path), path)


def convert_fp16(path: Path) -> None:
    """Weights, activations, KV cache and logits in fp16, with onnxruntime's converter."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(path)
    save_model(convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=model.ByteSize() > EXTERNAL_DATA_THRESHOLD), path)


def describe_io(path: Path, shared_buffer: bool = False) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], KVCacheSpec]:
    """Inputs, outputs and KV layout as ONNX Runtime sees them, for the manifest."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # Unpacked, the weights stay mapped from the data file and are never read: a session that only
    # names its I/O costs no memory beside the PyTorch model (packed, it would copy every MatMul weight).
    options.add_session_config_entry("session.disable_prepacking", "1")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def spec(arg) -> TensorSpec:
        dtype = ONNX_TYPES.get(arg.type)
        if dtype is None:
            raise SpecdeployError(f"{path}: unsupported tensor type {arg.type} for '{arg.name}'")
        return TensorSpec(name=arg.name, dtype=dtype, shape=tuple(d if isinstance(d, int) else str(d) for d in arg.shape))

    inputs = tuple(spec(a) for a in session.get_inputs())
    outputs = tuple(spec(a) for a in session.get_outputs())
    kv = KVCacheSpec()
    past = {t.name: t for t in inputs}
    if kv.past_key % 0 not in past or kv.present_key % 0 not in {t.name for t in outputs}:
        raise SpecdeployError(f"{path}: the exported graph has no '{kv.past_key % 0}' -> '{kv.present_key % 0}' KV cache")
    return inputs, outputs, KVCacheSpec(dtype=past[kv.past_key % 0].dtype, shared_buffer=shared_buffer)
