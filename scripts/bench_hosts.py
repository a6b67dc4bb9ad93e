#!/usr/bin/env python3
"""One bundle through every host, greedy, same prompts: decode tokens/s of each, and whether their tokens agree.

Hosts: specdeploy's Python runtime (hybrid and model drafters, and target-only), onnxruntime-genai
from Python on the bundle's own genai_config.json (speculative, and target/ for target-only), the
C++ host (`make host`, onnxruntime-genai's C API) and the Node host (`examples/node`, onnxruntime-node
and the bundle's accept graph). Each host runs every prompt once after one warm-up run; tokens/s is
new tokens over decode time as each host reports it (prefill apart), summed over the prompts.

    make host && (cd examples/node && npm ci --ignore-scripts)
    .venv/bin/python scripts/bench_hosts.py BUNDLE [--max-new-tokens 128] [--limit N]

Prints a Markdown table to stderr and one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STATS = re.compile(r"(\d+) new tokens; prefill [\d.]+ ms, decode ([\d.]+) tokens/s")
NODE_STATS = re.compile(r"(\d+) tokens in ([\d.]+) ms .*prefill ([\d.]+) ms")


def ours(bundle: Path, prompts: list[str], new: int, drafter: str, speculative: bool) -> dict:
    import specdeploy

    generator = specdeploy.load(bundle, drafter=drafter)
    generator.generate(prompts[0], max_new_tokens=new, speculative=speculative)
    tokens, ms, ids = 0, 0.0, []
    for prompt in prompts:
        generator.reset()
        out = generator.generate(prompt, max_new_tokens=new, speculative=speculative)
        tokens, ms = tokens + out.stats.new_tokens, ms + out.stats.decode_ms
        ids.append(out.token_ids)
    return {"tokens_per_s": 1000 * tokens / ms, "new_tokens": tokens, "ids": ids}


def genai(folder: Path, prompt_ids: list[list[int]], new: int) -> dict:
    import onnxruntime_genai as og

    model = og.Model(str(folder))

    def one(ids):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + new, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        start = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        seconds = time.perf_counter() - start
        return list(generator.get_sequence(0))[len(ids):], seconds

    one(prompt_ids[0])
    tokens, seconds, all_ids = 0, 0.0, []
    for ids in prompt_ids:
        out, spent = one(ids)
        tokens, seconds = tokens + len(out), seconds + spent
        all_ids.append([int(t) for t in out])
    return {"tokens_per_s": tokens / seconds, "new_tokens": tokens, "ids": all_ids}


def subprocess_host(cmd_for, prompts: list[str], pattern: re.Pattern, node: bool) -> dict:
    tokens, ms = 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for index, prompt in enumerate([prompts[0], *prompts]):  # the first run warms up
            path = Path(tmp) / "prompt.txt"
            path.write_text(prompt)
            done = subprocess.run(cmd_for(path), capture_output=True, text=True, check=True, cwd=REPO)
            match = pattern.search(done.stderr)
            if match is None:
                raise RuntimeError(f"no statistics in: {done.stderr[-500:]}")
            if index == 0:
                continue
            if node:
                count, total_ms, prefill_ms = int(match[1]), float(match[2]), float(match[3])
                tokens, ms = tokens + count, ms + total_ms - prefill_ms
            else:
                count, speed = int(match[1]), float(match[2])
                tokens, ms = tokens + count, ms + 1000 * count / speed
    return {"tokens_per_s": 1000 * tokens / ms, "new_tokens": tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    os.environ.setdefault("SPECDEPLOY_SHARED_THREADS", "0")  # genai's sessions share the process
    from specdeploy.bench import builtin_prompts

    prompts, new, bundle = builtin_prompts()[: args.limit], args.max_new_tokens, args.bundle.resolve()
    rows = {
        "specdeploy hybrid": ours(bundle, prompts, new, "hybrid", True),
        "specdeploy model drafter": ours(bundle, prompts, new, "model", True),
        "specdeploy target-only": ours(bundle, prompts, new, "hybrid", False),
    }
    import specdeploy

    codec = specdeploy.load(bundle, drafter="prompt-lookup").codec
    prompt_ids = [codec.encode(p) for p in prompts]
    rows["onnxruntime-genai speculative"] = genai(bundle, prompt_ids, new)
    rows["onnxruntime-genai target-only"] = genai(bundle / "target", prompt_ids, new)
    host = REPO / "build" / "specdeploy-host"
    rows["C++ host (genai C API)"] = subprocess_host(lambda p: [str(host), str(bundle), str(p), str(new)], prompts,
                                                     STATS, node=False)
    rows["Node host (onnxruntime-node)"] = subprocess_host(
        lambda p: ["node", "examples/node/host.mjs", str(bundle), str(p), str(new)], prompts, NODE_STATS, node=True)
    eos = set(specdeploy.load(bundle, drafter="prompt-lookup").eos_token_ids)
    strip = lambda ids: ids[:-1] if ids and ids[-1] in eos else ids  # noqa: E731 - ours lists EOS last, genai not
    reference = [strip(ids) for ids in rows["specdeploy target-only"]["ids"]]
    for row in rows.values():
        if "ids" in row:
            row["identical_to_target_only"] = [strip(ids) for ids in row.pop("ids")] == reference
    print("| host | decode tok/s | greedy tokens = target-only |\n|---|---|---|", file=sys.stderr)
    for name, row in rows.items():
        same = row.get("identical_to_target_only", "(text compared by its test)")
        print(f"| {name} | {row['tokens_per_s']:.0f} | {same} |", file=sys.stderr)
    print(json.dumps({"bundle": str(args.bundle), "prompts": len(prompts), "max_new_tokens": new, "hosts": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
