"""`distill(config)`: the folder, the target, the data, the draft, the loop, the files; events go to `report`."""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import SpecdeployError
from . import checkpoint as ckpt
from . import data as data_module
from .config import DistillConfig
from .evaluate import Evaluation

DRAFT_FORMAT_VERSION = 1
# The parts of --minutes the target's generations may take at most (the rest, loading aside, trains).
GENERATED_SHARE = 0.3   # training text
HELDOUT_SHARE = 0.1     # held-out text (greedy)


@dataclass(frozen=True)
class Note:
    text: str


@dataclass(frozen=True)
class RunClock:
    """--minutes over the whole run: loading, generating, training, the last evaluation and save."""
    minutes: float | None
    started: float = field(default_factory=time.monotonic)

    @property
    def end(self) -> float | None:
        """The run's end as a time.monotonic() value (None: no limit)."""
        return None if self.minutes is None else self.started + self.minutes * 60

    def phase_end(self, share: float) -> float | None:
        """The end of a phase that may take `share` of the run's minutes, from now, and never past the run's end."""
        return None if self.minutes is None else min(self.end, time.monotonic() + share * self.minutes * 60)


@dataclass(frozen=True)
class DistillResult:
    out: str
    kind: str
    step: int
    evaluation: Evaluation | None
    interrupted: bool
    parameters: dict             # what the draft holds, in parameter counts
    history: list


def resolve_device(name: str):
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise SpecdeployError("--device cuda: no CUDA device is available to PyTorch (torch.cuda.is_available() is False)")
    return torch.device(name)


def _cached_documents(path: Path, params: dict, make: Callable[[], list]) -> list:
    """Documents from `path` when it was made with the same params, else made now and stored."""
    stored = ckpt.read_json(path)
    if stored is not None and stored.get("params") == params:
        return [data_module.Document(d["kind"], tuple(d["ids"])) for d in stored["documents"]]
    documents = make()
    ckpt.write_json(path, {"params": params, "documents": [{"kind": d.kind, "ids": list(d.ids)} for d in documents]})
    return documents


def prepare_data(config: DistillConfig, target, text: list, files: int, out: Path, report: Callable,
                 clock: RunClock | None = None):
    """(training windows, held-out documents, data summary) from the text read and the target's generations,
    each generation cut short where its share of the run's minutes ends (and said so)."""
    clock = clock or RunClock(None)
    tokenizer = target.tokenizer
    text_train, text_heldout = data_module.split_text(text, config.heldout_tokens)
    identity = target.identity()
    train_prompts = data_module.seed_prompts(tokenizer, heldout=False)
    if not getattr(tokenizer, "chat_template", None):
        report(Note("the target's tokenizer has no chat template: code prompts only"))

    def generate(prompts, budget, sample, label, share):
        def progress(done, total):
            report(Note(f"generating {label}: {done}/{total} tokens"))
        documents, made, complete = data_module.generate(target, prompts, budget, config.seed, sample, progress,
                                                         clock.phase_end(share))
        if not complete:
            report(Note(f"{label}: {made} of {budget} tokens, all that fit in the {share:.0%} of --minutes "
                        f"{config.minutes:g} a run gives it (fewer tokens, the same kind of text)"))
        return documents

    generated = []
    if config.generate_tokens:
        generated = _cached_documents(out / ckpt.GENERATED_FILE,
                                      {"target": identity, "seed": config.seed, "tokens": config.generate_tokens},
                                      lambda: generate(train_prompts, config.generate_tokens, True, "training text",
                                                       GENERATED_SHARE))
    heldout_generated = []
    if config.heldout_tokens:
        heldout_generated = _cached_documents(
            out / ckpt.HELDOUT_FILE, {"target": identity, "tokens": config.heldout_tokens},
            lambda: generate(data_module.seed_prompts(tokenizer, heldout=True), 2 * config.heldout_tokens, False,
                             "held-out text (greedy)", HELDOUT_SHARE))
    separator = target.tokenizer.eos_token_id if target.tokenizer.eos_token_id is not None else 0
    windows = data_module.Windows(text_train + generated, separator, config.seq_len, config.batch_size, config.seed)
    summary = {"data": list(config.data), "text_files": files, "text_tokens": sum(len(d.ids) for d in text_train),
               "generated_tokens": sum(len(d.ids) for d in generated), "windows": windows.count,
               "heldout_tokens": sum(len(d.ids) for d in text_heldout + heldout_generated)}
    return windows, text_heldout + heldout_generated, summary


