"""Every host tokenizes alike: the bundle's tokenizer.json read by each host's tokenizer library, compared.

The Python runtime reads tokenizer.json with HF `tokenizers` (the reference); onnxruntime-genai (its
Python API and the C++ host) reads it with its own tokenizer (onnxruntime-extensions), the Node host
with @huggingface/tokenizers. They parse the same file differently where it mixes conventions: a GPT-2
byte-level vocabulary with `byte_fallback: true` and a SentencePiece-style decoder (as transformers
writes for SmolLM2 from GGUF) is encoded by onnxruntime-genai 0.18 with -1 ids and decoded into raw
byte-level pieces ('ĠnĠ==Ġ1'), while `tokenizers` reads it correctly.

At export, a fixed sample of text (code, prose, accents, CJK, emoji, whitespace runs, the tokenizer's
special tokens and its chat template) is encoded by each host as it encodes a prompt, and the
reference ids are decoded by each host as it prints text (onnxruntime-genai also token by token, as
the C++ host streams). Where a host differs, rewrites of tokenizer.json that keep the reference's ids
and text on the whole sample are tried; the first one every checked host then agrees on replaces the
file. A host that still differs is recorded as unsupported with its first difference. A host whose
library is not installed is recorded as not checked.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..bundle import FileEntry, HostTokenizerCheck, Manifest, file_entry
from ..errors import install_hint
from .tokenizer_readers import (NODE_DIR, TEXT_SAMPLES, Reading, compare, distance,  # noqa: F401 - the check's API
                                genai_version, node_version, quote, read_genai, read_node, read_reference,
                                sample_texts)

HOSTS = ("genai", "node")
# A byte-level BPE decodes through ByteLevel; SentencePiece's byte fallback and decoder do not belong to it.
BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
# Classes that read tokenizer.json as it is (transformers) and a byte-level BPE as one (onnxruntime-genai).
BYTE_LEVEL_CLASS = "PreTrainedTokenizerFast"
BYTE_LEVEL_CLASSES = ("PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast")
EDITABLE = ("tokenizer.json", "tokenizer_config.json")  # the files a repair may rewrite


@dataclass(frozen=True)
class HostResult:
    host: str
    version: str | None
    reading: Reading | None  # None: the host could not read the file at all
    problem: str | None  # the first difference from the reference (None: agrees)
    differing: int = 0  # how far from the reference (_distance summed; a host that cannot read the file: farther)


@dataclass(frozen=True)
class CheckReport:
    """What export_check found: each host before and (where a repair was taken) after, and the file to keep."""

    samples: tuple[str, ...]
    reference: Reading
    before: dict[str, HostResult]
    after: dict[str, HostResult]  # equal to before where no repair was taken
    repair: str | None  # what was rewritten (None: the files kept as they were)
    changed: dict[str, dict[str, Any]]  # file name -> its repaired JSON (empty: no repair)
    hosts: dict[str, HostTokenizerCheck]


def _host_readers(node_dir: Path) -> dict[str, tuple[str | None, str, Callable]]:
    """host -> (library version or None, what is missing, reader)."""
    return {
        "genai": (genai_version(), f"onnxruntime-genai is not installed ({install_hint('hosts')})", read_genai),
        "node": (node_version(node_dir), f"node or the Node host's packages are missing (npm ci in {node_dir})",
                 lambda folder, samples, decode: read_node(folder, samples, decode, node_dir)),
    }


def read_hosts(folder: Path, files: dict[str, dict[str, Any]], samples: tuple[str, ...], reference: Reading,
               genai_config: dict[str, Any], node_dir: Path = NODE_DIR) -> dict[str, HostResult]:
    """Each installed host's reading of files (name -> JSON), with folder's other files beside them."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="specdeploy-tokenizer-") as scratch:
        work = Path(scratch)
        for path in folder.iterdir():
            if path.is_file() and path.name not in files:
                shutil.copy2(path, work / path.name)
        for name, data in files.items():
            (work / name).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        (work / "genai_config.json").write_text(json.dumps(genai_config))
        for host, (version, _, reader) in _host_readers(node_dir).items():
            if version is None:
                continue
            try:
                reading = reader(work, samples, reference.ids)
            except Exception as exc:  # noqa: BLE001 - a host that cannot read the file is a finding, not a crash
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                results[host] = HostResult(host, version, None, f"cannot read the tokenizer: {first[:200]}",
                                           differing=4 * len(samples) + 1)
                continue
            differing = sum(distance(reference, reading, i) for i in range(len(samples)))
            results[host] = HostResult(host, version, reading, compare(reference, reading, samples), differing)
    return results


