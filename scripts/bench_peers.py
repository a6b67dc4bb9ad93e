#!/usr/bin/env python3
"""Side-by-side speculative decoding of peer systems on the benchmark pair.

Runs the SAME prompts (the SAME token ids) through

1. onnxruntime-genai 0.18 (fp32, CPU): target-only (the model builder's plain
   genai_config.json) vs. its own draft-model speculative decoding (one composed
   genai_config.json with ``model.type = "speculative"``, a ``model.draft`` block
   naming the draft ONNX model and ``speculative.max_draft_tokens = K``);
2. Hugging Face transformers assisted generation on PyTorch (fp32, CPU):
   ``target.generate(...)`` vs. ``target.generate(..., assistant_model=draft)``
   with a constant K draft tokens per round,

greedy and sampled (plain temperature sampling: top_k 0, top_p 1.0), and prints ONE
JSON line (the last line of stdout). Progress goes to stderr.

Environment (its own venv: onnxruntime-genai 0.18's model builder needs
transformers 5, which the main .venv cannot have)::

    python3.11 -m venv .venv-peers
    .venv-peers/bin/pip install torch==2.13.0
    .venv-peers/bin/pip install -r scripts/peers-requirements.txt

Run (from the repo root)::

    .venv-peers/bin/python scripts/bench_peers.py \
        --target ../shared/models/codepair/target --draft ../shared/models/codepair/draft \
        [--prompts specdeploy/data/code_prompts.json] [--max-new-tokens 128] \
        [--num-draft-tokens 4] [--temperature 0.8] [--repeat 1] [--work .peers-work] \
        [--ours BUNDLE]   # also `specdeploy bench BUNDLE` (main .venv), with ratios against each peer

Built ONNX models and the composed configs go to ``--work`` (default
``.peers-work/`` in the repo root)::

    <work>/onnx/target/   model builder output; genai_config.json = target only
    <work>/onnx/draft/    model builder output
    <work>/onnx/genai_config.json   speculative: decoder = target/model.onnx,
                                    draft = draft/model.onnx (0.18 rejects ".." in
                                    model paths, hence the shared parent folder)

They are rebuilt only when missing, when the source checkpoint changes, or with
``--rebuild``.

onnxruntime-genai 0.18 draft-model speculative decoding, as used here: the
config's ``model.type`` is ``"speculative"``; ``model.decoder`` is the target;
``model.draft`` is a second decoder block of the same shape (filename,
session_options, inputs, outputs, head/layer counts) naming the draft; a
top-level ``"speculative"`` object carries ``max_draft_tokens`` (K, 1..16),
``min_adaptive_k`` (0 = fixed K) and ``cooldown``. The source is
microsoft/onnxruntime-genai src/models/speculative_decoding.cpp (the
``SpeculativeDecodingModel`` constructor requires ``model.draft.filename`` and the
same execution provider for both models) and
test/python/integration/test_integration_speculative.py (overlay
``{"model": {"type": "speculative", "draft": ...}, "speculative":
{"max_draft_tokens": 4}}``). The 0.18 wheel's
``GeneratorParams.get_speculative_options()`` lists the same keys, and its
``Generator.get_speculative_stats()`` gives the acceptance counts reported here.
It supports batch 1, greedy and sampled (speculative-sampling acceptance),
``min_length`` and ``repetition_penalty``.

Measurement notes
-----------------
* Prompts are encoded once with the ``tokenizers`` library from the target
  folder's tokenizer.json, ``add_special_tokens=False`` (no BOS), and those ids
  are fed to every system.
* Every run generates exactly ``--max-new-tokens`` tokens: EOS is masked until
  then (onnxruntime-genai ``min_length``, HF ``min_new_tokens``); neither API
  can simply ignore EOS. The actual counts are reported and used for tokens/s.
* tokens/s is decode throughput. onnxruntime-genai: ``append_tokens(prompt)`` is
  the prefill and is timed apart, so decode = the ``generate_next_token`` loop
  and all new tokens count. HF ``generate`` cannot time the prefill apart, so
  decode runs from the first streamed new tokens (the prefill plus the first
  token, or the first assisted round) to the end, and the tokens of that first
  chunk are left out of the count ("decode_tokens"). ``total_tokens_per_s``
  (everything, prefill included) is reported beside it for both systems.
* Each variant is warmed up once (a full-length greedy run on prompt 0) before
  timing. Runs are interleaved per prompt (target-only and speculative back to
  back, order alternating per repeat). Aggregates are sum(tokens)/sum(seconds)
  over all prompts and repeats.
* Sampled runs use seed ``1000 * prompt_index + repeat`` for both variants.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO / "specdeploy" / "data" / "code_prompts.json"
DEFAULT_WORK = REPO / ".peers-work"


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- prompts


def load_prompts(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, list):
        items = data
    elif isinstance(data, dict):
        items = [data]
    else:  # JSONL
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        else:
            raise ValueError(f"{path}: expected a JSON list of strings or JSONL with a 'prompt' field")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def encode_prompts(target_dir: Path, prompts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return [tok.encode(p, add_special_tokens=False).ids for p in prompts]


# ----------------------------------------------------------------------------- helpers


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(runs: list[dict], n_prompts: int) -> dict:
    tokens = sum(r["new_tokens"] for r in runs)
    decode_tokens = sum(r["decode_tokens"] for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    total_s = sum(r["total_s"] for r in runs)
    per_prompt = []
    for pi in range(n_prompts):
        rs = [r for r in runs if r["prompt_index"] == pi]
        dt = sum(r["decode_tokens"] for r in rs)
        ds = sum(r["decode_s"] for r in rs)
        per_prompt.append(round(dt / ds, 2) if ds > 0 else None)
    counts = sorted({r["new_tokens"] for r in runs})
    return {
        "tokens_per_s": round(decode_tokens / decode_s, 3) if decode_s > 0 else None,
        "total_tokens_per_s": round(tokens / total_s, 3) if total_s > 0 else None,
        "new_tokens": tokens,
        "new_tokens_per_run": counts[0] if len(counts) == 1 else counts,
        "decode_tokens": decode_tokens,
        "decode_s": round(decode_s, 4),
        "total_s": round(total_s, 4),
        "mean_prefill_ms": round(1000 * sum(r["prefill_s"] for r in runs) / len(runs), 3),
        "runs": len(runs),
        "per_prompt_tokens_per_s": per_prompt,
    }


def compare_block(t_runs, s_runs, n_prompts, greedy: bool, extra_spec=None) -> dict:
    t = summarize(t_runs, n_prompts)
    s = summarize(s_runs, n_prompts)
    if extra_spec:
        s.update(extra_spec(s_runs))
    out = {
        "target_only": t,
        "speculative": s,
        "speedup": round(s["tokens_per_s"] / t["tokens_per_s"], 4)
        if s["tokens_per_s"] and t["tokens_per_s"]
        else None,
        "speedup_total": round(s["total_tokens_per_s"] / t["total_tokens_per_s"], 4)
        if s["total_tokens_per_s"] and t["total_tokens_per_s"]
        else None,
    }
    if greedy:
        mism = []
        for tr, sr in zip(t_runs, s_runs):
            assert (tr["prompt_index"], tr["repeat"]) == (sr["prompt_index"], sr["repeat"])
            mism.append(first_mismatch(tr["tokens"], sr["tokens"]))
        out["identical_outputs"] = all(m is None for m in mism)
        out["identical_runs"] = f"{sum(m is None for m in mism)}/{len(mism)}"
        out["first_mismatch_index"] = mism
    return out


def run_matrix(n_prompts, repeat, run_fn) -> dict:
    """run_fn(variant, mode, prompt_index, seed) -> run dict. Interleaves variants per prompt."""
    results = {m: {"target_only": [], "speculative": []} for m in ("greedy", "sampled")}
    for mode in ("greedy", "sampled"):
        for pi in range(n_prompts):
            for rep in range(repeat):
                seed = 1000 * pi + rep
                order = ("target_only", "speculative") if rep % 2 == 0 else ("speculative", "target_only")
                for variant in order:
                    r = run_fn(variant, mode, pi, seed)
                    r.update(prompt_index=pi, repeat=rep)
                    results[mode][variant].append(r)
                    log(
                        f"  {mode:7s} p{pi} r{rep} {variant:11s} new={r['new_tokens']:4d} "
                        f"decode={r['decode_tokens'] / r['decode_s']:8.1f} tok/s prefill={1000 * r['prefill_s']:.1f} ms"
                    )
    for mode in results:  # restore (prompt, repeat) order for pairing
        for v in results[mode]:
            results[mode][v].sort(key=lambda r: (r["prompt_index"], r["repeat"]))
    return results


# ----------------------------------------------------------------------------- onnxruntime-genai


def checkpoint_stamp(src: Path, genai_version: str) -> dict:
    files = sorted(src.glob("*.safetensors")) + sorted(src.glob("*.json"))
    return {
        "source": str(src.resolve()),
        "files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files},
        "onnxruntime_genai": genai_version,
        "precision": "fp32",
        "execution_provider": "cpu",
    }


def build_onnx(src: Path, out: Path, cache: Path, genai_version: str, rebuild: bool) -> bool:
    stamp = checkpoint_stamp(src, genai_version)
    stamp_file = out / "build-stamp.json"
    if (
        not rebuild
        and (out / "model.onnx").exists()
        and (out / "genai_config.builder.json").exists()
        and stamp_file.exists()
        and json.loads(stamp_file.read_text()) == stamp
    ):
        return False
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "onnxruntime_genai.models.builder",
        "-i", str(src), "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(cache),
    ]
    log("building:", " ".join(cmd))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log_file = out.parent / f"build-{out.name}.log"
    log_file.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not (out / "model.onnx").exists():
        raise RuntimeError(f"model builder failed for {src} (rc={proc.returncode}); see {log_file}: "
                           + (proc.stdout + proc.stderr)[-2000:])
    shutil.copy(out / "genai_config.json", out / "genai_config.builder.json")
    stamp_file.write_text(json.dumps(stamp, indent=1))
    return True


def compose_configs(onnx_dir: Path, k: int, threads: int) -> dict:
    """Write <onnx>/target/genai_config.json (target only) and <onnx>/genai_config.json (speculative)."""
    tcfg = json.loads((onnx_dir / "target" / "genai_config.builder.json").read_text())
    dcfg = json.loads((onnx_dir / "draft" / "genai_config.builder.json").read_text())

    def pin_threads(decoder: dict) -> None:
        so = decoder.setdefault("session_options", {})
        so["intra_op_num_threads"] = threads
        so["inter_op_num_threads"] = 1

    plain = copy.deepcopy(tcfg)
    pin_threads(plain["model"]["decoder"])
    (onnx_dir / "target" / "genai_config.json").write_text(json.dumps(plain, indent=4))

    spec = copy.deepcopy(plain)
    spec["model"]["type"] = "speculative"
    spec["model"]["decoder"]["filename"] = "target/model.onnx"
    draft = copy.deepcopy(dcfg["model"]["decoder"])
    draft["filename"] = "draft/model.onnx"
    pin_threads(draft)
    spec["model"]["draft"] = draft
    # max_draft_tokens = K (0.18 accepts 1..16); min_adaptive_k 0 = adaptive K off; cooldown off:
    # a fixed K every round, like HF's "constant" schedule.
    spec["speculative"] = {"max_draft_tokens": k, "min_adaptive_k": 0, "cooldown": False}
    (onnx_dir / "genai_config.json").write_text(json.dumps(spec, indent=4))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (onnx_dir / "target" / name).exists():
            shutil.copy(onnx_dir / "target" / name, onnx_dir / name)
    return spec


ORT_STAT_KEYS = (
    "rounds", "draft_tokens_proposed", "draft_tokens_accepted", "target_forward_passes",
    "draft_forward_passes", "standard_fallback_steps", "effective_k", "tokens_emitted",
    "target_verify_forward_passes", "target_reanchor_forward_passes", "target_reconciliation_forward_passes",
    "total_draft_ms", "total_target_verify_ms", "total_target_reanchor_ms", "total_reconciliation_ms",
)


def bench_ort(args, ids_list: list[list[int]]) -> dict:
    import onnxruntime_genai as og

    res: dict = {"version": og.__version__ if hasattr(og, "__version__") else None}
    try:
        import onnxruntime

        res["onnxruntime_version"] = onnxruntime.__version__
    except Exception:  # noqa: BLE001
        pass
    work = args.work.resolve()
    onnx_dir = work / "onnx"
    for name, src in (("target", args.target), ("draft", args.draft)):
        built = build_onnx(src, onnx_dir / name, work / "hf-cache", res["version"], args.rebuild)
        log(f"onnx {name}: {'built' if built else 'up to date'} in {onnx_dir / name}")
    spec_cfg = compose_configs(onnx_dir, args.num_draft_tokens, args.threads)
    res["configs"] = {"target_only": str(onnx_dir / "target" / "genai_config.json"),
                      "speculative": str(onnx_dir / "genai_config.json")}
    res["genai_config_speculative_extract"] = {
        "model.type": spec_cfg["model"]["type"],
        "model.decoder.filename": spec_cfg["model"]["decoder"]["filename"],
        "model.draft": spec_cfg["model"]["draft"],
        "speculative": spec_cfg["speculative"],
    }
    res["intra_op_num_threads"] = args.threads

    models = {"target_only": og.Model(str(onnx_dir / "target")), "speculative": og.Model(str(onnx_dir))}
    res["model_type"] = {k: m.type for k, m in models.items()}
    n = args.max_new_tokens

    def run(variant: str, mode: str, pi: int, seed: int, ids=None, new=n) -> dict:
        ids = ids_list[pi] if ids is None else ids
        model = models[variant]
        t_start = time.perf_counter()
        params = og.GeneratorParams(model)
        opts = dict(max_length=len(ids) + new, min_length=len(ids) + new, batch_size=1, num_beams=1,
                    repetition_penalty=1.0, no_repeat_ngram_size=0)
        if mode == "sampled":
            opts.update(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=1.0, random_seed=seed)
        else:
            opts.update(do_sample=False)
        params.set_search_options(**opts)
        if variant == "speculative":
            params.set_speculative_options(max_draft_tokens=args.num_draft_tokens)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids)
        t1 = time.perf_counter()
        while not gen.is_done():
            gen.generate_next_token()
        t2 = time.perf_counter()
        toks = [int(x) for x in gen.get_sequence(0)][len(ids):]
        out = {"tokens": toks, "new_tokens": len(toks), "decode_tokens": len(toks), "prefill_s": t1 - t0,
               "decode_s": t2 - t1, "total_s": t2 - t_start}
        if variant == "speculative":
            st = gen.get_speculative_stats()
            out["stats"] = {key: st.get(key) for key in ORT_STAT_KEYS}
        del gen
        return out

    log("onnxruntime-genai warm-up")
    for variant in models:
        run(variant, "greedy", 0, 0)
    log("onnxruntime-genai timed runs")
    raw = run_matrix(len(ids_list), args.repeat, run)

    def spec_extra(runs):
        agg = {key: sum((r["stats"].get(key) or 0) for r in runs) for key in ORT_STAT_KEYS if key != "effective_k"}
        agg = {key: round(v, 3) if isinstance(v, float) else v for key, v in agg.items()}
        prop, acc = agg["draft_tokens_proposed"], agg["draft_tokens_accepted"]
        dp, vp = agg["draft_forward_passes"], agg["target_verify_forward_passes"]
        return {"ort_stats": {
            **agg,
            "ms_per_draft_pass": round(agg["total_draft_ms"] / dp, 3) if dp else None,
            "ms_per_target_verify": round(agg["total_target_verify_ms"] / vp, 3) if vp else None,
            "effective_k": sorted({r["stats"].get("effective_k") for r in runs}),
            "acceptance_rate": round(acc / prop, 4) if prop else None,
            "new_tokens_per_target_verify": round(sum(r["new_tokens"] for r in runs) / agg["target_forward_passes"], 4)
            if agg["target_forward_passes"] else None,
        }}

    n_p = len(ids_list)
    res["greedy"] = compare_block(raw["greedy"]["target_only"], raw["greedy"]["speculative"], n_p, True, spec_extra)
    res["sampled"] = compare_block(raw["sampled"]["target_only"], raw["sampled"]["speculative"], n_p, False,
                                   spec_extra)
    res["token_ids"] = {"greedy_target_only": [r["tokens"] for r in raw["greedy"]["target_only"] if r["repeat"] == 0]}
    res["timing"] = "decode = generate_next_token loop after append_tokens(prompt); prefill excluded; all new tokens counted"
    del models
    gc.collect()
    return res


# ----------------------------------------------------------------------------- HF assisted generation


def bench_hf(args, ids_list: list[list[int]]) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    transformers.logging.set_verbosity_error()  # the assistant's inner generate() warns on every call

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    res: dict = {"version": transformers.__version__, "torch_version": torch.__version__,
                 "torch_threads": torch.get_num_threads()}

    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32, local_files_only=True).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(args.draft), dtype=torch.float32, local_files_only=True).eval()
    # transformers 5 reads the assisted-generation knobs from the ASSISTANT's generation_config.
    # Constant K, and no confidence-based early stop of drafting (default threshold 0.4).
    gc_d = draft.generation_config
    gc_d.num_assistant_tokens = args.num_draft_tokens
    gc_d.num_assistant_tokens_schedule = "constant"
    gc_d.assistant_confidence_threshold = 0.0
    res["assistant_generation_config"] = {
        "num_assistant_tokens": gc_d.num_assistant_tokens,
        "num_assistant_tokens_schedule": gc_d.num_assistant_tokens_schedule,
        "assistant_confidence_threshold": gc_d.assistant_confidence_threshold,
    }
    eos = target.config.eos_token_id
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else eos
    calls = {"target": 0, "draft": 0}
    target.register_forward_hook(lambda *a: calls.__setitem__("target", calls["target"] + 1))
    draft.register_forward_hook(lambda *a: calls.__setitem__("draft", calls["draft"] + 1))

    class TimingStreamer(BaseStreamer):
        def __init__(self):
            self.prompt_seen = False
            self.chunks: list[tuple[float, int]] = []

        def put(self, value):
            if not self.prompt_seen:  # generate() first puts the prompt
                self.prompt_seen = True
                return
            self.chunks.append((time.perf_counter(), int(value.numel())))

        def end(self):
            pass

    n = args.max_new_tokens

    def run(variant: str, mode: str, pi: int, seed: int) -> dict:
        ids = ids_list[pi]
        input_ids = torch.tensor([ids], dtype=torch.long)
        kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                      min_new_tokens=n, eos_token_id=eos, pad_token_id=pad)
        if mode == "sampled":
            kwargs.update(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=1.0)
        else:
            kwargs.update(do_sample=False)
        if variant == "speculative":
            kwargs.update(assistant_model=draft, num_assistant_tokens=args.num_draft_tokens,
                          num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
        streamer = TimingStreamer()
        calls.update(target=0, draft=0)
        torch.manual_seed(seed)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = target.generate(**kwargs, streamer=streamer)
            t2 = time.perf_counter()
        toks = [int(x) for x in out[0, len(ids):].tolist()]
        t1, first_n = streamer.chunks[0]
        return {"tokens": toks, "new_tokens": len(toks), "decode_tokens": len(toks) - first_n,
                "prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0,
                "first_chunk_tokens": first_n, "target_calls": calls["target"], "draft_calls": calls["draft"]}

    log("HF warm-up")
    for variant in ("target_only", "speculative"):
        run(variant, "greedy", 0, 0)
    log("HF timed runs")
    raw = run_matrix(len(ids_list), args.repeat, run)

    def spec_extra(runs):
        tc = sum(r["target_calls"] for r in runs)
        dc = sum(r["draft_calls"] for r in runs)
        return {"hf_stats": {
            "target_forward_calls": tc, "draft_forward_calls": dc,
            "new_tokens_per_target_call": round(sum(r["new_tokens"] for r in runs) / tc, 4) if tc else None,
            "draft_calls_per_target_call": round(dc / tc, 4) if tc else None,
        }}

    n_p = len(ids_list)
    res["greedy"] = compare_block(raw["greedy"]["target_only"], raw["greedy"]["speculative"], n_p, True, spec_extra)
    res["sampled"] = compare_block(raw["sampled"]["target_only"], raw["sampled"]["speculative"], n_p, False,
                                   spec_extra)
    res["token_ids"] = {"greedy_target_only": [r["tokens"] for r in raw["greedy"]["target_only"] if r["repeat"] == 0]}
    res["timing"] = ("decode = from the first streamed new tokens (prefill + first token, or the first assisted "
                     "round) to the end of generate(); the first chunk's tokens are not counted")
    del target, draft
    gc.collect()
    return res


# ----------------------------------------------------------------------------- main


def machine_info(threads: int) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "threads_requested": threads}
    try:
        info["affinity_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
        info["avx512f"] = " avx512f " in f" {flags} "
    except OSError:
        pass
    try:
        info["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def bench_ours(args) -> dict:
    """`specdeploy bench` on the bundle, greedy then sampled, in the main venv (a subprocess: this venv
    has transformers 5). Same prompts file, token budget, K and temperature as the peers."""
    res: dict = {"bundle": str(args.ours)}
    for mode, temperature in (("greedy", 0.0), ("sampled", args.temperature)):
        cmd = [str(args.ours_python), "-m", "specdeploy", "bench", str(args.ours), "--prompts", str(args.prompts),
               "--max-new-tokens", str(args.max_new_tokens), "-k", str(args.num_draft_tokens),
               "--temperature", str(temperature), "--top-k", str(args.top_k), "--repeat", str(args.repeat), "--json"]
        log(f"specdeploy {mode}: {' '.join(cmd)}")
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
        report = json.loads(out.strip().splitlines()[-1])
        res[mode] = {key: report[key] for key in ("target_only", "speculative", "speedup", "identical_outputs",
                                                  "acceptance_rate", "mean_accepted_tokens", "peak_rss_mb",
                                                  "memory_budget_mb", "drafter")}
        res["command_" + mode] = " ".join(cmd)
    return res


def ratios(result: dict) -> dict:
    """specdeploy against each peer, decode tokens/s over decode tokens/s (the issue's targets)."""
    ours = result.get("specdeploy", {})
    out: dict = {}
    for key in ("ort_genai", "hf_assisted"):
        peer = result.get(key, {})
        for mode in ("greedy", "sampled"):
            if mode not in ours or mode not in peer:
                continue
            for variant in ("target_only", "speculative"):
                a, b = ours[mode][variant]["tokens_per_s"], peer[mode][variant]["tokens_per_s"]
                if a and b:
                    out[f"{mode}_{variant}_vs_{key}"] = round(a / b, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="HF folder of the target model")
    ap.add_argument("--draft", type=Path, required=True, help="HF folder of the draft model")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                    help="JSON list of strings, or JSONL with a 'prompt' field")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=0,
                    help="top_k of the sampled runs, both systems (0 = off: plain temperature sampling)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="use only the first N prompts (for trials)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="built ONNX models and configs")
    ap.add_argument("--threads", type=int, default=2, help="ORT intra-op threads and torch threads")
    ap.add_argument("--systems", default="ort,hf", help="comma list of: ort, hf")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the ONNX models even if up to date")
    ap.add_argument("--ours", type=Path, default=None,
                    help="a specdeploy bundle of the same pair: run `specdeploy bench` on it in the same run")
    ap.add_argument("--ours-python", type=Path, default=REPO / ".venv" / "bin" / "python",
                    help="the interpreter with specdeploy installed (the main venv)")
    args = ap.parse_args()

    prompts = load_prompts(args.prompts)
    if args.limit:
        prompts = prompts[: args.limit]
    ids_list = encode_prompts(args.target, prompts)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    result: dict = {
        "prompts": len(prompts),
        "prompts_file": str(args.prompts),
        "prompt_tokens": [len(x) for x in ids_list],
        "max_new_tokens": args.max_new_tokens,
        "num_draft_tokens": args.num_draft_tokens,
        "temperature": args.temperature,
        "sampling": f"temperature {args.temperature}, top_k {args.top_k} (0 = off), top_p 1.0",
        "top_k": args.top_k,
        "repeat": args.repeat,
        "eos": "masked until max_new_tokens (ORT min_length, HF min_new_tokens)",
        "tokens_per_s": "decode-only, aggregated as sum(decode tokens)/sum(decode seconds); see each system's 'timing'",
    }
    for name, fn, key in (("ort", bench_ort, "ort_genai"), ("hf", bench_hf, "hf_assisted")):
        if name not in systems:
            continue
        try:
            result[key] = fn(args, ids_list)
        except Exception as exc:  # noqa: BLE001
            log(traceback.format_exc())
            result[key] = {"error": f"{type(exc).__name__}: {exc}"}
    if args.ours is not None:
        result["specdeploy"] = bench_ours(args)
        result["specdeploy_vs_peers"] = ratios(result)
    ort, hf = result.get("ort_genai", {}), result.get("hf_assisted", {})
    if "token_ids" in ort and "token_ids" in hf:
        a, b = ort["token_ids"]["greedy_target_only"], hf["token_ids"]["greedy_target_only"]
        mism = [first_mismatch(x, y) for x, y in zip(a, b)]
        result["cross_check"] = {
            "greedy_target_only_ort_vs_hf_identical": f"{sum(m is None for m in mism)}/{len(mism)}",
            "first_mismatch_index": mism,
        }
    result["machine"] = machine_info(args.threads)
    try:
        result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    print(json.dumps(result, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
