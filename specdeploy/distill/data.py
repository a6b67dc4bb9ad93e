"""Training text for a draft: the user's files and the target's own generations, as token windows.

- Text: every UTF-8 file named by --data (files, folders, glob patterns), read in a seeded order up
  to a token budget; the last tokens are held out.
- The target's text: completions of the seed prompts (prompts.py), sampled, chat prompts through
  the tokenizer's chat template; held-out prompts are completed greedily, so that a draft's greedy
  agreement on them is the acceptance greedy speculative decoding would see.
- Windows: the training documents in a seeded order, concatenated (EOS between them) and cut into
  [seq_len] windows; batch b of the run is a pure function of (seed, b), so a resumed run reads on
  exactly where it stopped.
"""

from __future__ import annotations

import glob
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import SpecdeployError
from ..export.draft_vocab import TokenCounts, rank_vocab  # the one ranking: export chooses from counts the same way
from . import prompts

KINDS = ("chat", "code", "text")
SKIPPED_DIRS = {"__pycache__", "node_modules", ".git"}
SAMPLING = dict(temperature=0.8, top_p=0.95)  # the target's training text: varied, yet its own
MAX_BATCH = 32        # completions generated together (a step of 32 rows costs little more than one of 8 on CPU)
MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class Document:
    kind: str            # chat | code | text
    ids: tuple[int, ...]


def expand_paths(paths: tuple[str, ...], exclude: Path | None = None) -> list[Path]:
    """Files of each --data entry: a file, every file under a folder, or a glob pattern's matches; none
    under `exclude` (the run's own --out, which a resumed run would otherwise read as text)."""
    files: list[Path] = []
    inside = exclude.resolve() if exclude is not None else None
    for entry in paths:
        path = Path(entry).expanduser()
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and not SKIPPED_DIRS & set(f.relative_to(path).parts)
                           and not any(part.startswith(".") for part in f.relative_to(path).parts))
            if not found:
                raise SpecdeployError(f"--data {entry}: an empty folder")
        elif glob.has_magic(entry):
            found = sorted(Path(f) for f in glob.glob(str(path), recursive=True) if Path(f).is_file())
            if not found:
                raise SpecdeployError(f"--data {entry}: matches no file")
        else:
            raise SpecdeployError(f"--data {entry}: no such file or folder")
        files.extend(f for f in found if inside is None or inside not in f.resolve().parents)
    return list(dict.fromkeys(files))


def read_text(file: Path) -> str | None:
    """The file's text, or None for a binary or non-UTF-8 file (skipped)."""
    try:
        data = file.read_bytes()
    except OSError:
        return None
    if b"\0" in data:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def read_documents(paths: tuple[str, ...], tokenizer, max_tokens: int, seed: int,
                   exclude: Path | None = None) -> tuple[list[Document], int]:
    """Text documents in a seeded file order, up to max_tokens (none under `exclude`); and how many files were read."""
    files = expand_paths(paths, exclude)
    order = np.random.default_rng(seed).permutation(len(files))
    documents, total, read = [], 0, 0
    for index in order:
        if total >= max_tokens:
            break
        text = read_text(files[index])
        if text is None:
            continue
        # a whole file, cut into windows later: no warning that it exceeds the model's context
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][: max_tokens - total]
        if ids:
            documents.append(Document("text", tuple(ids)))
            total, read = total + len(ids), read + 1
    if paths and not documents:
        raise SpecdeployError(f"--data {' '.join(paths)}: no text in it (every file is empty, binary or not UTF-8)")
    return documents, read


def prompt_ids(tokenizer, kind: str, prompt: str) -> list[int] | None:
    """A chat prompt through the chat template (None without one), a code prompt as plain text."""
    if kind == "chat":
        if not getattr(tokenizer, "chat_template", None):
            return None
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer(prompt)["input_ids"])


def seed_prompts(tokenizer, heldout: bool) -> list[tuple[str, list[int]]]:
    chat, code = (prompts.HELDOUT_CHAT, prompts.HELDOUT_CODE) if heldout else (prompts.CHAT, prompts.CODE)
    pairs = [("chat", prompt_ids(tokenizer, "chat", p)) for p in chat] + [("code", prompt_ids(tokenizer, "code", p)) for p in code]
    return [(kind, ids) for kind, ids in pairs if ids]


PROGRESS_EVERY_S = 5.0  # a progress line at least this often while the target generates


