"""How each host's tokenizer library reads a tokenizer: the sample of text, one reader per host, and
the comparison with the reference (HF tokenizers, as the Python runtime calls it).

tokenizer_hosts.py runs these readers at export and decides on repairs; this module only reads."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NODE_DIR = Path(__file__).resolve().parents[2] / "examples" / "node"  # the Node host in a source checkout
MAX_SPECIAL_SAMPLES = 24  # special tokens sampled one by one (a tokenizer may add hundreds)
NODE_TIMEOUT_S = 120

TEXT_SAMPLES = (
    "def fibonacci(n):",
    "def fibonacci(n):\n    if n == 1:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Stack:\n\tdef push(self, item):\n\t\tself.items.append(item)  # O(1)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 2; }",
    "The quick brown fox jumps over the lazy dog. It's 3.14 o'clock; isn't it?",
    "naïve café, Grüße aus Köln, ¿qué tal? — “quotes” … ½ °C",
    "你好，世界。日本語のテキスト、カタカナ。한국어 문장입니다.",
    "Emoji: 🙂 👍🏽 👨‍👩‍👧 🚀🔥!",
    "a  b   c\n\n\n\t\t  \r\n  end   ",
    "   leading spaces",
    "trailing spaces   ",
    " ",
    "12345678901234567890 0.000001 -42",
    "print(a , b) . x = 's' ; it 's , is n't",  # spaces before punctuation: decoders must keep them
)
CHAT = ({"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4 🙂"})


@dataclass(frozen=True)
class Reading:
    """One library's reading of the sample: ids per text (as a prompt), text per reference id list (as output)."""

    ids: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]
    streamed: tuple[str, ...] | None = None  # token-by-token decoding, where the host streams


def sample_texts(folder: Path) -> tuple[str, ...]:
    """The fixed sample plus the tokenizer's own special tokens and its chat template, rendered."""
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    specials = [t["content"] for t in data.get("added_tokens", []) if t.get("special")][:MAX_SPECIAL_SAMPLES]
    samples = list(TEXT_SAMPLES)
    samples += [f"{token}hello {token}\n" for token in specials]
    chat = _render_chat(folder)
    if chat:
        samples.append(chat)
    return tuple(dict.fromkeys(samples))  # in order, once each


def _render_chat(folder: Path) -> str | None:
    """The chat template applied to a two-turn conversation (None: no template, or it does not render)."""
    template = None
    config_path = folder / "tokenizer_config.json"
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif config_path.is_file():
        template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    if not isinstance(template, str):
        return None
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=list(CHAT), add_generation_prompt=True,
                                                bos_token="", eos_token="") or None
    except Exception:  # noqa: BLE001 - a template that needs transformers' helpers is left out of the sample
        return None


def read_reference(tokenizer_json: dict[str, Any], samples: tuple[str, ...], decode: tuple[tuple[int, ...], ...] | None = None) -> Reading:
    """HF tokenizers, as the Python runtime calls it (runtime/text.py)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(json.dumps(tokenizer_json))
    ids = tuple(tuple(tokenizer.encode(text, add_special_tokens=True).ids) for text in samples)
    decode = ids if decode is None else decode
    return Reading(ids, tuple(tokenizer.decode(list(item), skip_special_tokens=True) for item in decode))


def genai_version() -> str | None:
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    return getattr(og, "__version__", "unknown")


def read_genai(folder: Path, samples: tuple[str, ...], decode: tuple[tuple[int, ...], ...]) -> Reading:
    """onnxruntime-genai's tokenizer on folder (a genai_config.json beside the tokenizer files)."""
    import numpy as np
    import onnxruntime_genai as og

    tokenizer = og.Tokenizer(str(folder))
    ids = tuple(tuple(int(t) for t in tokenizer.encode(text)) for text in samples)
    texts = tuple(tokenizer.decode(np.asarray(item, dtype=np.int32)) for item in decode)
    streamed = []
    for item in decode:  # as the C++ host prints: one piece per token
        stream = tokenizer.create_stream()
        streamed.append("".join(stream.decode(int(token)) for token in item))
    return Reading(ids, texts, tuple(streamed))


def node_version(node_dir: Path = NODE_DIR) -> str | None:
    """@huggingface/tokenizers' version in the Node host's packages (None: node or the packages are missing)."""
    package = node_dir / "node_modules" / "@huggingface" / "tokenizers" / "package.json"
    if shutil.which("node") is None or not package.is_file():
        return None
    return json.loads(package.read_text(encoding="utf-8")).get("version", "unknown")


