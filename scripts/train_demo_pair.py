"""Train the small embedded demo draft/target pair shipped under ``specdeploy/demo/``.

Two Llama causal LMs trained from scratch on CPU on the running interpreter's standard-library
source with one shared byte-level BPE tokenizer (vocab 4096, ``<s>`` = 0, ``</s>`` = 1): a ~8.5M
param target (next-token CE) and a ~1.4M param draft distilled from it (0.5 CE + 0.5 KL). Both are
saved in fp16; ``PROVENANCE.md`` is written from this run's own measurements.

    HF_HUB_OFFLINE=1 python scripts/train_demo_pair.py                  # full run (~21 min)
    HF_HUB_OFFLINE=1 python scripts/train_demo_pair.py --quick --out /tmp/demo-quick
"""

import argparse
import contextlib
import copy
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, PreTrainedTokenizerFast)

VOCAB_SIZE = 4096
BOS_ID, EOS_ID = 0, 1
SEQ_LEN, BATCH = 256, 16
EVAL_EVERY_NTH_FILE, EVAL_WINDOWS = 40, 50
SEED, LOG_EVERY = 0, 25
WARMUP_STEPS, MIN_LR_FRAC = 30, 0.1
ACC_WINDOWS, ACC_PROMPT, ACC_NEW = 40, 64, 32
SAMPLE_PROMPT, SAMPLE_NEW = "def fibonacci(n):", 40
COMMON = dict(vocab_size=VOCAB_SIZE, head_dim=64, num_key_value_heads=1, max_position_embeddings=2048,
              rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=BOS_ID,
              eos_token_id=EOS_ID, pad_token_id=EOS_ID)
TARGET_SHAPE = dict(hidden_size=320, intermediate_size=768, num_hidden_layers=6, num_attention_heads=5)
DRAFT_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2)


def collect_corpus(stdlib):
    """Sorted (relative path, text) of every UTF-8 ``*.py`` under stdlib, minus site-packages."""
    files = []
    for path in sorted(Path(stdlib).rglob("*.py")):
        if "site-packages" in path.parts or not path.is_file():
            continue
        try:
            files.append((str(path.relative_to(stdlib)), path.read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return files


def split_corpus(files):
    """Deterministic held-out split: every 40th file (sorted order) goes to eval."""
    train = [f for i, f in enumerate(files) if i % EVAL_EVERY_NTH_FILE != EVAL_EVERY_NTH_FILE - 1]
    held = [f for i, f in enumerate(files) if i % EVAL_EVERY_NTH_FILE == EVAL_EVERY_NTH_FILE - 1]
    return train, held


def train_tokenizer(texts):
    """Byte-level BPE (vocab 4096) trained on the train texts, wrapped for transformers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id("<s>") == BOS_ID and tok.token_to_id("</s>") == EOS_ID
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>", model_max_length=COMMON["max_position_embeddings"])


def encode_stream(tokenizer, texts):
    """One int64 stream: each file's tokens (no BOS) followed by EOS."""
    ids = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def build_model(shape):
    """A freshly initialised LlamaForCausalLM of the given shape (fp32)."""
    return LlamaForCausalLM(LlamaConfig(**COMMON, **shape))


def count_params(model):
    return sum(p.numel() for p in model.parameters())


def sample_batch(stream, gen, batch=BATCH, seq=SEQ_LEN):
    """Random windows of ``seq`` tokens from the stream, drawn from ``gen``."""
    starts = torch.randint(0, len(stream) - seq, (batch,), generator=gen)
    return torch.stack([stream[s:s + seq] for s in starts.tolist()])


def lr_at(step, progress, warm_progress, peak):
    """Linear warmup over WARMUP_STEPS, then cosine from peak to MIN_LR_FRAC * peak as training
    ``progress`` (0..1) goes from ``warm_progress`` (its value when warmup ended) to 1."""
    if step < WARMUP_STEPS:
        return peak * (step + 1) / WARMUP_STEPS
    frac = min(1.0, max(0.0, (progress - warm_progress) / max(1e-9, 1 - warm_progress)))
    return peak * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * frac)))


