"""specdeploy against its peers, each at its best, on the same prompts and the same token ids.

Systems, every one target-only and speculative:

1. onnxruntime-genai 0.18 (fp32, CPU): the model builder's graphs of the same checkpoints;
   speculative = its draft-model speculative decoding (``model.type = "speculative"``, a
   ``model.draft`` block, ``speculative.max_draft_tokens = K``, a fixed K);
2. Hugging Face transformers assisted generation on PyTorch (fp32, CPU), a constant K;
3. specdeploy (``specdeploy bench`` on an exported bundle of the same pair, in the main venv).

Peers at their best: before timing, each peer's settings that matter on a CPU are searched on a
warm-up subset (greedy, the first ``--tune-prompts`` prompts, ``--tune-tokens`` new tokens, two
interleaved passes): for onnxruntime-genai the intra-op threads of each session (1..nproc) and
spinning on or off (``session.intra_op.allow_spinning``, passed through genai's session_options as a
session config entry); for Hugging Face the torch threads (1..nproc). The fastest configuration of
each variant (target-only, speculative) is chosen, printed in the JSON (``tuning``), and every
setting is then timed with it *and* with the peer's defaults (genai: the builder's config as
written; torch: its default thread count), so both are on record. Ratios compare us with the tuned
peers.

Same tokens: every system stops at EOS or at ``--max-new-tokens`` (nobody masks EOS), and
tokens/s counts each system's own new tokens (EOS included), decode time only. Greedy outputs are
cross-checked token for token between every pair of systems (``cross_check``: identical runs and
the first mismatch index of each prompt).

Sampling settings (``--settings``, comma-separated; words joined by "-"): ``greedy``, ``tT``
(temperature), ``kK`` (top-k), ``pP`` (top-p), ``minpM`` (min-p), ``repR`` (repetition penalty).
Default: ``greedy,t0.8,t0.8-k50-p0.95`` (greedy, plain temperature, the common setting). A
setting a peer does not support (onnxruntime-genai 0.18 has no min-p) is reported as such.

Environment (its own venv: onnxruntime-genai 0.18's model builder needs transformers 5, which the
main .venv cannot have)::

    python3.11 -m venv .venv-peers
    .venv-peers/bin/pip install torch==2.13.0
    .venv-peers/bin/pip install -r benchmarks/peers-requirements.txt

Run (from the repository root; PAIR is a folder holding the target and draft checkpoints)::

    specdeploy export --target PAIR/target --draft PAIR/draft --out bench-bundle
    .venv-peers/bin/python -m benchmarks.bench_peers --target PAIR/target --draft PAIR/draft \
        --ours bench-bundle [--settings greedy,t0.8,t0.8-k50-p0.95] [--max-new-tokens 128] \
        [--num-draft-tokens 4] [--repeat 1] [--rounds 1] [--systems ort,hf] [--work .peers-work]

One JSON line is the last line of stdout; a Markdown table of the run goes to stderr at the end.
onnxruntime-genai models and configs are built into ``--work`` (rebuilt when the checkpoint
changes or with ``--rebuild``): ``onnx/target/`` and ``onnx/draft/`` (builder output) and
``onnx/genai_config.json`` (speculative; 0.18 rejects ".." in model paths, hence one parent).

Timing: onnxruntime-genai's prefill is ``append_tokens(prompt)``, timed apart; decode is the
``generate_next_token`` loop. Hugging Face ``generate`` cannot time its prefill apart, so its decode
runs from the first streamed chunk (prefill plus the first token or assisted round) to the end, and
that chunk's tokens are not counted. specdeploy reports decode time itself. Variants are interleaved
per prompt (order alternating per repeat); settings are the outer loop, every system timed within
each setting: the first tuned peer, specdeploy, the other tuned peer (the sequence reversed from one
setting to the next), then both peers' defaults, so that ours is timed right beside each tuned peer
it is compared with; ``--rounds R`` runs the tuned sequence R times, reversed each time, and sums
each system's rounds (each round's tokens/s stays in the JSON). Sampled runs seed each run with ``1000 * prompt_index + repeat``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO / "specdeploy" / "data" / "code_prompts.json"
DEFAULT_WORK = REPO / ".peers-work"
VARIANTS = ("target_only", "speculative")


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- settings and prompts


@dataclass(frozen=True)
class Setting:
    name: str
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def parse_setting(name: str) -> Setting:
    fields: dict = {}
    for word in name.split("-"):
        for prefix, key, kind in (("minp", "min_p", float), ("rep", "repetition_penalty", float),
                                  ("t", "temperature", float), ("k", "top_k", int), ("p", "top_p", float)):
            if word.startswith(prefix) and word != "greedy":
                fields[key] = kind(word[len(prefix):])
                break
        else:
            if word != "greedy":
                raise ValueError(f"setting '{name}': unknown word '{word}' (greedy, tT, kK, pP, minpM, repR)")
    return Setting(name=name, **fields)


def load_prompts(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    prompts = [item if isinstance(item, str) else item.get("prompt") for item in data]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"{path}: expected a JSON list of strings or JSONL with a 'prompt' field")
    return prompts


def encode_prompts(target_dir: Path, prompts: list[str]) -> list[list[int]]:
    """The ids every system is fed: the target's tokenizer.json with its own special tokens, as
    specdeploy's codec encodes (for this pair's tokenizer that adds no BOS)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return [tokenizer.encode(p, add_special_tokens=True).ids for p in prompts]