def draft_vocabulary(config: DistillConfig, target, windows, summary: dict):
    """(vocab ids [draft_vocab], the draft_vocab.json record or None)."""
    if config.draft_vocab is None:
        return np.arange(target.vocab_size), None
    counts = np.bincount(windows.stream, minlength=target.vocab_size)[: target.vocab_size]  # [vocab]
    ids = data_module.choose_draft_vocab(counts, config.draft_vocab, data_module.special_ids(target))
    record = {"format": "specdeploy-draft-vocab", "version": 1, "vocab_size": target.vocab_size, "size": len(ids),
              "ids": ids.tolist(), "counts": counts[ids].tolist(), "always": data_module.special_ids(target),
              # every token counted, so that export may take another subset (an eagle head's rows are the target's)
              "frequencies": {"ids": np.flatnonzero(counts).tolist(), "counts": counts[counts > 0].tolist()},
              "source": {"counted_tokens": int(counts.sum()), "coverage": round(float(counts[ids].sum() / max(1, counts.sum())), 6),
                         "data": summary["data"], "text_tokens": summary["text_tokens"],
                         "generated_tokens": summary["generated_tokens"]}}
    return ids, record


def _draft_info(config, target, ids_record, eagle_config) -> dict:
    info = {"kind": config.kind, "format_version": DRAFT_FORMAT_VERSION, "target": target.identity(),
            "target_hidden_size": target.hidden_size, "target_vocab_size": target.vocab_size,
            "draft_vocab": ckpt.VOCAB_FILE if ids_record else None,
            "draft_vocab_size": ids_record["size"] if ids_record else target.vocab_size}
    if config.kind == "model":
        info["lm_head"] = ("full rows; the draft was trained on the rows of draft_vocab.json only, the others are "
                           "the target's" if ids_record else "full, trained")
    else:
        info.update({"feature_layer": target.num_layers, "feature": "output of the target's last decoder layer, before its final norm",
                     "input": "fc(concat([feature_t, embed(token_t+1)]))", "shares_lm_head": True, "shares_embedding": True,
                     "shares_final_norm": True, "architecture": dataclasses.asdict(eagle_config)})
    return info


def distill(config: DistillConfig, report: Callable = lambda event: None, stop=None) -> DistillResult:
    """Distil a draft of config.kind from config.target into config.out (see docs/distill.md)."""
    clock = RunClock(config.minutes)  # from the first moment: --minutes bounds the whole run
    config.validate()
    import torch

    out = Path(config.out).expanduser()
    made = [folder for folder in (out, *out.parents) if not folder.exists()]  # this run makes them, deepest first
    previous_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        return _distill(config, report, stop, clock)
    except SpecdeployError:  # bad input found once this run had made the folders (too little text): it leaves none
        if made and out.is_dir() and not (out / ckpt.STATE_FILE).exists():
            shutil.rmtree(out)
            for parent in made[1:]:
                try:
                    parent.rmdir()  # only while empty: nothing another program put there goes
                except OSError:
                    break
        raise
    finally:
        torch.set_num_threads(previous_threads)


def _restore(state: dict, module, optimizer, generator, draws_noise: bool, path: Path, device: str):
    """A checkpoint's weights, optimizer and noise generator into this run; its LoopState."""
    from .train import LoopState

    module.load_state_dict(state["draft"])
    optimizer.load_state_dict(state["optimizer"])
    try:
        generator.set_state(state["noise_rng"])
    except RuntimeError:  # another device's generator state (a model draft draws no noise: nothing lost)
        if draws_noise:
            raise SpecdeployError(f"--resume: {path} holds another device's noise generator; resume with the "
                                  f"--device it was trained on (this run: {device})") from None
    return LoopState(step=state["step"], elapsed_s=state["elapsed_s"], history=list(state["history"]))


