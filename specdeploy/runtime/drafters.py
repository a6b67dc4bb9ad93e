"""Drafters: whatever proposes the k tokens the target then verifies.

The seam (after transformers' candidate generators): `propose(context, k, ...)` returns the draft tokens and
the probabilities they were drawn from (None when greedy); `prefill(context, limit)` readies a drafter for a
sequence, `limit` tokens a call, and `reset()` forgets its cache. Between two prefills a drafter follows one
sequence, whose context only grows: a model drafter's cache drops rejected tokens when its next proposal
compares the tokens after the context it last saw. It needs nothing back from the verification (an eagle head
reads the target's features from the target's cache, where the verify pass left them). `for_cache(cache,
target_cache)` makes a drafter of the same kind on another draft cache (one per KV slot, beside that slot's
target cache), `with_target` binds one to its target cache; draft_rows.py proposes for several at once.

A draft whose logits cover a subset of the vocabulary (`vocab_ids`) is widened to the whole of it with
-inf elsewhere before any row is formed: its proposal gives every other token probability zero, and
the rows the accept rule reads are those it drew from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import SpecdeployError
from .engine import OrtEngine
from .session import PREFILL_CHUNK
from .sampling import Sampler

MAX_NGRAM = 3  # the longest n-gram prompt lookup matches


class Drafter(Protocol):
    engine: OrtEngine | None  # the draft model it runs, if any (timed by the generator)
    # It reads the target's features at every position (an eagle head): every token of the context must
    # have run through the target (a constraint forces none past it).
    reads_target_features: bool

    def propose(
        self, context: list[int], num_tokens: int, sampler: Sampler, rng: np.random.Generator,
        min_confidence: float = 0.0,
    ) -> tuple[list[int], np.ndarray | None]:
        """Up to num_tokens draft tokens and the draft_probs [k, vocab] they were drawn from (None when greedy).

        sampler (synced to context) forms every row: the row for draft position i is processed with
        the context and the i tokens drafted before it, as the target's verify row i is. A drafter may
        stop early, e.g. once its top probability falls below min_confidence: how many tokens are proposed
        never depends on the target, so the acceptance rule stays exact. The rows may live in a buffer
        the drafter reuses: they are valid until its next propose."""

    def prefill(self, context: list[int], limit: int | None = None) -> bool:
        """Bring the state to context, at most `limit` more tokens a call; returns whether done (propose may start)."""

    def reset(self) -> None: ...

    def for_cache(self, cache, target_cache=None) -> "Drafter": ...

    def with_target(self, target_cache) -> "Drafter": ...


def read_vocab_ids(path: Path, vocab_size: int, count: int) -> np.ndarray:
    """A bundle's draft vocabulary subset (export writes it): `count` sorted distinct ids in range."""
    try:
        ids = np.asarray(json.loads(Path(path).read_text(encoding="utf-8"))["ids"])  # integers stay integers (2.9: float)
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError, OverflowError) as exc:
        raise SpecdeployError(f"{path}: unreadable vocabulary subset ({exc})") from None
    ids = ids.astype(np.int64) if ids.dtype.kind == "i" or ids.size == 0 else np.full(1, -1)  # not integers: refused
    if ids.shape != (count,) or (count and (ids.min() < 0 or ids.max() >= vocab_size)) or np.any(np.diff(ids) <= 0):
        raise SpecdeployError(f"{path}: expected {count} sorted distinct ids in 0..{vocab_size - 1}")
    return ids


