"""`specdeploy inspect`'s text: a manifest summarized in plain lines that fit 80 columns.

Plain text rather than a terminal table: the same lines in a terminal, a pipe and a log, every
line short enough to read at 80 columns (a value too wide for its column wraps inside it), and
paths printed whole on lines of their own, never cut.
"""

from __future__ import annotations

import textwrap

WIDTH = 80
LABEL_WIDTH, VALUE_WIDTH = 20, 29  # 20 + 29 + 29 = 78 columns, two of them spaces
HOST_LIBRARIES = {"genai": "onnxruntime-genai", "node": "@huggingface/tokenizers"}  # the tokenizer each host reads with


def format_size(size: int) -> str:
    """Bytes in the unit that reads best: 812 B, 412.3 kB, 34.7 MB, 1.76 GB (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}" if unit == "GB" else f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _rows(label: str, target: str, draft: str) -> list[str]:
    """One table row, each cell wrapped within its column."""
    cells = [textwrap.wrap(text, width, break_on_hyphens=False) or [""]
             for text, width in ((label, LABEL_WIDTH), (target, VALUE_WIDTH), (draft, VALUE_WIDTH))]
    height = max(len(cell) for cell in cells)
    lines = []
    for i in range(height):
        parts = [cell[i] if i < len(cell) else "" for cell in cells]
        lines.append(f"{parts[0]:<{LABEL_WIDTH}} {parts[1]:<{VALUE_WIDTH}} {parts[2]}".rstrip())
    return lines


def _parity_check(spec) -> str:
    p = spec.parity
    comparison = "<=" if p.check == "max_abs_diff" else ">="
    verdict = "pass" if p.passed else "below, kept (--allow-lossy)"
    return f"{p.check} {comparison} {p.tolerance:g}: {verdict}"


def inspect_lines(bundle: str, manifest, chat_template: str | None) -> list[str]:
    """The summary of `manifest` (loaded from `bundle`); chat_template: its end of turn in words, or None."""
    t, d = manifest.target, manifest.draft
    lines = [f"bundle: {bundle}",
             f"format {manifest.format_version}, specdeploy {manifest.specdeploy_version}, created {manifest.created}",
             f"max context: {manifest.max_context} tokens", ""]
    for row in _model_table(t, d):
        lines += _rows(*row)
    if d is None:
        lines += textwrap.wrap("draft: none; the runtime drafts by prompt lookup (lossless, faster where the text "
                               "repeats its context)", WIDTH, subsequent_indent="    ")
    lines += ["", "files:"]
    entries = [entry for spec in manifest.models for entry in spec.files]
    name_width = min(max(len(entry.path) for entry in entries), WIDTH - 14)
    lines += [f"  {entry.path:<{name_width}}  {format_size(entry.size):>9}" for entry in entries]
    lines += ["sources:", f"  target: {t.source}", f"  draft:  {d.source if d is not None else 'none'}"]
    for spec in manifest.models:
        lines += gguf_lines(spec.role, spec.gguf)
    lines += vocab_source_lines(d)
    tok = manifest.tokenizer
    lines.append(f"tokenizer: {tok.vocab_size} tokens, bos {tok.bos_token_id}, eos {list(tok.eos_token_ids)}, "
                 f"pad {tok.pad_token_id}")
    lines += textwrap.wrap(f"chat template: {chat_template}" if chat_template else
                           "chat template: none (chat, run --chat and /v1/chat/completions need one)",
                           WIDTH, subsequent_indent="    ")
    return lines + tokenizer_host_lines(tok.hosts)


def _model_table(t, d) -> list[tuple[str, str, str]]:
    """(label, target, draft) rows; the draft's cells read "-" in a bundle without one."""
    def cells(value) -> tuple[str, str]:
        return value(t), (value(d) if d is not None else "-")

    return [
        ("", "target", "draft" if d is not None else "draft (none)"),
        ("architecture", *cells(lambda s: s.architecture + (" (eagle)" if s.eagle else ""))),
        ("parameters", *cells(lambda s: f"{s.num_parameters / 1e6:.1f}M")),
        ("layers x KV heads x head dim", *cells(lambda s: f"{s.num_layers} x {s.num_kv_heads} x {s.head_dim}")),
        ("vocab", *cells(lambda s: str(s.vocab_size) + (f", proposes from {s.vocab_subset}" if s.vocab_subset else ""))),
        ("dtype / quantize", *cells(lambda s: f"{s.dtype} / {s.quantize}")),
        ("graph", *cells(lambda s: s.graph)),
        ("KV cache", *cells(lambda s: ("shared buffer" if s.kv_cache.shared_buffer else "concat")
                            + (f", window {s.attention_window}" if s.attention_window else ""))),
        ("inputs / outputs", *cells(lambda s: f"{len(s.inputs)} / {len(s.outputs)}")),
        ("stored size", *cells(lambda s: format_size(sum(f.size for f in s.files)))),
        ("parity prefill", *cells(lambda s: f"max|diff| {s.parity.prefill_max_abs_diff:.2e}")),
        ("parity verify", *cells(lambda s: f"max|diff| {s.parity.verify_max_abs_diff:.2e}")),
        ("greedy agreement", *cells(lambda s: f"{s.parity.prefill_greedy_agreement:.2f} prefill, "
                                              f"{s.parity.verify_greedy_agreement:.2f} verify")),
        ("parity check", *cells(_parity_check)),
    ]