def _distill(config: DistillConfig, report: Callable, stop, clock: RunClock) -> DistillResult:
    import torch

    from . import models
    from .train import CheckpointSaved, LoopState, train_loop, uniform_noise

    out = Path(config.out).expanduser()
    device = resolve_device(config.device)
    run = ckpt.prepare_out(out, config.resume)
    target = _read_target(config, device, report)
    state = _check_inputs(config, target, out, run)
    text, files = data_module.read_documents(config.data, target.tokenizer, config.max_text_tokens, config.seed, out)
    if state is None:  # every input checked: the folder becomes a distill run
        ckpt.create_out(out)
        ckpt.write_json(out / ckpt.RUN_FILE, {"format": ckpt.RUN_FORMAT, "version": 1, "kind": config.kind, "step": None})

    windows, heldout_documents, summary = prepare_data(config, target, text, files, out, report, clock)
    ids, ids_record = draft_vocabulary(config, target, windows, summary)
    if state is not None and ids_record is not None and state["vocab_ids"].tolist() != ids.tolist():
        raise SpecdeployError(f"--resume: the draft vocabulary counted now differs from the checkpoint's in {out} "
                              "(the --data files changed)")
    vocab_ids = torch.from_numpy(ids).to(device)
    full_to_draft = torch.full((target.vocab_size,), -1, dtype=torch.long, device=device)
    full_to_draft[vocab_ids] = torch.arange(len(ids), device=device)
    report(Note(f"data: {summary['text_tokens']} tokens of text from {summary['text_files']} files, "
                f"{summary['generated_tokens']} generated by the target, {summary['windows']} windows of {config.seq_len}; "
                f"held out {summary['heldout_tokens']}"))

    kind, note, eagle_config = _build_draft(config, target, vocab_ids, device)
    module = kind.module()
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    noise = uniform_noise(config.feature_noise, generator) if config.kind == "eagle" and config.feature_noise else None
    loop = LoopState()
    if state is not None:
        loop = _restore(state, module, optimizer, generator, noise is not None, out / ckpt.STATE_FILE, device)
        report(Note(f"resuming at step {loop.step} ({loop.elapsed_s / 60:.1f} min trained)"))
    parameters = _parameters(config, module, target, len(ids))
    report(Note(f"draft ({config.kind}): {', '.join(note)}; {models.describe_count(parameters['trained'])} trained "
                f"parameters, {models.describe_count(parameters['per_step'])} per draft step "
                f"(head over {len(ids)} of {target.vocab_size} tokens)"))

    heldout = _heldout(config, target, heldout_documents, device)
    if ids_record is not None:
        ckpt.write_json(out / ckpt.VOCAB_FILE, ids_record)
    ckpt.copy_tokenizer(out, target)
    save = _Checkpointer(config, out, target, ids, module, optimizer, generator, loop, summary, parameters,
                         _draft_info(config, target, ids_record, eagle_config))
    if clock.end is not None:
        report(Note(f"training for {max(0.0, clock.end - time.monotonic()) / 60:.1f} min, less what the last "
                    "evaluation and save take"))
    evaluation = train_loop(kind, target, windows, full_to_draft, vocab_ids, heldout, optimizer, config, loop, noise,
                            save, report, stop, clock.end)
    interrupted = loop.stopped_by == "interrupt"
    reason = "interrupt" if interrupted else "final"
    report(CheckpointSaved(loop.step, save(reason), reason))
    return DistillResult(out=str(out), kind=config.kind, step=loop.step, evaluation=evaluation, interrupted=interrupted,
                         parameters=parameters, history=loop.history)


def _read_target(config: DistillConfig, device, report: Callable):
    """The target, loaded once its path is checked (bad input is one error line, before any progress line)."""
    from . import models

    models.check_target(config.target)
    report(Note("starting" + (f": --minutes {config.minutes:g} bounds the whole run, the target's generations "
                              f"taking at most {GENERATED_SHARE:.0%} and {HELDOUT_SHARE:.0%} of it"
                              if config.minutes is not None else "")))
    report(Note(f"reading the target {config.target}"))
    return models.load_target(config.target, device)


def _check_inputs(config: DistillConfig, target, out: Path, run) -> dict | None:
    """The draft's shape against the target's and a resumed run against its checkpoint, before any data is
    made; the checkpoint's state (None: a fresh run)."""
    from . import models

    if config.kind == "model":
        models.draft_config(target, config.num_layers, config.hidden_size)  # the width and depth checks
    elif config.num_layers > target.num_layers:
        raise SpecdeployError(f"--layers {config.num_layers}: the target has only {target.num_layers} layers")
    positions = next((getattr(target.config, name) for name in ("max_position_embeddings", "n_positions")
                      if isinstance(getattr(target.config, name, None), int)), None)
    if positions is not None and config.seq_len > positions:
        raise SpecdeployError(f"--seq-len {config.seq_len}: the target takes at most {positions} positions")
    if config.draft_vocab is not None:  # the range choose_draft_vocab accepts
        data_module.choose_draft_vocab(np.zeros(target.vocab_size), config.draft_vocab, data_module.special_ids(target))
    if config.kind == "eagle" or config.draft_vocab is not None:  # export builds either from fused graphs only
        from ..export.fused import unsupported_reason

        why = unsupported_reason(target.model, config.seq_len)
        if why is not None:
            needs = "an eagle head reads the target's features" if config.kind == "eagle" else "a draft vocabulary subset"
            raise SpecdeployError(f"{needs}, which export builds from the fused graph only, and this target cannot "
                                  f"take it: {why}")
    state = ckpt.load_state(out) if run is not None else None
    if state is not None:
        ckpt.check_resume(run, state, config.fingerprint(), target.identity(), out)
    return state


