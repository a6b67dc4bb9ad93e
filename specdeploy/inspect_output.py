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
    table = [
        ("", "target", "draft"),
        ("architecture", t.architecture, d.architecture + (" (eagle)" if d.eagle else "")),
        ("parameters", f"{t.num_parameters / 1e6:.1f}M", f"{d.num_parameters / 1e6:.1f}M"),
        ("layers x KV heads x head dim", f"{t.num_layers} x {t.num_kv_heads} x {t.head_dim}",
         f"{d.num_layers} x {d.num_kv_heads} x {d.head_dim}"),
        ("vocab", str(t.vocab_size), str(d.vocab_size) + (f", proposes from {d.vocab_subset}" if d.vocab_subset else "")),
        ("dtype / quantize", f"{t.dtype} / {t.quantize}", f"{d.dtype} / {d.quantize}"),
        ("graph", t.graph, d.graph),
        ("KV cache", *(("shared buffer" if s.kv_cache.shared_buffer else "concat")
                       + (f", window {s.attention_window}" if s.attention_window else "") for s in (t, d))),
        ("inputs / outputs", f"{len(t.inputs)} / {len(t.outputs)}", f"{len(d.inputs)} / {len(d.outputs)}"),
        ("stored size", format_size(sum(f.size for f in t.files)), format_size(sum(f.size for f in d.files))),
        ("parity prefill", f"max|diff| {t.parity.prefill_max_abs_diff:.2e}", f"max|diff| {d.parity.prefill_max_abs_diff:.2e}"),
        ("parity verify", f"max|diff| {t.parity.verify_max_abs_diff:.2e}", f"max|diff| {d.parity.verify_max_abs_diff:.2e}"),
        ("greedy agreement", *(f"{s.parity.prefill_greedy_agreement:.2f} prefill, {s.parity.verify_greedy_agreement:.2f} "
                               f"verify" for s in (t, d))),
        ("parity check", _parity_check(t), _parity_check(d)),
    ]
    for row in table:
        lines += _rows(*row)
    lines += ["", "files:"]
    entries = [*t.files, *d.files]
    name_width = min(max(len(entry.path) for entry in entries), WIDTH - 14)
    lines += [f"  {entry.path:<{name_width}}  {format_size(entry.size):>9}" for entry in entries]
    lines += ["sources:", f"  target: {t.source}", f"  draft:  {d.source}"]
    for role, spec in (("target", t), ("draft", d)):
        lines += gguf_lines(role, spec.gguf)
    tok = manifest.tokenizer
    lines.append(f"tokenizer: {tok.vocab_size} tokens, bos {tok.bos_token_id}, eos {list(tok.eos_token_ids)}, "
                 f"pad {tok.pad_token_id}")
    lines += textwrap.wrap(f"chat template: {chat_template}" if chat_template else
                           "chat template: none (chat, run --chat and /v1/chat/completions need one)",
                           WIDTH, subsequent_indent="    ")
    return lines + tokenizer_host_lines(tok.hosts)


def gguf_lines(role: str, gguf, width: int = WIDTH) -> list[str]:
    """What a model kept of its GGUF's blocks (none: its weights did not come from one that way)."""
    if gguf is None:
        return []
    kept = ", ".join(f"{kind} x{count}" for kind, count in gguf.kept.items()) or "nothing (a float file)"
    text = f"{role} weights: the GGUF's own blocks, {kept}"
    if gguf.dequantized:
        text += "; dequantized to fp32: " + ", ".join(f"{name} ({kind})" for name, kind in gguf.dequantized.items())
    return textwrap.wrap(text + f" (sha256 {gguf.sha256[:12]})", width, subsequent_indent="    ")


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