# ----------------------------------------------------------------------------- aggregation


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(runs: list[dict]) -> dict:
    decode_tokens = sum(r["decode_tokens"] for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    return {
        "tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s > 0 else None,
        "new_tokens": sum(r["new_tokens"] for r in runs),
        "decode_tokens": decode_tokens,
        "decode_s": round(decode_s, 4),
        "mean_prefill_ms": round(1000 * sum(r["prefill_s"] for r in runs) / len(runs), 3),
        "runs": len(runs),
    }


def timed_block(run, n_prompts: int, repeat: int, setting: Setting, label: str) -> dict:
    """run(variant, prompt_index, seed) for both variants, interleaved per prompt -> summaries and greedy ids."""
    runs = {v: [] for v in VARIANTS}
    for pi in range(n_prompts):
        for rep in range(repeat):
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                r = run(variant, pi, 1000 * pi + rep)
                r.update(prompt_index=pi, repeat=rep)
                runs[variant].append(r)
        log(f"  {label} {setting.name} p{pi}: " + ", ".join(
            f"{v} {runs[v][-1]['decode_tokens'] / max(runs[v][-1]['decode_s'], 1e-9):.0f} tok/s" for v in VARIANTS))
    out = {v: summarize(runs[v]) for v in VARIANTS}
    t, s = out["target_only"]["tokens_per_s"], out["speculative"]["tokens_per_s"]
    out["speedup"] = round(s / t, 3) if s and t else None
    if setting.greedy:
        first = {v: [r["tokens"] for r in sorted(runs[v], key=lambda r: r["prompt_index"]) if r["repeat"] == 0]
                 for v in VARIANTS}
        mismatches = [first_mismatch(a, b) for a, b in zip(first["target_only"], first["speculative"])]
        out["identical_outputs"] = all(m is None for m in mismatches)
        out["greedy_ids"] = first["target_only"]
    return out


def merge_rounds(blocks: list[dict]) -> dict:
    """One system's timed blocks of one setting over several rounds -> one block: per variant, decode tokens
    and seconds summed (time shares and prefill weighted), each round's tokens/s kept beside; the speedup,
    acceptance and identity over all rounds; the bound weighted by decode time; the first round's greedy ids."""
    if len(blocks) == 1:
        return blocks[0]
    out = dict(blocks[0])
    for v in VARIANTS:
        parts = [b[v] for b in blocks]
        seconds = sum(p["decode_s"] for p in parts)
        merged = {**parts[0], "decode_tokens": sum(p["decode_tokens"] for p in parts), "decode_s": round(seconds, 4),
                  "new_tokens": sum(p["new_tokens"] for p in parts),
                  "per_round_tokens_per_s": [p["tokens_per_s"] for p in parts]}
        merged["tokens_per_s"] = round(merged["decode_tokens"] / seconds, 2) if seconds > 0 else None
        if "runs" in parts[0]:
            merged["runs"] = sum(p["runs"] for p in parts)
            merged["mean_prefill_ms"] = round(sum(p["mean_prefill_ms"] * p["runs"] for p in parts) / merged["runs"], 3)
        if "time_share" in parts[0]:
            merged["time_share"] = {key: sum(p["time_share"][key] * p["decode_s"] for p in parts) / seconds
                                    for key in parts[0]["time_share"]}
        out[v] = merged
    t, s = out["target_only"]["tokens_per_s"], out["speculative"]["tokens_per_s"]
    out["speedup"] = round(s / t, 3) if s and t else None
    if out.get("identical_outputs") is not None:
        out["identical_outputs"] = all(b["identical_outputs"] for b in blocks)
    if "bound" in out:  # weighted by decode time, as the speedup is
        seconds = [b["speculative"]["decode_s"] for b in blocks]
        out["bound"] = round(sum(b["bound"] * w for b, w in zip(blocks, seconds)) / sum(seconds), 3)
    if "drafted" in out:
        out["accepted"], out["drafted"] = sum(b["accepted"] for b in blocks), sum(b["drafted"] for b in blocks)
        out["acceptance_rate"] = round(out["accepted"] / out["drafted"], 4) if out["drafted"] else 0.0
    return out


# ----------------------------------------------------------------------------- onnxruntime-genai


class GenaiPeer:
    name = "ort_genai"

    def __init__(self, args):
        import onnxruntime_genai as og

        self.og, self.args = og, args
        self.onnx_dir = args.work.resolve() / "onnx"
        for role, src in (("target", args.target), ("draft", args.draft)):
            self._build(src, self.onnx_dir / role)
        self._compose()
        self.version = og.__version__
        self.defaults = ("the model builder's genai_config.json as written: intra_op_num_threads unset (ONNX Runtime "
                         "picks one per physical core), spinning on")
        self.models: dict = {}

    def _build(self, src: Path, out: Path) -> None:
        stamp = {"source": str(src.resolve()), "genai": self.og.__version__,
                 "files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(src.iterdir())}}
        stamp_file = out / "build-stamp.json"
        if not self.args.rebuild and (out / "model.onnx").exists() and stamp_file.exists() \
                and json.loads(stamp_file.read_text()) == stamp:
            return
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(out),
               "-p", "fp32", "-e", "cpu", "-c", str(self.args.work.resolve() / "hf-cache")]
        log("building:", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not (out / "model.onnx").exists():
            raise RuntimeError(f"model builder failed for {src}: {(proc.stdout + proc.stderr)[-2000:]}")
        shutil.copy(out / "genai_config.json", out / "genai_config.builder.json")
        stamp_file.write_text(json.dumps(stamp, indent=1))

    def _compose(self) -> None:
        """target/genai_config.json: the builder's, untouched (the defaults); onnx/genai_config.json: speculative."""
        target = json.loads((self.onnx_dir / "target" / "genai_config.builder.json").read_text())
        draft = json.loads((self.onnx_dir / "draft" / "genai_config.builder.json").read_text())
        (self.onnx_dir / "target" / "genai_config.json").write_text(json.dumps(target, indent=4))
        spec = json.loads(json.dumps(target))
        spec["model"]["type"] = "speculative"
        spec["model"]["decoder"]["filename"] = "target/model.onnx"
        spec["model"]["draft"] = dict(draft["model"]["decoder"], filename="draft/model.onnx")
        # A fixed K every round (min_adaptive_k 0: no adaptive K; no cooldown), like HF's "constant" schedule.
        spec["speculative"] = {"max_draft_tokens": self.args.num_draft_tokens, "min_adaptive_k": 0, "cooldown": False}
        (self.onnx_dir / "genai_config.json").write_text(json.dumps(spec, indent=4))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(self.onnx_dir / "target" / name, self.onnx_dir / name)

    def candidates(self, variant: str) -> list[dict]:
        threads = range(1, (os.cpu_count() or 1) + 1)
        if variant == "target_only":
            return [{"target_threads": t, "spinning": s} for t in threads for s in (True, False)]
        return [{"target_threads": t, "draft_threads": d, "spinning": s}
                for t, d in itertools.product(threads, threads) for s in (True, False)]

    def load(self, variant: str, config: dict | None):
        """config None: the builder's genai_config as written (ONNX Runtime's defaults)."""
        key = (variant, json.dumps(config, sort_keys=True))
        if key in self.models:
            return self.models[key]
        folder = self.onnx_dir / ("target" if variant == "target_only" else "")
        og_config = self.og.Config(str(folder))
        if config is not None:
            def options(threads: int) -> dict:
                entry = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
                if not config["spinning"]:
                    entry["session.intra_op.allow_spinning"] = "0"
                return {"session_options": entry}
            overlay = {"model": {"decoder": options(config["target_threads"])}}
            if variant == "speculative":
                overlay["model"]["draft"] = options(config["draft_threads"])
            og_config.overlay(json.dumps(overlay))
        self.models[key] = self.og.Model(og_config)
        return self.models[key]

    def supports(self, setting: Setting) -> str | None:
        return "onnxruntime-genai 0.18 has no min_p search option" if setting.min_p else None

    def run(self, model, variant: str, ids: list[int], setting: Setting, seed: int, new_tokens: int) -> dict:
        og = self.og
        params = og.GeneratorParams(model)
        options = dict(max_length=len(ids) + new_tokens, batch_size=1, num_beams=1,
                       repetition_penalty=setting.repetition_penalty, do_sample=not setting.greedy)
        if not setting.greedy:  # the builder's config says top_k 50: every knob is set explicitly
            options.update(temperature=setting.temperature, top_k=setting.top_k, top_p=setting.top_p, random_seed=seed)
        params.set_search_options(**options)
        if variant == "speculative":
            params.set_speculative_options(max_draft_tokens=self.args.num_draft_tokens)
        generator = og.Generator(model, params)
        t0 = time.perf_counter()
        generator.append_tokens(ids)
        t1 = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        t2 = time.perf_counter()
        tokens = [int(x) for x in generator.get_sequence(0)][len(ids):]
        # append_tokens's pass computed the first token's logits, and the first generate_next_token only
        # samples them: the decode passes made the other tokens (counting that one read genai N/(N-1) fast).
        return {"tokens": tokens, "new_tokens": len(tokens), "decode_tokens": max(len(tokens) - 1, 0),
                "prefill_s": t1 - t0, "decode_s": t2 - t1}

    def close(self) -> None:
        self.models.clear()


# ----------------------------------------------------------------------------- Hugging Face


class HfPeer:
    name = "hf_assisted"

    def __init__(self, args):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()  # the assistant's inner generate() warns on every call
        self.torch, self.args = torch, args
        self.default_threads = torch.get_num_threads()
        self.defaults = f"torch's default thread count ({self.default_threads} here)"
        self.version = transformers.__version__
        load = lambda path: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,  # noqa: E731
                                                                 local_files_only=True).eval()
        self.target, self.draft = load(args.target), load(args.draft)
        # transformers 5 reads assisted generation's knobs from the assistant's generation_config:
        # a constant K and no confidence-based early stop (its default threshold is 0.4).
        draft_config = self.draft.generation_config
        draft_config.num_assistant_tokens = args.num_draft_tokens
        draft_config.num_assistant_tokens_schedule = "constant"
        draft_config.assistant_confidence_threshold = 0.0
        eos = self.target.config.eos_token_id
        self.eos, self.pad = eos, (self.target.config.pad_token_id if self.target.config.pad_token_id is not None else eos)

    def candidates(self, variant: str) -> list[dict]:
        return [{"torch_threads": t} for t in range(1, (os.cpu_count() or 1) + 1)]

    def load(self, variant: str, config: dict | None):
        return {"torch_threads": self.default_threads if config is None else config["torch_threads"]}

    def supports(self, setting: Setting) -> str | None:
        return None

    def run(self, model, variant: str, ids: list[int], setting: Setting, seed: int, new_tokens: int) -> dict:
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch
        torch.set_num_threads(model["torch_threads"])

        class Chunks(BaseStreamer):
            def __init__(self):
                self.seen_prompt, self.times = False, []

            def put(self, value):
                if self.seen_prompt:
                    self.times.append((time.perf_counter(), int(value.numel())))
                self.seen_prompt = True

            def end(self):
                pass

        input_ids = torch.tensor([ids], dtype=torch.long)
        kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                      eos_token_id=self.eos, pad_token_id=self.pad, repetition_penalty=setting.repetition_penalty,
                      do_sample=not setting.greedy)
        if not setting.greedy:
            kwargs.update(temperature=setting.temperature, top_k=setting.top_k, top_p=setting.top_p,
                          min_p=setting.min_p or None)
        if variant == "speculative":
            kwargs.update(assistant_model=self.draft)
        streamer = Chunks()
        torch.manual_seed(seed)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.target.generate(**kwargs, streamer=streamer)
            t2 = time.perf_counter()
        tokens = [int(x) for x in out[0, len(ids):].tolist()]
        t1, first = streamer.times[0]
        return {"tokens": tokens, "new_tokens": len(tokens), "decode_tokens": len(tokens) - first,
                "prefill_s": t1 - t0, "decode_s": t2 - t1}

    def close(self) -> None:
        del self.target, self.draft
        gc.collect()


