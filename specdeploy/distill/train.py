"""The losses, the two draft kinds behind one interface, and the training loop.

Loss: the forward KL from the target's distribution to the draft's, over the target's top-k tokens
(renormalized over those the draft's vocabulary holds; the draft cannot propose the others), plus
for an eagle head EAGLE's smooth-L1 regression of the predicted feature onto the target's next one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .evaluate import Evaluation, evaluate
from .models import EagleHead, ModelDraft, Target, Teaching, softcap


def kl_to_target(draft_logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor,
                 full_to_draft: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions of KL(target top-k, renormalized to the draft vocabulary || draft).

    draft_logits [batch, seq, draft_vocab]; top_ids, top_logprobs [batch, seq, top_k] (the target's);
    full_to_draft [vocab] the draft row of each id (-1: outside the draft vocabulary); valid [seq]."""
    rows = full_to_draft[top_ids]                                  # [batch, seq, top_k]
    inside = rows >= 0
    usable = inside.any(-1)                                        # [batch, seq]
    if valid is not None:
        usable = usable & valid[None, :]
    target_logprobs = torch.log_softmax(torch.where(inside, top_logprobs, float("-inf")).where(usable[..., None], 0.0), -1)
    draft_logprobs = torch.log_softmax(draft_logits, -1).gather(-1, rows.clamp(min=0))
    terms = torch.where(inside, target_logprobs.exp() * (target_logprobs - draft_logprobs), 0.0).sum(-1)
    return terms[usable].mean() if usable.any() else draft_logits.sum() * 0.0


def feature_loss(predicted: torch.Tensor, target_features: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """EAGLE's regression: smooth L1 between predicted and true features [batch, seq, hidden] at valid [seq].

    Both are divided by the true feature's RMS (per position): residual streams run at RMS 10-100
    with a few dimensions in the thousands, and a loss on that scale would drown the KL term."""
    scale = target_features[:, valid].pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-6)
    return F.smooth_l1_loss(predicted[:, valid] / scale, target_features[:, valid] / scale)


class ModelKind:
    """--kind model: the draft LM reads the tokens; one proposal per position."""

    offset = 0  # index i of the draft's output predicts what the target's position i predicts

    def __init__(self, draft: ModelDraft):
        self.draft = draft

    def module(self):
        return self.draft

    def logits(self, input_ids, teaching, steps, noise=None):  # -> ([steps of [batch, seq, draft_vocab]], None)
        return [self.draft(input_ids)], None

    def loss(self, input_ids, teaching, full_to_draft, config, noise):
        (logits,), _ = self.logits(input_ids, teaching, 1)
        kl = kl_to_target(logits, teaching.top_ids, teaching.top_logprobs, full_to_draft)
        return kl, {"kl": float(kl.detach())}


class EagleKind:
    """--kind eagle: the head reads the target's feature at i and the token at i+1, and predicts the feature at i+1."""

    offset = 1

    def __init__(self, head: EagleHead, target: Target, vocab_ids: torch.Tensor):
        self.head, self.target = head, target
        device = target.head_weight.device
        self.head_rows = target.head_weight.detach()[vocab_ids.to(device)].clone()  # [draft_vocab, hidden], frozen

    def module(self):
        return self.head

    def logits(self, input_ids, teaching, steps, noise=None):
        features = teaching.features[:, :-1]                        # [batch, seq - 1, hidden]
        if noise is not None:
            features = features + noise(features)
        embeds = self.target.embed(input_ids[:, 1:])                # [batch, seq - 1, hidden]
        predicted = self.head.rollout(features, embeds, steps)
        logits = [softcap(F.linear(self.target.final_norm(p), self.head_rows), self.target.softcap) for p in predicted]
        return logits, predicted

    def loss(self, input_ids, teaching, full_to_draft, config, noise):
        logits, predicted = self.logits(input_ids, teaching, config.unroll, noise)
        seq = input_ids.shape[1] - 1
        kl_total = feature_total = 0.0
        for step, (step_logits, step_features) in enumerate(zip(logits, predicted)):
            valid = torch.arange(seq, device=input_ids.device) >= step  # rows whose chain starts inside the sequence
            kl_total = kl_total + kl_to_target(step_logits, teaching.top_ids[:, 1:], teaching.top_logprobs[:, 1:],
                                               full_to_draft, valid)
            feature_total = feature_total + feature_loss(step_features, teaching.features[:, 1:], valid)
        kl, feature = kl_total / len(logits), feature_total / len(logits)
        return kl + config.feature_weight * feature, {"kl": float(kl.detach()), "feature": float(feature.detach())}


def uniform_noise(scale: float, generator: torch.Generator):
    """EAGLE-1's input-feature noise: uniform in +-scale times each feature vector's RMS."""
    def noise(features):
        rms = features.pow(2).mean(-1, keepdim=True).sqrt()
        uniform = torch.rand(features.shape, generator=generator, device=features.device, dtype=features.dtype)
        return (uniform * 2 - 1) * scale * rms
    return noise


@dataclass(frozen=True)
class HeldOut:
    """A held-out sequence with the target's answers, computed once."""
    kind: str
    input_ids: torch.Tensor      # [1, seq]
    teaching: Teaching           # the target on it (argmax [1, seq]; features for eagle)


