"""guidellm against OpenAI-compatible servers: ours (batched) and a peer, one after the other.

guidellm (vLLM's benchmarking client, installed apart: `pip install guidellm`) sends synthetic prompts
of --prompt-tokens tokens and asks --output-tokens tokens (it then sends "ignore_eos": true), from N
concurrent streams for --seconds at each stream count. This script runs it once per server, in the
order given (one guidellm start costs tens of seconds on a loaded 2-vCPU machine), and reads its
JSON: output tokens/s, time to first token, inter-token latency, requests done, errored, and cut off
when the time ran out. guidellm sends no temperature; --temperature goes through its backend's extra
body (`extras.body`) to every server alike.

Run (from the repo root; BUNDLE is served with `specdeploy serve BUNDLE --port 0`, its default
--max-batch; a peer is started by hand, e.g. `llama-server -m MODEL.gguf -t 2 -np 8 -cb -c 8192 --port 8080`)::

    .venv/bin/python -m benchmarks.serve_peers --guidellm GUIDELLM_VENV/bin/guidellm --tokenizer BUNDLE/tokenizer \
        --bundle BUNDLE --target llama-server=http://127.0.0.1:8080 --streams 1,2,4,8 --json-out peers.json

Prints a Markdown table, then one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from .load_test import fixed  # an empty cell where guidellm gives no figure (nothing succeeded)
from .servers import start_server, stop_server


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--guidellm", required=True, help="The guidellm executable.")
    parser.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer folder for guidellm's prompts.")
    parser.add_argument("--bundle", help="Serve this bundle (specdeploy serve, default --max-batch) as 'specdeploy'.")
    parser.add_argument("--target", action="append", default=[], help="NAME=URL of a running server (repeatable).")
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--seconds", type=int, default=30, help="guidellm's max_duration per stream count.")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--request-format", default="/v1/completions")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if not args.bundle and not args.target:
        parser.error("name a --bundle to serve or a --target NAME=URL")
    if any("=" not in target for target in args.target):
        parser.error("--target takes NAME=URL")
    return args


class GuidellmError(RuntimeError):
    """guidellm failed against one server: the others' rows are still reported."""


def guidellm_version(executable: str) -> str:
    result = subprocess.run([executable, "--version"], capture_output=True, text=True)
    return (result.stdout or result.stderr).strip().splitlines()[-1].replace("guidellm version:", "guidellm").strip()


def run_guidellm(args, url: str, levels: list[int], out: Path) -> list[dict]:
    """One guidellm run over every stream count (one benchmark each, in order); their summary figures."""
    backend = {"kind": "openai_http", "target": url, "request_format": args.request_format,
               "max_tokens": args.output_tokens, "extras": {"body": {"temperature": args.temperature}}}
    command = [args.guidellm, "run", "--backend", json.dumps(backend),
               "--tokenizer", f"kind=huggingface_auto,model={args.tokenizer}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
               "--profile", "kind=concurrent", "--override", "profile.streams", ",".join(map(str, levels)),
               "--constraint", f"kind=max_duration,seconds={args.seconds}",
               "--output", f"kind=json,path={out}", "--disable-console"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise GuidellmError(f"exit status {result.returncode}: {result.stderr.strip()[-500:]}")
    rows = []
    for benchmark in json.loads(out.read_text())["benchmarks"]:
        metrics = benchmark["metrics"]

        def stat(name: str, key: str = "mean") -> float | None:
            successful = (metrics.get(name) or {}).get("successful") or {}
            return (successful.get("percentiles") or {}).get(key) if key.startswith("p") else successful.get(key)

        totals = metrics["request_totals"]
        rows.append({"streams": benchmark["config"]["strategy"]["streams"],
                     "output_tokens_per_s": stat("output_tokens_per_second"),
                     "ttft_p50_ms": stat("time_to_first_token_ms", "p50"),
                     "ttft_p99_ms": stat("time_to_first_token_ms", "p99"),
                     "itl_p50_ms": stat("inter_token_latency_ms", "p50"),
                     "itl_p99_ms": stat("inter_token_latency_ms", "p99"),
                     "output_tokens_mean": stat("output_token_count"), "successful": totals["successful"],
                     "errored": totals["errored"], "incomplete": totals["incomplete"]})
    return rows


def markdown(rows: list[dict], version: str, args) -> str:
    lines = [f"{version}, synthetic {args.prompt_tokens}-token prompts, {args.output_tokens}-token outputs "
             f"(ignore_eos), T {args.temperature}, {args.seconds} s per row", "",
             "| server | streams | output tok/s | p50 TTFT ms | p99 TTFT ms | p50 ITL ms | p99 ITL ms | done | errored "
             "| cut at the end |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['streams']} | {fixed(r['output_tokens_per_s'], 1)} | "
                     f"{fixed(r['ttft_p50_ms'], 0)} | {fixed(r['ttft_p99_ms'], 0)} | {fixed(r['itl_p50_ms'], 1)} | "
                     f"{fixed(r['itl_p99_ms'], 1)} | {r['successful']} | {r['errored']} | {r['incomplete']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """0, or 1 when guidellm failed against a server (after the other servers' rows are written)."""
    args = parse_args(argv)
    version = guidellm_version(args.guidellm)
    process, targets = None, [tuple(t.split("=", 1)) for t in args.target]
    levels = [int(v) for v in args.streams.split(",")]
    rows, failures = [], {}
    try:
        if args.bundle:
            process, url = start_server(args.bundle, "--max-queue", str(max(levels) * 4 + 8), "--max-batch", "8")
            targets.insert(0, ("specdeploy", url))
        with tempfile.TemporaryDirectory() as folder:
            for name, url in targets:  # one guidellm process per server: each start costs tens of seconds here
                try:
                    measured = run_guidellm(args, url, levels, Path(folder) / "out.json")
                except GuidellmError as exc:
                    failures[name] = str(exc)
                    print(f"error: guidellm failed against {name} ({url}): {exc}", file=sys.stderr, flush=True)
                    continue
                for row in measured:
                    rows.append({"server": name, **row})
                    print(f"{name} streams={row['streams']}: {row['output_tokens_per_s'] or 0:.1f} tok/s",
                          file=sys.stderr, flush=True)
    finally:
        if process is not None:
            stop_server(process)
    rank = {name: i for i, (name, _) in enumerate(targets)}
    rows.sort(key=lambda r: (rank[r["server"]], r["streams"]))
    print(markdown(rows, version, args))
    report = {"guidellm": version, "targets": targets, "temperature": args.temperature, "rows": rows,
              "failed": failures}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