def generate(target, prompt_list: list[tuple[str, list[int]]], budget: int, seed: int, sample: bool,
             report: Callable[[int, int], None] | None = None,
             deadline: float | None = None) -> tuple[list[Document], int, bool]:
    """About `budget` new tokens of the target's completions of the prompts (cycled), batched with left padding:
    (the documents, the new tokens in them, whether the budget was met: False where `deadline`, a
    time.monotonic() value, ended the generation first)."""
    import torch
    from transformers import StoppingCriteriaList

    model, tokenizer = target.model, target.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = set(_ids(model.generation_config.eos_token_id)) | set(_ids(tokenizer.eos_token_id))
    device = next(model.parameters()).device
    documents, produced, start = [], 0, 0
    rows = max(1, min(MAX_BATCH, budget // MAX_NEW_TOKENS)) if sample else len(prompt_list)
    while produced < budget and prompt_list:
        if deadline is not None and time.monotonic() >= deadline:
            return documents, produced, False
        batch = [prompt_list[(start + i) % len(prompt_list)] for i in range(rows)]
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.tensor([[pad if pad is not None else 0] * (width - len(ids)) + ids for _, ids in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch], device=device)
        new = min(MAX_NEW_TOKENS, max(16, -(-(budget - produced) // len(batch))))
        torch.manual_seed(seed + start)
        options = dict(do_sample=True, **SAMPLING) if sample else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        watch = _Watch(len(batch), produced, budget, deadline, report, eos)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=1,
                                 pad_token_id=pad, stopping_criteria=StoppingCriteriaList([watch]), **options)
        for (kind, ids), row in zip(batch, out[:, width:].tolist()):
            stop = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
            documents.append(Document(kind, tuple(ids + row[:stop])))
            produced += stop
        start += len(batch)
        if report:
            report(min(produced, budget), budget)
        if watch.stopped:
            return documents, produced, False
        if not sample:
            break
    return documents, produced, True


class _Watch:
    """transformers' stopping-criteria hook (called after every generated token): a progress report every
    PROGRESS_EVERY_S seconds (each row's tokens counted up to its end token, as the documents will hold
    them), and the batch's end at the deadline."""

    def __init__(self, rows: int, produced: int, budget: int, deadline: float | None, report, eos: set[int]) -> None:
        self.produced, self.budget, self.deadline, self.report = produced, budget, deadline, report
        self.eos = np.array(sorted(eos), dtype=np.int64)
        self.lengths, self.ended = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=bool)  # [rows]
        self.last, self.stopped = time.monotonic(), False

    def __call__(self, input_ids, scores, **kwargs):  # input_ids: [rows, width + generated]
        import torch

        self.lengths += ~self.ended
        self.ended |= np.isin(input_ids[:, -1].cpu().numpy(), self.eos)
        now = time.monotonic()
        if self.report and now - self.last >= PROGRESS_EVERY_S:
            self.report(min(self.budget, self.produced + int(self.lengths.sum())), self.budget)
            self.last = now
        self.stopped = self.deadline is not None and now >= self.deadline
        return torch.full((input_ids.shape[0],), self.stopped, dtype=torch.bool, device=input_ids.device)


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def special_ids(target) -> list[int]:
    """Token ids the draft vocabulary always keeps: the tokenizer's special tokens, BOS, EOS and pad."""
    tokenizer, generation, config = target.tokenizer, target.model.generation_config, target.config
    ids = set(tokenizer.all_special_ids)
    for source in (generation, config):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            ids.update(_ids(getattr(source, name, None)))
    return sorted(i for i in ids if 0 <= i < target.vocab_size)


class Windows:
    """The training stream cut into [seq_len] windows; `batch(b)` is the run's b-th batch, from (seed, b) alone."""

    def __init__(self, documents: list[Document], separator: int, seq_len: int, batch_size: int, seed: int):
        order = np.random.default_rng([seed, 1]).permutation(len(documents))
        pieces = []
        for index in order:
            ids = documents[index].ids
            pieces.append(np.asarray(ids + ((separator,) if not ids or ids[-1] != separator else ()), dtype=np.int64))
        self.stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)  # [tokens]
        self.count = len(self.stream) // seq_len
        if self.count < 1:
            raise SpecdeployError(f"only {len(self.stream)} tokens of training text: fewer than one --seq-len {seq_len} "
                                  "window; pass more --data or --generate-tokens")
        self.windows = self.stream[: self.count * seq_len].reshape(self.count, seq_len)  # [count, seq_len]
        self.batch_size, self.seed = batch_size, seed

    def batch(self, index: int) -> np.ndarray:  # -> [batch_size, seq_len]
        slots = np.arange(index * self.batch_size, (index + 1) * self.batch_size)
        epochs, positions = slots // self.count, slots % self.count
        rows = [np.random.default_rng([self.seed, 2, int(epoch)]).permutation(self.count)[pos]
                for epoch, pos in zip(epochs, positions)]
        return self.windows[rows]

    def epoch(self, index: int) -> float:
        return index * self.batch_size / self.count


def heldout_sets(documents: list[Document], seq_len: int, budget: int) -> dict[str, list[np.ndarray]]:
    """kind -> held-out sequences, each at most seq_len tokens, about `budget` tokens per kind."""
    sets: dict[str, list[np.ndarray]] = {}
    for kind in KINDS:
        sequences, total = [], 0
        for document in (d for d in documents if d.kind == kind):
            for start in range(0, len(document.ids), seq_len):
                piece = np.asarray(document.ids[start : start + seq_len][: budget - total], dtype=np.int64)
                if len(piece) >= 2:
                    sequences.append(piece)
                    total += len(piece)
            if total >= budget:
                break
        if sequences:
            sets[kind] = sequences
    return sets


def split_text(documents: list[Document], budget: int) -> tuple[list[Document], list[Document]]:
    """(train, held out): the held-out text is the last tokens of the text, at most a tenth of it."""
    total = sum(len(d.ids) for d in documents)
    keep = max(0, total - min(budget, total // 10))
    train, heldout, seen = [], [], 0
    for document in documents:
        cut = min(len(document.ids), max(0, keep - seen))
        if cut:
            train.append(Document(document.kind, document.ids[:cut]))
        if cut < len(document.ids):
            heldout.append(Document(document.kind, document.ids[cut:]))
        seen += len(document.ids)
    return train, heldout


def choose_draft_vocab(counts: np.ndarray, size: int, always: list[int]) -> np.ndarray:
    """The `size` ids the draft's head covers: `always` first, then by count (ties: lower id), sorted.

    counts [vocab]: how often each id occurs in the training text."""
    vocab = len(counts)
    if not len(always) < size <= vocab:
        if size > vocab:
            raise SpecdeployError(f"--draft-vocab {size}: the target's vocabulary has only {vocab} tokens")
        raise SpecdeployError(f"--draft-vocab {size}: must be larger than the {len(always)} special tokens it always keeps")
    return rank_vocab(TokenCounts(np.arange(vocab), np.asarray(counts), tuple(int(i) for i in always),
                                  int(np.sum(counts))), size)
