"""`specdeploy bench`'s output: the tables on the terminal and the plot (the numbers come from bench.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import SpecdeployError, install_hint


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
                        f"repeat {report['repeat']}, drafter {report.get('drafter', '')}"
                        f"{', exact' if report.get('exact') else ''}")
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
    generations = report["prompts"] * report["repeat"]
    add("same tokens as target-only", "", lambda r: "" if r.get("identical_count") is None else f"{r['identical_count']}/{generations}")
    add("acceptance rate", "", lambda r: f"{r['acceptance_rate']:.2f}")
    add("tokens per round", "1.00", lambda r: f"{r['mean_accepted_tokens']:.2f}")
    add("accepted by position", "", lambda r: " ".join("-" if rate is None else f"{rate:.2f}"
                                                        for rate in r["acceptance_by_position"]))
    add("draft step cost c", "", lambda r: f"{r['cost_ratio_c']:.3f}")
    add("verify cost v", "1.00", lambda r: f"{r['verify_cost_v']:.2f}")
    add("fitted alpha", "", lambda r: f"{r['fitted_alpha']:.2f}")
    add("Leviathan bound", "", lambda r: f"{r['leviathan_bound']:.2f}")
    add("efficiency", "", lambda r: f"{r['efficiency']:.0%}")
    add("time draft/target/other", shares(base), lambda r: shares(r["speculative"]))
    add("prefill ms (mean)", f"{base['prefill_ms_mean']:.1f}", lambda r: f"{r['speculative']['prefill_ms_mean']:.1f}")
    console = Console() if sys.stdout.isatty() else Console(width=130)  # logs and pipes get the whole table
    console.print(table)
    if not report.get("exact") and any(r.get("identical_outputs") is False for r in rows):
        console.print("one-token target-only steps round otherwise than multi-token verify passes (most on a "
                      "quantized target), so greedy text may part where two tokens nearly tie; --exact runs every "
                      "pass as a multi-token one: the same text throughout.")
    console.print(memory_line(report))


def memory_line(report: dict) -> str:
    """Peak RSS against the floor it is held to: each model's weights as stored, in their dtype, and KV caches
    (MiB throughout, a line per model, none longer than a terminal's 80 columns)."""
    budget = report["memory_budget"]
    lines = [f"peak RSS {report['peak_rss_mb']:.0f} MiB, against a floor of {budget['total_mb']:.0f} MiB:"]
    lines += [f"  {role} {budget[role]['dtype']} weights {budget[role]['weights_bytes'] / 2**20:.1f} MiB as stored, "
              f"KV caches {budget[role]['kv_cache_bytes'] / 2**20:.1f} MiB at max context"
              for role in ("target", "draft") if role in budget]
    return "\n".join(lines)


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


def machine_description() -> str:
    """'AMD EPYC 7B13, 2 CPUs': the CPU model (Linux's /proc/cpuinfo, else platform's) and the CPUs this process sees."""
    import os
    import platform

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {count} CPUs"


def plot_title(report: dict) -> str:
    """Two lines: what was run (bundle, setting, workload) and where and when."""
    from pathlib import Path

    context = f" ({report['prompt_tokens']}-token prompts)" if report.get("prompt_tokens") else ""
    first = (f"{Path(report.get('bundle', 'bundle')).name}: {sampling_label(report)}, drafter {report.get('drafter', '?')}"
             f"{', exact' if report.get('exact') else ''}, "
             f"{report['prompts']} prompts{context} x {report['max_new_tokens']} new tokens, repeat {report['repeat']}")
    return f"{first}\n{report.get('date', '')[:10]}, {report.get('machine', '')}".rstrip(", \n")


# What matplotlib writes (FigureCanvasBase.get_supported_filetypes(); tests/test_cli_errors.py keeps this in step).
# --plot's file is checked against it before the benchmark without importing matplotlib, whose memory would
# otherwise count in the peak the benchmark reports.
PLOT_FORMATS = ("avif", "eps", "gif", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif",
                "tiff", "webp")
PLOT_NEEDS = f"--plot needs matplotlib ({install_hint('bench')})"


def pyplot():
    """matplotlib.pyplot on its file backend, or one error naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecdeployError(PLOT_NEEDS) from None
    return plt


def plot_file(path: str) -> Path:
    """The file --plot writes, checked before the benchmark: ~ expanded, `.png` added to a name without
    a suffix (as matplotlib adds it), a suffix matplotlib cannot write refused, the folder writable."""
    import importlib.util

    from .cli_support import check_output_file

    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # sys.modules["matplotlib"] = None, as a test hides it
        found = False
    if not found:
        raise SpecdeployError(PLOT_NEEDS)
    file = Path(path).expanduser()
    if not file.suffix and not file.is_dir():  # a folder is refused below, as given
        file = file.with_name(file.name + ".png")
    check_output_file(str(file), "--plot")
    if file.suffix[1:].lower() not in PLOT_FORMATS:
        raise SpecdeployError(f"--plot {path}: matplotlib cannot write .{file.suffix[1:]} files "
                              f"(it writes {', '.join(PLOT_FORMATS)})")
    return file.resolve()


def plot_report(report: dict, path: Path) -> None:
    """Draw the report (draw_report) into `path` (plot_file's), in the format its suffix names."""
    figure = draw_report(report)
    figure.savefig(path, dpi=100)
    pyplot().close(figure)


def draw_report(report: dict):
    """Speedup against k (measured beside the Leviathan bound, y from 0, target-only at 1) and the fraction
    of rounds that kept each draft position (0 to 1), one group of bars per k, so one k reads as well as many."""
    plt = pyplot()
    import numpy as np

    rows = report["by_num_draft_tokens"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    slots = np.arange(len(rows))
    width = 0.38
    measured = left.bar(slots - width / 2, [r["speedup"] for r in rows], width, label="measured")
    bound = left.bar(slots + width / 2, [r["leviathan_bound"] for r in rows], width, label="Leviathan bound", alpha=0.55)
    left.bar_label(measured, fmt="%.2f", fontsize=8)
    left.bar_label(bound, fmt="%.2f", fontsize=8)
    left.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="target-only")
    left.set_xticks(slots, [f"k = {r['num_draft_tokens']}" for r in rows])
    left.set_xlim(-0.7 if len(rows) > 1 else -1.2, len(rows) - 0.3 if len(rows) > 1 else 1.2)
    left.set_ylim(0, 1.15 * max(1.0, *(max(r["speedup"], r["leviathan_bound"]) for r in rows)))
    left.set_ylabel("speedup over target-only (decode tok/s)")
    left.set_title("speedup", fontsize=10)
    left.legend(loc="lower right", fontsize=8)
    longest = max(len(r["acceptance_by_position"]) for r in rows)
    positions = np.arange(1, longest + 1)
    bar_width = 0.8 / len(rows)
    for index, r in enumerate(rows):
        kept = [np.nan if rate is None else rate for rate in r["acceptance_by_position"]]  # never drafted: no bar
        offset = (index - (len(rows) - 1) / 2) * bar_width
        right.bar(positions[: len(kept)] + offset, kept, bar_width, label=f"k = {r['num_draft_tokens']}")
    right.set_xticks(positions)
    right.set_xlim(0.5, longest + 0.5)
    right.set_ylim(0, 1)
    right.set_xlabel("draft position")
    right.set_ylabel("kept, of the rounds that drafted it")
    right.set_title("acceptance by draft position", fontsize=10)
    right.legend(fontsize=8)
    figure.suptitle(plot_title(report), fontsize=9)
    figure.tight_layout()
    return figure