class ModelDrafter:
    """The bundle's draft model, decoding autoregressively on its own KV cache.

    vocab_ids: the token of each of the draft's logits columns (None: all of the vocabulary)."""

    batched = True  # draft_rows.propose_many steps several of these together
    reads_target_features = False

    def __init__(self, engine: OrtEngine, capacity: int, cache=None, vocab_ids: np.ndarray | None = None):
        self.engine = engine
        self.capacity = capacity
        self.cache = cache if cache is not None else engine.new_cache(capacity)
        self.vocab_ids = vocab_ids
        self._wide = None  # [vocab]: -inf, and the subset's logits at vocab_ids (see widen)
        if vocab_ids is not None:
            self._wide = np.full(engine.spec.vocab_size, -np.inf, dtype=np.float32)
        self._known = 0  # the cache agrees with the followed context's first _known tokens
        # Made by probability_rows for each generate call (its sampler): one [k, vocab] buffer of probability
        # rows reused by every sampled proposal, its row views [vocab] and leading-row views [i, vocab] made once.
        self._sampler: Sampler | None = None
        self._probs: np.ndarray | None = None
        self._row_views: list[np.ndarray] = []
        self._prefix_views: list[np.ndarray] = []
        self._capacity = 0  # proposals up to this length reuse the rows

    def prefill(self, context: list[int], limit: int | None = None) -> bool:
        if done := self.engine.prefill(context, self.cache, limit):
            self._known = len(context)
        return done

    def reset(self) -> None:
        self.cache.reset()
        self._known = 0

    def for_cache(self, cache, target_cache=None) -> "ModelDrafter":
        return ModelDrafter(self.engine, self.capacity, cache, self.vocab_ids)

    def with_target(self, target_cache) -> "ModelDrafter":
        return self

    def widen(self, logits: np.ndarray) -> np.ndarray:
        """A row of the draft's logits over the whole vocabulary (a buffer the next call overwrites)."""
        if self._wide is None:
            return logits
        self._wide[self.vocab_ids] = logits
        return self._wide

    def step(self, token: int) -> np.ndarray:
        """The logits [vocab] after one more drafted token (a buffer the next pass may overwrite)."""
        logits = self.engine.run([token], self.cache)[0]
        return logits if self._wide is None else self.widen(logits)  # (the draft's inner loop: no call to spare)

    def first_step(self, context: list[int]) -> tuple[np.ndarray | None, int | None]:
        """The start of a proposal: (the first draft position's logits [vocab], None) after a catch-up of
        several tokens, which runs alone, or (None, the one token still to run: propose_many batches it).
        (None, None): nothing to propose from. The logits may live in a buffer the next pass overwrites."""
        rest = self.pending(context)
        if len(rest) == 1:
            return None, rest[0]
        while len(rest) > PREFILL_CHUNK:
            self.engine.run(rest[:PREFILL_CHUNK], self.cache)
            rest = rest[PREFILL_CHUNK:]
        return self.widen(self.engine.run(rest, self.cache)[-1]), None

    def step_features(self) -> np.ndarray | None:
        """The feature row a batched step of this drafter reads (None: a model draft reads none)."""
        return None

    def pending(self, context: list[int]) -> list[int]:
        """The tokens of context the cache lacks (at least one): rejected drafts leave it here."""
        rest = self.cache.truncate_to_prefix(context, min_rest=1, start=self._known)
        self._known = len(context)  # the next pass runs rest: then the cache holds all of context
        return rest

    def propose(self, context, num_tokens, sampler, rng, min_confidence=0.0, follow=()):
        """As Drafter.propose. follow (a hybrid's lookup tokens): where the model's first draft token is
        follow's first, the proposal is that token and the rest of follow, with no more draft steps (DraftRow)."""
        row = self.start_row(context, num_tokens, sampler, rng, min_confidence, follow)
        if row is None:
            return [], None
        if row.logits is None:
            row.logits = self.step(row.pending)
        while row.choose():
            row.logits = self.step(row.pending)
        return row.result()

    def start_row(self, context: list[int], num_tokens: int, sampler: Sampler, rng: np.random.Generator,
                  min_confidence: float = 0.0, follow=()) -> "DraftRow | None":
        """A proposal after context (its cache caught up first; None: nothing to propose from)."""
        logits, pending = self.first_step(context)
        if logits is None and pending is None:
            return None
        return DraftRow(self, num_tokens, sampler, rng, min_confidence, logits, pending, follow)

    def probability_rows(self, sampler: Sampler, count: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Rows [vocab] for a sampled proposal's processed distributions, and their leading views [i, vocab].

        One [k, vocab] buffer per generate call (its sampler), reused by every proposal: a fresh
        [4, 8k] float32 array per round would be 128 KB, which glibc maps afresh (the CLI sets
        M_MMAP_THRESHOLD to 128 KB), and every page faults on first write."""
        if sampler is not self._sampler or self._capacity < count:
            self._sampler = sampler
            vocab = self.engine.spec.vocab_size
            probs = self._probs
            if probs is None or probs.shape[0] < count or probs.shape[1] != vocab:
                self._probs = probs = np.empty((count, vocab), dtype=np.float32)
                self._row_views = list(probs)
                self._prefix_views = [probs[:i] for i in range(count + 1)]
            self._capacity = len(probs)
        return self._row_views, self._prefix_views


class DraftRow:
    """One model proposal in progress: the tokens chosen so far, each from the draft's logits at its
    position. ModelDrafter.propose steps one alone; draft_rows.propose_many steps several together, a
    batched pass per position. Either way a token is chosen, and drafting stops, here alone.

    Greedy rows take the argmax; sampled rows draw from the processed distribution (the full one,
    written in place: proposing from a truncated one, exact too, was measured slower on an 8k
    vocabulary, argpartition costing what the softmax does, and lowered acceptance), with the
    round's uniforms drawn in one call. A row stops at num_tokens, or once the draft's top
    probability (at temperature 1 when greedy, of the processed distribution when sampled) falls
    below min_confidence. A row given `follow` (a hybrid's lookup) stops at its first token instead
    where that is follow's first, and proposes the rest of follow after it: each a one-hot row when
    sampled, the distribution that token was drawn from."""

    __slots__ = ("drafter", "num_tokens", "sampler", "min_confidence", "uniforms", "tokens", "logits", "pending",
                 "follow", "_rows", "_prefixes")

    def __init__(self, drafter: ModelDrafter, num_tokens: int, sampler: Sampler, rng: np.random.Generator,
                 min_confidence: float, logits: np.ndarray | None, pending: int | None, follow=()):
        self.drafter, self.num_tokens, self.sampler, self.min_confidence = drafter, num_tokens, sampler, min_confidence
        self.tokens: list[int] = []
        self.logits = logits  # [vocab]: the logits the next token is chosen from (None: `pending` runs first)
        self.pending = pending  # the token the next draft pass runs
        self.follow = list(follow)
        self.uniforms: list[float] = []
        self._rows = self._prefixes = None
        if not sampler.greedy:
            self._rows, self._prefixes = drafter.probability_rows(sampler, max(num_tokens, len(self.follow)))
            self.uniforms = rng.random(num_tokens).tolist()

    def choose(self) -> bool:
        """Choose the next token from self.logits; False once the row has proposed all it will (else the
        token is `pending`, for the next pass)."""
        sampler, logits, tokens = self.sampler, self.logits, self.tokens
        if sampler.constraint is not None and self.drafter.vocab_ids is not None:
            disallowed = sampler.constraint.disallowed(tokens)  # a draft over a vocabulary subset may have no token
            if disallowed is None or disallowed[self.drafter.vocab_ids].all():  # the constraint allows: stop here
                return False
        if self._rows is None:
            token = sampler.argmax(logits, tokens)
            tokens.append(token)
            if self.follow and self._followed(token):
                return False
            if len(tokens) == self.num_tokens:
                return False
            # Top probability at temperature 1: 1 / sum(exp(logits - max)).
            if self.min_confidence > 0 and np.exp(logits - logits[token]).sum() * self.min_confidence > 1.0:
                return False
        else:
            row = self._rows[len(tokens)]
            token = sampler.sample(logits, self.uniforms[len(tokens)], row, tokens)
            tokens.append(token)
            if self.follow and self._followed(token):
                return False
            if len(tokens) == self.num_tokens or (self.min_confidence > 0 and row.max() < self.min_confidence):
                return False
        self.pending = token
        return True

    def _followed(self, token: int) -> bool:
        """After the first token: whether it is follow's first, the rest of follow then proposed after it."""
        follow, self.follow = self.follow, []
        if token != follow[0]:
            return False
        rows, tokens = self._rows, self.tokens
        for next_token in follow[1:]:
            if rows is not None:
                row = rows[len(tokens)]
                row.fill(0.0)
                row[next_token] = 1.0
            tokens.append(next_token)
        return True

    def result(self) -> tuple[list[int], np.ndarray | None]:
        """(tokens, draft probabilities [len(tokens), vocab] or None when greedy)."""
        return self.tokens, None if self._prefixes is None else self._prefixes[len(self.tokens)]


class PromptLookupDrafter:
    """N-gram drafting from the context itself (prompt lookup decoding): no model, no cost.

    It proposes the tokens that followed the most recent earlier occurrence of the context's last
    n-gram. Its proposal is deterministic, so draft_probs are one-hot rows, and the rejection rule
    stays exact: accept x with probability target_probs[x], else draw from the target without x.
    The n-grams are indexed as the context grows (n-gram -> where its latest earlier occurrence
    ends), so a round costs a few dictionary operations, not a scan of the context. The index
    follows one sequence from prefill on (its context only grows); prefill starts a new index."""

    engine = None  # no model to run
    reads_target_features = False

    def __init__(self, vocab_size: int, max_ngram: int = MAX_NGRAM, min_ngram: int = 1):
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._indexed = 0  # n-grams ending before this position are in the index
        self._ends: dict[tuple[int, ...], int] = {}
        self._one_hot: np.ndarray | None = None  # [k, vocab] rows reused across rounds (see ModelDrafter.probability_rows)
        self._hot: list[int] = []  # the tokens set to 1 in it, one per row

    def prefill(self, context: list[int], limit: int | None = None) -> bool:
        self.reset()
        return True

    def reset(self) -> None:
        self._indexed, self._ends = 0, {}

    def for_cache(self, cache, target_cache=None) -> "PromptLookupDrafter":
        return PromptLookupDrafter(self.vocab_size, self.max_ngram, self.min_ngram)

    def with_target(self, target_cache) -> "PromptLookupDrafter":
        return self

    def propose(self, context, num_tokens, sampler, rng, min_confidence=0.0, min_ngram=None):
        """As Drafter.propose; min_ngram (None: the drafter's own, else min_ngram..max_ngram) is the shortest
        match it drafts from."""
        self._index(context)
        tokens: list[int] = []
        length = len(context)
        shortest = self.min_ngram if min_ngram is None else min_ngram
        for size in range(min(self.max_ngram, length - 1), shortest - 1, -1):
            end = self._ends.get(tuple(context[length - size :]))
            if end is not None:
                tokens = context[end + 1 : end + 1 + num_tokens]
                break
        tokens = tokens[: sampler.allowed_prefix(tokens)]  # none a constraint refuses: the target could not keep it
        if not tokens or sampler.greedy:
            return tokens, None
        count = len(tokens)
        if self._one_hot is None or self._one_hot.shape[0] < count:
            self._one_hot, self._hot = np.zeros((count, self.vocab_size), dtype=np.float32), []  # float32, as the model's rows
        one_hot = self._one_hot
        for row, token in enumerate(self._hot):
            one_hot[row, token] = 0.0
        for row, token in enumerate(tokens):
            one_hot[row, token] = 1.0
        self._hot = tokens
        return tokens, one_hot[:count]

    def _index(self, context: list[int]) -> None:
        """Add the n-grams that end at positions up to len(context) - 2 (the last one is what we look up)."""
        if len(context) < self._indexed + 1:  # not the followed sequence: index it afresh
            self.reset()
        ends = self._ends
        sizes = range(self.min_ngram, self.max_ngram + 1)
        for end in range(self._indexed, len(context) - 1):
            for size in sizes:
                if size <= end + 1:
                    ends[tuple(context[end - size + 1 : end + 1])] = end  # later ends overwrite: the latest wins
        self._indexed = max(self._indexed, len(context) - 1)
