"""`specdeploy export`: a target checkpoint, and a draft's where one is given -> a validated bundle, written atomically.

Stages: load, export, optimize (fp16 / weight-only quantization), validate (parity), write.
Everything is built in a temporary folder beside the output and swapped into place at the end
(see swap.py), so a failure or Ctrl-C leaves nothing behind and an existing bundle untouched.
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
import tempfile
from pathlib import Path

from .. import __version__, swap
from ..bundle import (MAX_CONTEXT, ROLES, FileEntry, Manifest, ModelSpec, TokenizerSpec, file_entry,
                      format_version_for, load_manifest, save_manifest)
from ..errors import SpecdeployError
from . import checkpoint as ckpt, convert, eagle, fused, genai
from .accept import write_accept_graphs
from .build import build_model, choose_graph, parity_failure
from .config import ExportConfig, Reporter, check_options, max_positions, weights_for
from .draft_vocab import TextSample
from .sources import model_source
from .special_tokens import check_special_tokens

STAGES = ("load", "export", "optimize", "validate", "write")

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
    out = check_options(config)
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
            checkpoints, eagle_draft = _load_checkpoints(config, work)
            max_context = _max_context(config, checkpoints)
            chosen = {role: weights_for(role, config, checkpoints, eagle_draft) for role in checkpoints}
            manifest = _build_bundle(config, checkpoints, max_context, work, report, chosen)
            _check_out(out, config.force)  # again: another writer may have put something there meanwhile
            swap.replace(work / "bundle", out)
            return manifest
        finally:
            shutil.rmtree(work, ignore_errors=True)  # with the old bundle, if one was exchanged for the new


def _load_checkpoints(config: ExportConfig, work: Path) -> tuple[dict, bool]:
    """role -> Checkpoint for each model the bundle will hold (the target alone without --draft), and
    whether the draft is an eagle head: that reads the target's tokens and runs on its weights, so the
    target's checkpoint is its own."""
    draft_folder = Path(config.draft).expanduser() if config.draft is not None else None
    eagle_draft = (draft_folder is not None and draft_folder.is_dir()
                   and (eagle.draft_kind(draft_folder) or {}).get("kind") == "eagle")
    roles = ("target",) if config.draft is None or eagle_draft else ROLES
    checkpoints = {role: ckpt.load_checkpoint(getattr(config, role), role, config.trust_remote_code,
                                              config.allow_pickle, work_dir=work) for role in roles}
    if eagle_draft:
        checkpoints["draft"] = dataclasses.replace(checkpoints["target"], role="draft")
    return checkpoints, eagle_draft


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
    swap.check_movable(out)


def _max_context(config: ExportConfig, checkpoints: dict) -> int:
    limits = [m for m in (max_positions(c.config) for c in checkpoints.values()) if m]
    model_limit = min(limits) if limits else None
    max_context = config.max_context or model_limit or 2048
    if model_limit and max_context > model_limit:
        raise SpecdeployError(f"--max-context {max_context} exceeds the models' max_position_embeddings {model_limit}")
    if max_context > MAX_CONTEXT:  # explicit, or the models' max_position_embeddings
        raise SpecdeployError(f"{max_context} positions is past the {MAX_CONTEXT} a bundle holds: pass --max-context N")
    return max_context


