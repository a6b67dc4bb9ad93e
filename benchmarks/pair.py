"""A target with a same-family draft against llama.cpp, over prompts written for it (the hybrid drafter's rule
was chosen from round logs of them: docs/performance.md).

    python -m benchmarks.pair --bundle WORK/bundles/qwen-coder-1.5b-gguf [--bundle trimmed=OTHER_BUNDLE] \\
        --target-gguf WORK/gguf/qwen-coder-1.5b.gguf --draft-gguf WORK/gguf/qwen-coder-0.5b.gguf \\
        --llama-bin LLAMA_CPP/build/bin --settings greedy,sampled --rounds 1 [--draft-max 3,4 --p-min 0,0.75]

Each prompt is a user message through the chat template (the Qwen2.5-Coder pair's `prepare` in
benchmarks/real_models.py makes the bundle and the GGUF files). Settings: greedy, and sampled (T 0.7,
top-p 0.9, one seed per prompt). Each run decodes --tokens new tokens, EOS not allowed to end it, on 2
threads; a rate is new tokens over decode time (prefill not counted), as every system reports it.

A round runs, in this order:
- ours, one process per bundle: for each prompt and setting, the target alone, `--drafter model` and
  `--drafter hybrid` one after the other (interleaved, the same loaded weights; --systems), k = 4 (the
  policy may draft fewer: it chooses from measured costs; `model-always` drafts 4 every round), each greedy
  text checked against the target alone's;
- llama.cpp's target alone: `llama-bench -t 2 -p 0 -n TOKENS` (decode speed does not depend on the prompt);
- llama.cpp's speculative decoding: `llama-speculative-simple` (draft-simple) on the same rendered prompt, at
  each --draft-max and --p-min, a fresh process per prompt.
The table gives each system's total tokens over total decode time per prompt kind (code, chat) and
setting (with --rounds N, of each prompt's run of median rate), and its ratio to our target alone and to
llama.cpp's fastest configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from .real_models import llama_speculative_run, time_llama

# Written for this benchmark and never used to tune a drafter or a policy.
PROMPTS = [("code", "Write a Python function that merges two sorted lists into one sorted list."),
           ("code", "Write a JavaScript function that debounces another function, with a short usage example."),
           ("code", "Write a SQL query that returns the five customers with the highest total order value."),
           ("code", "Write a Python class for an LRU cache with get and put methods."),
           ("chat", "What causes the seasons on Earth?"),
           ("chat", "Suggest a three-day itinerary for a first visit to Rome."),
           ("chat", "Explain the difference between a process and a thread."),
           ("chat", "Write a short, polite email declining a meeting invitation.")]
SETTINGS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}
# Our systems: name -> (load's drafter, its policy, speculative); the target alone runs on the hybrid's load (a
# bundle without a draft model has no other)
SYSTEMS = {"target": ("hybrid", "auto", False), "model": ("model", "auto", True), "hybrid": ("hybrid", "auto", True),
           "model-always": ("model", "always", True)}


def ours_child(args) -> None:
    """One process: each prompt and setting through the target alone and both drafters, interleaved."""
    import specdeploy
    from specdeploy.runtime import SessionConfig

    session = SessionConfig(intra_op_threads=2, shared_threads=True)
    loads = {SYSTEMS[name][:2] for name in args.systems}
    generators = {key: specdeploy.load(args.path, drafter=key[0], policy=key[1], session=session) for key in loads}
    for generator in generators.values():  # untimed: the first long prefill and decode of each load
        generator.generate(generator.encode_chat([{"role": "user", "content": PROMPTS[0][1]}]), max_new_tokens=16)
    results = []
    for index, (kind, text) in enumerate(PROMPTS[: args.prompts]):
        ids = next(iter(generators.values())).encode_chat([{"role": "user", "content": text}])
        for setting in args.settings:
            options = dict(SETTINGS[setting], max_new_tokens=args.tokens, ignore_eos=True, seed=index,
                           num_draft_tokens=4)
            for name in args.systems:
                drafter, policy, speculative = SYSTEMS[name]
                output = generators[(drafter, policy)].generate(ids, speculative=speculative, **options)
                stats = output.stats
                results.append({"kind": kind, "prompt": index, "setting": setting, "system": name,
                                "tokens": stats.new_tokens, "seconds": stats.decode_ms / 1000.0,
                                "ids": output.token_ids, "drafted": stats.drafted, "accepted": stats.accepted})
    print(json.dumps(results))


def rendered_prompt(bundle: str, text: str) -> str:
    """The chat template's text for one user message (what llama.cpp is given to tokenize)."""
    from specdeploy.bundle import load_manifest
    from specdeploy.runtime.chat import load_chat_template

    manifest = load_manifest(Path(bundle))
    return load_chat_template(Path(bundle) / manifest.tokenizer.path).render([{"role": "user", "content": text}])


