"""The draft's vocabulary subset (FR-Spec, Zhao et al., 2025: a draft's LM head over the most frequent
tokens only): which token ids it keeps, and the counts they are ranked by, from one of two sources:

- a folder `specdeploy distill --draft-vocab` wrote: its draft_vocab.json (the distillation data's counts);
- any other draft (a .gguf file, a Hugging Face folder) given `export --draft-vocab N`: a text sample
  (`--draft-vocab-text`, else the texts specdeploy/data/ ships) tokenized here with the target's tokenizer.

Both feed one ranking (`rank_vocab`): the special tokens always, then by count, ties and ids never
counted to the lower id (a BPE's ids follow its merge order, a frequency order of its own corpus).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import SpecdeployError

DRAFT_VOCAB_FILE = "draft_vocab.json"
DATA = Path(__file__).resolve().parent.parent / "data"
PIECE_CHARS = 1 << 16  # a sample file is tokenized this much at a time, cut at a line end
BATCH_PIECES = 64  # pieces per encode_batch call


@dataclass(frozen=True)
class TokenCounts:
    """What a subset is ranked by: the candidate ids, how often each was counted, the ids always kept."""

    ids: np.ndarray  # [candidates] the ids the head may keep
    counts: np.ndarray  # [candidates] occurrences of each
    always: tuple[int, ...]  # the special tokens, kept whatever their count
    total: int  # tokens counted in all (the subset's coverage is its share of them)
    source: dict = field(default_factory=dict)  # where the counts come from (the manifest's vocab_source)


@dataclass(frozen=True)
class VocabSubset:
    """The draft head's rows and where their ranking came from."""

    ids: np.ndarray  # [size] sorted: column i of the draft's logits is token ids[i]
    source: dict = field(default_factory=dict)  # TokenCounts.source, with the counted tokens the subset covers


@dataclass(frozen=True)
class TextSample:
    """What counting tokens over text needs: the target's tokenizer, the files, the target's special ids."""

    tokenizer_dir: Path  # the folder of the target's tokenizer.json (the one the bundle holds)
    files: tuple[str, ...] = ()  # UTF-8 text files; empty: the sample specdeploy/data/ ships
    specials: tuple[int, ...] = ()  # the target's BOS, EOS and pad, kept beside the tokenizer's added tokens


def rank_vocab(counts: TokenCounts, size: int) -> np.ndarray:
    """The `size` ids the head keeps, sorted: counts.always, then the most frequent, ties to the lower id."""
    if size > len(counts.ids):
        raise SpecdeployError(f"--draft-vocab {size}: the vocabulary has {len(counts.ids)} tokens")
    always = list(dict.fromkeys(counts.always))
    if size < len(always):
        raise SpecdeployError(f"--draft-vocab {size}: fewer than the {len(always)} special tokens it always "
                              "keeps (the tokenizer's added tokens, BOS, EOS, pad)")
    order = np.lexsort((counts.ids, -counts.counts))  # most frequent first, ties to the lower id
    chosen = list(dict.fromkeys([*always, *counts.ids[order].tolist()]))[:size]
    return np.sort(np.asarray(chosen, dtype=np.int64))


def subset(counts: TokenCounts, size: int | None = None) -> VocabSubset:
    """rank_vocab's `size` ids (None: every candidate), its source with the share of the counted tokens they cover."""
    ids = np.sort(counts.ids) if size is None else rank_vocab(counts, size)
    covered = int(counts.counts[np.isin(counts.ids, ids)].sum())
    return VocabSubset(ids, {**counts.source, "coverage": round(covered / counts.total, 6) if counts.total else 0.0})


