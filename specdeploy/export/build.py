"""One model of a bundle: its graph built from its source, optimized (fp16, int8 / int4) and checked against PyTorch.

The pipeline (pipeline.py) calls `build_model` once per role; everything it reads and decides about the one
model lives here: the graph it takes (fused or optimum's), the weights it keeps (config.weights_for), what
its manifest entry says, and whether its parity figures pass.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from ..bundle import GgufSpec, ModelSpec, ParityReport, file_entry
from ..errors import SpecdeployError
from . import checkpoint as ckpt, convert, eagle, fused, quantize as quantization
from .config import ExportConfig, Reporter
from .parity import check_parity, overall_agreement, worst_abs_diff

def choose_graph(model, role: str, requested: str, max_context: int) -> str:
    if requested == "optimum":
        return "optimum"
    reason = fused.unsupported_reason(model, max_context)
    if reason is None:
        return "fused"
    if requested == "fused":
        raise SpecdeployError(f"--graph fused cannot export the {role}: {reason} (use --graph auto or optimum)")
    return "optimum"


def model_spec(role: str, checkpoint: ckpt.Checkpoint, onnx_path: Path, root: Path, config: ExportConfig,
                max_context: int, num_parameters: int, graph: str, quantize: str) -> ModelSpec:
    inputs, outputs, kv = convert.describe_io(onnx_path, shared_buffer=graph == "fused")
    past = next(t for t in inputs if t.name == kv.past_key % 0)
    hf = checkpoint.config
    num_layers = sum(1 for t in inputs if t.name.startswith("past_key_values.") and t.name.endswith(".key"))
    files = tuple(file_entry(root, p) for p in sorted(onnx_path.parent.iterdir()) if p.is_file())
    logits = next(t for t in outputs if t.name == "logits")
    return ModelSpec(
        role=role,
        onnx_path=onnx_path.relative_to(root).as_posix(),
        files=files,
        source=checkpoint.source or str(checkpoint.path),
        architecture=(getattr(hf, "architectures", None) or [type(hf).__name__])[0],
        model_type=hf.model_type,
        num_parameters=num_parameters,
        num_layers=num_layers,
        num_attention_heads=int(getattr(hf, "num_attention_heads", 0) or getattr(hf, "n_head", 0)),
        num_kv_heads=int(past.shape[1]),
        head_dim=int(past.shape[3]),
        hidden_size=int(getattr(hf, "hidden_size", 0) or getattr(hf, "n_embd", 0)),
        vocab_size=int(logits.shape[-1]) if isinstance(logits.shape[-1], int) else int(hf.vocab_size),
        dtype=config.dtype,
        quantize=quantize,
        max_context=max_context,
        bos_token_id=checkpoint.bos_token_id,
        eos_token_ids=checkpoint.eos_token_ids,
        pad_token_id=checkpoint.pad_token_id,
        graph=graph,
        attention_window=config.draft_window if role == "draft" else None,
        inputs=inputs,
        outputs=outputs,
        kv_cache=kv,
        parity=ParityReport(0, 0, 0, float("nan"), float("nan"), 0.0, 0.0, "pending", 0.0, False),
    )


def build_model(role: str, quantize: str, source, checkpoint, root: Path, config: ExportConfig,
                 max_context: int, num_parameters: int, graph: str, tokenizer_dir: Path, report: Reporter,
                 fallback_to_fp32: bool = False, shape: eagle.GraphShape = eagle.GraphShape(),
                 keep_blocks: bool = False) -> ModelSpec:
    """Export one model into root/role, optimize it, and measure its parity (the spec carries the figures).

    fallback_to_fp32 (the draft under --draft-quantize auto): if quantizing fails, or the quantized
    model fails its parity check, the fp32 export made just before is kept instead. The draft's
    numbers never reach the output, so that only costs speed."""
    report("export", f"{role}: {num_parameters / 1e6:.1f}M parameters -> ONNX ({graph} graph)")
    model_dir = root / role
    model_dir.mkdir()
    onnx_path = _export_graph(role, source, model_dir, config, max_context, graph, shape, keep_blocks)
    gguf_spec = _gguf_spec(source, report, role) if keep_blocks else None
    if quantize == "gguf" and gguf_spec is not None and not gguf_spec.kept:
        quantize = "none"  # a float GGUF: nothing was quantized, the graph is fp32
    if config.dtype == "fp16":
        report("optimize", f"{role}: fp16")
        convert.convert_fp16(onnx_path)
    if quantize in ("none", "gguf") and graph == "optimum" and config.dtype == "fp32":
        convert.externalize(onnx_path)  # the other paths save the weights beside the graph themselves

    def validate(quantized: str) -> ModelSpec:
        spec = model_spec(role, checkpoint, onnx_path, root, config, max_context, num_parameters, graph, quantized)
        spec = dataclasses.replace(shape.describe(spec, root, int(checkpoint.config.vocab_size)), gguf=gguf_spec)
        report("validate", f"{role}: ONNX Runtime vs PyTorch")
        head = shape.head if shape.eagle is not None else None
        return dataclasses.replace(spec, parity=check_parity(source.reference, onnx_path, spec,
                                                             tokenizer_dir / "tokenizer.json", checkpoint.config,
                                                             columns=shape.vocab_ids, eagle_head=head))

    if quantize in ("none", "gguf"):
        return validate(quantize)
    backup = None
    if fallback_to_fp32:
        if graph == "optimum":
            convert.externalize(onnx_path)
        backup = root.parent / f"{role}-fp32"
        shutil.copytree(model_dir, backup)
    report("optimize", f"{role}: {quantize} weight-only (MatMulNBits)")
    try:
        quantization.quantize_weights(onnx_path, bits=int(quantize[3:]))
        spec = validate(quantize)
        problem = None if spec.parity.passed else f"fails its parity check ({parity_failure(spec.parity)})"
    except Exception as exc:  # noqa: BLE001 - with a fallback, any failure of the quantized model falls back
        if backup is None:
            raise
        problem = f"failed ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    if backup is None or problem is None:
        return spec
    report("optimize", f"{role}: {quantize} {problem}; keeping fp32")
    shutil.rmtree(model_dir)
    backup.rename(model_dir)
    return validate("none")


def _export_graph(role: str, source, model_dir: Path, config: ExportConfig, max_context: int, graph: str,
                  shape: eagle.GraphShape, keep_blocks: bool) -> Path:
    """The model's fp32 graph in model_dir (its weights beside it).

    source (sources.py) gives the model for each stage that reads it, let go after: a safetensors
    checkpoint is memory-mapped (loading it again costs a fraction of a second), and its pages,
    once read, stay resident for as long as the model lives; held from export to parity, they would
    sit under quantization and under ONNX Runtime's own copy of the weights. A GGUF is read one
    tensor at a time, its quantized blocks kept as they are where keep_blocks (quantize gguf, or an
    eagle draft over such a target)."""
    if graph == "fused":  # shape: the target's feature output, the draft's kind and head rows
        weights = source.weights(keep_blocks=keep_blocks)
        onnx_path = shape.build(weights, model_dir / convert.ONNX_NAME, max_context,
                                config.draft_window if role == "draft" else None)
        del weights
    else:
        model = source.load()
        onnx_path = convert.export_onnx(model, model_dir, config.opset)
        del model
    convert.release_freed_memory()
    return onnx_path


def _gguf_spec(source, report: Reporter, role: str) -> GgufSpec | None:
    """What the graph kept of a GGUF's blocks and what it dequantized (named in the progress and the manifest)."""
    use = source.gguf.use if getattr(source, "gguf", None) is not None else None
    if use is None:
        return None
    kept = use.kept_types()
    if kept:
        report("export", f"{role}: kept the GGUF's own blocks: " + ", ".join(f"{k} x{n}" for k, n in kept.items()))
    if use.dequantized:
        report("export", f"{role}: dequantized to fp32 (no exact ONNX Runtime form): "
               + ", ".join(f"{name} ({kind})" for name, kind in use.dequantized.items()))
    return GgufSpec(file=source.path.name, size=source.path.stat().st_size, sha256=source.sha256(), kept=kept,
                    dequantized=dict(use.dequantized))


def parity_failure(parity: ParityReport) -> str:
    if parity.check == "max_abs_diff":
        return f"max |diff| {worst_abs_diff(parity.prefill_max_abs_diff, parity.verify_max_abs_diff):.2e} > {parity.tolerance:g}"
    agreement = overall_agreement(parity.prefill_tokens, parity.prefill_greedy_agreement, parity.verify_tokens,
                                  parity.verify_greedy_agreement)
    return (f"greedy agreement with fp32 {agreement:.3f} < {parity.tolerance:g} over "
            f"{parity.prefill_tokens + parity.verify_tokens} tokens")
