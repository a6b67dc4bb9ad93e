"""`specdeploy bench`'s output: the tables on the terminal and the plot (the numbers come from bench.py)."""

from __future__ import annotations

import sys

from .errors import SpecdeployError


def sampling_label(report: dict) -> str:
    """'temperature 0.8, top-k 50, top-p 0.95': the sampling settings a bench report ran with (those that are on)."""
    parts = [f"temperature {report['temperature']}" if report["temperature"] else "greedy"]
    for key, name, off in (("top_k", "top-k", 0), ("top_p", "top-p", 1.0), ("min_p", "min-p", 0.0),
                           ("repetition_penalty", "repetition penalty", 1.0)):
        if report.get(key, off) != off:
            parts.append(f"{name} {report[key]}")
    return ", ".join(parts)


def print_bench(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    base = report["target_only"]
    rows = report["by_num_draft_tokens"]
    context = f"{report['prompt_tokens']}-token prompts" if report.get("prompt_tokens") else "prompts"
    table = Table(title=f"{report['prompts']} {context} x {report['max_new_tokens']} new tokens, {sampling_label(report)}, "
                        f"repeat {report['repeat']}, drafter {report.get('drafter', '')}")
    table.add_column("")
    table.add_column("target-only", justify="right")
    for row in rows:
        table.add_column(f"k={row['num_draft_tokens']}", justify="right")

    def add(name, base_value, getter):
        table.add_row(name, base_value, *(getter(row) for row in rows))

    def shares(totals):
        share = totals["time_share"]
        return f"{share['draft']:.0%} / {share['target']:.0%} / {share['other']:.0%}"

    add("tokens/s", f"{base['tokens_per_s']:.1f}", lambda r: f"{r['speculative']['tokens_per_s']:.1f}")
    add("speedup", "1.00", lambda r: f"{r['speedup']:.2f}")
    add("identical outputs", "", lambda r: "" if r["identical_outputs"] is None else ("yes" if r["identical_outputs"] else "NO"))
    add("acceptance rate", "", lambda r: f"{r['acceptance_rate']:.2f}")
    add("tokens per round", "1.00", lambda r: f"{r['mean_accepted_tokens']:.2f}")
    add("accepted by position", "", lambda r: " ".join(f"{a / max(r['speculative']['rounds'], 1):.2f}" for a in r["accepted_by_position"]))
    add("draft step cost c", "", lambda r: f"{r['cost_ratio_c']:.3f}")
    add("verify cost v", "1.00", lambda r: f"{r['verify_cost_v']:.2f}")
    add("fitted alpha", "", lambda r: f"{r['fitted_alpha']:.2f}")
    add("Leviathan bound", "", lambda r: f"{r['leviathan_bound']:.2f}")
    add("efficiency", "", lambda r: f"{r['efficiency']:.0%}")
    add("time draft/target/other", shares(base), lambda r: shares(r["speculative"]))
    add("prefill ms (mean)", f"{base['prefill_ms_mean']:.1f}", lambda r: f"{r['speculative']['prefill_ms_mean']:.1f}")
    console = Console() if sys.stdout.isatty() else Console(width=130)  # logs and pipes get the whole table
    console.print(table)
    console.print(memory_line(report))


def memory_line(report: dict) -> str:
    """Peak RSS against the floor it is held to: each model's weights as stored, in their dtype, and KV caches."""
    budget = report["memory_budget"]
    parts = [f"{role} {budget[role]['dtype']} weights {budget[role]['weights_bytes'] / 2**20:.1f} + KV "
             f"{budget[role]['kv_cache_bytes'] / 2**20:.1f}" for role in ("target", "draft")]
    return (f"peak RSS {report['peak_rss_mb']:.0f} MB (bundle weights as stored + KV caches at max context, MiB: "
            f"{', '.join(parts)}; {budget['total_mb']:.0f} MB in all)")


def print_context_sweep(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="decode speed against prompt length (one run)")
    for name in ("prompt tokens", "target-only tok/s", "ms/token", "vs first", "speculative tok/s", "vs first",
                 "acceptance", "tokens/round"):
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(str(row["prompt_tokens"]), f"{row['target_only_tokens_per_s']:.1f}",
                      f"{row['target_only_ms_per_token']:.2f}", f"{row['target_only_vs_first']:.2f}",
                      f"{row['speculative_tokens_per_s']:.1f}", f"{row['speculative_vs_first']:.2f}",
                      f"{row['acceptance_rate']:.2f}", f"{row['mean_accepted_tokens']:.2f}")
    (Console() if sys.stdout.isatty() else Console(width=130)).print(table)


def plot_report(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecdeployError("--plot needs matplotlib (pip install 'specdeploy[bench]')") from None
    rows = report["by_num_draft_tokens"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([r["num_draft_tokens"] for r in rows], [r["speedup"] for r in rows], "o-", label="measured")
    left.plot([r["num_draft_tokens"] for r in rows], [r["leviathan_bound"] for r in rows], "s--", label="bound")
    left.set_xlabel("draft tokens k")
    left.set_ylabel("speedup over target-only")
    left.legend()
    for r in rows:
        rounds = r["speculative"]["rounds"]
        right.plot(range(1, len(r["accepted_by_position"]) + 1), [a / max(rounds, 1) for a in r["accepted_by_position"]], "o-",
                   label=f"k={r['num_draft_tokens']}")
    right.set_xlabel("draft position")
    right.set_ylabel("fraction of rounds accepted")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
