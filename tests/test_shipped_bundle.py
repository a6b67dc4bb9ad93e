"""The demo bundle that ships in the package (specdeploy/demo/demo-bundle): whole, installed by the wheel, and
what a fresh export of the demo pair gives (scripts/ship_demo_bundle.py writes it)."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest

import specdeploy
from specdeploy.bundle import MANIFEST_NAME, listed_files, load_manifest
from specdeploy.defaults import SHIPPED_BUNDLE

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fib(n):", "import os\n", "class Stack:\n    def push(self, item):"]
# What differs between two exports of the same pair for reasons other than the bundle: when and with
# which package versions it ran, where the checkpoints were, which tokenizer hosts were installed, and
# the parity check's float differences from PyTorch (its reference is computed, not stored).
CIRCUMSTANCES = ("created", "tool_versions", "target.source", "draft.source", "tokenizer.hosts",
                 *(f"{role}.parity.{diff}_max_abs_diff" for role in ("target", "draft") for diff in ("prefill", "verify")))


def _without(manifest: dict, dotted: tuple[str, ...]) -> dict:
    manifest = json.loads(json.dumps(manifest))
    for name in dotted:
        *parents, last = name.split(".")
        holder = manifest
        for parent in parents:
            holder = holder[parent]
        holder.pop(last)
    return manifest


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def test_the_shipped_bundle_is_whole_and_names_no_machine_path():
    manifest = load_manifest(SHIPPED_BUNDLE, verify=True)  # every listed file present, its sha256 matching
    assert manifest.target.quantize == "none" and manifest.draft.quantize == "int8"  # export's defaults
    strings = list(_strings(json.loads((SHIPPED_BUNDLE / MANIFEST_NAME).read_text(encoding="utf-8"))))
    assert not [s for s in strings if s.startswith("/") or "/home/" in s or str(ROOT) in s]
    on_disk = {p.relative_to(SHIPPED_BUNDLE).as_posix() for p in SHIPPED_BUNDLE.rglob("*") if p.is_file()}
    assert on_disk == {entry.path for entry in listed_files(manifest)} | {MANIFEST_NAME}  # nothing unlisted


def test_the_wheel_carries_every_file_of_the_shipped_bundle():
    tomllib = pytest.importorskip("tomllib")
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"][
        "package-data"]["specdeploy"]
    package = ROOT / "specdeploy"

    def carried(path: Path) -> bool:  # setuptools' globs: '*' stays within one folder
        parts = path.relative_to(package).parts
        return any(len(parts) == len(pattern.split("/")) and all(map(fnmatch.fnmatch, parts, pattern.split("/")))
                   for pattern in patterns)

    files = [p for p in SHIPPED_BUNDLE.rglob("*") if p.is_file()]
    assert len(files) > 10 and [p for p in files if not carried(p)] == []


@pytest.mark.slow
def test_the_shipped_bundle_is_a_fresh_export_of_the_demo_pair(demo_bundle):
    """The same manifest (bar CIRCUMSTANCES) and the same tokens; the same bytes too where the export ran
    with the same package versions (the export is deterministic)."""
    shipped = json.loads((SHIPPED_BUNDLE / MANIFEST_NAME).read_text(encoding="utf-8"))
    fresh = json.loads((demo_bundle / MANIFEST_NAME).read_text(encoding="utf-8"))
    if shipped["tool_versions"] == fresh["tool_versions"]:
        assert _without(shipped, CIRCUMSTANCES) == _without(fresh, CIRCUMSTANCES)
    else:  # another torch or ONNX may write other bytes: the structure must still agree
        hashes = tuple(f"{role}.files" for role in ("target", "draft", "tokenizer"))
        assert _without(shipped, CIRCUMSTANCES + hashes + ("accept", "genai")) == \
            _without(fresh, CIRCUMSTANCES + hashes + ("accept", "genai"))
    ours, theirs = specdeploy.load(SHIPPED_BUNDLE), specdeploy.load(demo_bundle)
    for prompt in PROMPTS:
        for options in ({}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}):
            expected = theirs.generate(prompt, max_new_tokens=24, **options).token_ids
            assert ours.generate(prompt, max_new_tokens=24, **options).token_ids == expected, (prompt, options)
