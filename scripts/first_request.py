"""The first request in a fresh process against the ones after it, with and without load's warm-up.

    python scripts/first_request.py BUNDLE [--processes 6] [--requests 5] [--max-new-tokens 32]

Each process loads the bundle (warm_up on or off, the two alternating process by process), then
runs --requests greedy speculative requests of one built-in prompt (process i takes prompt i, so
the prompt lengths vary) from an empty cache (Generator.reset between them), and reports the
first request's wall time, the median of the rest, and their ratio. Each process sets the
allocator up as `specdeploy run` does (cli._return_freed_memory) before loading. Prints one JSON line: per setting, the median over processes of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = """
import json, sys, time
import specdeploy
from specdeploy.bench import builtin_prompts
from specdeploy.cli import _return_freed_memory
bundle, warm, requests, max_new, index = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
prompts = builtin_prompts()
prompt = prompts[index % len(prompts)]
_return_freed_memory()
start = time.perf_counter()
generator = specdeploy.load(bundle, warm_up=warm)
load_s = time.perf_counter() - start
times, prefills = [], []
for _ in range(requests):
    generator.reset()
    start = time.perf_counter()
    output = generator.generate(prompt, max_new_tokens=max_new)
    times.append(time.perf_counter() - start)
    prefills.append(output.stats.prefill_ms)
print(json.dumps({"load_s": load_s, "times_s": times, "prefill_ms": prefills}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--processes", type=int, default=6, help="per setting")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"warm_up": [], "no_warm_up": []}
    for index in range(args.processes):
        for name, flag in (("no_warm_up", "0"), ("warm_up", "1")):
            out = subprocess.run([sys.executable, "-c", CHILD, args.bundle, flag, str(args.requests),
                                  str(args.max_new_tokens), str(index)], capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    report = {"date": time.strftime("%Y-%m-%d"), "bundle": args.bundle, "processes": args.processes,
              "requests": args.requests, "max_new_tokens": args.max_new_tokens}
    for name, items in runs.items():
        first = [item["times_s"][0] * 1000 for item in items]
        later = [statistics.median(item["times_s"][1:]) * 1000 for item in items]
        report[name] = {"load_ms": statistics.median(item["load_s"] * 1000 for item in items),
                        "first_ms": statistics.median(first), "later_ms": statistics.median(later),
                        "first_over_later": statistics.median(f / rest for f, rest in zip(first, later)),
                        "first_prefill_ms": statistics.median(item["prefill_ms"][0] for item in items),
                        "later_prefill_ms": statistics.median(statistics.median(item["prefill_ms"][1:]) for item in items)}
    report["load_average"] = os.getloadavg()[0]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
