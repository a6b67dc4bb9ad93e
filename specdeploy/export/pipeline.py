"""`specdeploy export`: two checkpoints -> a validated bundle, written atomically.

Stages: load, export, optimize (fp16 / weight-only quantization), validate (parity), write.
Everything is built in a temporary folder beside the output and swapped into place at the end
(see swap.py), so a failure or Ctrl-C leaves nothing behind and an existing bundle untouched.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import __version__, swap
from ..bundle import (FORMAT_VERSION, MAX_CONTEXT, ROLES, FileEntry, Manifest, ModelSpec, ParityReport, TokenizerSpec,
                      file_entry, load_manifest, save_manifest)
from ..errors import SpecdeployError
from . import checkpoint as ckpt, convert, eagle, fused, genai, quantize as quantization
from .special_tokens import check_special_tokens
from .accept import write_accept_graphs
from .parity import check_parity, overall_agreement, worst_abs_diff

DTYPES = ("fp32", "fp16")
GRAPHS = ("auto", "fused", "optimum")
MIN_DRAFT_WINDOW = 64  # parity compares a windowed draft over its window (59 + 5 tokens at the least)
QUANTIZE = ("none", "int8", "int4")
STAGES = ("load", "export", "optimize", "validate", "write")


@dataclass(frozen=True)
class ExportConfig:
    target: str  # checkpoint folder (or a hub id already in the local cache)
    draft: str
    out: str  # the bundle folder to create
    dtype: str = "fp32"  # fp32 | fp16
    quantize: str = "none"  # none | int8 | int4 (weight-only MatMulNBits), both models
    # The draft alone: none | int8 | int4, or auto. The draft's numbers never reach the output (the
    # target verifies every token), so a quantized draft only trades a little acceptance for a
    # cheaper step. auto: int8 when the export is fp32 and unquantized (measured on codepair: draft
    # step 0.38 -> 0.17 ms, speculative greedy 1.12x and sampled 1.14x faster, same output), kept in
    # fp32 if the quantized draft fails its parity check; otherwise as quantize.
    draft_quantize: str = "auto"
    # Each draft query attends to its last this-many positions, itself included (None: all). Output is unchanged
    # (the target checks every token); a draft trained on short windows proposes better past them
    # and reads less: codepair (trained on 512) at 1,920-token prompts with 512: acceptance 0.32
    # -> 0.41, speculative 348 -> 405 tok/s. Needs the fused graph for the draft.
    draft_window: int | None = None
    max_context: int | None = None  # default: the smaller max_position_embeddings of the two
    force: bool = False  # replace an existing --out, if it is a specdeploy bundle (or an empty folder)
    # An --out that already holds a bundle (perhaps made by a concurrent export while this one
    # waited for the lock) is kept and its manifest returned: the default bundle's first use.
    reuse_existing: bool = False
    trust_remote_code: bool = False  # run model code shipped with a checkpoint (auto_map)
    allow_pickle: bool = False  # load pytorch_model.bin (pickle) weights when a checkpoint has no safetensors
    opset: int | None = None  # default: optimum's choice for the architecture
    # auto: the fused in-place-KV graph where the architecture allows it (fused.unsupported_reason),
    # optimum's graph elsewhere; fused / optimum force one (fused fails where it cannot apply).
    graph: str = "auto"
    # Keep a rounded (int8 / int4 / fp16) target whose greedy agreement with its fp32 model falls below
    # the parity threshold; the manifest records the figure and this option.
    allow_lossy: bool = False
    # The draft's head covers this many of the most frequent tokens (draft_vocab.json of a distilled draft
    # folder); None: the folder's own subset if it has one, else the whole vocabulary; 0: the whole vocabulary.
    draft_vocab: int | None = None


# stage name, detail -> None; the CLI draws progress from it, library callers may pass None.
Reporter = Callable[[str, str], None]


def _check_options(config: ExportConfig) -> Path:
    if config.dtype not in DTYPES:
        raise SpecdeployError(f"unknown --dtype '{config.dtype}' (choose from {', '.join(DTYPES)})")
    if config.quantize not in QUANTIZE:
        raise SpecdeployError(f"unknown --quantize '{config.quantize}' (choose from {', '.join(QUANTIZE)})")
    if config.draft_quantize not in ("auto", *QUANTIZE):
        raise SpecdeployError(
            f"unknown --draft-quantize '{config.draft_quantize}' (choose from auto, {', '.join(QUANTIZE)})"
        )
    if config.draft_window is not None and config.draft_window < MIN_DRAFT_WINDOW:
        raise SpecdeployError(f"--draft-window must be at least {MIN_DRAFT_WINDOW} (got {config.draft_window})")
    if config.graph not in GRAPHS:
        raise SpecdeployError(f"unknown --graph '{config.graph}' (choose from {', '.join(GRAPHS)})")
    if config.dtype != "fp32" and (config.quantize != "none" or config.draft_quantize not in ("auto", "none")):
        raise SpecdeployError("--quantize/--draft-quantize int8/int4 quantize fp32 weights; use them with --dtype fp32")
    if config.draft_vocab is not None and config.draft_vocab < 0:
        raise SpecdeployError(f"--draft-vocab {config.draft_vocab}: must be a count of tokens (0: the whole vocabulary)")
    if config.max_context is not None and config.max_context < 2:
        raise SpecdeployError("--max-context must be at least 2")
    out = Path(config.out).expanduser().resolve()
    if not out.parent.is_dir():
        raise SpecdeployError(f"--out {out}: the folder {out.parent} does not exist")
    return out


def _max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _quantize_for(role: str, config: ExportConfig) -> tuple[str, bool]:
    """The model's weight quantization, and whether auto chose it (then an fp32 fallback is allowed)."""
    if role == "target":
        return config.quantize, False
    if config.draft_quantize != "auto":
        return config.draft_quantize, False
    if config.dtype == "fp32" and config.quantize == "none":
        return "int8", True
    return config.quantize, False