def repairs(files: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    """Rewrites of the tokenizer files that hosts may read alike, fewest changes first: (what changed, the files).

    files: file name -> parsed JSON (tokenizer.json, and tokenizer_config.json where there is one). For a
    byte-level BPE: no SentencePiece byte fallback and a ByteLevel decoder (a plain GPT-2 tokenizer, which
    tokenizers reads with the same ids: every byte has a token), and a tokenizer class that names
    no SentencePiece tokenizer (onnxruntime-genai picks its pre-tokenizer's split pattern by the class:
    for 'LlamaTokenizer' it splits '\\n    if' as '\\n', '   ', ' if' where GPT-2's pattern gives '\\n   ', ' if')."""
    tokenizer_json, config = files["tokenizer.json"], files.get("tokenizer_config.json")
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or not _has_byte_level(tokenizer_json.get("pre_tokenizer")):
        return []
    fixes = []
    if model.get("byte_fallback") or (tokenizer_json.get("decoder") or {}) != BYTE_LEVEL_DECODER:
        fixes.append(("byte_fallback false and a ByteLevel decoder", "tokenizer.json",
                      lambda d: d.update(model={**d["model"], "byte_fallback": False}, decoder=dict(BYTE_LEVEL_DECODER))))
    if isinstance(config, dict) and config.get("tokenizer_class", BYTE_LEVEL_CLASS) not in BYTE_LEVEL_CLASSES:
        fixes.append((f"tokenizer_class {BYTE_LEVEL_CLASS} (was {config['tokenizer_class']})", "tokenizer_config.json",
                      lambda d: d.update(tokenizer_class=BYTE_LEVEL_CLASS)))
    candidates = []
    for size in range(1, len(fixes) + 1):
        for chosen in itertools.combinations(fixes, size):
            fixed = {name: copy.deepcopy(data) for name, data in files.items()}
            for _, name, apply in chosen:
                apply(fixed[name])
            candidates.append((", ".join(description for description, _, _ in chosen), fixed))
    return candidates


def _has_byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers") or ())


def check_tokenizer(folder: Path, genai_config: dict[str, Any], node_dir: Path = NODE_DIR) -> CheckReport:
    """Compare every installed host with the reference on folder's tokenizer, repairing its files where that helps.

    folder: the bundle's tokenizer folder (tokenizer.json, tokenizer_config.json, ...); genai_config: the
    genai_config.json the bundle gives onnxruntime-genai (its tokenizer reads the token ids there).
    A repair is taken only if the reference reads it exactly as before (ids and text, every sample)."""
    original = {name: json.loads((folder / name).read_text(encoding="utf-8"))
                for name in EDITABLE if (folder / name).is_file()}
    samples = sample_texts(folder)
    reference = read_reference(original["tokenizer.json"], samples)
    before = read_hosts(folder, original, samples, reference, genai_config, node_dir)
    after, repair, chosen = before, None, original
    if any(result.problem for result in before.values()):
        best = _misses(before)
        for description, candidate in repairs(original):
            if read_reference(candidate["tokenizer.json"], samples, reference.ids) != reference:
                continue  # the runtime would read it differently: never taken
            trial = read_hosts(folder, candidate, samples, reference, genai_config, node_dir)
            newly_broken = any(before[h].problem is None and trial[h].problem for h in trial)
            if not newly_broken and _misses(trial) < best:
                after, repair, chosen, best = trial, description, candidate, _misses(trial)
                if best == 0:
                    break
    changed = {name: data for name, data in chosen.items() if data != original[name]}
    hosts = _records(before, after, repair, len(samples), node_dir)
    return CheckReport(samples, reference, before, after, repair, changed, hosts)


def _misses(results: dict[str, HostResult]) -> int:
    """How far every host is from the reference (a repair is taken only if it brings them closer)."""
    return sum(result.differing for result in results.values())


def _records(before, after, repair, num_samples: int, node_dir: Path) -> dict[str, HostTokenizerCheck]:
    records = {}
    for host, (version, missing, _) in _host_readers(node_dir).items():
        if version is None:
            records[host] = HostTokenizerCheck(status="not checked", reason=missing)
            continue
        old, new = before[host], after[host]
        if old.problem is None:
            records[host] = HostTokenizerCheck(status="ok", version=version, samples=num_samples)
        elif new.problem is None:
            records[host] = HostTokenizerCheck(status="repaired", version=version, samples=num_samples,
                                               reason=f"read alike with {repair} (tokenizers' ids and text unchanged "
                                                      f"on the sample); before, it {old.problem}")
        else:
            tried = f"; with {repair} it still {new.problem}" if repair else "; no rewrite that keeps tokenizers' ids makes it agree"
            records[host] = HostTokenizerCheck(status="unsupported", version=version, samples=num_samples,
                                               reason=f"it {old.problem}{tried}")
    return records


def _brief(record: HostTokenizerCheck, problem: str | None, repair: str | None) -> str:
    """One short line for the export's log: the status and why (the first difference stays in the manifest)."""
    if record.status == "unsupported":
        counted = re.search(r"\((\d+ of \d+) samples differ\)$", problem or "")
        how_many = f"{counted.group(1)} samples" if counted else "the samples"
        return (f"unsupported: {how_many} read otherwise than by tokenizers, with or without a rewrite "
                "(`specdeploy inspect` shows the first)")
    if record.status == "repaired":
        return f"repaired: read alike with {repair}"
    return record.status + (f": {record.reason}" if record.reason else "")


def check_bundle(manifest: Manifest, root: Path, report: Callable[[str, str], None] | None = None,
                 node_dir: Path = NODE_DIR) -> Manifest:
    """check_tokenizer on the bundle in root (its genai configs already written); the manifest with the hosts recorded.

    A repaired tokenizer.json replaces the bundle's and every copy beside a genai config, with their
    manifest entries; where onnxruntime-genai reads it differently, the genai section says so."""
    report = report or (lambda stage, detail: None)
    folder = root / manifest.tokenizer.path
    result = check_tokenizer(folder, _genai_config(manifest, root), node_dir)
    tokenizer, genai = manifest.tokenizer, manifest.genai
    if result.changed:
        fresh = {}
        for entry in [*tokenizer.files, *(genai.files if genai else ())]:  # the folder's files and genai's copies
            name = Path(entry.path).name
            if name in result.changed:
                text = json.dumps(result.changed[name], ensure_ascii=False, indent=2) + "\n"
                (root / entry.path).write_text(text, encoding="utf-8")
                fresh[entry.path] = file_entry(root, root / entry.path)

        def renew(entries: tuple[FileEntry, ...]) -> tuple[FileEntry, ...]:
            return tuple(fresh.get(entry.path, entry) for entry in entries)

        tokenizer = dataclasses.replace(tokenizer, files=renew(tokenizer.files))
        if genai is not None:
            genai = dataclasses.replace(genai, files=renew(genai.files))
    for host, record in result.hosts.items():  # a result beside its reason, in brief (`inspect` shows it whole)
        after = result.after.get(host)  # none for a host not checked (not installed)
        report("validate", f"tokenizer under {host}: {_brief(record, after and after.problem, result.repair)}")
    genai_record = result.hosts["genai"]
    if genai is not None and genai_record.status == "unsupported" and (genai.speculative or genai.target_only):
        note = (f"onnxruntime-genai's tokenizer reads tokenizer.json differently ({genai_record.reason}): "
                "its configs run on token ids, not text")
        genai = dataclasses.replace(genai, unsupported=f"{genai.unsupported}; {note}" if genai.unsupported else note)
    return dataclasses.replace(manifest, tokenizer=dataclasses.replace(tokenizer, hosts=result.hosts), genai=genai)


def _genai_config(manifest: Manifest, root: Path) -> dict[str, Any]:
    """The bundle's own genai_config.json where one is written, else the least genai's tokenizer needs."""
    genai = manifest.genai
    folder = (genai.target_only or genai.speculative) if genai else None
    if folder is not None:
        return json.loads((root / folder / "genai_config.json").read_text(encoding="utf-8"))
    tok = manifest.tokenizer
    return minimal_genai_config(manifest.target.vocab_size, tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id,
                                manifest.max_context)


def minimal_genai_config(vocab_size: int, bos_token_id: int | None = None, eos_token_ids=(), pad_token_id: int | None = None,
                         max_context: int = 4096) -> dict[str, Any]:
    """A genai_config.json onnxruntime-genai's tokenizer loads beside (it names a model it never opens)."""
    eos = list(eos_token_ids) or [0]
    decoder = {"filename": "model.onnx", "head_size": 1, "hidden_size": 1, "num_attention_heads": 1,
               "num_hidden_layers": 1, "num_key_value_heads": 1, "session_options": {}}
    return {"model": {"type": "decoder", "bos_token_id": eos[0] if bos_token_id is None else bos_token_id,
                      "eos_token_id": eos, "pad_token_id": eos[0] if pad_token_id is None else pad_token_id,
                      "vocab_size": vocab_size, "context_length": max_context, "decoder": decoder},
            "search": {"max_length": max_context}}


def main(argv: list[str] | None = None) -> int:
    """`python -m specdeploy.export.tokenizer_hosts FOLDER`: each host's ids on FOLDER's tokenizer, before and after repair."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("folder", type=Path, help="a folder holding tokenizer.json (and tokenizer_config.json)")
    parser.add_argument("--show", type=int, default=3, help="samples to print ids for")
    args = parser.parse_args(argv)
    data = json.loads((args.folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = len(data["model"].get("vocab") or ()) + len(data.get("added_tokens") or ())
    config = minimal_genai_config(vocab)
    result = check_tokenizer(args.folder, config)
    for i, text in enumerate(result.samples[: args.show]):
        print(f"{quote(text, 60)}\n  tokenizers      {list(result.reference.ids[i])}")
        for stage, results in (("before", result.before), ("after", result.after)):
            for host, host_result in results.items():
                if host_result.reading is not None:
                    print(f"  {host:<6} {stage:<8} {list(host_result.reading.ids[i])}  {quote(host_result.reading.texts[i], 40)}")
    print(f"repair: {result.repair or 'none'}")
    for host, record in result.hosts.items():
        print(f"{host}: {record.status}" + (f": {record.reason}" if record.reason else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
