"""A sequence: everything one generation owns, so that a scheduler can step many of them together.

Its context (the prompt and every emitted token), its KV slot (the target's cache and its own
drafter, whose cache is the draft's row of the same slot), its sampler and random generator, its
text stream and stop rules, its stats and why it finished. Nothing about a generation lives
anywhere else: a Generator runs one sequence, the scheduler many, through the same object.

Invariant between rounds: the target's cache holds context[:-1] and maybe, after a rejection,
rejected draft tokens behind it (the next pass's start drops them); the last token is pending,
and the next pass runs it first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .config import GenerationConfig, GenerationOutput, GenerationStats, TokenLogprob
from .session import PREFILL_CHUNK
from .sampling import Sampler
from .text import TextCodec, TextStream

# A draft's prefill tokens per iteration once the target's prefill is done (a prompt whose target
# positions came from another slot's cache): a multiple of PREFILL_CHUNK, so that its passes are
# those of one call. A draft costs a fraction of its target per token, so this many of its tokens
# cost about what one target chunk does.
DRAFT_PREFILL_TOKENS = 4 * PREFILL_CHUNK


def token_logprobs(logits: np.ndarray, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """The log-softmax of each row of logits [n, vocab] at token_ids [n], with the `top` most likely
    tokens of each row (ties to the lower id): float32 rows, their log-sum-exp summed in float64."""
    result = []
    for row, token in zip(np.asarray(logits, dtype=np.float32), token_ids):
        peak = row.max()
        log_total = float(peak) + float(np.log(np.exp(row - peak).sum(dtype=np.float64)))
        best: tuple = ()
        if top:
            # every token tied with the top-th likeliest is a candidate, so that the lower ids win the ties
            candidates = np.flatnonzero(row >= np.partition(row, len(row) - top)[len(row) - top]) if top < len(row) \
                else np.arange(len(row))
            best = tuple(sorted(candidates.tolist(), key=lambda i: (-row[i], i))[:top])
        result.append(TokenLogprob(int(token), float(row[token]) - log_total,
                                   tuple((int(i), float(row[i]) - log_total) for i in best)))
    return result


def shared_prefix(tokens: list[int], context: list[int]) -> int:
    """How many leading tokens a cache's tokens share with context[:-1] (the part a prefill runs)."""
    limit = min(len(tokens), len(context) - 1)
    for index in range(limit):
        if tokens[index] != context[index]:
            return index
    return limit


@dataclass
class Slot:
    """One row of a generator's caches: the target's cache and the drafter that owns the draft's row."""

    index: int
    target_cache: object  # SharedKVCache | KVCache
    drafter: object | None  # a Drafter bound to this slot's draft cache (None: target-only)


