"""The scheduler: many sequences stepped together (continuous batching), each exactly as it would run alone.

One `step` is one iteration:
  1. waiting sequences take free KV slots (the slot whose caches share the longest prefix with the
     prompt first), up to the generator's slots;
  2. every sequence still prefilling takes one chunk of the target's prefill (PREFILL_CHUNK tokens)
     and one step of its draft's (a chunk beside each target chunk; DRAFT_PREFILL_TOKENS an iteration
     after the last, where the target's positions came from another slot's cache). Where the
     target has rows graphs (rows.py), the chunks ride in this iteration's rows pass beside the
     decoding rows, packed, so that a prompt costs its neighbours the time its own tokens take in
     that pass, not a pass of its own per chunk;
  3. every prefilled sequence (but those whose last chunk rides in this iteration's pass) decodes
     one round. Target-only rows share one batched target pass
     ([rows, 1], OrtEngine.run_batch). Speculative rows share batched draft passes (propose_many),
     then one rows pass (OrtEngine.run_rows, rows.py) verifies them all: the target's graph with
     one attention node per slot, since ONNX Runtime's CPU GroupQueryAttention refuses a batch of
     several rows with several tokens each over a past; each row computes as its own verify pass,
     bit for bit. An exact target's target-only rows run in a rows pass too (its rows graphs
     compute a single token as its two-token pass alone does), beside the verify rows or in one of
     their own. The policy's measured costs choose (round_plan): a pass per verify row
     where that is cheaper (a tiny model, or few rows beside many idle slots). Acceptance is per row;
  4. finished sequences leave; their slots keep their caches for a later prompt's prefix.

Whether a round speculates, and with how many draft tokens, is the policy's choice
(SpeculationPolicy): at a large batch a verify pass per row can cost more than it saves, where
one batched target pass serves every row. A batched row computes as a one-token pass alone
does, bit for bit; a verify row as a multi-token pass, which differs from it in the last bits
(more for fp16 and quantized targets). So the choice changes speed, and a greedy output only where
that rounding splits a near-tie, as speculative against target-only decoding alone can; every
round samples the target's distribution as its pass computes it. An exact target (OrtEngine's
`exact`) runs every row as a multi-token pass, so that nothing about the batch or k changes a
greedy output; there the policy chooses for greedy rows only, since a sampled row's random numbers
depend on its draft lengths: it drafts its request's k, and the same seed gives the sample it gives
alone, whatever its neighbours.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from .draft_rows import DraftRequest, propose_many
from .policy import SpeculationPolicy
from .rejection import accept
from .sequence import Sequence, Slot, shared_prefix


@dataclass(frozen=True)
class RoundStart:
    """When a round began: which rows it ran, the clock, and the engines' seconds in passes so far."""

    row_ids: tuple[int, ...]
    time: float
    engine_seconds: float


@dataclass(frozen=True)
class RoundRecord:
    """The last round, for its cost outside the engines (observed when the next round of the same rows starts)."""

    kind: str  # "target" or "speculative": the policy's table it is filed in
    start: RoundStart
    rows: int  # the rows its cost is filed under (those that wanted drafts, else all)


