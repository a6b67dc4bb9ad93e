"""The draft's vocabulary subset (export/draft_vocab.py): one ranking for both sources of counts, and
`export --draft-vocab N` for a draft without draft_vocab.json (a GGUF file, a Hugging Face folder),
its N ids counted over a text sample with the target's tokenizer; the output still the target's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import specdeploy
from specdeploy.bundle import load_manifest
from specdeploy.cli import main
from specdeploy.errors import SpecdeployError
from specdeploy.export.draft_vocab import TokenCounts, rank_vocab, read_sample

SUBSET = 64  # of the tiny GGUF's 320 tokens
PROMPTS = ["def merge(a, b):\n    ", "class Node:\n    def __init__(self", "import os\n\nfor name in"]
PROSE = "The lazy dog sleeps while the quick brown fox jumps. Sleep, dog, sleep!\n" * 40


def test_the_ranking_keeps_the_specials_then_the_most_frequent_ties_to_the_lower_id():
    counts = TokenCounts(np.arange(8), np.array([0, 5, 5, 1, 0, 9, 0, 0]), always=(7,), total=20)
    assert rank_vocab(counts, 4).tolist() == [1, 2, 5, 7]  # 7 kept at count 0; 1 and 2 tie, both fit
    assert rank_vocab(counts, 3).tolist() == [1, 5, 7]  # of the tie, the lower id
    assert rank_vocab(counts, 6).tolist() == [0, 1, 2, 3, 5, 7]  # ids never counted: the lower first
    with pytest.raises(SpecdeployError, match="the vocabulary has 8 tokens"):
        rank_vocab(counts, 9)
    with pytest.raises(SpecdeployError, match="fewer than the 1 special tokens"):
        rank_vocab(counts, 0)


def _sample_counts(tokenizer_file: Path, files: tuple[str, ...], vocab: int) -> np.ndarray:
    """How often each id occurs in the sample, counted here apart from export's own counting."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    counts = np.zeros(vocab, dtype=np.int64)
    for _, texts in read_sample(files):
        for text in texts:
            np.add.at(counts, tokenizer.encode(text, add_special_tokens=False).ids, 1)
    return counts


def _expected_subset(bundle: Path, files: tuple[str, ...]) -> tuple[list[int], list[int]]:
    """(the tokenizer's added tokens, the ids a subset of SUBSET keeps over the sample): every special, then
    the most frequent of the rest, ties to the lower id."""
    from tokenizers import Tokenizer

    manifest = load_manifest(bundle)
    tokenizer_file = bundle / manifest.tokenizer.path / "tokenizer.json"
    specials = sorted(Tokenizer.from_file(str(tokenizer_file)).get_added_tokens_decoder())
    counts = _sample_counts(tokenizer_file, files, manifest.draft.vocab_size)
    rest = [i for i in np.lexsort((np.arange(len(counts)), -counts)).tolist() if i not in specials]
    return specials, sorted(specials + rest[: SUBSET - len(specials)])


def _vocab_ids(bundle: Path) -> list[int]:
    draft = load_manifest(bundle).draft
    return json.loads((bundle / draft.vocab_ids).read_text())["ids"]


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory) -> Path:
    """A tiny quantized Qwen2 GGUF (a Q6_K head, as Qwen2.5-Coder's files), target and draft alike."""
    pytest.importorskip("gguf")
    from test_gguf_blocks import ARCH_TYPES, write_quantized_gguf

    return write_quantized_gguf(tmp_path_factory.mktemp("gguf") / "qwen2.gguf", "qwen2", ARCH_TYPES["qwen2"])


@pytest.fixture(scope="module")
def trimmed_bundle(tmp_path_factory, gguf_pair) -> Path:
    out = tmp_path_factory.mktemp("trimmed") / "bundle"
    result = CliRunner().invoke(main, ["export", "--target", str(gguf_pair), "--draft", str(gguf_pair), "--out", str(out),
                                       "--draft-vocab", str(SUBSET)])
    assert result.exit_code == 0, result.output
    return out


def test_a_gguf_draft_keeps_the_specials_and_the_samples_most_frequent_tokens(trimmed_bundle):
    manifest = load_manifest(trimmed_bundle)
    draft = manifest.draft
    assert draft.quantize == "gguf" and draft.vocab_subset == SUBSET and draft.parity.passed
    assert next(t for t in draft.outputs if t.name == "logits").shape[-1] == SUBSET  # the head has N columns
    specials, expected = _expected_subset(trimmed_bundle, ())
    assert specials == [0, 1, 2]  # ChatML's <|endoftext|>, <|im_start|>, <|im_end|>: a chat's end can be drafted
    assert _vocab_ids(trimmed_bundle) == expected
    source = draft.vocab_source
    assert source["counts"] == "text" and source["counted_tokens"] > 1000 and 0.5 < source["coverage"] <= 1
    assert source["files"] == ["specdeploy/data/parity_text.txt", "specdeploy/data/code_prompts.json"]
    assert manifest.export_options["draft_vocab"] == SUBSET
    lines = CliRunner().invoke(main, ["inspect", str(trimmed_bundle)]).output.splitlines()
    assert any(line.startswith(f"draft vocabulary: {SUBSET} tokens") for line in lines)
    assert "  specdeploy/data/parity_text.txt" in lines and max(len(line) for line in lines) <= 80