class Sequence:
    """One generation from prompt ids to a finish reason; see the module docstring."""

    def __init__(self, prompt_ids: list[int], config: GenerationConfig, codec: TextCodec,
                 eos_token_ids: frozenset[int], max_context: int, vocab_size: int, streaming: bool = False,
                 constraint=None):
        self.prompt_ids = list(prompt_ids)
        self.config = config
        self.slot: Slot | None = None  # given by the scheduler when the sequence starts (bind)
        self.error: BaseException | None = None  # what failed it (finish reason "error")
        self.codec = codec
        self.context = list(prompt_ids)
        self.new_tokens: list[int] = []
        self.budget = min(config.max_new_tokens, max_context - len(prompt_ids))
        self.max_context = max_context
        positions = config.num_draft_tokens if config.speculative else 0
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), accepted_by_position=[0] * positions,
                                     drafted_by_position=[0] * positions)
        # every row of this sequence is processed through it (a Constraint, constraint.py, masks each first)
        self.sampler = Sampler(config.sampling, vocab_size, prompt_length=len(prompt_ids), constraint=constraint)
        self.rng = np.random.default_rng(config.seed)  # every draw of this sequence comes from it
        self.target_probs = None if self.sampler.greedy else np.empty((config.num_draft_tokens + 1, vocab_size),
                                                                     dtype=np.float32)  # [k + 1, vocab]
        self.drafter = None
        end_ids = frozenset() if config.ignore_eos else eos_token_ids.union(config.stop_token_ids)
        self.end_ids = end_ids
        # Text is decoded token by token only when someone reads it that way (streaming or stop strings).
        self.text = TextStream(codec, config.stop) if streaming or config.stop else None
        self.streaming = streaming
        self.cancelled = None  # a callable that turns true once nobody wants it (Generator.new_sequence)
        self.admitted_at: float | None = None  # when it took its slot (perf_counter)
        self.logprobs: list[TokenLogprob] | None = [] if config.logprobs is not None else None
        self.pieces: list[str] = []  # text that is ready and nobody has taken yet (see take_pieces)
        self.finish_reason: str | None = None
        self.finished = False  # finish() sets it, with finish_reason (an attribute: the scheduler reads it every step)
        # A constraint's forced tokens are appended without a pass, unless the drafter reads the target's
        # features of every position (an eagle head): then each token runs through the target (bind sets it).
        self.forcing = True
        self.ended_at = [0] * (config.num_draft_tokens + 1)  # [i]: rounds that accepted exactly i draft tokens
        self.lengths = [0] * (config.num_draft_tokens + 1)  # [i]: rounds that drafted exactly i tokens (the policy may cut k)
        # [i]: rounds whose i-th draft token was tested (drafted, and every one before it kept), and kept
        self.reached = [0] * (config.num_draft_tokens + 1)
        self.kept = [0] * (config.num_draft_tokens + 1)
        self._prefill_rest: list[int] | None = None  # target tokens still to prefill (None: not started)
        self._draft_prefilled = False
        self._decode_start: float | None = None
        self._known = 0  # the target's cache agrees with context[:_known] (where its next pass may start comparing)

    def bind(self, slot: Slot) -> None:
        """Start on a KV slot (its caches may hold an earlier sequence's tokens: a shared prefix is kept)."""
        self.slot = slot
        self.admitted_at = time.perf_counter()
        self.drafter = slot.drafter if self.config.speculative else None
        self._draft_prefilled = self.drafter is None
        self.forcing = not getattr(self.drafter, "reads_target_features", False)  # a drafter of its own may not say

    # -- prefill ---------------------------------------------------------------------------------------

    @property
    def target_started(self) -> bool:
        return self._prefill_rest is not None

    @property
    def target_prefilling(self) -> bool:
        """The target's prefill has started and has chunks left."""
        return bool(self._prefill_rest)

    @property
    def prefilled(self) -> bool:
        """Every prefill chunk has been taken and run, and the draft's prefill has run."""
        return self._prefill_rest is not None and not self._prefill_rest and self._draft_prefilled

    def draft_prefill_step(self) -> None:
        """The drafter's next prefill step: one chunk while the target's prefill has chunks left (it keeps
        pace with the target's), then DRAFT_PREFILL_TOKENS a step; an eagle head's only as far as the
        target's cache holds features. A long prompt's draft prefill spreads over iterations as the
        target's does, rather than stalling the rows decoding beside it for one long iteration."""
        if not self._draft_prefilled:
            limit = PREFILL_CHUNK if self.target_prefilling else DRAFT_PREFILL_TOKENS
            self._draft_prefilled = self.drafter.prefill(self.context[:-1], limit)

    def take_prefill_chunk(self, donor=None) -> list[int] | None:
        """The target tokens of this sequence's next prefill step, taken off what is left (None: the
        target's prefill is done). The cache may already hold a prefix of the prompt (an earlier request
        on this slot), and a donor (another slot's target cache that holds more of it) gives its
        positions first. The runner runs the chunk (in its own pass, or in a packed pass beside other
        rows), and the scheduler's update ends the step (end_prefill_step)."""
        cache = self.slot.target_cache
        if self._prefill_rest is None:
            self._prefill_rest = cache.truncate_to_prefix(self.context[:-1])
            if donor is not None and getattr(cache, "shared_buffer", False):
                shared = len(self.context) - 1 - len(self._prefill_rest)
                donated = shared_prefix(donor.tokens, self.context)
                if donated > shared:
                    cache.copy_prefix(donor, donated)
                    self._prefill_rest = self.context[donated:-1]
        if not self._prefill_rest:
            return None
        chunk, self._prefill_rest = self._prefill_rest[:PREFILL_CHUNK], self._prefill_rest[PREFILL_CHUNK:]
        return chunk

    def end_prefill_step(self, start: float) -> None:
        """A prefill step that began at `start` (perf_counter) is over: its time, and decoding's start."""
        self.stats.prefill_ms += (time.perf_counter() - start) * 1000
        if self.prefilled:
            self._decode_start = time.perf_counter()
            if self.budget <= 0:
                self.finish("length")

    # -- decoding --------------------------------------------------------------------------------------

    def num_draft_tokens(self, limit: int | None = None) -> int:
        """How many tokens the drafter may propose this round: k (or limit), within the budget and the context."""
        if self.drafter is None:
            return 0
        k = self.config.num_draft_tokens if limit is None else min(limit, self.config.num_draft_tokens)
        room = self.max_context - len(self.context)  # the verify pass adds k + 1 positions to len(context) - 1
        return max(0, min(k, self.budget - len(self.new_tokens) - 1, room))

    def pending_tokens(self) -> list[int]:
        """The context tokens the target's cache lacks (at least the last one), after dropping what a
        rejection left in it. The cache holds a prefix of the context up to the last round's verify
        pass: only the tokens after the previous context can disagree."""
        return self.slot.target_cache.truncate_to_prefix(self.context, min_rest=1, start=self._known)

    def sample_target(self, logits: np.ndarray) -> int:
        """The next token from the target's logits [vocab] at this sequence's settings (target-only rounds)."""
        sampler = self.sampler
        if sampler.greedy:
            return sampler.argmax(logits)
        return sampler.sample(logits, self.rng.random(), self.target_probs[0])

    def record_round(self, num_drafted: int, num_accepted: int) -> None:
        self.stats.rounds += 1
        if num_drafted:
            self.stats.drafted += num_drafted
            self.ended_at[num_accepted] += 1
            self.lengths[num_drafted] += 1
            for position in range(1, min(num_drafted, num_accepted + 1) + 1):
                self.reached[position] += 1
                self.kept[position] += position <= num_accepted

    def emit(self, tokens: list[int], logits: np.ndarray | None = None) -> None:
        """Append one round's tokens; ends the sequence at an end token, a stop string or the budget.
        logits [len(tokens), vocab]: the target's rows they came from (read for logprobs only)."""
        if self.logprobs is not None and logits is not None:
            self.logprobs += token_logprobs(logits[: len(tokens)], tokens, self.config.logprobs)
        self._known = len(self.context)  # the last pass ran every token up to here (the pending ones included)
        constraint = self.sampler.constraint
        if constraint is None:
            self._append(tokens)
            return
        self._append(tokens[: constraint.commit(tokens)])  # none past the end token that completes it
        self._force(constraint)

    def _force(self, constraint) -> None:
        """Append the tokens the constraint leaves alone, one after another: each has probability 1 under the
        constrained target, so no pass chooses it (the next pass computes its cache entry). With logprobs
        asked for, every token keeps its row in a pass, and none is forced."""
        while self.finish_reason is None:
            # Complete: it took an end token this sequence does not stop at (a chat template's end of turn in a
            # prompt request), or only end tokens may follow and the request ignores them.
            if constraint.ended or (constraint.done and self.config.ignore_eos):
                self.finish("stop")
                return
            token = None if self.logprobs is not None or not self.forcing else constraint.forced()
            if token is None:
                return
            constraint.commit([token])
            self.stats.forced_tokens += 1
            self._append([token])

    def _append(self, tokens: list[int]) -> None:
        """Tokens onto the context, each through the end tokens, the stop strings and the budget."""
        text = self.text
        for token in tokens:
            if self.finish_reason is not None:
                break
            self.new_tokens.append(token)
            self.context.append(token)
            if token in self.end_ids:
                self.finish("eos")
                break
            if text is not None:
                piece = text.push(token)
                if piece and self.streaming:
                    self.pieces.append(piece)
                if text.stopped:
                    self.finish("stop")
                    break
        if self.finish_reason is None and len(self.new_tokens) >= self.budget:
            self.finish("length")

    def fail(self, error: BaseException) -> None:
        """End the sequence because a pass or its bookkeeping raised (finish reason "error")."""
        self.error = error
        self.finish("error")

    def finish(self, reason: str) -> None:
        """End the sequence (eos | length | stop | interrupted | cancelled | error); its stats are settled here."""
        if self.finish_reason is not None:
            return
        self.finish_reason, self.finished = reason, True
        stats = self.stats
        if self.text is not None:
            piece = self.text.finish()
            if self.text.stopped and reason in ("eos", "length"):  # a stop string in the text held back to the end
                reason = self.finish_reason = "stop"
            if piece and self.streaming and reason not in ("interrupted", "cancelled", "error"):
                self.pieces.append(piece)
        stats.new_tokens = len(self.new_tokens)
        stats.finish_reason = "interrupted" if reason == "cancelled" else reason
        if self._decode_start is not None:
            stats.decode_ms = (time.perf_counter() - self._decode_start) * 1000
        stats.draft_rounds = sum(self.ended_at)
        stats.accepted = sum(count * accepted for accepted, count in enumerate(self.ended_at))
        if self.config.speculative:
            k = self.config.num_draft_tokens
            stats.accepted_by_position = [sum(self.ended_at[position + 1 :]) for position in range(k)]
            stats.drafted_by_position = [sum(self.lengths[position + 1 :]) for position in range(k)]
        stats.other_ms = max(0.0, stats.decode_ms - stats.target_ms - stats.draft_ms)
        if reason == "length" and self.budget < self.config.max_new_tokens:
            stats.note = (f"stopped at the bundle's max context of {self.max_context} tokens "
                          f"(prompt {len(self.prompt_ids)} + {self.budget} new)")

    def take_pieces(self) -> list[str]:
        """The text pieces that became ready since the last call (streaming sequences)."""
        pieces, self.pieces = self.pieces, []
        return pieces

    def output(self) -> GenerationOutput:
        # The end token writes no text (a stream never pushes it), whether the tokenizer calls it special or not.
        shown = self.new_tokens[:-1] if self.finish_reason == "eos" else self.new_tokens
        text = self.text.text if self.text is not None else self.codec.decode(shown)
        logprobs = self.logprobs[: len(self.new_tokens)] if self.logprobs is not None else None
        return GenerationOutput(text=text, token_ids=list(self.new_tokens), stats=self.stats, logprobs=logprobs)