def llama_speculative(args, prompt: str, setting: str, draft_max: int, p_min: float, seed: int) -> tuple[int, float]:
    """(tokens, decode seconds) of one llama-speculative-simple run."""
    sampling = SETTINGS[setting]
    return llama_speculative_run(args.llama_bin / "llama-speculative-simple", args.target_gguf, args.draft_gguf, prompt,
                                 args.tokens, "--spec-draft-n-max", str(draft_max), "--spec-draft-p-min", str(p_min),
                                 "--temp", str(sampling["temperature"]), "--top-p", str(sampling.get("top_p", 1.0)),
                                 "--top-k", "0", "--seed", str(seed))


def llama_alone(args) -> tuple[int, float]:
    return args.tokens, args.tokens / time_llama(args.llama_bin / "llama-bench", args.target_gguf, args.tokens)


def run_round(args, totals: dict, greedy_texts: dict) -> None:
    for name, path in args.bundle:
        command = [sys.executable, "-m", "benchmarks.pair", "--child", "--path", path, "--tokens", str(args.tokens),
                   "--prompts", str(args.prompts), "--settings", ",".join(args.settings),
                   "--systems", ",".join(args.systems)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"error: {name}: {(result.stderr.strip().splitlines() or ['the child failed'])[-1]}")
        for run in json.loads(result.stdout.strip().splitlines()[-1]):
            system = f"specdeploy {name} {run['system']}" if run["system"] != "target" else f"specdeploy {name} target alone"
            _add(totals, system, run["setting"], run["kind"], run["prompt"], run["tokens"], run["seconds"])
            if run["setting"] == "greedy":
                greedy_texts[(name, run["prompt"], run["system"])] = run["ids"]
            print(f"  {system} {run['setting']} prompt {run['prompt']}: {run['tokens'] / run['seconds']:.1f} tok/s"
                  + (f", kept {run['accepted']}/{run['drafted']}" if run["drafted"] else ""), flush=True)
    if args.llama_bin is None:
        return
    tokens, seconds = llama_alone(args)
    for setting in args.settings:
        for kind in {kind for kind, _ in PROMPTS[: args.prompts]}:
            _add(totals, "llama.cpp target alone", setting, kind, -1, tokens, seconds)
    print(f"  llama.cpp target alone: {tokens / seconds:.1f} tok/s", flush=True)
    for index, (kind, text) in enumerate(PROMPTS[: args.prompts]):
        prompt = rendered_prompt(args.bundle[0][1], text)
        for setting in args.settings:
            for draft_max in args.draft_max:
                for p_min in args.p_min:
                    tokens, seconds = llama_speculative(args, prompt, setting, draft_max, p_min, index)
                    system = f"llama.cpp speculative draft-max {draft_max} p-min {p_min}"
                    _add(totals, system, setting, kind, index, tokens, seconds)
                    print(f"  {system} {setting} prompt {index}: {tokens / seconds:.1f} tok/s", flush=True)


def _add(totals: dict, system: str, setting: str, kind: str, prompt: int, tokens: int, seconds: float) -> None:
    """One run: its (tokens, seconds) among the rounds' runs of that prompt (-1: llama-bench's, any prompt)."""
    totals[(system, setting, kind)].setdefault(prompt, []).append((tokens, seconds))


