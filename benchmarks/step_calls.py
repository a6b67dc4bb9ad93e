"""Python function calls per decoding round: the interpreter's share of a step, counted, not timed.

Loads a bundle, warms it, then generates with a profile hook that counts every call into a Python
function (`sys.setprofile`'s "call" events; C functions and NumPy's kernels are not counted) and
divides by the scheduler's steps, by the rows' rounds the stats report (a step of n decoding rows
is n rounds) and by the tokens. Run it from a checkout to count that checkout's code:

    python -m benchmarks.step_calls BUNDLE --max-batch 1 --prompts 4 --max-new-tokens 64
    python -m benchmarks.step_calls BUNDLE --max-batch 8 --prompts 8 --temperature 0.8 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import specdeploy

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef walk(path):\n",
           "def quicksort(items):\n", "def parse_args(argv):\n", "class Node:\n", "def read_json(path):\n",
           "def merge(a, b):\n"]


def count_calls(generator, prompts: list[str], by_function: Counter | None = None, **kwargs) -> tuple[int, int, int, int]:
    """(python calls, scheduler steps, rounds, new tokens) over generate_many(prompts, **kwargs)."""
    calls = steps = 0
    step = type(generator.scheduler).step.__code__

    def hook(frame, event, arg):
        nonlocal calls, steps
        if event == "call":
            calls += 1
            steps += frame.f_code is step
            if by_function is not None:
                code = frame.f_code
                by_function[f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}"] += 1

    sys.setprofile(hook)
    try:
        outputs = generator.generate_many(prompts, **kwargs)
    finally:
        sys.setprofile(None)
    rounds = sum(output.stats.rounds for output in outputs)
    return calls, steps, rounds, sum(output.stats.new_tokens for output in outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--max-batch", type=int, default=1, help="KV slots (sequences decoded together)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts generated, in one generate_many call")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=True,
                        help="speculative rounds, or target-only steps")
    parser.add_argument("--top", type=int, default=0, help="print the N most called functions")
    parser.add_argument("--json", action="store_true", help="one JSON line")
    args = parser.parse_args()
    generator = specdeploy.load(args.bundle, max_batch=args.max_batch)
    generator.warm_up()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0, ignore_eos=True,
                    speculative=args.speculative)
    generator.generate_many(prompts, **settings)  # the shapes' first runs
    by_function = Counter() if args.top else None
    calls, steps, rounds, tokens = count_calls(generator, prompts, by_function, **settings)
    result = {"max_batch": args.max_batch, "prompts": len(prompts), "temperature": args.temperature,
              "speculative": args.speculative, "calls": calls, "steps": steps, "rounds": rounds, "new_tokens": tokens,
              "calls_per_step": round(calls / max(steps, 1), 1), "calls_per_round": round(calls / max(rounds, 1), 1),
              "calls_per_token": round(calls / max(tokens, 1), 1)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{calls} Python calls over {steps} steps, {rounds} rows' rounds ({tokens} new tokens): "
              f"{result['calls_per_step']} per step, {result['calls_per_round']} per round, "
              f"{result['calls_per_token']} per token")
        for name, count in (by_function or Counter()).most_common(args.top):
            print(f"  {count / max(rounds, 1):7.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
