"""Load test for OpenAI-compatible servers: concurrent streaming clients, batched against sequential serving.

`specdeploy serve BUNDLE --port 0 --max-batch N` is started once for each N in --max-batch (default
8,1: the batched default and one request at a time) and the cells alternate between the servers (A B,
then B A), so their ratios come from one run. A cell is one prompt kind (code prompts on
/v1/completions, chat messages on /v1/chat/completions), one mode (greedy, or sampled at
--temperature) and one concurrency: max(--min-requests, --requests-per-stream x concurrency)
streaming requests from that many concurrent clients (--no-stream: whole answers, to measure what
streaming costs apart; no TTFT, ITL or chunks then). Request i of a cell takes prompt i mod the
number of prompts and that prompt's index as its seed. Reported per cell:

- aggregate generated tokens/s (all tokens over the cell's wall time), and p50 latency (JSON);
- p50/p99 time to first token (TTFT: sending the request -> the first chunk with text);
- p50/p99 inter-token latency (ITL): one chunk may carry several tokens (a speculative round), so each
  gap between chunks is divided by the tokens it brought (the `usage` of every chunk, asked for with
  stream_options.continuous_usage_stats; a server that sends none is counted one token a chunk);
- failures: an answer other than 200, an error in the stream, or (with --ignore-eos) fewer tokens than
  max_tokens; altered: a greedy output (or a seeded sampled one) that differs from the runtime's own
  `specdeploy.load(bundle).generate(...)` for the same prompt and seed. Without --exact a sampled row in
  a batch takes the policy's draft lengths, and a greedy one the batch's arithmetic, so only an --exact
  server owes the runtime's own text; without it `altered` says how often the text moved.

The clients are `specdeploy bench --url`'s (specdeploy.load_test, which says how each figure is taken):
aiohttp, whose HTTP parser is C, as what the client spends per chunk comes out of the server's cores
(httpx's pure-Python parser cost the benchmark pair's one-stream figure about a tenth; docs/performance.md).
This benchmark adds the servers it starts, their interleaving and the comparison with the runtime's text.

The reference generations run right before each prompt kind and mode's cells, in a child process
that loads the bundle as `specdeploy run` does (its default session, a spinning thread pool that ends
with the child, so it takes no CPU from the servers), and after one warm-up generation their wall
time gives `specdeploy run`'s end-to-end tokens/s on the prompts of the one-stream cell.

Run (from the repo root)::

    .venv/bin/python -m benchmarks.load_test BUNDLE --ignore-eos --max-tokens 128 --kinds code,chat \
        --json-out load.json --markdown-out load.md

Another server (llama.cpp's llama-server, say) joins the same interleaved run with `--url
http://127.0.0.1:8080 --name llama-server --plain` (--plain: its requests carry only OpenAI fields plus
ignore_eos and seed, and its outputs are not compared); `--max-batch none` starts no server of ours.
Prints the Markdown tables, then one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specdeploy.bench import builtin_prompts, read_prompts
from specdeploy.load_test import cell_figures, median, request_bodies as client_bodies, run_cell

from .servers import start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]


CHAT_PROMPTS = [  # short user turns, each asking for a reply longer than 128 tokens
    "Explain how a hash table handles collisions.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP?",
    "Give me a recipe for a simple vegetable soup, step by step.",
    "Describe the water cycle to a ten-year-old.",
    "List some tips for writing clear documentation for a software library.",
    "Why is the sky blue? Answer in a few paragraphs.",
    "Summarize the causes of the French Revolution.",
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", nargs="?", help="Bundle to serve, and the reference for greedy outputs.")
    parser.add_argument("--url", action="append", default=[], help="A running server's base URL (repeatable); "
                        "its cells alternate with those of the servers started.")
    parser.add_argument("--name", action="append", default=[], help="Each --url server's name in the tables.")
    parser.add_argument("--plain", action="store_true", help="Send the --url servers no specdeploy extension fields.")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-batch", default="8,1", help="With a BUNDLE, one server per value, comma-separated "
                        "(8 is serve's default; none: start no server).")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="Concurrent clients per cell, comma-separated.")
    parser.add_argument("--sequential-concurrency", default=None, help="The levels at which the --max-batch 1 "
                        "server runs (default: all; its throughput stays at its one-stream figure anyway).")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true", help='Send "ignore_eos": true (exactly max_tokens each).')
    parser.add_argument("--no-stream", action="store_true", help='Send "stream": false: each answer whole (no time '
                        "to first token, inter-token latency or chunks to report), what streaming costs measured apart.")
    parser.add_argument("--kinds", default="code", help="code (/v1/completions) and/or chat (/v1/chat/completions)")
    parser.add_argument("--modes", default="greedy,sampled", help="greedy and/or sampled")
    parser.add_argument("--temperature", type=float, default=0.8, help="Temperature of the sampled mode.")
    parser.add_argument("--speculative", choices=("on", "off"), default="on")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--exact", action="store_true", help="Serve (and make the reference generations) with --exact: "
                        "then a seeded sampled output is the runtime's own whatever the batch, and `altered` counts it.")
    parser.add_argument("--prompts", default=None, help="JSON list or JSONL of code prompts (default: the built-in ones).")
    parser.add_argument("--num-prompts", type=int, default=None, help="Use the first N prompts of each kind "
                        "(fewer reference generations on a slow model).")
    parser.add_argument("--no-reference", action="store_true", help="Skip the reference generations (and run's tok/s).")
    parser.add_argument("--repeat", type=int, default=1, help="Run every mode's cells this many times (the "
                        "reference's timing too); tables give medians.")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--markdown-out", default=None)
    args = parser.parse_args(argv)
    if args.bundle is None and not args.url:
        parser.error("name a BUNDLE to serve or the --url of a running server")
    if len(args.name) > len(args.url):
        parser.error("one --name per --url at most")
    if args.min_requests < 1 or args.requests_per_stream < 1 or args.max_tokens < 1:
        parser.error("--min-requests, --requests-per-stream and --max-tokens must be at least 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    for name, allowed in (("kinds", ("code", "chat")), ("modes", ("greedy", "sampled"))):
        unknown = set(getattr(args, name).split(",")) - set(allowed)
        if unknown:
            parser.error(f"--{name}: unknown {', '.join(sorted(unknown))} (choose from {', '.join(allowed)})")
    for name in ("concurrency", "sequential_concurrency", "max_batch"):
        value = getattr(args, name)
        if value is None or (name == "max_batch" and value == "none"):
            continue
        try:
            setattr(args, name, [int(v) for v in value.split(",")])
        except ValueError:
            parser.error(f"--{name.replace('_', '-')} takes comma-separated integers (got {value!r})")
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name.replace('_', '-')}: every value must be at least 1")
    return args


def summarize(records: list[dict], wall_s: float, args, references: dict | None) -> dict:
    """One cell's figures (the package's), and which outputs differ from the runtime's; references maps prompt
    index -> the runtime's text (None: nothing to compare)."""
    figures = cell_figures(records, wall_s, args.max_tokens, args.ignore_eos)
    ok = [r for r in records if r["ok"] and (not args.ignore_eos or r["tokens"] == args.max_tokens)]
    altered = [r for r in ok if references is not None and r["text"] != references[r["prompt"]]]
    examples = []  # where the first few altered texts part from the runtime's
    for r in altered[:3]:
        expected = references[r["prompt"]]
        at = next((i for i, (a, b) in enumerate(zip(expected, r["text"])) if a != b), min(len(expected), len(r["text"])))
        examples.append({"prompt": r["prompt"], "char": at, "generate": expected[at:at + 60], "served": r["text"][at:at + 60]})
    return {**figures, "compared": len(ok) if references is not None else 0, "altered": len(altered),
            "altered_prompts": [r["prompt"] for r in altered], "altered_examples": examples}