# ----------------------------------------------------------------------------- tuning and timing


def tune(peer, ids_list: list[list[int]], args) -> dict:
    """Each variant's candidate configurations timed greedy on the warm-up subset; the fastest wins."""
    subset = ids_list[: args.tune_prompts]
    greedy = Setting("greedy")
    result = {}
    for variant in VARIANTS:
        tried = {}
        candidates = peer.candidates(variant)
        for candidate in candidates:
            peer.run(peer.load(variant, candidate), variant, subset[0], greedy, 0, 16)  # warm-up
        for rnd in range(2):  # two passes, the second in reverse order: drift hits every candidate alike
            for candidate in (candidates if rnd == 0 else candidates[::-1]):
                model = peer.load(variant, candidate)
                runs = [peer.run(model, variant, ids, greedy, 0, args.tune_tokens) for ids in subset]
                totals = tried.setdefault(json.dumps(candidate, sort_keys=True), [0, 0.0])
                totals[0] += sum(r["decode_tokens"] for r in runs)
                totals[1] += sum(r["decode_s"] for r in runs)
        speeds = {key: round(tokens / seconds, 1) for key, (tokens, seconds) in tried.items()}
        best = max(speeds, key=speeds.get)
        result[variant] = {"chosen": json.loads(best),
                           "tried": [{"config": json.loads(key), "tokens_per_s": speed} for key, speed in speeds.items()]}
        log(f"{peer.name} {variant}: chose {best} ({speeds[best]} tok/s of {speeds})")
    if hasattr(peer, "models"):  # keep only the chosen models loaded
        chosen = {(v, json.dumps(result[v]["chosen"], sort_keys=True)) for v in VARIANTS}
        for key in [k for k in peer.models if k not in chosen]:
            del peer.models[key]
    return result


