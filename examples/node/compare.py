"""Run the Node host and `specdeploy run --temperature 0` on the same prompts: same text? tokens/s of each.

    python examples/node/compare.py BUNDLE [--max-new-tokens N] [--drafter model|hybrid] [--prompts FILE]

Prompts: as `specdeploy bench --prompts` reads them (default: specdeploy's 10 built-in code prompts). Each run is a
fresh process for both hosts (load, prefill, then decode); tokens/s is new tokens over decode time,
the prefill reported apart, as both hosts define it. Run `npm ci --ignore-scripts` in examples/node first.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def node_run(bundle: str, prompt: str, max_new_tokens: int) -> tuple[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
        handle.write(prompt)
    result = subprocess.run(["node", str(HERE / "host.mjs"), bundle, handle.name, str(max_new_tokens)],
                            capture_output=True, text=True)
    Path(handle.name).unlink()
    if result.returncode != 0:
        sys.exit(f"error: the Node host failed: {result.stderr.strip()}")
    return result.stdout, float(re.search(r"\(([\d.]+) tok/s\)", result.stderr).group(1))


def python_run(bundle: str, prompt: str, max_new_tokens: int, drafter: str) -> tuple[str, float]:
    result = subprocess.run([sys.executable, "-m", "specdeploy", "run", bundle, "--prompt", "-", "--temperature", "0",
                             "--max-new-tokens", str(max_new_tokens), "--drafter", drafter, "--json"],
                            input=prompt, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: specdeploy run failed: {result.stderr.strip()}")
    payload = json.loads(result.stdout)
    return payload["text"], payload["stats"]["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafter", default="model", choices=("model", "hybrid"),
                        help="the Python runtime's drafter (the Node host drafts with the model)")
    parser.add_argument("--prompts", help="JSON list of prompts, or JSONL with a 'prompt' field")
    args = parser.parse_args()
    from specdeploy.bench import builtin_prompts, read_prompts

    prompts = read_prompts(args.prompts) if args.prompts else builtin_prompts()
    rows = []
    for prompt in prompts:
        node_text, node_speed = node_run(args.bundle, prompt, args.max_new_tokens)
        python_text, python_speed = python_run(args.bundle, prompt, args.max_new_tokens, args.drafter)
        rows.append((node_text == python_text, node_speed, python_speed))
        print(f"same text: {node_text == python_text!s:5}  node {node_speed:7.1f} tok/s  "
              f"specdeploy run {python_speed:7.1f} tok/s  {prompt.splitlines()[0][:40]!r}")
    same = sum(row[0] for row in rows)
    print(f"{same}/{len(rows)} identical; median tok/s: node {statistics.median(r[1] for r in rows):.1f}, "
          f"specdeploy run (--drafter {args.drafter}) {statistics.median(r[2] for r in rows):.1f}")
    sys.exit(0 if same == len(rows) else 1)


if __name__ == "__main__":
    main()
