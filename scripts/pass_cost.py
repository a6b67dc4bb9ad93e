#!/usr/bin/env python3
"""What a verify pass costs next to a one-token step, in the state each decoding mode runs in.

The cost model's bound takes the target's time per token in target-only decoding against its time
per round in speculative decoding. The two differ by the pass (k + 1 tokens against one) and by
the state the machine is in when it runs: in speculative decoding every target pass follows draft
passes and a verify pass. To tell the two apart, each generate call here times every target pass,
and every third pass it also runs one extra probe pass of the other shape at the same position (a
5-token pass during target-only decoding, a 1-token pass during speculative decoding), then takes
it back (the cache is truncated to where it was, and the logits the loop reads are copied first,
so the tokens are unchanged). Per setting, medians of:

    target-only state: the 1-token step, and the (k + 1)-token probe
    speculative state: the (k + 1)-token verify pass, and the 1-token probe

    .venv/bin/python scripts/pass_cost.py BUNDLE [--settings greedy,t0.8] [--repeat 2] [--drafter hybrid]

Timing wraps ONNX Runtime's run call only; the probes are not part of any generation's figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import parse_setting  # noqa: E402

PROBE_EVERY = 3  # passes between probes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--settings", default="greedy,t0.8")
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--drafter", default="hybrid", help="hybrid | model | prompt-lookup")
    args = ap.parse_args()
    import specdeploy
    from specdeploy.bench import builtin_prompts

    gen = specdeploy.load(args.bundle, drafter=args.drafter)
    target, cache, k = gen.target, gen.target_cache, args.num_draft_tokens
    durations: list[float] = []  # the passes of the current target.run call
    samples: dict[tuple, list[float]] = defaultdict(list)
    now = {"setting": "", "speculative": False, "passes": 0}

    session_run = target._run

    def timed(binding, options):
        start = time.perf_counter()
        session_run(binding, options)
        durations.append(time.perf_counter() - start)

    target._run = timed
    loop_run = target.run

    def probe(token_ids: list[int], key: tuple) -> None:
        length = cache.length
        target._stepping = None  # the probe must not leave the one-token binding state behind it
        durations.clear()
        loop_run(token_ids, cache)
        samples[key].append(durations[-1])
        cache.truncate(length)

    def run(token_ids, on_cache):
        durations.clear()
        logits = loop_run(token_ids, on_cache)
        if on_cache is not cache or len(durations) != 1:  # the draft's cache, or a chunked prefill
            return logits
        setting, count = now["setting"], len(token_ids)
        now["passes"] += 1
        probe_now = now["passes"] % PROBE_EVERY == 0
        if now["speculative"] and count == k + 1:
            samples[(setting, "verify")].append(durations[-1])
            if probe_now:
                logits = logits.copy()
                probe([int(token_ids[-1])], (setting, "spec probe 1"))
        elif not now["speculative"] and count == 1:
            samples[(setting, "step")].append(durations[-1])
            if probe_now:
                logits = logits.copy()
                probe([int(token_ids[-1])] * (k + 1), (setting, f"target-only probe {k + 1}"))
        return logits

    target.run = run
    prompts = builtin_prompts()
    settings = [parse_setting(name) for name in args.settings.split(",")]
    gen.generate(prompts[0], max_new_tokens=16)  # warm-up
    for repeat in range(args.repeat):
        for setting in settings:
            fields = {key: value for key, value in asdict(setting).items() if key != "name"}
            now["setting"] = setting.name
            for index, prompt in enumerate(prompts):
                for speculative in (False, True):
                    now["speculative"] = speculative
                    gen.generate(prompt, speculative=speculative, max_new_tokens=args.max_new_tokens,
                                 num_draft_tokens=k, seed=repeat * len(prompts) + index, **fields)

    print(f"| setting | target-only: step | its {k + 1}-token probe | ratio | speculative: verify | its 1-token probe "
          f"| ratio | speculative 1-token / target-only step | verify / target-only step |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for setting in settings:
        m = {key[1]: 1000 * statistics.median(values) for key, values in samples.items() if key[0] == setting.name}
        step, probe5, verify, probe1 = m["step"], m[f"target-only probe {k + 1}"], m["verify"], m["spec probe 1"]
        print(f"| {setting.name} | {step:.2f} ms | {probe5:.2f} ms | {probe5 / step:.2f} | {verify:.2f} ms | {probe1:.2f} ms "
              f"| {verify / probe1:.2f} | {probe1 / step:.2f} | {verify / step:.2f} |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
