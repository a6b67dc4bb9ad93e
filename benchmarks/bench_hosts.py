"""One bundle through every host, greedy, same prompts: decode tokens/s of each, and whether their tokens agree.

Hosts: specdeploy's Python runtime (hybrid and model drafters, and target-only), onnxruntime-genai
from Python on the bundle's own genai_config.json (speculative, and target/ for target-only), the
C++ host (`make host`, onnxruntime-genai's C API) and the Node host (`examples/node`, onnxruntime-node
and the bundle's accept graph). Each host runs every prompt once after one warm-up run; tokens/s is
new tokens over decode time as each host reports it (prefill apart), summed over the prompts.

    make host && (cd examples/node && npm ci --ignore-scripts)
    .venv/bin/python -m benchmarks.bench_hosts BUNDLE [--max-new-tokens 128] [--limit N]

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


def genai(folder: Path, prompt_ids: list[list[int]], new: int, threads: int | None) -> dict:
    """The config as written (threads None), or with every session's intra-op threads set."""
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    if threads is not None:
        options = {"session_options": {"intra_op_num_threads": threads}}
        config.overlay(json.dumps({"model": {"decoder": options, **({"draft": options} if folder.name != "target" else {})}}))
    model = og.Model(config)

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
    tokens, decoded, seconds, all_ids = 0, 0, 0.0, []
    for ids in prompt_ids:
        out, spent = one(ids)
        # append_tokens's pass (untimed) computed the first token's logits; the first generate_next_token only
        # samples them, so the timed passes made the other tokens (as bench_peers.py counts genai's decode)
        tokens, decoded, seconds = tokens + len(out), decoded + max(len(out) - 1, 0), seconds + spent
        all_ids.append([int(t) for t in out])
    return {"tokens_per_s": decoded / seconds, "new_tokens": tokens, "ids": all_ids}


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


PYTHON_HOSTS = {
    "specdeploy hybrid": lambda a: ours(a.bundle, a.prompts, a.new, "hybrid", True),
    "specdeploy model drafter": lambda a: ours(a.bundle, a.prompts, a.new, "model", True),
    "specdeploy target-only": lambda a: ours(a.bundle, a.prompts, a.new, "hybrid", False),
    "onnxruntime-genai speculative": lambda a: genai(a.bundle, a.prompt_ids, a.new, None),
    "onnxruntime-genai target-only": lambda a: genai(a.bundle / "target", a.prompt_ids, a.new, None),
    "onnxruntime-genai speculative, threads = cores": lambda a: genai(a.bundle, a.prompt_ids, a.new, os.cpu_count()),
    "onnxruntime-genai target-only, threads = cores": lambda a: genai(a.bundle / "target", a.prompt_ids, a.new,
                                                                      os.cpu_count()),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--host", default=None, help=argparse.SUPPRESS)  # one Python host, in this process
    args = ap.parse_args()
    import specdeploy
    from specdeploy.bench import builtin_prompts

    args.prompts, args.new, args.bundle = builtin_prompts()[: args.limit], args.max_new_tokens, args.bundle.resolve()
    generator = specdeploy.load(args.bundle, drafter="prompt-lookup")
    args.prompt_ids = [generator.codec.encode(p) for p in args.prompts]
    if args.host is not None:
        print(json.dumps(PYTHON_HOSTS[args.host](args)))
        return 0
    rows = {}
    for name in PYTHON_HOSTS:  # each in its own process: ONNX Runtime's thread pools are per process
        cmd = [sys.executable, __file__, str(args.bundle), "--max-new-tokens", str(args.new), "--host", name]
        cmd += ["--limit", str(args.limit)] if args.limit else []
        rows[name] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    host = REPO / "build" / "specdeploy-host"
    rows["C++ host (genai C API)"] = subprocess_host(lambda p: [str(host), str(args.bundle), str(p), str(args.new)],
                                                     args.prompts, STATS, node=False)
    rows["Node host (onnxruntime-node)"] = subprocess_host(
        lambda p: ["node", "examples/node/host.mjs", str(args.bundle), str(p), str(args.new)], args.prompts, NODE_STATS,
        node=True)
    eos = set(generator.eos_token_ids)
    strip = lambda ids: ids[:-1] if ids and ids[-1] in eos else ids  # noqa: E731 - ours lists EOS last, genai not
    reference = [strip(ids) for ids in rows["specdeploy target-only"]["ids"]]
    for row in rows.values():
        if "ids" in row:
            row["identical_to_target_only"] = [strip(ids) for ids in row.pop("ids")] == reference
    print("| host | decode tok/s | greedy tokens = target-only |\n|---|---|---|", file=sys.stderr)
    for name, row in rows.items():
        same = row.get("identical_to_target_only", "(text compared by its test)")
        print(f"| {name} | {row['tokens_per_s']:.0f} | {same} |", file=sys.stderr)
    print(json.dumps({"bundle": str(args.bundle), "prompts": len(args.prompts), "max_new_tokens": args.new, "hosts": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
