#!/usr/bin/env python3
"""Do GGUF vocabularies tokenize as llama.cpp tokenizes them, once export has converted them?

    python scripts/gguf_tokenizers.py vectors LLAMA_CPP/models [NAME ...]
    python scripts/gguf_tokenizers.py server TOKENIZER.json http://127.0.0.1:PORT [--corpus FILE ...]
    python scripts/gguf_tokenizers.py splits LLAMA_CPP/build/bin/llama-tokenize LLAMA_CPP/models/ggml-vocab-llama-bpe.gguf

`vectors`: llama.cpp's own tokenizer test vectors (models/ggml-vocab-NAME.gguf with its .inp texts and
the .out ids made from each model's original tokenizer). Each vocabulary is converted as export converts
it: transformers' reading (AutoTokenizer with gguf_file), then specdeploy.export.gguf_vocab's rebuild.
Both are counted, so the table shows what the rebuild changes. Files of an architecture transformers
cannot read are listed as such.

`server`: a bundle's tokenizer.json against a running `llama-server -m MODEL.gguf` (its /tokenize,
special tokens parsed, no BOS added), on probe texts (code, prose, accents, CJK, emoji, whitespace runs,
digits, contractions) and 400-character chunks of the given files (default: a few standard-library
modules). Prints each text that differs and the count.

`splits`: every tokenizer.ggml.pre name the rebuild knows (gguf_vocab.PRE_SPLITS), on one byte-level
vocabulary: a copy of the GGUF with that name is tokenized by llama.cpp's `llama-tokenize` (no BOS, special
tokens parsed) and by the rebuilt tokenizer, on the probe texts and 400-character chunks of a few
standard-library modules. So each name's split is checked against llama.cpp itself, where test vectors
exist for a few names only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import sysconfig
import tempfile
import urllib.request
from pathlib import Path

PROBES = [
    "x = 12345 + 3.14", "In 2024, 1,000,000 people", "I'm sure they've done it; we'll see. He'd GO. YOU'RE", "  leading spaces",
    "tabs\tand\nnewlines\n\n\n  indented", "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n",
    "héllo wörld — naïve café", "中文测试，日本語のテキスト", "emoji 🎉🚀 end", "   ", "a\u00a0b", "don't DON'T Don't",
    "price: $9.99!!! ...", "x1y22z333w4444", "https://example.com/a?b=c&d=e", "ÀÉÎÕÜ ßẞ", "0123456789", " 42",
    "\n\n\n\n", "a  b   c    d", "αβγ δεζ", "Привет, мир! 2025 год", "snake_case_name CamelCaseName",
    "a\n\n  \u3000 中文字符 ПриветМир cafe\u0301",
    "'quoted' \"double\"", "i've I'VE i'Ve", "Cửa Việt", "ied 4 ½ months", "\t\t\tx\r\n",
]
MODULES = ("textwrap.py", "bisect.py", "heapq.py", "json/decoder.py", "argparse.py")


def _read_gguf(path: Path):
    """The GGUF's reader, a metadata lookup (key -> contents or None) and its vocabulary as export reads it."""
    from gguf import GGUFReader

    from specdeploy.export.gguf_vocab import read_vocab

    reader = GGUFReader(str(path))

    def value(key):
        field = reader.get_field(key)
        return None if field is None else field.contents()

    return reader, value, read_vocab(value)


def _texts(paths: list[Path], max_chars: int) -> list[str]:
    """The probe texts, then 400-character chunks of the first max_chars characters of each file."""
    texts = list(PROBES)
    for path in paths:
        text = path.read_text(encoding="utf-8")
        texts += [text[at : at + 400] for at in range(0, min(len(text), max_chars), 400)]
    return texts


def _difference(ours: list[int], theirs: list[int]) -> str:
    """Where two id lists part: the position and a few ids of each from there."""
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return f"from token {at}, ours {ours[at : at + 4]}, llama.cpp {theirs[at : at + 4]}"


def vectors(models: Path, names: list[str]) -> None:
    os.environ.setdefault("TQDM_DISABLE", "1")
    logging.disable(logging.WARNING)
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from specdeploy.export.gguf_vocab import rebuild_tokenizer

    names = names or sorted(p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in models.glob("ggml-vocab-*.gguf.inp"))
    print("| vocabulary | tokenizer.ggml.model, .pre | transformers | rebuilt |\n|---|---|---:|---:|")
    for name in names:
        gguf = models / f"ggml-vocab-{name}.gguf"
        texts = (models / f"{gguf.name}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
        expected = [[int(i) for i in line.split()] for line in
                    (models / f"{gguf.name}.out").read_text(encoding="utf-8").split("\n")[: len(texts)]]
        vocab = _read_gguf(gguf)[2]
        with tempfile.TemporaryDirectory() as folder:
            try:
                AutoTokenizer.from_pretrained(str(models), gguf_file=gguf.name).save_pretrained(folder)
            except Exception as exc:  # noqa: BLE001 - transformers refuses architectures it does not read
                print(f"| {name} | {vocab.model}, {vocab.pre} | not read: {str(exc).splitlines()[0][:60]} | |")
                continue
            counts = []
            for rebuild in (False, True):
                if rebuild and not rebuild_tokenizer(Path(folder) / "tokenizer.json", vocab):
                    counts.append("(not rebuilt)")
                    break
                tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
                equal = sum(tokenizer.encode(t, add_special_tokens=False).ids == e for t, e in zip(texts, expected))
                counts.append(f"{equal}/{len(texts)}")
        print(f"| {name} | {vocab.model}, {vocab.pre} | {counts[0]} | {counts[1]} |", flush=True)


def server(tokenizer_json: Path, url: str, corpus: list[Path]) -> int:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = _texts(corpus or [stdlib / name for name in MODULES], 40_000)
    different = 0
    for text in texts:
        ours = tokenizer.encode(text, add_special_tokens=False).ids
        request = urllib.request.Request(f"{url.rstrip('/')}/tokenize", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"content": text, "parse_special": True}).encode())
        theirs = json.loads(urllib.request.urlopen(request, timeout=60).read())["tokens"]
        if ours != theirs:
            different += 1
            print(f"differs: {text[:60]!r}: {_difference(ours, theirs)}")
    print(f"{len(texts) - different}/{len(texts)} texts tokenize alike ({tokenizer_json}, llama-server at {url})")
    return 1 if different else 0


