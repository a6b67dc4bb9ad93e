"""Every host tokenizes alike: export compares onnxruntime-genai's and the Node host's tokenizers with HF
tokenizers on a sample of text, repairs a tokenizer.json they misread, and records what it found.

The tokenizers are built here: a clean byte-level BPE, the GGUF-converted hybrid (byte-level vocabulary,
`byte_fallback: true`, a SentencePiece-style decoder, tokenizer_class LlamaTokenizer) that
onnxruntime-genai 0.18 misreads, and one whose byte-fallback tokens carry real ids, so no repair can keep
HF's ids. The genai and Node parts skip when those libraries are not installed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specdeploy.bundle import file_entry, load_manifest, save_manifest
from specdeploy.cli import main
from specdeploy.export import tokenizer_hosts as th

HYBRID_DECODER = {"type": "Sequence", "decoders": [
    {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

needs_genai = pytest.mark.skipif(th.genai_version() is None, reason="onnxruntime-genai is not installed")


def build_folder(folder: Path, kind: str) -> Path:
    """A tokenizer folder: kind 'clean', 'hybrid' or 'byte-tokens' (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [(stdlib / name).read_text() for name in ("textwrap.py", "bisect.py")] + list(th.TEXT_SAMPLES)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = [] if kind == "byte-tokens" else pre_tokenizers.ByteLevel.alphabet()  # byte-tokens: ASCII only
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False, initial_alphabet=alphabet)
    tokenizer.train_from_iterator([text for text in corpus if text.isascii()] if kind == "byte-tokens" else corpus, trainer)
    data = json.loads(tokenizer.to_str())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "chat_template": CHAT_TEMPLATE}
    if kind != "clean":
        data["model"]["byte_fallback"] = True
        data["decoder"] = HYBRID_DECODER
        config["tokenizer_class"] = "LlamaTokenizer"
    if kind == "byte-tokens":  # SentencePiece's byte tokens: what every non-ASCII byte falls back to
        vocab = data["model"]["vocab"]
        for byte in range(256):
            vocab.setdefault(f"<0x{byte:02X}>", len(vocab) + len(SPECIALS))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def check(folder: Path) -> th.CheckReport:
    return th.check_tokenizer(folder, th.minimal_genai_config(1024, eos_token_ids=(2,)))


def hf_ids(folder: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=True).ids


def genai_ids(folder: Path, text: str) -> list[int]:
    """onnxruntime-genai's ids, read here without the module under test."""
    import onnxruntime_genai as og

    (folder / "genai_config.json").write_text(json.dumps(th.minimal_genai_config(1024, eos_token_ids=(2,))))
    return [int(t) for t in og.Tokenizer(str(folder)).encode(text)]


def write_repair(folder: Path, result: th.CheckReport) -> None:
    for name, data in result.changed.items():
        (folder / name).write_text(json.dumps(data, ensure_ascii=False))