def prompt_sets(args) -> dict[str, list]:
    code = read_prompts(args.prompts) if args.prompts else builtin_prompts()
    chat = [[{"role": "user", "content": text}] for text in CHAT_PROMPTS]
    return {kind: {"code": code, "chat": chat}[kind][:args.num_prompts] for kind in args.kinds.split(",")}


def request_bodies(kind: str, prompts: list, count: int, mode: str, args, plain: bool = False) -> list[dict]:
    """The package's bodies for this kind and mode; plain: OpenAI's fields (and ignore_eos, seed) only, for a
    server that is not ours."""
    fields = {"temperature": 0.0 if mode == "greedy" else args.temperature}
    if not plain:
        fields.update(speculative=args.speculative == "on", num_draft_tokens=args.num_draft_tokens)
    return client_bodies(prompts, count, chat=kind == "chat", max_tokens=args.max_tokens, stream=not args.no_stream,
                         ignore_eos=args.ignore_eos, fields=fields)


def reference_outputs(kind: str, prompts: list, mode: str, args, timed: int) -> dict:
    """The runtime's own text for each prompt (seeded by its index), and run's end-to-end tokens/s over the
    first `timed` prompts (those of the one-stream cell), each timed from the call to the output; made in a
    child process (reference_child) with `specdeploy run`'s default session."""
    job = {"bundle": os.path.abspath(args.bundle), "kind": kind, "prompts": prompts, "timed": timed, "exact": args.exact,
           "options": dict(max_new_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                           temperature=0.0 if mode == "greedy" else args.temperature,
                           speculative=args.speculative == "on", num_draft_tokens=args.num_draft_tokens)}
    result = subprocess.run([sys.executable, "-m", "benchmarks.load_test", REFERENCE_CHILD], input=json.dumps(job),
                            capture_output=True, text=True, cwd=ROOT)
    lines = result.stdout.strip().splitlines()
    if result.returncode or not lines:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        raise SystemExit(errors[-1] if errors else f"error: the reference generations failed: {result.stderr[-500:]}")
    reference = json.loads(lines[-1])
    return {"texts": {int(i): text for i, text in reference["texts"].items()},
            "run_tokens_per_s": reference["run_tokens_per_s"]}


