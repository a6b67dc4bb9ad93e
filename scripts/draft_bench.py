#!/usr/bin/env python3
"""Drafts for one target, side by side: acceptance by position, tokens per round, the draft's step cost,
and speed against the target alone, on held-out chat and code prompts, interleaved.

Each BUNDLE holds the same target with another draft (the distilled eagle head and model draft,
their vocabulary subsets, a shipped draft). For every prompt and setting, each bundle runs the
target alone and then speculatively, back to back, the bundles in turn, so every ratio is taken
seconds apart on this noisy host; `--repeat` runs the whole loop again.

    python scripts/draft_bench.py --bundle NAME=BUNDLE [--bundle ...] [--settings greedy,t0.7-p0.9]
        [--max-new-tokens 128] [--repeat 2] [--drafter model] [-k 4] [--draft-confidence P]
        [--policies auto,always] [--exact] [--json OUT]

--policies loads each bundle once per speculation policy (named "NAME POLICY"): "always" drafts k
tokens every round; "auto" (the default) lets a greedy row draft fewer (at least one, or with
--exact, load(exact=True), none) where the costs measured at load say that pays (runtime/policy.py).

Prompts: `specdeploy bench`'s code prompts (specdeploy/data/code_prompts.json) as text, and CHAT below
through the bundle's chat template (skipped without one); none is a seed prompt of `specdeploy
distill` (checked at start). EOS ends a run (the chat reply's end of turn too), as users run it.

Reported per bundle, kind (chat, code) and setting: the target-only and speculative tokens/s
(median over prompts and repeats), their ratio, acceptance by draft position (the share of
rounds whose i-th draft token was kept, among the rounds that drafted at least i tokens), draft
tokens per draft round, the share of rounds that ran the target alone, tokens per round, and the
draft's step cost (draft time per draft pass, over target-only time per target pass).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import specdeploy
from specdeploy.distill import prompts as seed_prompts

ROOT = Path(__file__).resolve().parents[1]
CHAT = ["What is the capital of France?", "Give me three tips for a good night's sleep.",
        "Explain what a hash table is in two sentences.", "Write a haiku about the sea.",
        "How do I reverse a list in Python?", "What are the benefits of regular exercise?",
        "Describe the water cycle briefly.", "How do I write a for loop in JavaScript?"]
SETTINGS = {"greedy": {}, "t0.7-p0.9": dict(temperature=0.7, top_p=0.9), "t0.8": dict(temperature=0.8)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", action="append", required=True, help="NAME=BUNDLE (repeatable)")
    parser.add_argument("--settings", default="greedy,t0.7-p0.9")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--drafter", default="model", help="model | hybrid")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    parser.add_argument("--code-prompts", type=int, default=6)
    parser.add_argument("--chat-prompts", type=int, default=6)
    parser.add_argument("--draft-confidence", type=float, default=0.0,
                        help="the speculative runs stop drafting once the draft's top probability falls below this")
    parser.add_argument("--policies", default="auto", help="speculation policies, comma-separated (auto, always)")
    parser.add_argument("--exact", action="store_true", help="load every bundle with exact=True")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    seeds = set(seed_prompts.CHAT) | set(seed_prompts.CODE) | set(seed_prompts.HELDOUT_CHAT) | set(seed_prompts.HELDOUT_CODE)
    code = json.loads((ROOT / "specdeploy" / "data" / "code_prompts.json").read_text())[: args.code_prompts]
    chat = CHAT[: args.chat_prompts]
    assert not seeds & (set(code) | set(chat)), "a benchmark prompt is a distill seed prompt"
    bundles = dict(item.split("=", 1) for item in args.bundle)
    policies = args.policies.split(",")
    labels = {(name if len(policies) == 1 else f"{name} {policy}"): (path, policy) for name, path in bundles.items()
              for policy in policies}
    generators = {label: specdeploy.load(path, drafter=args.drafter, policy=policy, exact=args.exact)
                  for label, (path, policy) in labels.items()}
    runs: list[dict] = []
    for repeat in range(args.repeat):
        for kind, texts in (("chat", chat), ("code", code)):
            for index, text in enumerate(texts):
                for setting in args.settings.split(","):
                    for name, generator in generators.items():
                        run = _pair(generator, kind, text, SETTINGS[setting], args, seed=repeat * 1000 + index)
                        if run is not None:
                            runs.append({"bundle": name, "kind": kind, "setting": setting, "repeat": repeat, **run})
    table = _summarize(runs, list(generators), args.settings.split(","), args.num_draft_tokens)
    print(_markdown(table), file=sys.stderr)
    result = {"bundles": {label: path for label, (path, _) in labels.items()}, "policies": policies, "settings": args.settings,
              "max_new_tokens": args.max_new_tokens, "k": args.num_draft_tokens, "draft_confidence": args.draft_confidence,
              "drafter": args.drafter, "summary": table, "runs": runs}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps({"summary": table}))
    return 0


def _pair(generator, kind: str, text: str, options: dict, args, seed: int) -> dict | None:
    """The target alone, then speculative decoding, on one prompt."""
    if kind == "chat":
        if generator.chat_template is None:
            return None
        prompt = dict(messages=[{"role": "user", "content": text}])
    else:
        prompt = dict(prompt=text)
    common = dict(max_new_tokens=args.max_new_tokens, seed=seed, **options)
    alone = generator.generate(**prompt, speculative=False, **common).stats
    spec = generator.generate(**prompt, num_draft_tokens=args.num_draft_tokens, draft_confidence=args.draft_confidence,
                              **common).stats
    return {"target_tok_s": alone.tokens_per_s, "spec_tok_s": spec.tokens_per_s,
            "target_step_ms": alone.target_ms / max(1, alone.target_calls),
            "draft_step_ms": spec.draft_ms / max(1, spec.draft_calls), "draft_calls": spec.draft_calls,
            "rounds": spec.rounds, "draft_rounds": spec.draft_rounds, "new_tokens": spec.new_tokens,
            "accepted": spec.accepted, "drafted": spec.drafted, "accepted_by_position": spec.accepted_by_position,
            "drafted_by_position": spec.drafted_by_position}


def _summarize(runs: list[dict], bundles: list[str], settings: list[str], k: int) -> list[dict]:
    rows = []
    for name in bundles:
        for kind in ("chat", "code"):
            for setting in settings:
                chosen = [r for r in runs if r["bundle"] == name and r["kind"] == kind and r["setting"] == setting]
                if not chosen:
                    continue
                draft_rounds = sum(r["draft_rounds"] for r in chosen)
                by_position = [sum(r["accepted_by_position"][i] for r in chosen) / max(1, sum(r["drafted_by_position"][i] for r in chosen))
                               for i in range(k)]
                rounds = sum(r["rounds"] for r in chosen)
                target = statistics.median(r["target_tok_s"] for r in chosen)
                spec = statistics.median(r["spec_tok_s"] for r in chosen)
                rows.append({
                    "bundle": name, "kind": kind, "setting": setting, "runs": len(chosen),
                    "target_tok_s": round(target, 1), "spec_tok_s": round(spec, 1),
                    "speedup": round(statistics.median(r["spec_tok_s"] / r["target_tok_s"] for r in chosen), 3),
                    "acceptance_by_position": [round(a, 3) for a in by_position],
                    "draft_tokens_per_draft_round": round(sum(r["drafted"] for r in chosen) / max(1, draft_rounds), 2),
                    "target_only_rounds": round(1 - draft_rounds / max(1, rounds), 3),
                    "tokens_per_round": round(sum(r["new_tokens"] for r in chosen) / max(1, rounds), 2),
                    "draft_step_cost": round(statistics.median(r["draft_step_ms"] / r["target_step_ms"] for r in chosen
                                                               if r["draft_calls"]) if any(r["draft_calls"] for r in chosen)
                                             else 0.0, 3),
                })
    return rows


def _markdown(rows: list[dict]) -> str:
    lines = ["| draft | prompts | setting | target-only tok/s | speculative tok/s | speedup | acceptance by position "
             "| drafts / draft round | target-only rounds | tokens/round | draft step / target step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bundle']} | {r['kind']} | {r['setting']} | {r['target_tok_s']} | {r['spec_tok_s']} | "
                     f"{r['speedup']:.2f}x | {' / '.join(f'{a:.2f}' for a in r['acceptance_by_position'])} | "
                     f"{r['draft_tokens_per_draft_round']} | {r['target_only_rounds']:.2f} | "
                     f"{r['tokens_per_round']} | {r['draft_step_cost']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