@pytest.fixture(scope="module")
def prose_bundle(tmp_path_factory, gguf_pair) -> tuple[Path, Path]:
    """(the bundle, its --draft-vocab-text): the pair exported with the subset counted over prose."""
    root = tmp_path_factory.mktemp("prose")
    text = root / "traffic.txt"
    text.write_text(PROSE)
    result = CliRunner().invoke(main, ["export", "--target", str(gguf_pair), "--draft", str(gguf_pair),
                                       "--out", str(root / "bundle"), "--draft-vocab", str(SUBSET),
                                       "--draft-vocab-text", str(text)])
    assert result.exit_code == 0, result.output
    return root / "bundle", text


def assert_greedy_is_the_targets(bundle: Path, drafter: str) -> int:
    """Speculative greedy output equals target-only output for each prompt; returns the draft tokens accepted."""
    generator = specdeploy.load(bundle, drafter=drafter, exact=True)  # a quantized target's steps round otherwise
    accepted = 0
    for prompt in PROMPTS:
        ids = generator.codec.encode(prompt)
        alone = generator.generate(ids, max_new_tokens=32, speculative=False)
        speculative = generator.generate(ids, max_new_tokens=32, num_draft_tokens=4)
        assert speculative.token_ids == alone.token_ids
        assert drafter != "model" or speculative.stats.drafted > 0
        accepted += speculative.stats.accepted
    return accepted


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_a_trimmed_gguf_draft_leaves_greedy_output_the_targets(trimmed_bundle, drafter):
    """The random target's favourite token is outside the subset: every draft is rejected and the target's own
    choice kept (the trained pair below is accepted)."""
    assert_greedy_is_the_targets(trimmed_bundle, drafter)


def test_a_text_sample_changes_the_choice(trimmed_bundle, prose_bundle):
    out, text = prose_bundle
    ids = _vocab_ids(out)
    assert ids == _expected_subset(out, (str(text),))[1] and ids != _vocab_ids(trimmed_bundle)
    manifest = load_manifest(out)
    assert manifest.draft.vocab_source["files"] == [str(text.resolve())]
    assert manifest.draft.vocab_source["coverage"] == 1.0  # prose of fewer distinct tokens than the subset holds
    assert manifest.export_options["draft_vocab_text"] == [str(text.resolve())]


def test_a_hugging_face_draft_takes_draft_vocab_too(trained_pair, tmp_path):
    """A plain checkpoint folder (no draft_vocab.json) trained on code, its own draft: the shipped code sample's
    subset holds much of what it writes, so its trimmed head's proposals are accepted."""
    target = str(trained_pair["target"])
    result = CliRunner().invoke(main, ["export", "--target", target, "--draft", target, "--out", str(tmp_path / "b"),
                                       "--draft-vocab", "100"])
    assert result.exit_code == 0, result.output
    draft = load_manifest(tmp_path / "b").draft
    assert draft.vocab_subset == 100 and draft.vocab_source["counts"] == "text" and draft.graph == "fused"
    assert {0, 1} <= set(_vocab_ids(tmp_path / "b"))  # <s>, </s>
    assert assert_greedy_is_the_targets(tmp_path / "b", "model") > 0


@pytest.mark.parametrize("options, message", [
    (["--draft-vocab", "400"], "--draft-vocab 400: the vocabulary has 320 tokens"),
    (["--draft-vocab", "2"], "--draft-vocab 2: fewer than the 3 special tokens"),
    (["--draft-vocab", "8", "--draft-vocab-text", "{missing}"], "cannot be read"),
    (["--draft-vocab", "8", "--draft-vocab-text", "{empty}"], "holds no text"),
    (["--draft-vocab", "8", "--draft-vocab-text", "{binary}"], "not UTF-8 text"),
    (["--draft-vocab-text", "{text}"], "pass --draft-vocab N too"),
    (["--draft-vocab", "0", "--draft-vocab-text", "{text}"], "pass --draft-vocab N too"),
])
def test_draft_vocab_errors_are_one_line(gguf_pair, tmp_path, options, message):
    files = {"missing": tmp_path / "missing.txt", "empty": tmp_path / "empty.txt", "binary": tmp_path / "binary.txt",
             "text": tmp_path / "text.txt"}
    files["empty"].write_text(" \n\n")
    files["binary"].write_bytes(b"\xff\xfe\x00 not utf-8 \x80")
    files["text"].write_text(PROSE)
    options = [o.format(**{k: str(v) for k, v in files.items()}) for o in options]
    result = CliRunner().invoke(main, ["export", "--target", str(gguf_pair), "--draft", str(gguf_pair),
                                       "--out", str(tmp_path / "b"), *options])
    assert result.exit_code == 2 and result.output.count("error:") == 1, result.output
    assert message in result.output and not (tmp_path / "b").exists()