def gguf_lines(role: str, gguf, width: int = WIDTH) -> list[str]:
    """What a model kept of its GGUF's blocks (none: its weights did not come from one that way)."""
    if gguf is None:
        return []
    kept = ", ".join(f"{kind} x{count}" for kind, count in gguf.kept.items()) or "nothing (a float file)"
    text = f"{role} weights: the GGUF's own blocks, {kept}"
    if gguf.dequantized:
        text += "; dequantized to fp32: " + ", ".join(f"{name} ({kind})" for name, kind in gguf.dequantized.items())
    return textwrap.wrap(text + f" (sha256 {gguf.sha256[:12]})", width, subsequent_indent="    ")


def vocab_source_lines(spec, width: int = WIDTH) -> list[str]:
    """Where the counts that chose a draft's vocabulary subset came from (none: no subset, or not recorded)."""
    source = spec.vocab_source if spec is not None and spec.vocab_subset else None
    if not source:
        return []
    counted, coverage = source.get("counted_tokens"), source.get("coverage")
    figures = ", ".join(part for part in (
        f"{counted:,} tokens counted" if isinstance(counted, int) else "",
        f"{coverage:.1%} of them inside" if isinstance(coverage, (int, float)) else "") if part)
    figures = f" ({figures})" if figures else ""
    if source.get("counts") == "text":
        files = [str(name) for name in source.get("files", []) if isinstance(name, str)]
        text = (f"draft vocabulary: {spec.vocab_subset} tokens, the most frequent in {len(files)} text file"
                f"{'' if len(files) == 1 else 's'} under the target's tokenizer{figures}:")
        return textwrap.wrap(text, width, subsequent_indent="    ") + [f"  {name}" for name in files]
    text = f"draft vocabulary: {spec.vocab_subset} tokens, the most frequent in its distillation data{figures}"
    return textwrap.wrap(text, width, subsequent_indent="    ")


def tokenizer_host_lines(hosts, width: int = WIDTH) -> list[str]:
    """How each host read the tokenizer at export, one wrapped paragraph each (fits `width` columns)."""
    if not hosts:
        return ["tokenizer under other hosts: not checked (exported before the check)"]
    lines = ["tokenizer under other hosts (against HF tokenizers at export):"]
    for host, record in sorted(hosts.items()):
        head = f"  {host}: {record.status}"
        if record.version:
            head += f" ({HOST_LIBRARIES.get(host, host)} {record.version}, {record.samples} samples)"
        text = f"{head}: {record.reason}" if record.reason else head
        lines += textwrap.wrap(text, width=width, subsequent_indent="      ", break_on_hyphens=False)
    return lines
