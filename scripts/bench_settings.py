#!/usr/bin/env python3
"""Every sampling setting in one process, interleaved: does any setting cost speed?

For each prompt, every setting runs target-only and speculative back to back (the order of the
settings rotating from prompt to prompt), so ratios between settings are taken seconds apart,
not minutes. Reported per setting: target-only and speculative tokens/s, target-only against
greedy target-only, the speedup, acceptance, the share of decode time outside ONNX Runtime, and the
cost model's bound (`specdeploy bench`'s): the speedup the same passes give with nothing outside
ONNX Runtime, the most that faster sampling and bookkeeping can reach.
Settings use scripts/bench_peers.py's words (greedy, tT, kK, pP, minpM, repR, joined by "-").

    .venv/bin/python scripts/bench_settings.py BUNDLE [--settings greedy,t0.8,...] [-k 4] [--max-new-tokens 128]

Prints a Markdown table to stderr and one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import parse_setting  # noqa: E402

DEFAULT = "greedy,t0.8,t0.8-k50,t0.8-p0.95,t0.8-k50-p0.95,t0.8-minp0.05,greedy-rep1.1,t0.8-p0.95-rep1.1"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--settings", default=DEFAULT)
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    import specdeploy
    from specdeploy.bench import KResult, ModeTotals, builtin_prompts

    settings = [parse_setting(name) for name in args.settings.split(",")]
    options = {s.name: {k: v for k, v in asdict(s).items() if k != "name"} for s in settings}
    generator = specdeploy.load(args.bundle)
    prompts = builtin_prompts()
    for s in settings:  # warm-up of every path
        generator.generate(prompts[0], max_new_tokens=32, speculative=False, **options[s.name])
        generator.generate(prompts[0], max_new_tokens=32, num_draft_tokens=args.num_draft_tokens, **options[s.name])
    totals = {s.name: {"target_only": ModeTotals(), "speculative": ModeTotals()} for s in settings}
    for repeat in range(args.repeat):
        for index, prompt in enumerate(prompts):
            shift = (index + repeat) % len(settings)
            for s in settings[shift:] + settings[:shift]:
                for speculative in ((False, True) if index % 2 == 0 else (True, False)):
                    generator.reset()
                    out = generator.generate(prompt, max_new_tokens=args.max_new_tokens, seed=index, speculative=speculative,
                                             num_draft_tokens=args.num_draft_tokens, **options[s.name])
                    totals[s.name]["speculative" if speculative else "target_only"].add(out.stats)
            print(f"prompt {index + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    greedy = totals[settings[0].name]["target_only"].tokens_per_s
    rows = {}
    for s in settings:
        t, sp = totals[s.name]["target_only"], totals[s.name]["speculative"]
        rows[s.name] = {
            "target_only_tokens_per_s": round(t.tokens_per_s, 1), "speculative_tokens_per_s": round(sp.tokens_per_s, 1),
            "target_only_vs_first": round(t.tokens_per_s / greedy, 3), "speedup": round(sp.tokens_per_s / t.tokens_per_s, 3),
            "acceptance_rate": round(sp.accepted / sp.drafted, 3) if sp.drafted else None,
            "other_share_target_only": round(t.other_ms / t.decode_ms, 4),
            "other_share_speculative": round(sp.other_ms / sp.decode_ms, 4),
            "bound": round(KResult(args.num_draft_tokens, sp, None).summary(t)["leviathan_bound"], 3),
            "new_tokens": [t.new_tokens, sp.new_tokens],
        }
    print(f"| setting | target-only tok/s | vs {settings[0].name} | speculative tok/s | speedup | acceptance "
          "| outside ONNX Runtime (target-only / speculative) | bound (nothing outside it) |\n"
          "|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for name, r in rows.items():
        print(f"| {name} | {r['target_only_tokens_per_s']:.0f} | {r['target_only_vs_first']:.2f} | "
              f"{r['speculative_tokens_per_s']:.0f} | {r['speedup']:.2f} | {r['acceptance_rate'] or 0:.2f} | "
              f"{100 * r['other_share_target_only']:.1f}% / {100 * r['other_share_speculative']:.1f}% | "
              f"{r['bound']:.2f} |", file=sys.stderr)
    print(json.dumps({"bundle": str(args.bundle), "num_draft_tokens": args.num_draft_tokens,
                      "max_new_tokens": args.max_new_tokens, "repeat": args.repeat, "settings": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