REFERENCE_CHILD = "--reference-child"


def reference_child() -> int:
    """The child of reference_outputs: a job on stdin (the bundle, prompts and options; no prompts: only check
    that the bundle loads, with a chat template where chat prompts are asked for), one JSON line on stdout."""
    import specdeploy

    job = json.loads(sys.stdin.read())
    try:
        generator = specdeploy.load(job["bundle"], exact=job.get("exact", False))
    except specdeploy.SpecdeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if job["kind"] == "chat" and generator.chat_template is None:
        print(f"error: {job['bundle']} has no chat template: drop 'chat' from --kinds", file=sys.stderr)
        return 2

    def generate(prompt, **options):
        return generator.generate(messages=prompt, **options) if job["kind"] == "chat" else generator.generate(prompt, **options)

    if job["prompts"]:
        generate(job["prompts"][0], **{**job["options"], "max_new_tokens": 8})  # warm-up, as the servers get one
    texts, tokens, wall = {}, 0, 0.0
    for index, prompt in enumerate(job["prompts"]):
        start = time.perf_counter()
        output = generate(prompt, **job["options"], seed=index)
        if index < job["timed"]:
            wall += time.perf_counter() - start
            tokens += output.stats.new_tokens
        texts[index] = output.text
    print(json.dumps({"texts": texts, "run_tokens_per_s": tokens / wall if wall else None}))
    return 0


def ms(value) -> str:
    return "" if value is None else f"{1000 * value:.0f}"


