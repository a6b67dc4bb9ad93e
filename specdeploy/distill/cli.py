"""The `specdeploy distill` command: flags into a DistillConfig, events into lines on stderr."""

from __future__ import annotations

import signal
import threading

import click

from ..cli_support import EXIT_INTERRUPTED, fail
from ..errors import SpecdeployError, install_hint
from .config import DEVICES, DistillConfig


def format_event(event) -> str | None:
    """One stderr line per event of the run (None: nothing to show)."""
    from .pipeline import Note
    from .train import CheckpointSaved, Progress

    if isinstance(event, Note):
        return f"distill: {event.text}"
    if isinstance(event, CheckpointSaved):
        return f"checkpoint step {event.step} ({event.reason}) -> {event.path}"
    if isinstance(event, Progress):
        overall = event.evaluation.overall
        kinds = ", ".join(f"{kind} {score.agreement:.3f}" for kind, score in event.evaluation.by_kind.items())
        loss = " ".join(f"{name} {value:.4f}" for name, value in event.loss.items()) or "-"
        per_step = f"  {event.seconds_per_step:.2f} s/step" if event.seconds_per_step else ""
        k = len(overall.by_position)
        return (f"step {event.step:>6}  {event.elapsed_s / 60:6.1f} min  epoch {event.epoch:.2f}  loss {loss}  "
                f"held-out agreement {overall.agreement:.3f} ({kinds})  accepted/round@{k} {overall.accepted_per_round:.2f}"
                f"{per_step}")
    return None


@click.command()
@click.option("--target", required=True, help="The target: a Hugging Face folder (safetensors) or a .gguf file.")
@click.option("--out", required=True, type=click.Path(), help="The draft folder (new or empty; or a run to --resume).")
@click.option("--kind", type=click.Choice(["model", "eagle"]), default="model", show_default=True,
              help="model: a small causal LM `export --draft` takes; eagle: a head over the target's last hidden state.")
@click.option("--data", multiple=True, help="Text files, folders or glob patterns to train on (repeatable).")
@click.option("--generate-tokens", type=int, default=DistillConfig.generate_tokens, show_default=True,
              help="Tokens of the target's own text from built-in chat and code prompts (0: none).")
@click.option("--max-text-tokens", type=int, default=DistillConfig.max_text_tokens, show_default=True,
              help="Tokens read from --data at most.")
@click.option("--minutes", type=float, default=DistillConfig.minutes, show_default=True,
              help="Wall-clock time of this run, all of it: reading the target, its generations (at most 30% "
                   "and 10% of the time), training, the last evaluation and save.")
@click.option("--steps", type=int, default=None, help="Stop at this many optimizer steps in all (resumed runs included).")
@click.option("--layers", type=int, default=None, help="Decoder layers of the draft (default: 2 for model, 1 for eagle).")
@click.option("--hidden-size", type=int, default=None, help="Model kind: the draft's width (default: the target's).")
@click.option("--draft-vocab", type=int, default=None,
              help="The draft's head covers the N most frequent tokens of the data (default: all).")
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True, help="Where PyTorch trains.")
@click.option("--threads", type=int, default=None,
              help="PyTorch's CPU threads (default: its own); 1 runs faster on a CPU shared with other work.")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its checkpoint (same options).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True,
              help="Seeds the data's order, the draft's initial weights and the generated text.")
@click.option("--seq-len", type=int, default=DistillConfig.seq_len, show_default=True, help="Tokens per training window.")
@click.option("--batch-size", type=int, default=DistillConfig.batch_size, show_default=True, help="Windows per optimizer step.")
@click.option("--lr", type=float, default=None, help="Peak learning rate (default: 3e-4 model, 1e-3 eagle).")
@click.option("--top-k", type=int, default=DistillConfig.top_k, show_default=True,
              help="The divergence is taken over the target's top-k tokens.")
@click.option("--unroll", type=int, default=DistillConfig.unroll, show_default=True,
              help="Eagle: chain steps trained per position (the head fed its own features; 1: EAGLE-1).")
@click.option("--heldout-tokens", type=int, default=DistillConfig.heldout_tokens, show_default=True,
              help="Held-out tokens per kind of text (chat, code, text) for the acceptance estimate.")
@click.option("--eval-every", type=int, default=DistillConfig.eval_every, show_default=True,
              help="Steps between progress lines.")
@click.option("--checkpoint-minutes", type=float, default=DistillConfig.checkpoint_minutes, show_default=True,
              help="Wall-clock minutes between checkpoints (--resume continues from the last).")
@click.option("--checkpoint-steps", type=int, default=None, help="Also checkpoint every N steps.")
def distill(target, out, kind, data, generate_tokens, max_text_tokens, minutes, steps, layers, hidden_size, draft_vocab,
            device, threads, resume, seed, seq_len, batch_size, lr, top_k, unroll, heldout_tokens, eval_every, checkpoint_minutes,
            checkpoint_steps) -> None:
    """Distil a draft for a target: trained on the target's own distribution, checkpointed, resumable.

    Progress goes to stderr (loss, held-out greedy agreement, accepted tokens per round at k = 4);
    the draft folder's path to stdout. Ctrl-C saves a checkpoint and exits 130; --resume continues it."""
    config = DistillConfig(target=target, out=out, kind=kind, data=tuple(data), generate_tokens=generate_tokens,
                           max_text_tokens=max_text_tokens, minutes=minutes, steps=steps, layers=layers,
                           hidden_size=hidden_size, draft_vocab=draft_vocab, device=device, threads=threads, resume=resume, seed=seed,
                           seq_len=seq_len, batch_size=batch_size, lr=lr, top_k=top_k, unroll=unroll,
                           heldout_tokens=heldout_tokens, eval_every=eval_every, checkpoint_minutes=checkpoint_minutes,
                           checkpoint_steps=checkpoint_steps).validate()
    try:
        from . import pipeline
        from .train import TrainingStarted
    except ImportError as exc:
        raise SpecdeployError(f"distilling needs the export extra ({install_hint('export')}): {exc}") from None

    stop, training = threading.Event(), threading.Event()

    def on_signal(signum, frame):
        if not training.is_set() or stop.is_set():  # before training there is nothing to keep; a second Ctrl-C: now
            raise KeyboardInterrupt
        stop.set()
        click.echo("distill: stopping after this step (a checkpoint is written; Ctrl-C again to stop now)", err=True)

    def report(event) -> None:
        if isinstance(event, TrainingStarted):
            training.set()
        line = format_event(event)
        if line:
            click.echo(line, err=True)

    # Scoped to the run and restored after it: Ctrl-C and SIGTERM become "checkpoint, then stop".
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = pipeline.distill(config, report, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if result.interrupted:
        fail(f"interrupted at step {result.step}; the checkpoint in {result.out} is kept (--resume continues it)",
             EXIT_INTERRUPTED)
    if result.evaluation is not None:
        overall = result.evaluation.overall
        click.echo(f"distill: done at step {result.step}: held-out agreement {overall.agreement:.3f}, accepted/round "
                   f"{overall.accepted_per_round:.2f} (by position {', '.join(f'{r:.2f}' for r in overall.by_position)})",
                   err=True)
    click.echo(result.out)