def test_the_sample_covers_code_text_scripts_whitespace_and_special_tokens(tmp_path):
    samples = th.sample_texts(build_folder(tmp_path, "clean"))
    joined = "".join(samples)
    for needle in ("def ", "\t", "   ", "é", "你好", "🙂", "\u200d", "<|im_start|>", "<|im_end|>"):
        assert needle in joined, needle
    assert any(text.startswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>") for text in samples)  # the chat template


def test_the_reference_is_the_runtime_tokenizer(tmp_path):
    from specdeploy.runtime.text import TextCodec  # noqa: F401 - the runtime's reading, through its own class

    folder = build_folder(tmp_path, "clean")
    data = json.loads((folder / "tokenizer.json").read_text())
    reference = th.read_reference(data, ("def f(x):",))
    assert list(reference.ids[0]) == hf_ids(folder, "def f(x):") and reference.texts == ("def f(x):",)


@needs_genai
def test_genai_misreads_the_hybrid_and_the_repair_makes_it_agree(tmp_path):
    folder = build_folder(tmp_path / "hybrid", "hybrid")
    text = "def fibonacci(n):\n    if n == 1:"
    before = genai_ids(folder, text)
    assert before != hf_ids(folder, text) and -1 in before  # the misreading this repair is for
    original_hf = {sample: hf_ids(folder, sample) for sample in th.sample_texts(folder)}

    result = check(folder)
    assert result.before["genai"].problem is not None
    assert result.repair is not None and "ByteLevel decoder" in result.repair
    repaired = result.changed["tokenizer.json"]
    assert repaired["model"]["byte_fallback"] is False and repaired["decoder"]["type"] == "ByteLevel"
    assert result.hosts["genai"].status == "repaired" and "byte_fallback false" in result.hosts["genai"].reason

    write_repair(folder, result)
    for sample, ids in original_hf.items():
        assert hf_ids(folder, sample) == ids, sample  # the repair never changes HF's ids
        assert genai_ids(folder, sample) == ids, sample
    import onnxruntime_genai as og

    tokenizer = og.Tokenizer(str(folder))
    assert tokenizer.decode(np.asarray(hf_ids(folder, text), dtype=np.int32)) == text
    assert check(folder).hosts["genai"].status == "ok"  # the repaired file needs no further repair


@needs_genai
def test_a_clean_tokenizer_is_ok_and_left_alone(tmp_path):
    result = check(build_folder(tmp_path, "clean"))
    assert result.hosts["genai"].status == "ok" and result.hosts["genai"].reason is None
    assert result.repair is None and result.changed == {}
    assert result.hosts["genai"].samples == len(result.samples) == len(th.TEXT_SAMPLES) + len(SPECIALS) + 1


@needs_genai
def test_no_repair_that_changes_hf_ids_is_taken_and_the_host_is_unsupported(tmp_path):
    folder = build_folder(tmp_path, "byte-tokens")
    text = "你好 🙂"
    assert any(i >= 400 for i in hf_ids(folder, text))  # HF reads the bytes as the <0xNN> tokens
    assert genai_ids(folder, text) != hf_ids(folder, text)
    result = check(folder)
    record = result.hosts["genai"]
    assert record.status == "unsupported" and "encodes" in record.reason
    for _, candidate in th.repairs({"tokenizer.json": json.loads((folder / "tokenizer.json").read_text())}):
        if "byte_fallback false" in _:
            assert th.read_reference(candidate["tokenizer.json"], (text,)).ids != (tuple(hf_ids(folder, text)),)
    if result.changed:  # a partial repair may be kept only with HF's reading unchanged
        write_repair(folder, result)
        assert th.read_reference(json.loads((folder / "tokenizer.json").read_text()), result.samples) == result.reference


def test_node_reads_the_hybrid_and_the_repair_alike(node, tmp_path):
    """`node` installs examples/node's locked packages where they are missing."""
    folder = build_folder(tmp_path, "hybrid")
    samples = th.sample_texts(folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    reference = th.read_reference(data, samples)
    reading = th.read_node(folder, samples, reference.ids)
    assert reading.ids == reference.ids and reading.texts == reference.texts
    broken = dict(data, decoder={"type": "Replace", "pattern": {"String": "Ġ"}, "content": "_"})
    (folder / "tokenizer.json").write_text(json.dumps(broken, ensure_ascii=False))
    other = th.read_node(folder, samples, reference.ids)  # the comparison sees a decoder difference
    assert th.compare(reference, other, samples) is not None


def test_hosts_not_installed_are_recorded_as_not_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(th, "genai_version", lambda: None)
    result = check(build_folder(tmp_path, "hybrid"))
    assert result.hosts["genai"].status == "not checked" and "not installed" in result.hosts["genai"].reason
    missing = th.check_tokenizer(build_folder(tmp_path / "b", "clean"), th.minimal_genai_config(1024),
                                 node_dir=tmp_path / "no-node-host")
    assert missing.hosts["node"].status == "not checked"


@needs_genai
def test_export_records_the_hosts_and_an_old_manifest_still_loads(bundles, tmp_path):
    manifest = load_manifest(bundles("llama"), verify=True)
    assert manifest.tokenizer.hosts["genai"].status == "ok"
    node = manifest.tokenizer.hosts["node"]
    if th.node_version() is None:
        assert node.status == "not checked"
    else:  # the suite may install the Node host's packages (tests/test_node_host.py) after this bundle was made
        assert node.status == "ok" or (node.status == "not checked" and "node" in node.reason.lower())
    assert manifest.genai.unsupported is None
    old = shutil.copytree(bundles("llama"), tmp_path / "old")
    save_manifest(dataclasses.replace(manifest, tokenizer=dataclasses.replace(manifest.tokenizer, hosts={})), old)
    data = json.loads((old / "specdeploy.json").read_text())
    del data["tokenizer"]["hosts"]
    (old / "specdeploy.json").write_text(json.dumps(data))
    assert load_manifest(old).tokenizer.hosts == {}
    result = CliRunner().invoke(main, ["inspect", str(old)])
    assert result.exit_code == 0 and "not checked (exported before the check)" in result.output


def put_tokenizer(bundle: Path, source: Path):
    """The bundle with source's tokenizer files in its tokenizer folder and beside each genai config."""
    manifest = load_manifest(bundle)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        for entry in [*manifest.tokenizer.files, *manifest.genai.files]:
            if Path(entry.path).name == name:
                shutil.copy2(source / name, bundle / entry.path)

    def renew(entries):
        return tuple(file_entry(bundle, bundle / entry.path) for entry in entries)

    return dataclasses.replace(manifest, tokenizer=dataclasses.replace(manifest.tokenizer, files=renew(manifest.tokenizer.files)),
                               genai=dataclasses.replace(manifest.genai, files=renew(manifest.genai.files)))


@needs_genai
def test_check_bundle_rewrites_every_copy_and_the_manifest_hashes(bundles, tmp_path):
    bundle = shutil.copytree(bundles("llama"), tmp_path / "bundle")
    manifest = th.check_bundle(put_tokenizer(bundle, build_folder(tmp_path / "hybrid", "hybrid")), bundle)
    save_manifest(manifest, bundle)
    manifest = load_manifest(bundle, verify=True)  # every rewritten file hashed anew
    assert manifest.tokenizer.hosts["genai"].status == "repaired" and manifest.genai.unsupported is None
    for folder in (bundle / "tokenizer", bundle, bundle / manifest.genai.target_only):
        assert json.loads((folder / "tokenizer.json").read_text())["decoder"]["type"] == "ByteLevel"
        assert genai_ids(folder, "def f(x):\n    return") == hf_ids(bundle / "tokenizer", "def f(x):\n    return")


@needs_genai
def test_an_unsupported_host_is_in_the_manifest_the_genai_section_and_inspect(bundles, tmp_path):
    bundle = shutil.copytree(bundles("llama"), tmp_path / "bundle")
    manifest = th.check_bundle(put_tokenizer(bundle, build_folder(tmp_path / "bytes", "byte-tokens")), bundle)
    save_manifest(manifest, bundle)
    manifest = load_manifest(bundle, verify=True)
    assert manifest.tokenizer.hosts["genai"].status == "unsupported"
    assert "onnxruntime-genai's tokenizer reads tokenizer.json differently" in manifest.genai.unsupported
    result = CliRunner().invoke(main, ["inspect", str(bundle)], terminal_width=200)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    start = lines.index("tokenizer under other hosts (against HF tokenizers at export):")
    section = lines[start:]
    assert any(line.startswith("  genai: unsupported (") for line in section)
    assert all(len(line) <= 80 for line in section)
    assert "encodes" in " ".join(section)


def test_an_id_difference_is_shown_where_the_readings_part():
    want = tuple(range(100, 120))
    got = want[:12] + (-1, -1) + want[13:]
    line = th.compare(th.Reading((want,), ("x",)), th.Reading((got,), ("x",)), ("naive text",))
    assert line == ('encodes "naive text" as [..., 110, 111, -1, -1, 113, 114, 115, 116, 117, 118, ...] '
                    'where tokenizers gives [..., 110, 111, 112, 113, 114, 115, 116, 117, 118, 119] (1 of 1 samples differ)')


@needs_genai
def test_check_bundle_reports_a_host_that_is_not_installed_in_its_line(bundles, tmp_path):
    """A host not installed (no node packages here) has no reading: its line says "not checked" and why, and
    the export goes on."""
    bundle = shutil.copytree(bundles("llama"), tmp_path / "bundle")
    lines = []
    manifest = th.check_bundle(put_tokenizer(bundle, build_folder(tmp_path / "hybrid", "hybrid")), bundle,
                               report=lambda stage, detail: lines.append(detail), node_dir=tmp_path / "no-node-host")
    assert manifest.tokenizer.hosts["node"].status == "not checked"
    assert any(line.startswith("tokenizer under node: not checked: ") for line in lines), lines
    assert any(line.startswith("tokenizer under genai: repaired: read alike with ") for line in lines), lines