def _choose_graph(model, role: str, requested: str, max_context: int) -> str:
    if requested == "optimum":
        return "optimum"
    reason = fused.unsupported_reason(model, max_context)
    if reason is None:
        return "fused"
    if requested == "fused":
        raise SpecdeployError(f"--graph fused cannot export the {role}: {reason} (use --graph auto or optimum)")
    return "optimum"


def _model_spec(role: str, checkpoint: ckpt.Checkpoint, onnx_path: Path, root: Path, config: ExportConfig,
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


def _build_model(role: str, quantize: str, load_model: Callable, checkpoint, root: Path, config: ExportConfig,
                 max_context: int, num_parameters: int, graph: str, tokenizer_dir: Path, report: Reporter,
                 fallback_to_fp32: bool = False, shape: eagle.GraphShape = eagle.GraphShape()) -> ModelSpec:
    """Export one model into root/role, optimize it, and measure its parity (the spec carries the figures).

    load_model() gives the PyTorch model, loaded for each stage that reads it and let go after: a
    safetensors checkpoint is memory-mapped (loading it again costs a fraction of a second), and
    its pages, once read, stay resident for as long as the model lives; held from export to parity,
    they would sit under quantization and under ONNX Runtime's own copy of the weights.

    fallback_to_fp32 (the draft under --draft-quantize auto): if quantizing fails, or the quantized
    model fails its parity check, the fp32 export made just before is kept instead. The draft's
    numbers never reach the output, so that only costs speed."""
    report("export", f"{role}: {num_parameters / 1e6:.1f}M parameters -> ONNX ({graph} graph)")
    model_dir = root / role
    model_dir.mkdir()
    model = load_model()
    if graph == "fused":  # shape: the target's feature output, the draft's kind and head rows
        onnx_path = shape.build(model, model_dir / convert.ONNX_NAME, max_context, config.draft_window if role == "draft" else None)
    else:
        onnx_path = convert.export_onnx(model, model_dir, config.opset)
    del model
    convert.release_freed_memory()
    if config.dtype == "fp16":
        report("optimize", f"{role}: fp16")
        convert.convert_fp16(onnx_path)
    if quantize == "none" and graph == "optimum" and config.dtype == "fp32":
        convert.externalize(onnx_path)  # the other paths save the weights beside the graph themselves

    def validate(quantized: str) -> ModelSpec:
        spec = _model_spec(role, checkpoint, onnx_path, root, config, max_context, num_parameters, graph, quantized)
        spec = shape.describe(spec, root, int(checkpoint.config.vocab_size))
        report("validate", f"{role}: ONNX Runtime vs PyTorch")
        head = shape.head if shape.eagle is not None else None
        return dataclasses.replace(spec, parity=check_parity(load_model, onnx_path, spec, tokenizer_dir / "tokenizer.json",
                                                             checkpoint.config, columns=shape.vocab_ids, eagle_head=head))

    if quantize == "none":
        return validate("none")
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
        problem = None if spec.parity.passed else f"fails its parity check ({_parity_failure(spec.parity)})"
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


def _parity_failure(parity: ParityReport) -> str:
    if parity.check == "max_abs_diff":
        return f"max |diff| {worst_abs_diff(parity.prefill_max_abs_diff, parity.verify_max_abs_diff):.2e} > {parity.tolerance:g}"
    agreement = overall_agreement(parity.prefill_tokens, parity.prefill_greedy_agreement, parity.verify_tokens,
                                  parity.verify_greedy_agreement)
    return (f"greedy agreement with fp32 {agreement:.3f} < {parity.tolerance:g} over "
            f"{parity.prefill_tokens + parity.verify_tokens} tokens")


def _tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("torch", "transformers", "optimum-onnx", "onnx", "onnxruntime", "tokenizers"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            pass
    return versions


def export_bundle(config: ExportConfig, report: Reporter | None = None) -> Manifest:
    """Export, validate and write the bundle; returns its manifest. Raises SpecdeployError on bad input.

    Holds `.NAME.lock` beside --out from start to end, so two exports to one path run one after
    the other; leftovers of an interrupted export to the same path are cleaned first."""
    report = report or (lambda stage, detail: None)
    out = _check_options(config)
    from ..runtime import global_pool_active

    if global_pool_active():
        raise SpecdeployError(
            "cannot export in a process where specdeploy.load switched ONNX Runtime to its shared thread pool "
            "(optimum needs per-session pools): export first, or set SPECDEPLOY_SHARED_THREADS=0"
        )
    with swap.bundle_lock(out, on_wait=lambda message: report("wait", message)):
        for action in swap.clean_leftovers(out):
            report("clean", action)
        if config.reuse_existing and out.is_dir() and swap.is_replaceable(out) is None and any(out.iterdir()):
            return load_manifest(out)  # a concurrent export made it while this one waited
        _check_out(out, config.force)
        convert.quiet_export_logs()
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}{swap.PARTIAL}", dir=out.parent))
        try:
            report("load", "reading checkpoints")
            draft_folder = Path(config.draft).expanduser()
            eagle_draft = (eagle.draft_kind(draft_folder) or {}).get("kind") == "eagle" if draft_folder.is_dir() else False
            # An eagle head reads the target's tokens and runs on its weights: the target's checkpoint is its own.
            checkpoints = {role: ckpt.load_checkpoint(getattr(config, role), role, config.trust_remote_code,
                                                      config.allow_pickle, work_dir=work)
                           for role in (("target",) if eagle_draft else ROLES)}
            if eagle_draft:
                checkpoints["draft"] = dataclasses.replace(checkpoints["target"], role="draft")
            max_context = _max_context(config, checkpoints)
            manifest = _build_bundle(config, checkpoints, max_context, work, report)
            _check_out(out, config.force)  # again: another writer may have put something there meanwhile
            swap.replace(work / "bundle", out)
            return manifest
        finally:
            shutil.rmtree(work, ignore_errors=True)  # with the old bundle, if one was exchanged for the new


def _check_out(out: Path, force: bool) -> None:
    """--out must be new, or (with --force) a bundle or an empty folder: nothing else is ever replaced."""
    if not out.exists():
        return
    problem = swap.is_replaceable(out)
    if problem is not None:
        raise SpecdeployError(f"--out {out} {problem}; --force only replaces a specdeploy bundle or an empty folder, "
                              "so nothing was touched")
    if not force:
        what = "is an empty folder" if not any(out.iterdir()) else "holds a specdeploy bundle"
        raise SpecdeployError(f"--out {out} {what}; pass --force to replace it")


def _max_context(config: ExportConfig, checkpoints: dict) -> int:
    limits = [m for m in (_max_positions(c.config) for c in checkpoints.values()) if m]
    model_limit = min(limits) if limits else None
    max_context = config.max_context or model_limit or 2048
    if model_limit and max_context > model_limit:
        raise SpecdeployError(f"--max-context {max_context} exceeds the models' max_position_embeddings {model_limit}")
    if max_context > MAX_CONTEXT:  # explicit, or the models' max_position_embeddings
        raise SpecdeployError(f"{max_context} positions is past the {MAX_CONTEXT} a bundle holds: pass --max-context N")
    return max_context


def _build_bundle(config: ExportConfig, checkpoints: dict, max_context: int, work: Path, report: Reporter) -> Manifest:
    """Both models, the tokenizer and the manifest, in work/bundle."""
    root = work / "bundle"
    root.mkdir()
    tokenizer_dirs = {role: ckpt.load_tokenizer_json(c, work) for role, c in checkpoints.items()}
    repairs = {}
    for role in ROLES:  # the special tokens each checkpoint states, agreed (or repaired) before anything is built
        checked = check_special_tokens(checkpoints[role], tokenizer_dirs[role], work, report)
        checkpoints[role], tokenizer_dirs[role], repairs[role] = checked.checkpoint, checked.tokenizer_dir, checked.repairs
    ckpt.check_pair(checkpoints["target"], checkpoints["draft"], tokenizer_dirs["target"], tokenizer_dirs["draft"])
    specs: dict[str, ModelSpec] = {}
    draft_path = Path(config.draft).expanduser() if Path(config.draft).expanduser().is_dir() else checkpoints["draft"].path
    shapes = eagle.graph_shapes(config.draft, draft_path, config.draft_vocab, int(checkpoints["target"].config.vocab_size))
    if shapes["draft"].eagle is not None and (config.dtype != "fp32" or config.draft_window is not None):
        raise SpecdeployError("an eagle draft exports with --dtype fp32 and no --draft-window (its feature rows are "
                              "float32 and it attends to its whole context); quantize with --quantize int8|int4")
    for role in ROLES:
        checkpoint = checkpoints[role]
        report("load", f"{role}: {Path(checkpoint.source or checkpoint.path).name}")  # a GGUF's, not its folder's
        load_model = functools.partial(convert.load_torch_model, checkpoint.path, role, config.trust_remote_code)
        model = load_model()
        num_parameters = shapes[role].num_parameters(model)
        graph = "fused" if shapes[role].eagle is not None else _choose_graph(model, role, config.graph, max_context)
        shapes[role].check(graph, model, max_context)
        if role == "draft" and config.draft_window is not None and graph != "fused":
            raise SpecdeployError(
                f"--draft-window needs the fused graph for the draft, which cannot take it: "
                f"{fused.unsupported_reason(model, max_context) or '--graph optimum was asked for'}"
            )
        del model
        convert.release_freed_memory()  # and what reading the checkpoints and tokenizers left behind
        quantize, chosen_by_auto = _quantize_for(role, config)
        specs[role] = _build_model(role, quantize, load_model, checkpoint, root, config, max_context, num_parameters,
                                   graph, tokenizer_dirs["target"], report, fallback_to_fp32=chosen_by_auto,
                                   shape=shapes[role])
        parity = specs[role].parity
        if not parity.passed and role == "target" and config.allow_lossy and parity.check == "greedy_agreement":
            report("validate", f"target: {_parity_failure(parity)}; kept (--allow-lossy)")
        elif not parity.passed:
            hint = " (--allow-lossy keeps it anyway)" if role == "target" and parity.check == "greedy_agreement" else ""
            raise SpecdeployError(f"parity check failed for the {role}: {_parity_failure(parity)}{hint}; nothing was written")
    report("write", "tokenizer and manifest")
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        specdeploy_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        max_context=max_context,
        target=specs["target"],
        draft=specs["draft"],
        tokenizer=_copy_tokenizer(tokenizer_dirs["target"], root, checkpoints["target"]),
        export_options={**_export_options(config, max_context),
                        "special_token_repairs": {role: list(lines) for role, lines in repairs.items()}},
        tool_versions=_tool_versions(),
        accept=write_accept_graphs(root, specs["target"]),
    )
    manifest = _host_files(manifest, root, report)
    save_manifest(manifest, root)
    load_manifest(root)  # what the runtime will read, read back through the same checks (files hashed above)
    return manifest


