#!/usr/bin/env python3
"""Load test for `specdeploy serve`: concurrent streaming clients, a fixed number of requests per cell.

For each concurrency level (default 1, 8, 32), each decoding mode (greedy, sampled) and speculative
on and off, REQUESTS streaming completions are sent by that many concurrent clients; reported per
cell: requests/s, generated tokens/s, p50/p99 end-to-end latency and time to first token (client
side, from sending the request to the first text), the server's acceptance rate and tokens per
round, and requests that failed (a 429 counts as failed: size --max-queue for the concurrency).

The server runs one request at a time, so latency grows with concurrency while throughput stays
near the single-client figure; the table shows how much queueing costs and what speculation buys.

Run (from the repo root; starts `specdeploy serve BUNDLE` on a free port and stops it at the end)::

    .venv/bin/python scripts/load_test.py PAIR-BUNDLE --requests 64 --max-tokens 128 \
        --json-out load.json --markdown-out load.md

or against a running server: `--url http://127.0.0.1:8000 [--api-key KEY]`.
Prints the Markdown table, and one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

from specdeploy.bench import builtin_prompts, read_prompts


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", nargs="?", help="Bundle to serve (omit with --url).")
    parser.add_argument("--url", help="A running server's base URL instead of starting one.")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default="1,8,32", help="Concurrent clients per cell, comma-separated.")
    parser.add_argument("--requests", type=int, default=64, help="Requests per cell.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--modes", default="greedy,sampled", help="greedy and/or sampled")
    parser.add_argument("--temperature", type=float, default=0.8, help="Temperature of the sampled mode.")
    parser.add_argument("--speculative", default="on,off", help="on and/or off")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--prompts", default=None, help="JSON list or JSONL of prompts (default: the built-in ones).")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--markdown-out", default=None)
    args = parser.parse_args(argv)
    if (args.bundle is None) == (args.url is None):
        parser.error("name a BUNDLE to serve or the --url of a running server (one of them)")
    if args.requests < 1 or args.max_tokens < 1:
        parser.error("--requests and --max-tokens must be at least 1")
    return args


def start_server(bundle: str, max_queue: int) -> tuple[subprocess.Popen, str]:
    """`specdeploy serve BUNDLE --port 0`, once /health answers 200; returns the process and its URL."""
    command = [sys.executable, "-m", "specdeploy", "serve", bundle, "--port", "0", "--max-queue", str(max_queue)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = None
    while url is None:
        line = process.stderr.readline()
        if not line:
            raise SystemExit(f"error: the server exited ({process.wait()}) before listening")
        if "http://" in line:
            url = line.split("on ", 1)[1].split()[0]
    # Keep reading the server's log (its access log) so a full pipe never blocks it.
    threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.terminate()
    raise SystemExit("error: the server did not become ready in 120 s")


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streaming completion: latency, time to first text, tokens, the server's speculative figures."""
    start = time.perf_counter()
    first = None
    record = {"ok": False}
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"ok": False, "status": response.status_code}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return {"ok": False, "status": "stream error"}
            if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter()
            if "specdeploy" in chunk:
                record["extension"] = chunk["specdeploy"]
            if chunk.get("usage"):
                record.update(ok=True, tokens=chunk["usage"]["completion_tokens"])
    end = time.perf_counter()
    record.update(latency_s=end - start, first_token_s=(first or end) - start)
    return record


async def run_cell(url: str, headers: dict, bodies: list[dict], concurrency: int) -> dict:
    """Send every body with `concurrency` clients at a time; the cell's throughput and latency figures."""
    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    records: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def client_loop() -> None:
            while not queue.empty():
                records.append(await one_request(client, url, queue.get_nowait()))

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall_s = time.perf_counter() - start
    return summarize(records, wall_s, concurrency)