def autocast_ctx(use_bf16):
    return torch.autocast("cpu", dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()


def make_optimizer(model, lr):
    """AdamW, weight decay 0.1 on matrices only (not norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def step_loss(model, batch, use_bf16, teacher=None):
    """Next-token CE; with a teacher, 0.5 * CE + 0.5 * KL(teacher || model) at T=1."""
    with autocast_ctx(use_bf16):
        logits = model(input_ids=batch).logits[:, :-1].float()
        ce = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
        if teacher is None:
            return ce, ce
        with torch.no_grad():
            t_logits = teacher(input_ids=batch).logits[:, :-1].float()
    kl = F.kl_div(F.log_softmax(logits, -1).reshape(-1, VOCAB_SIZE),
                  F.log_softmax(t_logits, -1).reshape(-1, VOCAB_SIZE), log_target=True,
                  reduction="batchmean")
    return 0.5 * ce + 0.5 * kl, ce


def train_step(model, opt, batch, use_bf16, teacher=None):
    """One clipped AdamW update; returns (loss, ce) as floats."""
    loss, ce = step_loss(model, batch, use_bf16, teacher)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), ce.item()


def pick_precision(model, stream, teacher=None, steps=3):
    """Time throwaway steps in fp32 and bf16 autocast on copies, alternating (min per mode, robust
    to a busy machine); the first step of each is warm-up. Returns (use_bf16, timings)."""
    trials = {mode: copy.deepcopy(model) for mode in ("fp32", "bf16")}
    opts = {mode: make_optimizer(m, 1e-4) for mode, m in trials.items()}
    gen, times = torch.Generator().manual_seed(SEED), {"fp32": [], "bf16": []}
    for i in range(steps + 1):
        for mode in list(trials):
            batch, t0 = sample_batch(stream, gen), time.perf_counter()
            try:
                train_step(trials[mode], opts[mode], batch, mode == "bf16", teacher)
            except RuntimeError as exc:  # bf16 unsupported here: fall back to fp32
                print(f"  bf16 autocast failed ({exc}); using fp32")
                del trials[mode], times[mode]
                continue
            if i > 0:
                times[mode].append(time.perf_counter() - t0)
    timings = {mode: min(ts) for mode, ts in times.items()}
    use_bf16 = "bf16" in timings and timings["bf16"] < timings["fp32"]
    print("  s/step (min of alternating steps): " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items())
          + f" -> {'bf16' if use_bf16 else 'fp32'}")
    return use_bf16, timings


def train(name, model, stream, max_steps, minutes, peak_lr, use_bf16, teacher=None):
    """Train until ``max_steps`` or ``minutes`` elapse, whichever comes first. Progress is
    max(step / max_steps, elapsed / budget), so the cosine ends where training actually stops even
    when CPU speed varies. Returns stats (steps, wall time, last-20 train CE and total loss)."""
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    opt = make_optimizer(model, peak_lr)
    model.train()
    losses, ces, budget, t0 = [], [], minutes * 60.0, time.perf_counter()
    step, progress, warm_progress = 0, 0.0, None
    while progress < 1.0:
        if step == WARMUP_STEPS:
            warm_progress = progress
        lr = lr_at(step, progress, warm_progress, peak_lr)
        for group in opt.param_groups:
            group["lr"] = lr
        loss, ce = train_step(model, opt, sample_batch(stream, gen), use_bf16, teacher)
        losses.append(loss)
        ces.append(ce)
        step += 1
        elapsed = time.perf_counter() - t0
        progress = max(step / max_steps, elapsed / budget)
        if step % LOG_EVERY == 0 or progress >= 1.0:
            print(f"  [{name}] step {step} ({progress:.0%}) loss {loss:.4f} ce {ce:.4f} "
                  f"lr {lr:.2e} {elapsed:.0f}s", flush=True)
    wall = time.perf_counter() - t0
    print(f"  [{name}] stopped by {'step limit' if step >= max_steps else 'time budget'}")
    model.eval()
    return {"steps": step, "wall_s": wall, "train_loss": sum(ces[-20:]) / len(ces[-20:]),
            "train_total": sum(losses[-20:]) / len(losses[-20:])}


def save_checkpoint(model, tokenizer, folder):
    """fp16 safetensors + generation config + tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                               pad_token_id=EOS_ID)
    model.half().save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


@torch.no_grad()
def eval_loss(model, stream):
    """Mean CE over EVAL_WINDOWS seeded random windows of the held-out stream."""
    windows = sample_batch(stream, torch.Generator().manual_seed(SEED + 1), EVAL_WINDOWS)
    return sum(F.cross_entropy(model(input_ids=w[None]).logits[0, :-1], w[1:]).item()
               for w in windows) / len(windows)


@torch.no_grad()
def greedy_continue(model, ids, n_new):
    """Greedy continuation of a batch of prompts (full recompute each step; exact)."""
    for _ in range(n_new):
        nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@torch.no_grad()