def _rate(runs: dict) -> float | None:
    """Tokens over seconds, summed over the prompts, each prompt's run the one of median rate over the rounds
    (of an even count, the slower middle one): a run slowed by another job on the host counts for no more."""
    tokens = seconds = 0.0
    for prompt_runs in runs.values():
        ordered = sorted(prompt_runs, key=lambda run: run[0] / run[1] if run[1] else 0.0)
        middle = ordered[(len(ordered) - 1) // 2]
        tokens, seconds = tokens + middle[0], seconds + middle[1]
    return tokens / seconds if seconds else None


def report(args, totals: dict, greedy_texts: dict) -> dict:
    kinds = sorted({kind for kind, _ in PROMPTS[: args.prompts]})
    systems = list(dict.fromkeys(system for system, _, _ in totals))
    rates = {key: rate for key, runs in totals.items() if (rate := _rate(runs)) is not None}
    print(f"\ndecode tok/s, {args.tokens} new tokens, 2 threads, {args.rounds} round(s), {args.prompts} prompts")
    for setting in args.settings:
        for kind in kinds:
            ours = rates.get((f"specdeploy {args.bundle[0][0]} target alone", setting, kind))
            llama = max((rate for (system, s, k), rate in rates.items()
                         if system.startswith("llama.cpp") and s == setting and k == kind), default=None)
            print(f"\n{setting}, {kind}\n| system | tok/s | / our target alone | / llama.cpp's fastest |\n|---|---|---|---|")
            for system in systems:
                rate = rates.get((system, setting, kind))
                if rate is not None:
                    print(f"| {system} | {rate:.1f} | {rate / ours:.2f} | " + (f"{rate / llama:.2f} |" if llama else "- |")
                          if ours else f"| {system} | {rate:.1f} | - | - |")
    same = defaultdict(lambda: [0, 0])
    for (name, prompt, system), ids in greedy_texts.items():
        if system != "target":
            same[(name, system)][0] += ids == greedy_texts[(name, prompt, "target")]
            same[(name, system)][1] += 1
    for (name, system), (equal, count) in same.items():
        print(f"greedy text of {name} {system} = the target alone's: {equal} of {count} runs")
    return {"rates": {" | ".join(key): rate for key, rate in rates.items()},
            "greedy_same": {f"{name} {system}": counts for (name, system), counts in same.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", action="append", default=[], help="[NAME=]BUNDLE with a draft (the first names the "
                                                                       "target alone the ratios are taken against)")
    parser.add_argument("--target-gguf", type=Path), parser.add_argument("--draft-gguf", type=Path)
    parser.add_argument("--llama-bin", type=Path, default=None, help="llama.cpp's bin folder (llama-bench, "
                                                                      "llama-speculative-simple and their libraries)")
    parser.add_argument("--settings", default="greedy,sampled")
    parser.add_argument("--systems", default="target,model,hybrid", help=f"ours, of {', '.join(SYSTEMS)} (model-always: "
                                                                          "k = 4 every round, the policy 'always')")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N of the built-in prompts")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each prompt and system (the median counts)")
    parser.add_argument("--draft-max", default="3", help="llama-speculative-simple's --spec-draft-n-max values")
    parser.add_argument("--p-min", default="0", help="its --spec-draft-p-min values")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.settings = [s for s in args.settings.split(",") if s]
    args.systems = [s for s in args.systems.split(",") if s]
    if "target" not in args.systems or any(s not in SYSTEMS for s in args.systems):
        raise SystemExit(f"error: --systems takes target and any of {', '.join(SYSTEMS)}")
    if any(s not in SETTINGS for s in args.settings):
        raise SystemExit(f"error: --settings takes {', '.join(SETTINGS)}")
    if args.child:
        ours_child(args)
        return 0
    if not args.bundle:
        raise SystemExit("error: pass --bundle BUNDLE (a bundle with a draft)")
    if args.llama_bin is not None and (args.target_gguf is None or args.draft_gguf is None):
        raise SystemExit("error: --llama-bin needs --target-gguf and --draft-gguf")
    args.bundle = [tuple(b.split("=", 1)) if "=" in b else (Path(b).name, b) for b in args.bundle]
    if args.llama_bin is not None:  # llama.cpp's libraries beside its binaries
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(args.llama_bin), os.environ.get("LD_LIBRARY_PATH")]))
    args.draft_max = [int(v) for v in args.draft_max.split(",")]
    args.p_min = [float(v) for v in args.p_min.split(",")]
    totals: dict = defaultdict(dict)
    greedy_texts: dict = {}
    started = time.perf_counter()
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}", flush=True)
        run_round(args, totals, greedy_texts)
    summary = report(args, totals, greedy_texts)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