def _build_draft(config: DistillConfig, target, vocab_ids, device) -> tuple[Any, list[str], Any]:
    """The draft to train, initialised from the target: (its training kind, a description, EAGLE's config or None)."""
    from . import models
    from .train import EagleKind, ModelKind

    if config.kind == "model":
        draft, note = models.build_model_draft(target, config.num_layers, config.hidden_size, vocab_ids.cpu(), config.seed)
        return ModelKind(draft.to(device)), note, None
    head, note = models.build_eagle_head(target, config.num_layers, config.seed)
    return EagleKind(head.to(device), target, vocab_ids), note, head.c


def _heldout(config: DistillConfig, target, documents, device) -> list:
    """The held-out sequences of each kind with the target's teaching (its top log-probabilities, and
    features for an EAGLE head), computed once for every evaluation."""
    import torch

    from .train import HeldOut

    heldout = []
    for kind_name, sequences in data_module.heldout_sets(documents, config.seq_len, config.heldout_tokens).items():
        for sequence in sequences:
            input_ids = torch.from_numpy(sequence[None]).to(device)
            heldout.append(HeldOut(kind_name, input_ids, target.teach(input_ids, 1, features=config.kind == "eagle")))
    return heldout


class _Checkpointer:
    """save(reason): the training state (for --resume), the draft's files (for export) and the run record,
    each written atomically; returns the state file's path."""

    def __init__(self, config, out, target, ids, module, optimizer, generator, loop, summary, parameters, info):
        self.config, self.out, self.target, self.ids = config, out, target, ids
        self.module, self.optimizer, self.generator, self.loop = module, optimizer, generator, loop
        self.summary, self.parameters, self.info = summary, parameters, info

    def __call__(self, reason: str) -> str:
        import torch

        config, out, loop = self.config, self.out, self.loop
        ckpt.save_state(out, {"format": 1, "step": loop.step, "elapsed_s": loop.elapsed_s,
                              "fingerprint": config.fingerprint(), "target": self.target.identity(),
                              "vocab_ids": torch.from_numpy(self.ids), "history": loop.history,
                              "draft": {k: v.detach().cpu() for k, v in self.module.state_dict().items()},
                              "optimizer": self.optimizer.state_dict(), "noise_rng": self.generator.get_state()})
        if config.kind == "model":
            files = ckpt.write_model_draft(out, self.module, self.target, self.info)
        else:
            files = ckpt.write_eagle_draft(out, self.module, self.info)
        ckpt.write_json(out / ckpt.RUN_FILE, {
            "format": ckpt.RUN_FORMAT, "version": 1, "kind": config.kind, "step": loop.step, "checkpoint": ckpt.STATE_FILE,
            "saved_because": reason, "elapsed_s": round(loop.elapsed_s, 1), "target": self.target.identity(),
            "options": config.fingerprint(), "data": self.summary, "draft_files": files, "parameters": self.parameters,
            "history": loop.history})
        return str(out / ckpt.STATE_FILE)


def _parameters(config, module, target, draft_vocab: int) -> dict:
    """trained: what the optimizer updates; per_step: the weights one draft step multiplies by (no embedding rows)."""
    from .models import parameter_count

    trained = parameter_count(module, trainable_only=True)
    if config.kind == "model":
        lm = module.lm
        body = sum(p.numel() for name, p in lm.named_parameters()
                   if p is not lm.get_input_embeddings().weight and p is not lm.get_output_embeddings().weight)
        hidden = module.head.shape[1]
        return {"trained": trained, "per_step": body + draft_vocab * hidden,
                "exported": parameter_count(lm), "embedding": lm.get_input_embeddings().weight.numel()}
    return {"trained": trained, "per_step": trained + draft_vocab * target.hidden_size,
            "head": trained, "shared_lm_head_rows": draft_vocab * target.hidden_size}