def acceptance_rate(target, draft, stream):
    """Fraction of target-greedy tokens that the draft's argmax reproduces (teacher-forced)."""
    prompts = sample_batch(stream, torch.Generator().manual_seed(SEED + 2), ACC_WINDOWS, ACC_PROMPT)
    full = greedy_continue(target, prompts, ACC_NEW)
    draft_pred = draft(input_ids=full).logits[:, ACC_PROMPT - 1:-1].argmax(-1)
    return (draft_pred == full[:, ACC_PROMPT:]).float().mean().item()


def sample_text(model, tokenizer):
    ids = torch.tensor([tokenizer.encode(SAMPLE_PROMPT)])
    return tokenizer.decode(greedy_continue(model, ids, SAMPLE_NEW)[0])


def cpu_name():
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def write_provenance(out, r):
    """PROVENANCE.md from the measurements collected in ``r``."""
    t, d = r["target"], r["draft"]
    shape = lambda sh: ", ".join(f"{k} {v}" for k, v in sh.items())
    row = lambda n, m: (f"| {n} | {m['params']:,} | {m['fp16_mb']:.2f} | {m['params'] * 4 / 1e6:.2f} "
                        f"| {m['steps']} | {m['wall_s'] / 60:.1f} | {m['train_loss']:.4f} "
                        f"| {m['eval_loss']:.4f} |")
    text = f"""# Demo model pair: provenance

Generated by `scripts/train_demo_pair.py{r['argv']}` — every number below was measured by that run.

## Corpus
- Python {r['python']} standard library source (the `stdlib` folder of `sysconfig.get_paths()`), every `*.py` file that decodes as
  UTF-8, recursively, excluding `site-packages`; paths sorted.
- {r['n_files']} files: {r['n_train']} train, {r['n_eval']} held out (every {EVAL_EVERY_NTH_FILE}th file in sorted order).
- Tokens (each file followed by `</s>`): {r['train_tokens']:,} train, {r['eval_tokens']:,} held out.
- Tokenizer: byte-level BPE (`tokenizers`), vocab {VOCAB_SIZE}, trained on the train files;
  `<s>` = {BOS_ID} (BOS), `</s>` = {EOS_ID} (EOS and pad); no BOS post-processor. Shared by both models.
  Tokenizer training + encoding took {r['tok_s']:.0f} s.

## Models (Llama architecture, saved in fp16)
| model | params | fp16 safetensors MB | fp32 MB (params x 4) | steps | wall min | train CE (last 20 steps) | held-out CE |
|---|---|---|---|---|---|---|---|
{row('target', t)}
{row('draft', d)}

Total fp16 safetensors: {t['fp16_mb'] + d['fp16_mb']:.2f} MB. Draft distillation loss (last 20 steps): {d['train_total']:.4f}.
- Shapes: target {shape(TARGET_SHAPE)}; draft {shape(DRAFT_SHAPE)}; both head_dim 64, 1 KV head,
  untied embeddings, vocab {VOCAB_SIZE}, max positions 2048, RoPE theta 10000.

## Training
- torch {torch.__version__} on CPU ({r['cpu']}), {torch.get_num_threads()} threads; seed {SEED}.
- Batches: {BATCH} x {SEQ_LEN}-token random windows of the train stream (seeded `torch.Generator`).
- AdamW betas (0.9, 0.95), weight decay 0.1 (matrices), grad clip 1.0; linear warmup {WARMUP_STEPS}
  steps then cosine to {MIN_LR_FRAC:.0%} of peak over training progress = max(step / step limit,
  elapsed / time budget), so the decay ends where training stops (whichever limit comes first).
- Target: next-token cross-entropy, peak lr {r['target_lr']}, budget {r['target_budget']}.
  Precision: {t['precision']} (min s/step measured: {t['timings']}).
- Draft: distilled from the trained target, loss 0.5 * CE + 0.5 * KL(target || draft), T = 1,
  peak lr {r['draft_lr']}, budget {r['draft_budget']}. Precision: {d['precision']} (s/step: {d['timings']}).

## Evaluation (fp16 checkpoints reloaded in fp32)
- Held-out loss: mean cross-entropy over {EVAL_WINDOWS} seeded random {SEQ_LEN}-token windows of the held-out stream.
- Greedy acceptance rate: {r['acceptance']:.4f} — over {ACC_WINDOWS} held-out windows, a {ACC_PROMPT}-token
  prompt, the target's {ACC_NEW}-token greedy continuation, and the fraction of those positions where the
  draft's argmax (teacher-forced along the target's continuation) equals the target's token.

## Sample (target, greedy, {SAMPLE_NEW} tokens)
```python
{r['sample']}
```
"""
    (out / "PROVENANCE.md").write_text(text)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("specdeploy/demo"))
    p.add_argument("--quick", action="store_true", help="a few steps each (smoke test)")
    p.add_argument("--target-steps", type=int, default=2000)
    p.add_argument("--draft-steps", type=int, default=2000)
    p.add_argument("--target-minutes", type=float, default=14.0)
    p.add_argument("--draft-minutes", type=float, default=7.0)
    p.add_argument("--target-lr", type=float, default=3e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    args = p.parse_args()
    if args.quick:
        args.target_steps, args.draft_steps = 12, 12
    return args


def run_phase(name, model, stream, args, teacher=None):
    """Pick precision, train, and report the stats for one model."""
    print(f"{name}: {count_params(model):,} params; measuring fp32 vs bf16 autocast")
    use_bf16, timings = pick_precision(model, stream, teacher, steps=2 if args.quick else 4)
    steps, minutes, lr = ((args.target_steps, args.target_minutes, args.target_lr) if teacher is None
                          else (args.draft_steps, args.draft_minutes, args.draft_lr))
    stats = train(name, model, stream, steps, minutes, lr, use_bf16, teacher)
    stats.update(precision="bf16 autocast" if use_bf16 else "fp32", params=count_params(model),
                 timings=", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
    print(f"{name}: {stats['steps']} steps in {stats['wall_s'] / 60:.1f} min, "
          f"train loss {stats['train_loss']:.4f}")
    return stats


def main():
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    stdlib = sysconfig.get_paths()["stdlib"]
    print(f"Python {platform.python_version()} ({sys.executable}); corpus {stdlib}")
    files = collect_corpus(stdlib)
    train_files, held_files = split_corpus(files)
    print(f"{len(files)} files: {len(train_files)} train, {len(held_files)} held out")
    t0 = time.perf_counter()
    tokenizer = train_tokenizer([t for _, t in train_files])
    train_ids = encode_stream(tokenizer, [t for _, t in train_files])
    held_ids = encode_stream(tokenizer, [t for _, t in held_files])
    tok_s = time.perf_counter() - t0
    print(f"tokenizer + encoding {tok_s:.0f}s: "
          f"{len(train_ids):,} train tokens, {len(held_ids):,} held-out tokens")

    torch.manual_seed(SEED)
    target = build_model(TARGET_SHAPE)
    t_stats = run_phase("target", target, train_ids, args)
    torch.manual_seed(SEED + 1)
    draft = build_model(DRAFT_SHAPE)
    d_stats = run_phase("draft", draft, train_ids, args, teacher=target)

    save_checkpoint(target, tokenizer, args.out / "target")
    save_checkpoint(draft, tokenizer, args.out / "draft")
    target, draft = (AutoModelForCausalLM.from_pretrained(args.out / n, dtype=torch.float32).eval()
                     for n in ("target", "draft"))
    for name, model, stats in (("target", target, t_stats), ("draft", draft, d_stats)):
        stats["fp16_mb"] = (args.out / name / "model.safetensors").stat().st_size / 1e6
        stats["eval_loss"] = eval_loss(model, held_ids)
        print(f"{name}: {stats['params']:,} params, fp16 {stats['fp16_mb']:.2f} MB, "
              f"fp32 {stats['params'] * 4 / 1e6:.2f} MB, train loss {stats['train_loss']:.4f}, "
              f"held-out loss {stats['eval_loss']:.4f}")
    total_mb = t_stats["fp16_mb"] + d_stats["fp16_mb"]
    print(f"total fp16 safetensors {total_mb:.2f} MB")
    if not args.quick:
        assert t_stats["params"] * 4 > 32e6 and total_mb <= 20.5, "size constraints violated"
    acc = acceptance_rate(target, draft, held_ids)
    sample = sample_text(target, PreTrainedTokenizerFast.from_pretrained(args.out / "target"))
    print(f"greedy acceptance rate {acc:.4f}\nsample:\n{sample}")
    argv = " " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""
    write_provenance(args.out, dict(
        argv=argv, python=platform.python_version(), stdlib=stdlib, n_files=len(files),
        n_train=len(train_files), n_eval=len(held_files), train_tokens=len(train_ids),
        eval_tokens=len(held_ids), cpu=cpu_name(), tok_s=tok_s,
        target=t_stats, draft=d_stats, acceptance=acc, sample=sample,
        target_lr=args.target_lr, draft_lr=args.draft_lr,
        target_budget=f"{args.target_steps} steps / {args.target_minutes} min",
        draft_budget=f"{args.draft_steps} steps / {args.draft_minutes} min"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
