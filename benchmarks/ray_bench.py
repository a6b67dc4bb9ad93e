"""Ray Serve against single-process `specdeploy serve`, interleaved: the overhead of Ray's proxy at one
stream, and replica layouts at higher concurrency.

For each --layout REPLICASxTHREADS (default: 1x2, then 2x1 on a 2-core machine), this starts
`specdeploy serve BUNDLE --replicas R --threads-per-replica T` on its own local Ray cluster, then runs
benchmarks.load_test with that server as a --url beside the single-process server load_test starts
itself (--max-batch, all threads), so every ratio comes from one interleaved run. The Ray server's
outputs are compared with the runtime's like our own server's (greedy identical, seeded samples at one
stream). Then the Ray server gets SIGTERM and the next layout starts.

    .venv/bin/python -m benchmarks.ray_bench BUNDLE --layout 1x2 --concurrency 1 --repeat 3 --out ray-overhead
    .venv/bin/python -m benchmarks.ray_bench BUNDLE --layout 1x2 --layout 2x1 --concurrency 1,2,4,8 --out ray-layouts

Writes OUT-LAYOUT.json and OUT-LAYOUT.md (load_test's tables) for each layout and prints them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .servers import start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle")
    parser.add_argument("--layout", action="append", default=[], help="REPLICASxTHREADS (repeatable; default 1x2, 2x1)")
    parser.add_argument("--max-batch", type=int, default=8, help="Per replica, and for the single-process server.")
    parser.add_argument("--concurrency", default="1")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", default="ray-bench")
    parser.add_argument("--kinds", default="code", help="load_test's --kinds")
    parser.add_argument("--modes", default="greedy,sampled", help="load_test's --modes")
    parser.add_argument("--speculative", choices=("on", "off"), default="on", help="load_test's --speculative")
    parser.add_argument("--num-prompts", default=None, help="load_test's --num-prompts")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # the servers' local clusters report nothing outside
    for layout in args.layout or ["1x2", "2x1"]:
        replicas, threads = (int(v) for v in layout.split("x"))
        process, url = start_server(args.bundle, "--max-queue", "64", "--max-batch", str(args.max_batch),
                                    "--replicas", str(replicas), "--threads-per-replica", str(threads))
        try:
            command = [sys.executable, "-m", "benchmarks.load_test", os.path.abspath(args.bundle), "--max-batch",
                       str(args.max_batch), "--url", url, "--name", f"ray ({replicas} x {threads} threads)",
                       "--concurrency", args.concurrency, "--repeat", str(args.repeat), "--ignore-eos",
                       "--json-out", os.path.abspath(f"{args.out}-{layout}.json"),
                       "--markdown-out", os.path.abspath(f"{args.out}-{layout}.md"),
                       "--kinds", args.kinds, "--modes", args.modes, "--speculative", args.speculative,
                       *(["--num-prompts", args.num_prompts] if args.num_prompts else [])]
            subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                           stdout=subprocess.DEVNULL)
            print(f"## {layout}\n\n{Path(f'{args.out}-{layout}.md').read_text()}")
        finally:
            stop_server(process, 120)


if __name__ == "__main__":
    main()