# As examples/node/host.mjs loads, encodes and prints; run from node_dir so that the import resolves there.
_NODE_SCRIPT = """
import { Tokenizer } from "@huggingface/tokenizers";
import fs from "node:fs";
const job = JSON.parse(fs.readFileSync(0, "utf8"));
const read = (p) => JSON.parse(fs.readFileSync(p, "utf8"));
const tokenizer = new Tokenizer(read(job.tokenizer), job.config ? read(job.config) : {});
process.stdout.write(JSON.stringify({
  ids: job.texts.map((text) => tokenizer.encode(text, { add_special_tokens: true }).ids.map(Number)),
  texts: job.decode.map((ids) => tokenizer.decode(ids, { skip_special_tokens: true, clean_up_tokenization_spaces: false })),
}));
"""


def read_node(folder: Path, samples: tuple[str, ...], decode: tuple[tuple[int, ...], ...], node_dir: Path = NODE_DIR) -> Reading:
    config = folder / "tokenizer_config.json"
    job = {"tokenizer": str(folder / "tokenizer.json"), "config": str(config) if config.is_file() else None,
           "texts": list(samples), "decode": [list(item) for item in decode]}
    result = subprocess.run([shutil.which("node") or "node", "--input-type=module", "-e", _NODE_SCRIPT], cwd=node_dir,
                            input=json.dumps(job), capture_output=True, text=True, encoding="utf-8",
                            timeout=NODE_TIMEOUT_S)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        raise RuntimeError(next((line for line in lines if "Error" in line), lines[-1] if lines else "node failed"))
    out = json.loads(result.stdout)
    return Reading(tuple(tuple(item) for item in out["ids"]), tuple(out["texts"]))


def compare(reference: Reading, reading: Reading, samples: tuple[str, ...]) -> str | None:
    """The first difference and how many samples differ, in one line (None: the readings agree)."""
    problems = []
    for text, want, got in zip(samples, reference.ids, reading.ids):
        if want != got:
            problems.append(_id_difference(text, want, got))
    for name, texts in (("decodes", reading.texts), ("streams", reading.streamed)):
        for want_ids, want, got in zip(reference.ids, reference.texts, texts or ()):
            if want != got:
                problems.append(f"{name} {_ids(want_ids)} as {quote(got)} where tokenizers gives {quote(want)}")
    if not problems:
        return None
    differing = sum(1 for i in range(len(samples)) if _differs(reference, reading, i))
    return f"{problems[0]} ({differing} of {len(samples)} samples differ)"


def _id_difference(text: str, want: tuple[int, ...], got: tuple[int, ...]) -> str:
    if want[1:] == got:  # a start token the post-processor adds: the prompt's framing, not its text
        return f"encodes {quote(text)} without the start token {want[0]} tokenizers adds ({_ids(got)})"
    if got[1:] == want:
        return f"encodes {quote(text)} with a start token {got[0]} tokenizers does not add ({_ids(want)})"
    at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return f"encodes {quote(text)} as {_ids(got, at)} where tokenizers gives {_ids(want, at)}"


def _differs(reference: Reading, reading: Reading, i: int) -> bool:
    streamed = reading.streamed[i] if reading.streamed else reference.texts[i]
    return (reference.ids[i] != reading.ids[i] or reference.texts[i] != reading.texts[i]
            or reference.texts[i] != streamed)


def distance(reference: Reading, reading: Reading, i: int) -> int:
    """0 when sample i reads alike; 1 for each of: other ids, ids beyond a start token, other text, other streamed text."""
    want, got = reference.ids[i], reading.ids[i]
    streamed = reading.streamed[i] if reading.streamed else reference.texts[i]
    return ((want != got) + (want != got and want[1:] != got and got[1:] != want)
            + (reference.texts[i] != reading.texts[i]) + (reference.texts[i] != streamed))


def quote(text: str, limit: int = 40) -> str:
    shown = json.dumps(text, ensure_ascii=False)
    return shown if len(shown) <= limit else shown[: limit - 4] + '..."'


def _ids(ids, start: int = 0, limit: int = 10) -> str:
    """ids from `start` (where two readings part; a few before it for context), at most `limit` of them."""
    ids, start = list(ids), max(0, start - 2)
    return ("[" + ("..., " if start else "") + ", ".join(map(str, ids[start : start + limit]))
            + (", ...]" if len(ids) > start + limit else "]"))