class Scheduler:
    """Steps every live sequence of one generator each iteration; see the module docstring.

    One thread drives a scheduler (the generate loop, or a server's worker). `submit` and `cancel`
    take effect between iterations."""

    def __init__(self, target, slots: list[Slot], policy: SpeculationPolicy | None = None):
        self.target = target
        self.slots = slots
        self.free: list[Slot] = list(slots)
        self.policy = policy or SpeculationPolicy("always" if len(slots) == 1 else "auto")
        rows = getattr(getattr(slots[0].target_cache, "pool", None), "rows_pass", None)
        self.policy.rows_sizes = rows.sizes if rows is not None else []
        self.policy.single_rows = bool(rows is not None and rows.spare)
        self.policy.exact = getattr(target, "exact", False)
        spec = getattr(target, "spec", None)
        rounded = spec is not None and (spec.quantize != "none" or spec.dtype != "fp32")
        self.policy.choose_alone = self.policy.exact or rounded
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._last_round: RoundRecord | None = None

    @property
    def active(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def cancel(self, sequence: Sequence, reason: str = "cancelled") -> None:
        """End a sequence now (before its next round); its slot frees at once."""
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        sequence.finish(reason)
        self._retire()

    def step(self) -> list[Sequence]:
        """One iteration; returns the sequences that ended in it."""
        self._admit()
        riders = self._prefill([s for s in self.running if not s.prefilled])
        riding = {id(sequence) for sequence, _, _ in riders}  # their last chunk has not run yet
        decoding = [s for s in self.running if s.prefilled and not s.finished and id(s) not in riding]
        if decoding:
            try:
                self._decode(decoding, riders)
            except Exception as exc:  # out of the step, maybe before the riders' pass: their prompts are cut
                for sequence, _, _ in riders:
                    if not sequence.finished:
                        sequence.fail(exc)
                raise
        else:
            self._last_round = None  # prefill only: no round to charge it to
            self._run_riders(riders)
        return self._retire()

    def _run_riders(self, riders: list[tuple]) -> None:
        """Prefill chunks (see _prefill) in a pass of their own: one rows pass for several, or the chunk's own."""
        if len(riders) == 1:
            (sequence, chunk, start), = riders
            self._guarded(sequence, sequence.run_chunk, self.target, chunk, start)
        elif riders:
            self._rows_round([], [], riders)

    def _prefill(self, prefilling: list[Sequence]) -> list[tuple]:
        """One prefill step of each prefilling sequence: first those under way, then those starting. A starting
        one may copy another slot's prompt positions (_donor): those its passes have run so far (a rider's
        chunk runs later in the iteration). Sequences with one prompt prefill it once: the first runs it,
        the others wait, then copy its cache. Where the target has rows graphs,
        target chunks that a rows pass can hold (rows.py: two tokens or more, or any on a target whose
        single tokens join rows passes) are returned as riders, (sequence, chunk, start), for this
        iteration's rows pass; the rest run their own passes now (a draft-only prefill step, a one-token chunk)."""
        rows = bool(self.policy.rows_sizes) and len(self.running) > 1  # the slots' target pool has rows graphs
        riders: list[tuple] = []
        self._prefill_group([s for s in prefilling if s.target_started], prefilling, rows, riders)
        self._prefill_group([s for s in prefilling if not s.target_started], prefilling, rows, riders)
        return riders

    def _prefill_group(self, group: list[Sequence], prefilling: list[Sequence], rows: bool, riders: list) -> None:
        target = self.target
        for sequence in group:
            donor, begin = None, time.perf_counter()
            if not sequence.target_started:
                prompt = sequence.context[:-1]
                if any(other.context[:-1] == prompt for other, _, _ in riders) or any(
                        other.target_prefilling and other.context[:-1] == prompt for other in prefilling):
                    continue
                donor = self._donor(sequence)
            chunk = self._guarded(sequence, sequence.take_prefill_chunk, donor)
            if sequence.finished:
                continue
            if rows and chunk is not None and (len(chunk) > 1 or self.policy.single_rows):
                self._guarded(sequence, sequence.draft_prefill_step)  # the target's chunk runs later, in the rows pass
                if not sequence.finished:
                    riders.append((sequence, chunk, begin))
            else:
                self._guarded(sequence, sequence.prefill_step, target, chunk, begin)

    def _donor(self, sequence: Sequence):
        """Another slot's target cache that holds more of this sequence's prompt than its own (or None)."""
        own = shared_prefix(sequence.slot.target_cache.tokens, sequence.context)
        best, best_length = None, own
        for slot in self.slots:
            cache = slot.target_cache
            if slot is sequence.slot or not getattr(cache, "shared_buffer", False) or cache.device != "cpu":
                continue
            if any(s.slot is slot and (s.target_prefilling or not s.target_started) for s in self.running):
                continue  # still being written
            length = shared_prefix(cache.tokens, sequence.context)
            if length > best_length:
                best, best_length = cache, length
        return best

    def _admit(self) -> None:
        while self.waiting and self.free:
            sequence = self.waiting.popleft()
            if sequence.finished:
                continue
            slot = max(self.free, key=lambda s: (shared_prefix(s.target_cache.tokens, sequence.context), -s.index))
            self.free.remove(slot)
            sequence.bind(slot)
            self.running.append(sequence)

    def _retire(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        if done:
            self.running = [s for s in self.running if not s.finished]
            self.free.extend(s.slot for s in done)
            self.free.sort(key=lambda slot: slot.index)
        if not self.running:
            self._last_round = None  # what comes before the next round (idle time, a new prompt) is no round's cost
        return done

    def _guarded(self, sequence: Sequence, work, *arguments):
        """Run one sequence's work; an error fails that sequence only (Ctrl-C goes on up)."""
        try:
            return work(*arguments)
        except Exception as exc:  # noqa: BLE001 - reported to the sequence's owner, the loop goes on
            sequence.fail(exc)
            return None

    def _decode(self, rows: list[Sequence], riders: list[tuple]) -> None:
        wanted = {}  # each row's draft tokens this round, before the policy's limit
        for row in rows:
            k = self._guarded(row, self._round_start, row)
            if k is not None:
                wanted[row] = k
        rows = list(wanted)
        if not rows:  # every row failed: the riders still take their chunks
            self._last_round = None
            self._run_riders(riders)
            return
        speculative = [row for row in rows if wanted[row] > 0]
        start = self._observe_period(rows)
        # The policy limits greedy rows' drafts; a sampled row's random numbers depend on its draft lengths, so
        # alone or on an exact target it keeps its request's k and a seed gives one sample. In a batch on a
        # target that is not exact the policy limits sampled rows too. ("never" still means never.)
        batch = len(speculative) > 1 and not self.policy.exact
        limited = [row for row in speculative if row.sampler.greedy or batch]
        own = self.policy.mode != "never"
        limit = self.policy.draft_limit(limited, max(wanted.values())) if limited or not own else None
        ks = {row: row.num_draft_tokens(limit if row in limited or not own else None) for row in speculative}
        drafting = [row for row in speculative if ks[row] > 0]
        plain = [row for row in rows if row not in drafting]
        verifying = []
        if drafting:
            verifying, without = self._propose(drafting, ks)
            plain += without
        self._target_passes(verifying, plain, riders)
        # filed under the rows the policy decides for (those that want drafts)
        self._last_round = RoundRecord("speculative" if verifying else "target", start, len(speculative) or len(rows))

    @staticmethod
    def _round_start(row: Sequence) -> int:
        """A row's draft tokens this round, its penalties' context synced first (nothing to do without one)."""
        row.sampler.sync(row.context)
        return row.num_draft_tokens()

    def _target_passes(self, verifying: list[tuple], plain: list[Sequence], riders: list[tuple]) -> None:
        """The round's target passes: verify passes (rows with drafts) and target-only steps (plain rows),
        as the policy's costs say (round_plan): where the target has rows graphs (rows.py), every row in
        one rows pass (a target whose single tokens join them, or verify rows alone), or the verify rows
        in one and the plain rows in another; else a verify pass per row, and one batched step of the
        plain rows. Prefill chunks (riders) join the rows pass of every row, or of the verify rows, or
        else run in one of their own: a prompt costs the rows decoding beside it its tokens' share of
        their pass, not a pass of its own."""
        tokens = max([len(drafts) + 1 for _, drafts, _ in verifying] + [1])
        _, together, verify_shared, plain_shared = self.policy.round_plan(len(verifying), len(plain), tokens)
        if riders:  # a target whose single tokens join rows passes takes every row; else the verify rows
            together = together or self.policy.single_rows
            verify_shared = not together and bool(verifying)
            if not together and not verifying:
                self._run_riders(riders)
                riders = []
        if together:
            self._rows_round(verifying, plain, riders)
            return
        if verify_shared:
            self._rows_round(verifying, [], riders)
        else:
            for row, drafts, draft_probs in verifying:
                self._guarded(row, self._verify, row, drafts, draft_probs)
        if plain_shared:
            self._rows_round([], plain)
        elif plain:
            self._target_round(plain)

    def _observe_period(self, rows: list[Sequence]) -> RoundStart:
        """The last round's cost outside the engines, from its start to this one's: the scheduler's own work
        and its caller's (a server detokenizes and streams each round's tokens). Observed only between two
        rounds of the same rows. Returns this round's start."""
        start = RoundStart(tuple(map(id, rows)), time.perf_counter(), self._engine_seconds(rows))
        last = self._last_round
        if last is not None and last.start.row_ids == start.row_ids:
            outside = (start.time - last.start.time) - (start.engine_seconds - last.start.engine_seconds)
            self.policy.observe(self.policy.outside_ms[last.kind], last.rows, 1000 * outside)
        return start

    def _engine_seconds(self, rows: list[Sequence]) -> float:
        """Seconds the target and the rows' draft engine have spent in their passes so far."""
        draft = next((row.drafter.engine for row in rows if getattr(row.drafter, "engine", None) is not None), None)
        return self.target.seconds + (draft.seconds if draft is not None else 0.0)

    def _target_round(self, rows: list[Sequence]) -> None:
        """One token per row from one batched target pass."""
        target, tokens, caches, ready = self.target, [], [], []
        for row in rows:
            try:
                pending = row.pending_tokens()
                if len(pending) > 1:  # a catch-up (not after a round of this loop): its own pass first
                    target.run(pending[:-1], row.slot.target_cache)
            except Exception as exc:  # noqa: BLE001 - fails this row only
                row.fail(exc)
                continue
            tokens.append(pending[-1])
            caches.append(row.slot.target_cache)
            ready.append(row)
        if not ready:
            return
        seconds, calls = target.seconds, target.calls
        try:
            logits = target.run_batch(tokens, caches)  # [rows, vocab]
        except Exception as exc:  # noqa: BLE001 - a failed batched pass fails its rows
            for row in ready:
                row.fail(exc)
            return
        spent = (target.seconds - seconds) * 1000
        self.policy.observe(self.policy.target_ms, len(ready), spent)
        for row, row_logits in zip(ready, logits):
            row.stats.target_ms += spent
            row.stats.target_calls += target.calls - calls
            self._guarded(row, self._plain_token, row, row_logits)

    def _propose(self, rows: list[Sequence], ks: dict) -> tuple[list[tuple], list[Sequence]]:
        """Draft for every row together (ks: each row's draft length); returns (row, drafts, draft
        probabilities) for the rows that proposed, and the rows that proposed nothing."""
        draft = rows[0].drafter.engine
        requests = []
        for row in rows:
            requests.append(DraftRequest(row.drafter, row.context, ks[row], row.sampler, row.rng, row.config.draft_confidence))
        seconds, calls = (draft.seconds, draft.calls) if draft is not None else (0.0, 0)
        steps = []  # (rows, seconds) of each batched draft step
        try:
            proposals = propose_many(requests, steps)
        except Exception as exc:  # noqa: BLE001 - a failed batched draft fails its rows
            for row in rows:
                row.fail(exc)
            return [], []
        for count, step_seconds in steps:  # catch-ups left out: they follow target-only rounds, not a draft length
            self.policy.observe(self.policy.draft_ms, count, 1000 * step_seconds)
        if draft is not None and draft.calls > calls:
            spent = (draft.seconds - seconds) * 1000
            for row in rows:
                row.stats.draft_ms += spent
                row.stats.draft_calls += draft.calls - calls
        verifying, without = [], []
        for row, proposal in zip(rows, proposals):
            if isinstance(proposal, Exception):  # this row's own drafting failed: it alone ends
                row.fail(proposal)
                continue
            drafts, draft_probs = proposal
            if drafts:
                verifying.append((row, drafts, draft_probs))
            else:
                without.append(row)
        return verifying, without

    def _verify(self, row: Sequence, drafts: list[int], draft_probs: np.ndarray | None) -> None:
        target = self.target
        seconds, calls = target.seconds, target.calls
        pending = row.pending_tokens()  # [context[-1]]: the cache holds the rest
        logits = target.run(pending + drafts, row.slot.target_cache)[-(len(drafts) + 1) :]  # [k + 1, vocab]
        spent = (target.seconds - seconds) * 1000
        row.stats.target_ms += spent
        row.stats.target_calls += target.calls - calls
        self.policy.observe(self.policy.verify_ms, len(drafts) + 1, spent)
        self._accept(row, drafts, draft_probs, logits)

    def _accept(self, row: Sequence, drafts: list[int], draft_probs: np.ndarray | None, logits: np.ndarray) -> None:
        """The rejection rule over one row's verified drafts (logits [k + 1, vocab]); emits what it keeps."""
        num_accepted, token = accept(row.sampler, drafts, draft_probs, logits, row.rng, row.target_probs)
        row.record_round(len(drafts), num_accepted)
        self.policy.observe_round(len(drafts), num_accepted)
        row.emit(drafts[:num_accepted] + [token], logits)

    def _rows_round(self, verifying: list[tuple], plain: list[Sequence], riders: list[tuple] = ()) -> None:
        """One rows pass (OrtEngine.run_rows): each verify row's pending token and drafts, each plain row's
        pending tokens, each rider's prefill chunk; then each row's acceptance or target-only token, as its
        own pass would give, and each rider's prefill step ended."""
        target, entries = self.target, []  # (row, tokens, drafts or None, draft probabilities, logits wanted)
        for row, drafts, draft_probs in verifying + [(row, None, None) for row in plain]:
            try:
                pending = row.pending_tokens()
            except Exception as exc:  # noqa: BLE001 - fails this row only
                row.fail(exc)
                continue
            entries.append((row, pending + (drafts or []), drafts, draft_probs, len(drafts or []) + 1))
        entries += [(sequence, chunk, None, None, 0) for sequence, chunk, _ in riders]
        if not entries:
            return
        seconds, calls = target.seconds, target.calls
        try:
            logits = target.run_rows([entry[1] for entry in entries], [entry[0].slot.target_cache for entry in entries],
                                     [entry[4] for entry in entries])
        except Exception as exc:  # noqa: BLE001 - a failed pass fails its rows
            for entry in entries:
                entry[0].fail(exc)
            return
        spent = (target.seconds - seconds) * 1000
        if target.calls - calls == 1 and not riders:  # one rows pass (not the one-by-one fallback), filed under its
            # tokens; prompt chunks skip the head, so a pass that carries them would price verify tokens low
            size = self.policy.rows_size(len(entries))
            total = sum(len(entry[1]) for entry in entries) + size - len(entries)  # with a filler token per idle row
            self.policy.observe(self.policy.rows_ms.setdefault(size, {}), total, spent)
        decoding = len(entries) - len(riders)
        for (row, tokens, drafts, draft_probs, _), row_logits in zip(entries[:decoding], logits):
            row.stats.target_ms += spent
            row.stats.target_calls += target.calls - calls
            if drafts is not None:
                self._guarded(row, self._accept, row, drafts, draft_probs, row_logits)
            else:
                self._guarded(row, self._plain_token, row, row_logits[-1])
        for sequence, _, start in riders:
            if not sequence.finished:
                self._guarded(sequence, sequence.end_prefill_step, start)

    @staticmethod
    def _plain_token(row: Sequence, logits: np.ndarray) -> None:
        token = row.sample_target(logits)
        row.record_round(0, 0)
        row.emit([token], logits[None])
