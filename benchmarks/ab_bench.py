"""Interleaved A/B of two checkouts with `specdeploy bench`: is the new code as fast as the old?

Each checkout runs `python -m specdeploy bench BUNDLE ... --json` from its own folder (so it
imports its own package and C kernel), alternating A, B, B, A, ... for --runs pairs per setting,
and the ratio B/A of speculative and target-only tokens/s is reported per setting from the summed
decode time of its runs. Machine drift hits both sides alike; differences within a few percent
need repeats before they mean anything.

    git worktree add /tmp/base <commit> && (cd /tmp/base && python setup.py build_ext --inplace -q)
    python -m benchmarks.ab_bench --a /tmp/base --b . --bundle bench-bundle --runs 3 \
        --setting greedy= --setting "t0.8=--temperature 0.8"
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path


def bench(checkout: Path, bundle: Path, extra: list[str], python: str) -> dict:
    cmd = [python, "-m", "specdeploy", "bench", str(bundle.resolve()), "--json", *extra]
    done = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="the base checkout")
    ap.add_argument("--b", type=Path, required=True, help="the new checkout")
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=3, help="A/B pairs per setting")
    ap.add_argument("--setting", action="append", default=[], help="NAME=BENCH ARGS (repeatable)")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    settings = [s.split("=", 1) for s in (args.setting or ["greedy="])]
    result = {}
    for name, extra in settings:
        totals = {side: {"target_only": [0, 0.0], "speculative": [0, 0.0]} for side in "ab"}
        for run in range(args.runs):
            for side in ("ab" if run % 2 == 0 else "ba"):
                report = bench(getattr(args, side), args.bundle, shlex.split(extra), args.python)
                for variant in ("target_only", "speculative"):
                    totals[side][variant][0] += report[variant]["new_tokens"]
                    totals[side][variant][1] += report[variant]["decode_ms"]
                print(f"{name} run {run} {side}: speculative {report['speculative']['tokens_per_s']:.0f} tok/s, "
                      f"target-only {report['target_only']['tokens_per_s']:.0f}", file=sys.stderr, flush=True)
        speed = {side: {v: 1000 * n / ms for v, (n, ms) in totals[side].items()} for side in "ab"}
        result[name] = {"a": speed["a"], "b": speed["b"],
                        "b_over_a": {v: round(speed["b"][v] / speed["a"][v], 4) for v in speed["a"]}}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