def fixed(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def grouped(cells: list[dict]) -> dict:
    """(kind, mode, streams, server) -> that cell's repeats, in run order."""
    groups: dict = {}
    for c in cells:
        groups.setdefault((c["kind"], c["mode"], c["concurrency"], c["server"]), []).append(c)
    return groups


def markdown(cells: list[dict], runs: dict, args, interrupted: bool = False) -> str:
    """One row per cell (medians over the repeats each cell ran; x sequential: the median of each repeat's own
    ratio); an interrupted run says so first."""
    done = max((c["repeat"] + 1 for c in cells), default=0)
    lines = (["**Interrupted**: the cells run before the run was stopped.", ""] if interrupted else []) + [
             f"{args.max_tokens}-token outputs{' (ignore_eos)' if args.ignore_eos else ''}, speculative "
             f"{args.speculative} (k = {args.num_draft_tokens}), sampled at T {args.temperature}; requests per cell: "
             f"max({args.min_requests}, {args.requests_per_stream} x streams)"
             + ("; not streamed (whole answers)" if args.no_stream else "")
             + (f"; medians of {done} repeats" if done > 1 else ""), "",
             "| prompts | mode | streams | server | gen tok/s | x sequential | p50 TTFT ms | p99 TTFT ms | p50 ITL ms "
             "| p99 ITL ms | tokens/chunk | failed | altered |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    groups = grouped(cells)
    for (kind, mode, level, server), group in groups.items():
        base = [g for key, g in groups.items() if key[:3] == (kind, mode, level) and g[0]["max_batch"] == 1]
        ratio = ""
        if base and group[0]["max_batch"] != 1:
            ratios = [c["tokens_per_s"] / b["tokens_per_s"] for c, b in zip(group, base[0]) if b["tokens_per_s"] > 0]
            ratio = f"{median(ratios):.2f}" if ratios else "n/a"  # n/a: every sequential request failed
        compared = sum(c["compared"] for c in group)
        altered = f"{sum(c['altered'] for c in group)}/{compared}" if compared else ""
        figure = {key: median(c[key] for c in group) for key in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s",
                                                                 "itl_p50_ms", "itl_p99_ms", "tokens_per_chunk")}
        lines.append(f"| {kind} | {mode} | {level} | {server} | {figure['tokens_per_s']:.1f} | {ratio} | "
                     f"{ms(figure['ttft_p50_s'])} | {ms(figure['ttft_p99_s'])} | {fixed(figure['itl_p50_ms'], 1)} | "
                     f"{fixed(figure['itl_p99_ms'], 1)} | {fixed(figure['tokens_per_chunk'], 2)} | "
                     f"{sum(c['failed'] for c in group)} | {altered} |")
    if runs:
        lines += ["", "| prompts | mode | `run` end-to-end tok/s (one-stream prompts) | served, 1 stream | x run |",
                  "|---|---|---:|---|---|"]
        for (kind, mode), values in runs.items():
            ones = [g for key, g in groups.items() if key[:3] == (kind, mode, 1)]
            served = ", ".join(f"{g[0]['server']} {median(c['tokens_per_s'] for c in g):.1f}" for g in ones)
            ratios = ", ".join(f"{median(c['tokens_per_s'] / v for c, v in zip(g, values)):.2f}" for g in ones)
            lines.append(f"| {kind} | {mode} | {median(values):.1f} | {served} | {ratios} |")
    return "\n".join(lines)


def warm_up(servers: list[tuple], headers: dict, kind: str, prompts: list, streams: int, args) -> None:
    """A short request of this kind per stream at the highest level to every server, so that none runs batched passes
    of that many rows for the first time (a first run allocates) in a timed cell's first burst."""
    short = argparse.Namespace(**{**vars(args), "max_tokens": min(args.max_tokens, 16)})
    for name, max_batch, url in servers:
        records, _ = asyncio.run(run_cell(url, headers, request_bodies(kind, prompts, streams, "greedy", short,
                                                                       args.plain and max_batch is None), streams))
        if not any(record["ok"] for record in records):
            print(f"warning: every warm-up request to {name} failed: {records[0].get('status')}", file=sys.stderr)


def main(argv=None) -> None:
    args = parse_args(argv)
    levels = args.concurrency
    sequential_levels = args.sequential_concurrency or args.concurrency
    kinds = prompt_sets(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    processes, servers = [], []  # servers: (name, max_batch (None: a --url server), url)
    cells, runs, turn, interrupted = [], {}, 0, False
    # SIGTERM (and Ctrl-C) stop the run between requests: the servers stop, the cells so far are written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    referencing = bool(args.bundle and not args.no_reference)
    if referencing:  # the bundle loads (with a chat template where asked for) before any server starts
        reference_outputs("chat" if "chat" in kinds else "code", [], "greedy", args, 0)
    try:
        if args.bundle and args.max_batch != "none":
            for value in args.max_batch:
                process, url = start_server(args.bundle, "--max-queue", str(max(levels) * args.requests_per_stream + 8),
                                            "--max-batch", str(value), *(("--exact",) if args.exact else ()))
                processes.append(process)
                servers.append(("sequential (1)" if value == 1 else f"batched ({value})", value, url))
        names = args.name + args.url[len(args.name):]
        servers += [(name, None, url.rstrip("/")) for name, url in zip(names, args.url)]
        for kind, prompts in kinds.items():
            warm_up(servers, headers, kind, prompts, max(levels), args)
            for repeat in range(args.repeat):
                for mode in args.modes.split(","):
                    references = None
                    if referencing:
                        timed = min(len(prompts), max(args.min_requests, args.requests_per_stream))
                        reference = reference_outputs(kind, prompts, mode, args, timed)
                        references = reference["texts"]
                        runs.setdefault((kind, mode), []).append(reference["run_tokens_per_s"])
                    for level in levels:
                        turn += 1
                        for name, max_batch, url in (servers if turn % 2 else servers[::-1]):
                            if max_batch == 1 and level not in sequential_levels:
                                continue
                            plain = args.plain and max_batch is None  # another server: its outputs are its own
                            count = max(args.min_requests, args.requests_per_stream * level)
                            records, wall_s = asyncio.run(run_cell(url, headers, request_bodies(
                                kind, prompts, count, mode, args, plain), level))
                            cell = {"kind": kind, "mode": mode, "concurrency": level, "server": name,
                                    "max_batch": max_batch, "repeat": repeat,
                                    **summarize(records, wall_s, args, None if plain else references)}
                            cells.append(cell)
                            print(f"{kind} {mode} streams={level} {name}: {cell['tokens_per_s']:.1f} tok/s, "
                                  f"failed {cell['failed']}, altered {cell['altered']}", file=sys.stderr, flush=True)
    except (KeyboardInterrupt, SystemExit) as exc:
        if isinstance(exc, SystemExit) and str(exc.code).startswith("error:"):
            raise  # a server that did not start: its error, not an interruption (the finally stops the others)
        interrupted = True
        print("interrupted: writing the cells so far", file=sys.stderr)
    finally:
        for process in processes:
            stop_server(process)
    rank = {name: i for i, (name, _, _) in enumerate(servers)}
    cells.sort(key=lambda c: (list(kinds).index(c["kind"]), c["mode"], c["concurrency"], rank[c["server"]],
                              c["repeat"]))
    report = {"interrupted": interrupted, "bundle": args.bundle, "url": args.url, "servers": [s[:2] for s in servers], "max_tokens": args.max_tokens,
              "ignore_eos": args.ignore_eos, "stream": not args.no_stream, "speculative": args.speculative, "num_draft_tokens": args.num_draft_tokens,
              "temperature": args.temperature, "cpu_count": os.cpu_count(), "cells": cells,
              "run_tokens_per_s": [{"kind": k, "mode": m, "tokens_per_s": v} for (k, m), v in runs.items()]}
    if args.json_out:  # before the tables: a run's figures are kept whatever formatting them does
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    table = markdown(cells, runs, args, interrupted)
    if args.markdown_out:
        with open(args.markdown_out, "w") as f:
            f.write(table + "\n")
    print(table)
    print(json.dumps(report))
    if interrupted:
        raise SystemExit(1)


if __name__ == "__main__":
    if sys.argv[1:] == [REFERENCE_CHILD]:
        sys.exit(reference_child())
    main()