def _build_bundle(config: ExportConfig, checkpoints: dict, max_context: int, work: Path, report: Reporter,
                  chosen: dict) -> Manifest:
    """Each model (the target, and the draft where there is one), the tokenizer and the manifest, in
    work/bundle; chosen: each role's weights (config.weights_for)."""
    root = work / "bundle"
    root.mkdir()
    tokenizer_dirs = {role: ckpt.load_tokenizer_json(c, work) for role, c in checkpoints.items()}
    repairs = {}
    for role, checkpoint in checkpoints.items():  # the special tokens each states, agreed (or repaired) before anything is built
        checked = check_special_tokens(checkpoint, tokenizer_dirs[role], work, report)
        checkpoints[role], tokenizer_dirs[role], repairs[role] = checked.checkpoint, checked.tokenizer_dir, checked.repairs
    if "draft" in checkpoints:
        ckpt.check_pair(checkpoints["target"], checkpoints["draft"], tokenizer_dirs["target"], tokenizer_dirs["draft"])
    specs = _build_models(config, checkpoints, max_context, root, report, chosen, tokenizer_dirs["target"])
    report("write", "tokenizer and manifest")
    manifest = Manifest(
        format_version=format_version_for(has_draft="draft" in specs),
        specdeploy_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        max_context=max_context,
        target=specs["target"],
        draft=specs.get("draft"),
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


def _graph_shapes(config: ExportConfig, checkpoints: dict, tokenizer_dir: Path) -> dict[str, eagle.GraphShape]:
    """Each role's GraphShape (eagle.graph_shapes); the target alone has the plain one. tokenizer_dir: the
    target's tokenizer, which counts --draft-vocab's tokens for a draft without draft_vocab.json."""
    if "draft" not in checkpoints:
        return {"target": eagle.GraphShape()}
    draft_path = Path(config.draft).expanduser() if Path(config.draft).expanduser().is_dir() else checkpoints["draft"].path
    target = checkpoints["target"]
    specials = tuple(i for i in (target.bos_token_id, *target.eos_token_ids, target.pad_token_id) if i is not None)
    sample = TextSample(tokenizer_dir, tuple(config.draft_vocab_text), specials)
    shapes = eagle.graph_shapes(draft_path, config.draft_vocab, int(target.config.vocab_size), sample)
    if shapes["draft"].eagle is not None and (config.dtype != "fp32" or config.draft_window is not None):
        raise SpecdeployError("an eagle draft exports with --dtype fp32 and no --draft-window (its feature rows are "
                              "float32 and it attends to its whole context); quantize with --quantize int8|int4")
    return shapes


def _build_models(config: ExportConfig, checkpoints: dict, max_context: int, root: Path, report: Reporter,
                  chosen: dict, tokenizer_dir: Path) -> dict[str, ModelSpec]:
    """role -> ModelSpec of each model built into root and checked against PyTorch (parity)."""
    shapes = _graph_shapes(config, checkpoints, tokenizer_dir)
    sources = {role: model_source(checkpoints[role], role, config.trust_remote_code) for role in checkpoints}
    eagle_draft = "draft" in shapes and shapes["draft"].eagle is not None
    if eagle_draft:
        sources["draft"] = sources["target"]  # an eagle head runs on the target's own weights
    specs: dict[str, ModelSpec] = {}
    for role, checkpoint in checkpoints.items():
        report("load", f"{role}: {Path(checkpoint.source or checkpoint.path).name}")  # a GGUF's, not its folder's
        quantize, chosen_by_auto = chosen[role]
        keep_blocks = quantize == "gguf" or (role == "draft" and eagle_draft and chosen["target"][0] == "gguf")
        graph, num_parameters = _graph_for(role, sources[role], shapes[role], config, max_context, keep_blocks)
        specs[role] = build_model(role, quantize, sources[role], checkpoint, root, config, max_context, num_parameters,
                                   graph, tokenizer_dir, report, fallback_to_fp32=chosen_by_auto,
                                   shape=shapes[role], keep_blocks=keep_blocks)
        parity = specs[role].parity
        if not parity.passed and role == "target" and config.allow_lossy and parity.check == "greedy_agreement":
            report("validate", f"target: {parity_failure(parity)}; kept (--allow-lossy)")
        elif not parity.passed:
            hint = " (--allow-lossy keeps it anyway)" if role == "target" and parity.check == "greedy_agreement" else ""
            raise SpecdeployError(f"parity check failed for the {role}: {parity_failure(parity)}{hint}; nothing was written")
    return specs


def _graph_for(role: str, source, shape: eagle.GraphShape, config: ExportConfig, max_context: int,
               keep_blocks: bool) -> tuple[str, int]:
    """The graph the model takes (fused or optimum) and its parameter count, refused where what it needs
    (a draft window, an eagle head's features, a GGUF's blocks) needs a fused graph it cannot take."""
    model = source.structure()
    num_parameters = shape.num_parameters(model)
    graph = "fused" if shape.eagle is not None else choose_graph(model, role, config.graph, max_context)
    shape.check(graph, model, max_context)
    why = fused.unsupported_reason(model, max_context) or "--graph optimum was asked for"
    if role == "draft" and config.draft_window is not None and graph != "fused":
        raise SpecdeployError(f"--draft-window needs the fused graph for the draft, which cannot take it: {why}")
    if keep_blocks and graph != "fused":
        raise SpecdeployError(f"the {role}'s GGUF blocks go into the fused graph only, which it cannot take: {why}; "
                              "--quantize none|int8|int4 dequantizes it")
    del model
    convert.release_freed_memory()  # and what reading the checkpoints and tokenizers left behind
    return graph, num_parameters


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
        "draft_vocab_text": [str(Path(f).expanduser().resolve()) for f in config.draft_vocab_text],
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
