#!/usr/bin/env python3
"""What a long prompt joining costs the rows already decoding: each scheduler iteration's time while it prefills.

    python scripts/join_stall.py BUNDLE --long FILE [--tokens 1800] [--rows 7] [--runs 3]

Per run: ROWS built-in code prompts start decoding (ignore_eos, so none leaves), 10 iterations
pass, then the first TOKENS tokens of FILE (any text file) join as one prompt. Every iteration
until that prompt's first token is timed (ms); the longest is what a streaming client beside it
waits between two tokens. Each run's prompts carry a marker, so no run reuses another's cache.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import specdeploy

PROMPTS = json.loads((Path(specdeploy.__file__).parent / "data" / "code_prompts.json").read_text())


def one_run(generator, run: int, rows: int, long_ids: list[int]) -> list[float]:
    scheduler = generator.scheduler
    marker = generator.codec.encode(f"# run {run}\n")
    decoding = [generator._sequence(*generator._request(marker + generator.codec.encode(PROMPTS[i % len(PROMPTS)]), None,
                                                        dict(max_new_tokens=4096, ignore_eos=True)), streaming=False)
                for i in range(rows)]
    for sequence in decoding:
        scheduler.submit(sequence)
    for _ in range(10):
        scheduler.step()
    joining = generator._sequence(*generator._request(marker + long_ids, None, dict(max_new_tokens=1)), streaming=False)
    scheduler.submit(joining)
    steps = []
    while not joining.new_tokens and not joining.finished:
        start = time.perf_counter()
        scheduler.step()
        steps.append((time.perf_counter() - start) * 1000)
    for sequence in decoding:
        scheduler.cancel(sequence)
    while scheduler.active:
        scheduler.step()
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--long", required=True, help="a text file: the joining prompt is its first TOKENS tokens")
    parser.add_argument("--tokens", type=int, default=1800)
    parser.add_argument("--rows", type=int, default=7, help="sequences decoding when it joins")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    generator = specdeploy.load(args.bundle, max_batch=args.rows + 1)
    long_ids = generator.codec.encode(Path(args.long).read_text())[: args.tokens]
    for run in range(args.runs):
        steps = one_run(generator, run, args.rows, long_ids)
        print(f"run {run}: {len(long_ids)}-token prompt, {len(steps)} iterations to its first token, "
              f"longest {max(steps):.1f} ms, each: {' '.join(f'{ms:.0f}' for ms in steps)}")


if __name__ == "__main__":
    main()