def read_draft_vocab(folder: Path) -> dict | None:
    """draft_vocab.json of a distilled draft folder (None: it has none)."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ids, counts = np.asarray(data["ids"], dtype=np.int64), np.asarray(data["counts"], dtype=np.int64)
        always = [int(i) for i in data.get("always", [])]
        vocab = int(data["vocab_size"])
        frequencies = data.get("frequencies") or {}
        all_ids = np.asarray(frequencies.get("ids", []), dtype=np.int64)
        all_counts = np.asarray(frequencies.get("counts", []), dtype=np.int64)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as exc:
        raise SpecdeployError(f"--draft {folder}: {DRAFT_VOCAB_FILE} is unreadable ({exc})") from None
    if ids.ndim != 1 or ids.shape != counts.shape or len(ids) == 0 or ids.min() < 0 or ids.max() >= vocab:
        raise SpecdeployError(f"--draft {folder}: {DRAFT_VOCAB_FILE} lists ids outside 0..{vocab - 1}, or no ids")
    return {"ids": ids, "counts": counts, "always": always, "vocab_size": vocab, "source": data.get("source", {}),
            "all_ids": all_ids, "all_counts": all_counts}


def choose_vocab(folder: Path | None, requested: int | None, vocab_size: int, eagle: bool = False,
                 sample: TextSample | None = None) -> VocabSubset | None:
    """The ids the draft's head keeps (None: the whole vocabulary).

    requested None: the draft folder's own draft_vocab.json (all of its ids), if it has one; 0: the
    whole vocabulary; N: the N most frequent of draft_vocab.json's ids, or, for a draft without one,
    of every id as counted over `sample` (the special ids kept either way). An eagle head's rows are
    the target's own, so it may also take more than it was distilled over, by every token's count
    (draft_vocab.json's `frequencies`)."""
    vocab = read_draft_vocab(folder) if folder is not None else None
    if vocab is not None and sample is not None and sample.files:
        raise SpecdeployError(f"--draft-vocab-text: the draft folder's {DRAFT_VOCAB_FILE} already holds the counts of "
                              "the data it was distilled on; leave --draft-vocab-text out")
    if requested == 0 or (requested is None and vocab is None):
        return None
    if vocab is None:
        if sample is None:
            raise SpecdeployError(f"--draft-vocab {requested}: the draft has no {DRAFT_VOCAB_FILE} and no text was "
                                  "given to count tokens over; pass --draft-vocab 0 for the whole vocabulary")
        return subset(count_text(sample, vocab_size), requested)
    if vocab["vocab_size"] != vocab_size:
        raise SpecdeployError(f"--draft {folder}: {DRAFT_VOCAB_FILE} is for a vocabulary of {vocab['vocab_size']}, "
                              f"the target has {vocab_size}")
    wide = eagle and requested is not None and requested > len(vocab["ids"]) and len(vocab["all_ids"]) > 0
    counts = _distilled_counts(vocab, folder, vocab_size, wide)
    if not wide and requested is not None and requested > len(counts.ids):
        raise SpecdeployError(f"--draft-vocab {requested}: the draft was distilled over {len(counts.ids)} tokens; "
                              f"choose at most that many (or 0 for the whole vocabulary)")
    return subset(counts, None if requested is None or requested == len(counts.ids) else requested)


def _distilled_counts(vocab: dict, folder: Path, vocab_size: int, wide: bool) -> TokenCounts:
    """draft_vocab.json's ids and counts; wide (an eagle head given more): every id, by its `frequencies`."""
    ids, counts = vocab["ids"], vocab["counts"]
    if wide and len(vocab["all_ids"]):
        ids, counts = np.arange(vocab_size), np.zeros(vocab_size, dtype=np.int64)
        counts[vocab["all_ids"]] = vocab["all_counts"]
    recorded = vocab["source"] if isinstance(vocab["source"], dict) else {}
    total = int(recorded.get("counted_tokens") or (vocab["all_counts"].sum() if len(vocab["all_counts"]) else counts.sum()))
    source = {"counts": DRAFT_VOCAB_FILE, "folder": str(Path(folder).resolve()), "counted_tokens": total}
    return TokenCounts(ids, counts, tuple(i for i in vocab["always"] if 0 <= i < vocab_size), total, source)


def read_sample(files: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """(name, texts) of each --draft-vocab-text file (its text cut into pieces at line ends), or of the
    shipped sample when none is given: specdeploy/data/parity_text.txt and the prompts of code_prompts.json."""
    if not files:
        prompts = json.loads((DATA / "code_prompts.json").read_text(encoding="utf-8"))
        return [("specdeploy/data/parity_text.txt", [(DATA / "parity_text.txt").read_text(encoding="utf-8")]),
                ("specdeploy/data/code_prompts.json", [str(p) for p in prompts])]
    named = []
    for name in files:
        path = Path(name).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise SpecdeployError(f"--draft-vocab-text {name}: not UTF-8 text") from None
        except OSError as exc:
            raise SpecdeployError(f"--draft-vocab-text {name}: cannot be read ({exc.strerror or exc})") from None
        if not text.strip():
            raise SpecdeployError(f"--draft-vocab-text {name}: holds no text to count tokens over")
        named.append((str(path.resolve()), _pieces(text)))
    return named


def _pieces(text: str) -> list[str]:
    """text in pieces of about PIECE_CHARS, each ending at a line end (where the tokenizer splits anyway)."""
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + PIECE_CHARS)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    return pieces


def count_text(sample: TextSample, vocab_size: int) -> TokenCounts:
    """How often each id occurs in the sample, tokenized by the target's tokenizer without added BOS/EOS;
    always kept: the tokenizer's added tokens (the chat template's among them) and the target's specials."""
    from tokenizers import Tokenizer

    named = read_sample(sample.files)
    tokenizer = Tokenizer.from_file(str(Path(sample.tokenizer_dir) / "tokenizer.json"))
    counts = np.zeros(vocab_size, dtype=np.int64)  # [vocab]
    for _, pieces in named:
        for start in range(0, len(pieces), BATCH_PIECES):
            encodings = tokenizer.encode_batch(pieces[start:start + BATCH_PIECES], add_special_tokens=False)
            ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64)
            counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    added = tokenizer.get_added_tokens_decoder()
    always = tuple(sorted(i for i in {*added, *sample.specials} if 0 <= i < vocab_size))
    total = int(counts.sum())
    source = {"counts": "text", "files": [name for name, _ in named], "counted_tokens": total}
    return TokenCounts(np.arange(vocab_size), counts, always, total, source)
