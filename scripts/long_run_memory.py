"""Resident memory over a long generation: does it stay flat after a warm-up?

    python scripts/long_run_memory.py BUNDLE [--tokens 4000] [--warmup 4000] [--drafter hybrid|model|none]

Generates --warmup tokens once, then streams --tokens more from another prompt (temperature 0.8,
EOS ignored so the whole count is generated; the bundle's context must hold them), sampling RSS
every 250 text pieces (about one per token). Growth per 1,000 tokens runs from the first sample
to the last. A warm-up as long as the run separates leaks from the shared-buffer KV cache's
pages, which are mapped on first use.
Prints one JSON line. Linux only (RSS from /proc/self/statm).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import specdeploy


def resident_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=4000)
    parser.add_argument("--drafter", default="hybrid", choices=("hybrid", "model", "none"))
    args = parser.parse_args()
    speculative = args.drafter != "none"
    generator = specdeploy.load(args.bundle, drafter=args.drafter if speculative else "hybrid")
    generator.eos_token_ids = frozenset()  # generate the whole count
    options = dict(speculative=speculative, temperature=0.8, seed=1)
    generator.generate("def f(x):", max_new_tokens=args.warmup, **options)
    samples, start = [], time.time()
    pieces = generator.stream("import os\n", max_new_tokens=args.tokens, **options)
    for count, _ in enumerate(pieces, 1):
        if count % 250 == 0:
            samples.append(round(resident_mib(), 1))
    stats = pieces.output.stats
    covered = stats.new_tokens * (len(samples) - 1) / len(samples)
    print(json.dumps({
        "drafter": args.drafter, "warmup_tokens": args.warmup, "new_tokens": stats.new_tokens,
        "finish_reason": stats.finish_reason, "seconds": round(time.time() - start, 1),
        "rss_after_warmup_mib": samples[0], "rss_end_mib": samples[-1],
        "growth_mib_per_1000_tokens": round((samples[-1] - samples[0]) / covered * 1000, 2), "samples": samples,
    }))


if __name__ == "__main__":
    main()