def splits(llama_tokenize: Path, vocabulary: Path, chunks: int, names: list[str]) -> int:
    import subprocess

    os.environ.setdefault("TQDM_DISABLE", "1")
    logging.disable(logging.WARNING)
    from dataclasses import replace

    from gguf import GGUFValueType, GGUFWriter
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from specdeploy.export.gguf_vocab import PRE_SPLITS, rebuild_tokenizer

    reader, value, vocab = _read_gguf(vocabulary)
    if vocab.model != "gpt2" or vocab.pre is None:
        print(f"error: {vocabulary} is no byte-level vocabulary with a tokenizer.ggml.pre (model {vocab.model!r}, "
              f"pre {vocab.pre!r}): each copy must name its split where the source names one", file=sys.stderr)
        return 2
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = _texts([stdlib / name for name in MODULES], 400 * chunks)
    failed = 0
    print("| tokenizer.ggml.pre | texts alike | first that differs |\n|---|---:|---|")
    with tempfile.TemporaryDirectory() as folder:
        AutoTokenizer.from_pretrained(str(vocabulary.parent), gguf_file=vocabulary.name).save_pretrained(folder)
        converted = (Path(folder) / "tokenizer.json").read_text(encoding="utf-8")
        for pre in names or PRE_SPLITS:
            rebuilt, copy = Path(folder) / f"{pre}.json", Path(folder) / f"{pre}.gguf"
            rebuilt.write_text(converted, encoding="utf-8")
            rebuild_tokenizer(rebuilt, replace(vocab, pre=pre))
            tokenizer = Tokenizer.from_file(str(rebuilt))
            writer = GGUFWriter(str(copy), arch=value("general.architecture"))
            for key, field in reader.fields.items():
                if key.startswith("GGUF.") or key == "general.architecture":
                    continue
                kind = field.types[0]
                writer.add_key_value(key, pre if key == "tokenizer.ggml.pre" else field.contents(), kind,
                                     sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.close()
            alike, first = 0, ""
            for text in texts:
                # as it is: llama-tokenize reads backslash escapes unless --no-escape
                command = [str(llama_tokenize), "-m", str(copy), "--stdin", "--no-escape", "--ids", "--no-bos", "--log-disable"]
                run = subprocess.run(command, input=text, capture_output=True, text=True, check=True)
                theirs = json.loads(run.stdout.strip().splitlines()[-1])
                ours = tokenizer.encode(text, add_special_tokens=False).ids
                alike += ours == theirs
                if ours != theirs and not first:
                    first = f"{text[:30]!r} {_difference(ours, theirs)}"
            failed += alike < len(texts)
            print(f"| {pre} | {alike}/{len(texts)} | {first} |", flush=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("vectors", help="llama.cpp's tokenizer test vectors")
    command.add_argument("models", type=Path, help="llama.cpp's models/ folder")
    command.add_argument("names", nargs="*", help="vocabularies (default: every one with test vectors)")
    command = commands.add_parser("server", help="a tokenizer.json against llama-server's /tokenize")
    command.add_argument("tokenizer", type=Path)
    command.add_argument("url")
    command.add_argument("--corpus", type=Path, nargs="*", default=[])
    command = commands.add_parser("splits", help="every pre-tokenizer name against llama.cpp's llama-tokenize")
    command.add_argument("llama_tokenize", type=Path)
    command.add_argument("vocabulary", type=Path, help="a byte-level (gpt2) vocabulary GGUF")
    command.add_argument("--chunks", type=int, default=2, help="400-character chunks of each module")
    command.add_argument("--names", nargs="*", default=[], help="these tokenizer.ggml.pre names only (default: all)")
    args = parser.parse_args()
    if args.command == "splits":
        return splits(args.llama_tokenize, args.vocabulary, args.chunks, args.names)
    if args.command == "vectors":
        vectors(args.models, args.names)
        return 0
    return server(args.tokenizer, args.url, args.corpus)


if __name__ == "__main__":
    sys.exit(main())