def time_peer(peer, tuning: dict, ids_list, setting: Setting, args, label: str) -> dict:
    """One setting timed with the peer's tuned configuration (label "tuned") or its defaults ("defaults")."""
    reason = peer.supports(setting)
    if reason:
        return {"unsupported": reason}
    configs = {v: tuning[v]["chosen"] for v in VARIANTS} if label == "tuned" else dict.fromkeys(VARIANTS)
    models = {v: peer.load(v, configs[v]) for v in VARIANTS}
    run = lambda v, pi, seed: peer.run(models[v], v, ids_list[pi], setting, seed, args.max_new_tokens)  # noqa: E731
    run("speculative", 0, 0), run("target_only", 0, 0)  # warm-up of this configuration
    return timed_block(run, len(ids_list), args.repeat, setting, f"{peer.name} {label}")


# ----------------------------------------------------------------------------- specdeploy


def bench_ours(args, setting: Setting, ids_list: list[list[int]], greedy_ids: bool = True) -> dict:
    """`specdeploy bench` on the bundle in the main venv, and (greedy, unless greedy_ids is False) our
    speculative token ids of the same ids."""
    cmd = [str(args.ours_python), "-m", "specdeploy", "bench", str(args.ours), "--prompts", str(args.prompts_used),
           "--max-new-tokens", str(args.max_new_tokens), "-k", str(args.num_draft_tokens),
           "--repeat", str(args.repeat), "--temperature", str(setting.temperature), "--json"]
    for flag, value, off in (("--top-k", setting.top_k, 0), ("--top-p", setting.top_p, 1.0),
                             ("--min-p", setting.min_p, 0.0), ("--repetition-penalty", setting.repetition_penalty, 1.0)):
        if value != off:
            cmd += [flag, str(value)]
    log("specdeploy:", " ".join(cmd))
    report = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout.splitlines()[-1])
    out = {v: {"tokens_per_s": round(report[v]["tokens_per_s"], 2), "new_tokens": report[v]["new_tokens"],
               "decode_tokens": report[v]["new_tokens"], "decode_s": round(report[v]["decode_ms"] / 1000, 4),
               "time_share": report[v]["time_share"]} for v in VARIANTS}
    # The cost model's bound: the speedup these passes give with nothing outside ONNX Runtime.
    bound = next(r["leviathan_bound"] for r in report["by_num_draft_tokens"]
                 if r["num_draft_tokens"] == report["num_draft_tokens"])
    out.update(speedup=round(report["speedup"], 3), bound=round(bound, 3), identical_outputs=report["identical_outputs"],
               acceptance_rate=round(report["acceptance_rate"], 4), accepted=report["speculative"]["accepted"],
               drafted=report["speculative"]["drafted"], command=" ".join(cmd))
    if setting.greedy and greedy_ids:
        script = ("import json, sys, specdeploy\n"
                  "g = specdeploy.load(sys.argv[1])\n"
                  "spec = json.loads(sys.stdin.read())\n"
                  "kwargs = dict(max_new_tokens=spec['n'], num_draft_tokens=spec['k'], temperature=0)\n"
                  "if spec['rep'] != 1.0:\n"
                  "    kwargs['repetition_penalty'] = spec['rep']\n"
                  "print(json.dumps([g.generate(ids, **kwargs).token_ids for ids in spec['ids']]))\n")
        spec = {"n": args.max_new_tokens, "k": args.num_draft_tokens, "rep": setting.repetition_penalty, "ids": ids_list}
        done = subprocess.run([str(args.ours_python), "-c", script, str(args.ours)], input=json.dumps(spec),
                              capture_output=True, text=True, check=True, cwd=REPO)
        out["greedy_ids"] = json.loads(done.stdout.splitlines()[-1])
    return out


