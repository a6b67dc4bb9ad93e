"""Batched decoding against one-at-a-time, in one process: aggregate tok/s of generate_many at each batch size.

    python -m benchmarks.batch_bench BUNDLE --batch 1,2,4,8 --tokens 128 --rounds 2 [--setting "t0.8=temperature=0.8"]
        [--requests 64]

For each batch size B and setting: B code prompts (specdeploy/data/code_prompts.json, cycled)
decoded by `generate_many` on a generator with max_batch B under each speculation policy
(auto, always, never), and the same prompts one after another with `generate` (speculative,
then target-only) on a max_batch 1 generator. Aggregate tok/s = all new tokens / wall time,
prefill included (every timed run starts from empty caches); EOS does not end a sequence (ignore_eos), so every system emits B x tokens.
With --requests N, a cell of B < N decodes N prompts instead, B at a time and each of the others joining
as one ends, as a server's requests do under B streams (so the cell's start, all B prompts
at once, and its uneven end weigh little); request i's prompt starts with its own line "# request i",
so that no slot finds another request's prompt cached, and is seeded i unless the setting gives a seed.
Rounds repeat the whole grid in the same order; the table gives each cell's median and its
ratio to the sequential speculative figure of the same B and setting.

First it prints the pass costs the largest batch's speculation policy measured at load (calibrate):
a batched one-token step of n rows, a verify pass of one row, and a pass of each packed graph
(runtime/packed.py) at each number of tokens per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import specdeploy

PROMPTS = json.loads((Path(specdeploy.__file__).parent / "data" / "code_prompts.json").read_text())


def settings_arg(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition("=")
    values = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        values[key] = float(value) if "." in value else int(value)
    return name, values


def print_costs(policy) -> None:
    """The policy's measured pass costs (ms) as Markdown."""
    print("| pass | " + " | ".join(f"{n}" for n in range(1, 9)) + " |")
    print("|---|" + "---:|" * 8)
    print("| batched one-token step, n rows | " + " | ".join(f"{policy.target_ms.get(n, float('nan')):.1f}" for n in range(1, 9)) + " |")
    verify = [f"{policy.verify_ms[n]:.1f}" if n in policy.verify_ms else "" for n in range(1, 9)]
    print("| verify pass of one row, n tokens | " + " | ".join(verify) + " |")
    for size, table in sorted(policy.packed_ms.items()):
        print(f"| {size}-row graph, n tokens per row | " + " | ".join(f"{table[size * n]:.1f}" if size * n in table else ""
                                                                    for n in range(1, 9)) + " |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle")
    parser.add_argument("--batch", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=0,
                        help="Prompts per cell (default: B); more than B keep B decoding as they join")
    parser.add_argument("--setting", action="append", type=settings_arg, default=[])
    parser.add_argument("--json", dest="json_out", default=None, help="also write the medians here")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch.split(",")]
    settings = args.setting or [("greedy", {})]
    prompts = [p if isinstance(p, str) else p["prompt"] for p in PROMPTS]
    single = specdeploy.load(args.bundle)
    batched = {size: {policy: specdeploy.load(args.bundle, max_batch=size, policy=policy)
                      for policy in ("auto", "always", "never")} for size in sizes if size > 1}
    if batched:
        print_costs(batched[max(batched)]["auto"].scheduler.policy)
    results: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for size in sizes:
            count = max(size, args.requests)
            batch = [prompts[i % len(prompts)] for i in range(size)] if count == size else \
                [f"# request {i}\n" + prompts[i % len(prompts)] for i in range(count)]
            for name, values in settings:
                common = dict(max_new_tokens=args.tokens, ignore_eos=True, **values)
                seeds = list(range(count)) if count > size and "seed" not in values else None
                # Every timed run prefills its prompts: a generator keeps its slots' prompts cached, so each
                # is reset first (a batched generator would otherwise find all B prompts cached from round 2).
                for label, speculative in (("sequential speculative", True), ("sequential target-only", False)):
                    tokens, elapsed = 0, 0.0
                    for i, prompt in enumerate(batch):
                        single.reset()
                        seed = {} if seeds is None else {"seed": seeds[i]}
                        start = time.perf_counter()
                        tokens += len(single.generate(prompt, speculative=speculative, **common, **seed).token_ids)
                        elapsed += time.perf_counter() - start
                    results.setdefault((size, name, label), []).append(tokens / elapsed)
                for policy, generator in batched.get(size, {}).items():
                    generator.reset()
                    start = time.perf_counter()
                    outputs = generator.generate_many(batch, seeds=seeds, **common)
                    tokens = sum(len(o.token_ids) for o in outputs)
                    results.setdefault((size, name, f"batched {policy}"), []).append(tokens / (time.perf_counter() - start))
    print(f"{'B':>3} {'setting':<10} {'system':<24} {'tok/s':>8} {'vs seq spec':>12}")
    medians = {key: statistics.median(values) for key, values in results.items()}
    for (size, name, label), value in medians.items():
        base = medians[(size, name, "sequential speculative")]
        print(f"{size:>3} {name:<10} {label:<24} {value:8.1f} {value / base:12.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([{"batch": s, "setting": n, "system": system, "tokens_per_s": v}
                                                   for (s, n, system), v in medians.items()], indent=1))


if __name__ == "__main__":
    main()