@torch.no_grad()
def measure(kind, heldout: list[HeldOut], vocab_ids: torch.Tensor, num_draft_tokens: int) -> Evaluation:
    """Greedy agreement of the draft with the target on each held-out sequence, by draft step."""
    kind.module().eval()
    steps = num_draft_tokens if isinstance(kind, EagleKind) else 1
    by_kind: dict[str, list[np.ndarray]] = {}
    for item in heldout:
        logits, _ = kind.logits(item.input_ids, item.teaching, steps)
        target_choice = item.teaching.argmax[0, kind.offset:]
        rows = [(vocab_ids.to(row.device)[row[0].argmax(-1)] == target_choice).cpu().numpy() for row in logits]
        by_kind.setdefault(item.kind, []).append(np.stack(rows))
    kind.module().train()
    return evaluate(by_kind, num_draft_tokens)


@dataclass(frozen=True)
class Progress:
    step: int
    elapsed_s: float             # training time, resumed runs included
    loss: dict                   # mean of each loss part since the last progress line
    evaluation: Evaluation
    seconds_per_step: float | None
    epoch: float


@dataclass(frozen=True)
class TrainingStarted:
    step: int                    # from here on an interrupt is answered with a checkpoint


@dataclass(frozen=True)
class CheckpointSaved:
    step: int
    path: str
    reason: str                  # interval | final | interrupt


@dataclass
class LoopState:
    step: int = 0
    elapsed_s: float = 0.0
    history: list = field(default_factory=list)
    stopped_by: str = ""         # steps | minutes | interrupt


def train_step(kind, target: Target, windows_batch: np.ndarray, full_to_draft, optimizer, config, step: int,
               noise) -> dict:
    """One optimizer step on a batch of windows ([batch, seq_len] token ids), warm-up included; the loss's parts."""
    batch = torch.from_numpy(windows_batch).to(full_to_draft.device)
    teaching = target.teach(batch, config.top_k, features=isinstance(kind, EagleKind))
    loss, parts = kind.loss(batch, teaching, full_to_draft, config, noise)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in kind.module().parameters() if p.requires_grad], 1.0)
    for group in optimizer.param_groups:
        group["lr"] = config.learning_rate * min(1.0, (step + 1) / config.warmup_steps)
    optimizer.step()
    return parts


SAVE_ESTIMATE_S = 5.0  # what the last save is taken to cost until a save has been timed


def train_loop(kind, target: Target, windows, full_to_draft, vocab_ids, heldout, optimizer, config, state: LoopState,
               noise, save: Callable[[str], str], report: Callable, stop, deadline: float | None = None) -> Evaluation:
    """Step until --steps, `deadline` (time.monotonic(): the end of --minutes, less what the last evaluation and
    save take, as timed so far) or `stop`; progress every eval_every steps; checkpoints by time and steps."""
    kind.module().train()
    started = last_checkpoint = time.monotonic()
    elapsed_before, interval, interval_started = state.elapsed_s, [], time.monotonic()
    evaluation = None
    costs = {"evaluation": 0.0, "save": SAVE_ESTIMATE_S, "step": 0.0}  # seconds, the latest timed

    def progress() -> Evaluation:
        nonlocal interval, interval_started
        began = time.monotonic()
        result = measure(kind, heldout, vocab_ids, config.num_draft_tokens)
        costs["evaluation"] = time.monotonic() - began
        loss = {name: float(np.mean([parts[name] for parts in interval])) for name in (interval[0] if interval else {})}
        per_step = (time.monotonic() - interval_started) / len(interval) if interval else None
        event = Progress(state.step, state.elapsed_s, loss, result, per_step, windows.epoch(state.step))
        state.history.append({"step": state.step, "elapsed_s": round(state.elapsed_s, 1), "loss": loss,
                              "seconds_per_step": per_step, **result.to_dict()})
        report(event)
        interval, interval_started = [], time.monotonic()
        return result

    report(TrainingStarted(state.step))
    if state.step == 0 and not state.history:
        evaluation = progress()
    while True:
        state.elapsed_s = elapsed_before + time.monotonic() - started
        if stop is not None and stop.is_set():
            state.stopped_by = "interrupt"
            break
        if config.steps is not None and state.step >= config.steps:
            state.stopped_by = "steps"
            break
        if deadline is not None and time.monotonic() + costs["step"] + costs["evaluation"] + costs["save"] >= deadline:
            state.stopped_by = "minutes"
            break
        step_began = time.monotonic()
        interval.append(train_step(kind, target, windows.batch(state.step), full_to_draft, optimizer, config, state.step,
                                   noise))
        state.step += 1
        costs["step"] = time.monotonic() - step_began
        state.elapsed_s = elapsed_before + time.monotonic() - started
        if state.step % config.eval_every == 0:
            evaluation = progress()
        by_steps = config.checkpoint_steps is not None and state.step % config.checkpoint_steps == 0
        if by_steps or time.monotonic() - last_checkpoint >= config.checkpoint_minutes * 60:
            began = time.monotonic()
            report(CheckpointSaved(state.step, save("interval"), "interval"))
            last_checkpoint = time.monotonic()
            costs["save"] = last_checkpoint - began
    if state.stopped_by != "interrupt" and (evaluation is None or interval):
        evaluation = progress()
    return evaluation