# ----------------------------------------------------------------------------- report


def cross_check(block: dict) -> dict:
    """Greedy ids of every pair of systems: identical runs and first mismatch per prompt."""
    ids = {name: result["greedy_ids"] for name, result in block.items() if "greedy_ids" in result}
    out = {}
    for a, b in itertools.combinations(sorted(ids), 2):
        mismatches = [first_mismatch(x, y) for x, y in zip(ids[a], ids[b])]
        out[f"{a}_vs_{b}"] = {"identical": f"{sum(m is None for m in mismatches)}/{len(mismatches)}",
                              "first_mismatch_index": mismatches}
    return out


def table(result: dict) -> str:
    lines = ["| setting | system | target-only tok/s | speculative tok/s | speedup | ours spec. vs it |",
             "|---|---|---|---|---|---|"]
    for name, block in result["settings"].items():
        ours = block.get("specdeploy", {}).get("speculative", {}).get("tokens_per_s")
        rows = [("specdeploy", block.get("specdeploy"))]
        for peer in ("ort_genai", "hf_assisted"):
            for label in ("tuned", "defaults"):
                rows.append((f"{peer} ({label})", block.get(peer, {}).get(label)))
        for system, r in rows:
            if not r:
                continue
            t, s = r["target_only"]["tokens_per_s"], r["speculative"]["tokens_per_s"]
            vs = f"{ours / s:.2f}x" if ours and s and system != "specdeploy" else ""
            lines.append(f"| {name} | {system} | {t:.0f} | {s:.0f} | {r['speedup']:.2f} | {vs} |")
    return "\n".join(lines)


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
        info["avx512f"] = any(line.startswith("flags") and " avx512f" in line for line in cpuinfo)
        info["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except (OSError, StopIteration):
        pass
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="HF folder of the target model")
    ap.add_argument("--draft", type=Path, required=True, help="HF folder of the draft model")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSON list of strings, or JSONL with 'prompt'")
    ap.add_argument("--settings", default="greedy,t0.8,t0.8-k50-p0.95", help="comma list (see the docstring)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="times each setting's tuned sequence (peer, ours, other peer) runs, reversed each time")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts (for trials)")
    ap.add_argument("--tune-prompts", type=int, default=3, help="warm-up subset used to choose each peer's configuration")
    ap.add_argument("--tune-tokens", type=int, default=64)
    ap.add_argument("--systems", default="ort,hf", help="comma list of peers: ort, hf")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="built ONNX models and configs")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the ONNX models even if up to date")
    ap.add_argument("--ours", type=Path, default=None, help="a specdeploy bundle of the same pair")
    ap.add_argument("--ours-python", type=Path, default=REPO / ".venv" / "bin" / "python",
                    help="the interpreter with specdeploy installed (the main venv)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    settings = [parse_setting(name) for name in args.settings.split(",") if name]
    prompts = load_prompts(args.prompts)[: args.limit]
    args.work.mkdir(parents=True, exist_ok=True)
    args.prompts_used = args.work / "prompts-used.json"  # what `specdeploy bench` reads: the same (limited) list
    args.prompts_used.write_text(json.dumps(prompts))
    ids_list = encode_prompts(args.target, prompts)
    result: dict = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine_info(), "prompts": len(prompts),
        "prompt_tokens": [len(ids) for ids in ids_list], "max_new_tokens": args.max_new_tokens,
        "num_draft_tokens": args.num_draft_tokens, "repeat": args.repeat, "rounds": args.rounds,
        "settings_defined": {s.name: asdict(s) for s in settings},
        "eos": "every system stops at EOS or max_new_tokens; tokens/s counts each system's own new tokens",
        "tokens_per_s": "decode only: sum(decode tokens) / sum(decode seconds) over prompts and repeats",
        "peers": {}, "tuning": {}, "settings": {s.name: {} for s in settings},
    }
    peers = []
    for key, cls in (("ort", GenaiPeer), ("hf", HfPeer)):
        if key in args.systems.split(","):
            try:
                peer = cls(args)
                result["peers"][peer.name] = {"version": peer.version, "defaults": peer.defaults}
                result["tuning"][peer.name] = tune(peer, ids_list, args)
                peers.append(peer)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, the others still run
                log(traceback.format_exc())
                result["peers"][cls.name] = {"error": f"{type(exc).__name__}: {exc}"}
    for index, setting in enumerate(settings):
        block = result["settings"][setting.name]
        # Ours between the two tuned peers (the whole sequence reversed from one setting to the next),
        # the defaults after: this machine drifts over minutes, and the ratios that matter are ours
        # against the tuned peers. With --rounds the sequence runs again, reversed each time, so that
        # drift within a setting averages out; each system's rounds are summed (merge_rounds).
        timed = lambda peer, label: time_peer(peer, result["tuning"][peer.name], ids_list, setting, args, label)  # noqa: E731
        tuned, ours_rounds = {peer.name: [] for peer in peers}, []
        sequence = peers[:1] + ([None] if args.ours is not None else []) + peers[1:]  # None: ours
        for rnd in range(args.rounds):
            for system in (sequence if (index + rnd) % 2 == 0 else sequence[::-1]):
                if system is None:
                    ours_rounds.append(bench_ours(args, setting, ids_list, greedy_ids=rnd == 0))
                else:
                    tuned[system.name].append(timed(system, "tuned"))
        if ours_rounds:
            block["specdeploy"] = merge_rounds(ours_rounds)
        for peer in peers:
            rounds = tuned[peer.name]
            block[peer.name] = rounds[0] if "unsupported" in rounds[0] else \
                {"tuned": merge_rounds(rounds), "defaults": timed(peer, "defaults")}
        flat = {"specdeploy": block.get("specdeploy", {})}
        flat.update({f"{p.name}": block[p.name].get("tuned", {}) for p in peers})
        if setting.greedy:
            block["cross_check"] = cross_check({k: v for k, v in flat.items() if v})
        ours = block.get("specdeploy", {})
        block["ratios"] = {f"speculative_vs_{p.name}": round(ours["speculative"]["tokens_per_s"]
                                                             / flat[p.name]["speculative"]["tokens_per_s"], 3)
                           for p in peers if ours and "speculative" in flat[p.name]}
    for peer in peers:
        peer.close()
    for block in result["settings"].values():  # ids were for the cross-check; keep the JSON line readable
        for system in block.values():
            for entry in ([system] + [system.get(label, {}) for label in ("tuned", "defaults")]
                          if isinstance(system, dict) else []):
                if isinstance(entry, dict):
                    entry.pop("greedy_ids", None)
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    log(table(result))
    print(json.dumps(result, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