def summarize(records: list[dict], wall_s: float, concurrency: int) -> dict:
    done = [r for r in records if r["ok"]]
    latency = np.array([r["latency_s"] for r in done]) if done else np.zeros(1)
    first = np.array([r["first_token_s"] for r in done]) if done else np.zeros(1)
    extensions = [r["extension"] for r in done if "extension" in r]
    drafted = sum(e["drafted_tokens"] for e in extensions)
    rounds = sum(e["rounds"] for e in extensions)
    tokens = sum(r["tokens"] for r in done)
    return {
        "concurrency": concurrency, "requests": len(records), "failed": len(records) - len(done), "wall_s": wall_s,
        "requests_per_s": len(done) / wall_s, "tokens_per_s": tokens / wall_s, "generated_tokens": tokens,
        "latency_p50_s": float(np.percentile(latency, 50)), "latency_p99_s": float(np.percentile(latency, 99)),
        "ttft_p50_s": float(np.percentile(first, 50)), "ttft_p99_s": float(np.percentile(first, 99)),
        "acceptance_rate": sum(e["accepted_tokens"] for e in extensions) / drafted if drafted else None,
        "tokens_per_round": tokens / rounds if rounds else None,
    }


def request_bodies(prompts: list[str], count: int, mode: str, speculative: bool, args) -> list[dict]:
    bodies = []
    for i in range(count):
        body = {"prompt": prompts[i % len(prompts)], "max_tokens": args.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "speculative": speculative,
                "num_draft_tokens": args.num_draft_tokens, "seed": i,
                "temperature": 0.0 if mode == "greedy" else args.temperature}
        bodies.append(body)
    return bodies


def markdown(cells: list[dict], args) -> str:
    lines = [f"{args.requests} requests per row, {args.max_tokens} max new tokens, k = {args.num_draft_tokens}, "
             f"sampled at temperature {args.temperature}", "",
             "| mode | speculative | clients | req/s | gen tok/s | p50 latency s | p99 latency s | p50 TTFT s "
             "| p99 TTFT s | acceptance | tokens/round | failed |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        acceptance = "" if c["acceptance_rate"] is None else f"{c['acceptance_rate']:.2f}"
        per_round = "" if c["tokens_per_round"] is None else f"{c['tokens_per_round']:.2f}"
        lines.append(f"| {c['mode']} | {'on' if c['speculative'] else 'off'} | {c['concurrency']} | "
                     f"{c['requests_per_s']:.2f} | {c['tokens_per_s']:.1f} | {c['latency_p50_s']:.3f} | "
                     f"{c['latency_p99_s']:.3f} | {c['ttft_p50_s']:.3f} | {c['ttft_p99_s']:.3f} | {acceptance} | "
                     f"{per_round} | {c['failed']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    levels = [int(v) for v in args.concurrency.split(",")]
    prompts = read_prompts(args.prompts) if args.prompts else builtin_prompts()
    process, url = (None, args.url.rstrip("/")) if args.url else start_server(args.bundle, max(levels))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    cells = []
    try:
        warmup = request_bodies(prompts, 1, "greedy", True, args)
        asyncio.run(run_cell(url, headers, warmup, 1))
        for mode in args.modes.split(","):
            for speculative in (s == "on" for s in args.speculative.split(",")):
                for level in levels:
                    bodies = request_bodies(prompts, args.requests, mode, speculative, args)
                    cell = asyncio.run(run_cell(url, headers, bodies, level))
                    cells.append({"mode": mode, "speculative": speculative, **cell})
                    print(f"{mode} speculative={speculative} clients={level}: {cell['tokens_per_s']:.1f} tok/s",
                          file=sys.stderr)
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    table = markdown(cells, args)
    report = {"url": url, "bundle": args.bundle, "requests": args.requests, "max_tokens": args.max_tokens,
              "num_draft_tokens": args.num_draft_tokens, "temperature": args.temperature, "cpu_count": os.cpu_count(),
              "cells": cells}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    if args.markdown_out:
        with open(args.markdown_out, "w") as f:
            f.write(table + "\n")
    print(table)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