def _host_files(manifest: Manifest, root: Path, report: Reporter) -> Manifest:
    """onnxruntime-genai's configs, then every host's reading of the tokenizer: alike, or the manifest says not."""
    from . import tokenizer_hosts  # not at import: `python -m specdeploy.export.tokenizer_hosts` runs it as a script

    return tokenizer_hosts.check_bundle(genai.write_genai_config(manifest, root), root, report)


def _export_options(config: ExportConfig, max_context: int) -> dict:
    return {
        "dtype": config.dtype,
        "quantize": config.quantize,
        "draft_quantize": config.draft_quantize,
        "draft_window": config.draft_window,
        "max_context": max_context,
        "opset": config.opset,
        "graph": config.graph,
        "task": convert.TASK,
        "trust_remote_code": config.trust_remote_code,
        "allow_pickle": config.allow_pickle,
        "allow_lossy": config.allow_lossy,
        "draft_vocab": config.draft_vocab,
    }


def _copy_tokenizer(source: Path, root: Path, target: ckpt.Checkpoint) -> TokenizerSpec:
    from tokenizers import Tokenizer

    folder = root / "tokenizer"
    folder.mkdir()
    entries: list[FileEntry] = []
    for name in (*ckpt.TOKENIZER_FILES, "chat_template.jinja"):  # the template, where a checkpoint keeps it apart
        if (source / name).is_file():
            shutil.copy2(source / name, folder / name)
            entries.append(file_entry(root, folder / name))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return TokenizerSpec(
        path="tokenizer",
        files=tuple(entries),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        bos_token_id=target.bos_token_id,
        eos_token_ids=target.eos_token_ids,
        pad_token_id=target.pad_token_id,
    )
