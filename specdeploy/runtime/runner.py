"""The runner: a step's passes. `Runner.execute(plan)` is the one place that chooses passes and batch
shapes, moves the KV caches and calls the engines for a step; it decides nothing about tokens.

For a StepPlan (step.py) it runs, in order:
  1. each prefill step: the sequence's next target chunk (PREFILL_CHUNK tokens, after copying a
     donor slot's positions where the plan names one) and its draft's next prefill step. Where the
     target has packed graphs (packed.py) and other rows run beside it, a chunk rides in this step's
     packed pass beside the decoding rows, so that a prompt costs its neighbours the time its
     own tokens take in that pass, not a pass of its own; else it runs in its own pass;
  2. the drafts: every row with a draft length proposes together (propose_many: one batched draft
     pass per draft position);
  3. the target passes, the cheapest the policy's measured costs give (SpeculationPolicy.choose_passes):
     every row in one packed pass (its graph has one attention node per slot, since ONNX Runtime's CPU
     GroupQueryAttention refuses a batch of several rows with several tokens each over a past; each
     row computes as its own pass would, bit for bit), or the verify rows in one packed pass or a pass
     each, and the target-only rows in one batched step ([rows, 1], OrtEngine.run_batch) or a packed
     pass of their own (a target whose single tokens join packed passes, policy.single_packed).

It returns each row's drafts and the target's logits over them (a StepResult), and each pass's cost.
A row whose own work fails is reported in the result's errors and left out of later passes; a
failed pass reports every row it ran.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .draft_rows import DraftRequest, propose_many
from .policy import SpeculationPolicy
from .sequence import Sequence
from .step import PassCost, PrefillDone, RowResult, StepPlan, StepResult


@dataclass(frozen=True)
class _Rider:
    """A prefill chunk that rides in this step's packed pass."""

    sequence: Sequence
    chunk: list[int]
    start: float


class Runner:
    """Runs the passes of each step for one target and its slots' drafters; see the module docstring."""

    def __init__(self, target, policy: SpeculationPolicy):
        self.target = target
        self.policy = policy
        self._views: list[RowResult] = []  # rows whose logits are views of the last target pass's buffers

    def execute(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        self._views = []
        packed = bool(self.policy.packed_sizes) and len(plan.prefill) + len(plan.decode) > 1
        riders = self._prefill(plan, packed, result)
        if not plan.decode:
            self._prefill_apart(riders, result)
            return result
        speculative, plain = [], []
        for work in plan.decode:
            if work.sequence in result.errors:  # (a failed prefill step)
                continue
            if work.num_draft_tokens > 0:
                speculative.append(work)
            else:
                plain.append(RowResult(work.sequence))
        verifying = []
        if speculative:
            verifying, without = self._propose(speculative, result)
            plain += without
            result.speculative = bool(verifying)
        self._target_passes(verifying, plain, riders, result)
        return result

    @staticmethod
    def _fail(result: StepResult, sequence: Sequence, exc: Exception) -> None:
        result.errors.setdefault(sequence, exc)

    def _guarded(self, result: StepResult, sequence: Sequence, work, *arguments):
        """work(...) for one sequence; an error is that sequence's alone (Ctrl-C goes on up)."""
        try:
            return work(*arguments)
        except Exception as exc:  # noqa: BLE001 - reported to the sequence's owner, the step goes on
            self._fail(result, sequence, exc)
            return None

    # -- prefill -------------------------------------------------------------------------------------

    def _prefill(self, plan: StepPlan, packed: bool, result: StepResult) -> list[_Rider]:
        """Each prefill step: chunks a packed pass can hold (two tokens or more, or any on a target whose
        single tokens join packed passes) ride, with their draft's step run now; the rest run now."""
        riders = []
        for work in plan.prefill:
            sequence, begin = work.sequence, time.perf_counter()
            chunk = self._guarded(result, sequence, sequence.take_prefill_chunk, work.donor)
            if sequence in result.errors:
                continue
            if packed and chunk is not None and (len(chunk) > 1 or self.policy.single_packed):
                self._guarded(result, sequence, sequence.draft_prefill_step)
                if sequence not in result.errors:
                    riders.append(_Rider(sequence, chunk, begin))
            else:
                self._guarded(result, sequence, self._prefill_alone, sequence, chunk)
                if sequence not in result.errors:
                    result.prefilled.append(PrefillDone(sequence, begin))
        return riders

    def _prefill_alone(self, sequence: Sequence, chunk: list[int] | None) -> None:
        """A chunk (None: the target's prefill is done) in its own pass, then the draft's prefill step."""
        if chunk is not None:
            self._pass()
            self.target.run(chunk, sequence.slot.target_cache)
        sequence.draft_prefill_step()

    def _prefill_apart(self, riders: list[_Rider], result: StepResult) -> None:
        """Riding chunks in a pass of their own: one packed pass for several, or the chunk's own."""
        if len(riders) == 1:
            rider = riders[0]
            self._pass()
            self._guarded(result, rider.sequence, self.target.run, rider.chunk, rider.sequence.slot.target_cache)
            if rider.sequence not in result.errors:
                result.prefilled.append(PrefillDone(rider.sequence, rider.start))
        elif riders:
            self._packed_pass([], [], riders, result)

    # -- drafts --------------------------------------------------------------------------------------

    def _propose(self, works: list, result: StepResult) -> tuple[list[RowResult], list[RowResult]]:
        """Every row's drafts together; returns the rows that proposed and those that proposed nothing."""
        rows, requests = [], []
        for work in works:
            row = work.sequence
            rows.append(row)
            requests.append(DraftRequest(row.drafter, row.context, work.num_draft_tokens, row.sampler, row.rng,
                                         row.config.draft_confidence, row.num_draft_tokens()))
        draft = rows[0].drafter.engine
        seconds, calls = (draft.seconds, draft.calls) if draft is not None else (0.0, 0)
        steps = []  # (rows, seconds) of each batched draft step
        try:
            proposals = propose_many(requests, steps)
        except Exception as exc:  # noqa: BLE001 - a failed batched draft fails its rows
            for row in rows:
                self._fail(result, row, exc)
            return [], []
        for count, step_seconds in steps:  # catch-ups left out: they follow target-only rounds, not a draft length
            result.passes.append(PassCost("draft", count, count, 1000 * step_seconds))
        spent, spent_calls = 0.0, 0
        if draft is not None and draft.calls > calls:
            spent, spent_calls = (draft.seconds - seconds) * 1000, draft.calls - calls
        verifying, without = [], []
        for row, proposal in zip(rows, proposals):
            if isinstance(proposal, Exception):  # this row's own drafting failed: it alone ends
                self._fail(result, row, proposal)
                continue
            drafts, draft_probs = proposal
            outcome = RowResult(row, drafts, draft_probs, draft_ms=spent, draft_calls=spent_calls)
            (verifying if drafts else without).append(outcome)
        return verifying, without

    # -- target passes -------------------------------------------------------------------------------

    def _target_passes(self, verifying: list[RowResult], plain: list[RowResult], riders: list[_Rider],
                       result: StepResult) -> None:
        """The cheapest passes for the round (see the module docstring); riders join the packed pass of every
        row, or of the verify rows, or else run in one of their own."""
        tokens = 1  # the longest row's
        for row in verifying:
            tokens = max(tokens, len(row.drafts) + 1)
        choice = self.policy.choose_passes(len(verifying), len(plain), tokens)
        together, verify_shared, plain_shared = choice.together, choice.verify_shared, choice.plain_shared
        if riders:  # a target whose single tokens join packed passes takes every row; else the verify rows
            together = together or self.policy.single_packed
            verify_shared = not together and bool(verifying)
            if not together and not verifying:
                self._prefill_apart(riders, result)
                riders = []
        if together:
            self._packed_pass(verifying, plain, riders, result)
            return
        if verify_shared:
            self._packed_pass(verifying, [], riders, result)
        else:
            for row in verifying:
                self._guarded(result, row.sequence, self._verify, row, result)
        if plain_shared:
            self._packed_pass([], plain, [], result)
        elif plain:
            self._batched_step(plain, result)

    def _pass(self) -> None:
        """Before a target pass: the rows whose logits are views of the last one's buffers get copies."""
        for row in self._views:
            row.logits = row.logits.copy()
        self._views = []

    def _took(self, rows: list[RowResult], result: StepResult, spent: float, calls: int) -> None:
        """Rows whose logits came from the last pass(es): its cost is theirs, their logits views of its buffers."""
        for row in rows:
            row.target_ms += spent
            row.target_calls += calls
            result.rows.append(row)
        self._views += rows

    def _verify(self, row: RowResult, result: StepResult) -> None:
        """One row's pending token and drafts in a pass of their own."""
        target = self.target
        pending = row.sequence.pending_tokens()  # [context[-1]]: the cache holds the rest
        self._pass()
        seconds, calls = target.seconds, target.calls
        count = len(row.drafts) + 1
        row.logits = target.run(pending + row.drafts, row.sequence.slot.target_cache)[-count:]  # [k + 1, vocab]
        spent = (target.seconds - seconds) * 1000
        # filed under the tokens it ran: more than k + 1 after tokens a constraint forced (or a catch-up)
        result.passes.append(PassCost("verify", 1, len(pending) + len(row.drafts), spent))
        self._took([row], result, spent, target.calls - calls)

    def _batched_step(self, rows: list[RowResult], result: StepResult) -> None:
        """One token per row from one batched target pass."""
        target, tokens, caches, ready = self.target, [], [], []
        for row in rows:
            sequence = row.sequence
            try:
                pending = sequence.pending_tokens()
                if len(pending) > 1:  # a catch-up (not after a round of this loop): its own pass first
                    self._pass()
                    target.run(pending[:-1], sequence.slot.target_cache)
            except Exception as exc:  # noqa: BLE001 - fails this row only
                self._fail(result, sequence, exc)
                continue
            tokens.append(pending[-1])
            caches.append(sequence.slot.target_cache)
            ready.append(row)
        if not ready:
            return
        self._pass()
        seconds, calls = target.seconds, target.calls
        try:
            logits = target.run_batch(tokens, caches)  # [rows, vocab]
        except Exception as exc:  # noqa: BLE001 - a failed batched pass fails its rows
            for row in ready:
                self._fail(result, row.sequence, exc)
            return
        spent = (target.seconds - seconds) * 1000
        result.passes.append(PassCost("target", len(ready), len(ready), spent))
        for index, row in enumerate(ready):
            row.logits = logits[index : index + 1]  # [1, vocab]
        self._took(ready, result, spent, target.calls - calls)

    def _packed_pass(self, verifying: list[RowResult], plain: list[RowResult], riders: list[_Rider],
                     result: StepResult) -> None:
        """One packed pass (OrtEngine.run_packed): each verify row's pending token and drafts, each target-only
        row's pending tokens, each rider's prefill chunk."""
        target, entries = self.target, []  # (row, tokens, logits wanted)
        for row in verifying + plain:
            try:
                pending = row.sequence.pending_tokens()
            except Exception as exc:  # noqa: BLE001 - fails this row only
                self._fail(result, row.sequence, exc)
                continue
            entries.append((row, pending + row.drafts, len(row.drafts) + 1))
        decoding = len(entries)
        if not entries and not riders:
            return
        token_lists = [tokens for _, tokens, _ in entries] + [rider.chunk for rider in riders]
        caches = [row.sequence.slot.target_cache for row, _, _ in entries] + [r.sequence.slot.target_cache for r in riders]
        self._pass()
        seconds, calls = target.seconds, target.calls
        try:
            logits = target.run_packed(token_lists, caches, [want for _, _, want in entries] + [0] * len(riders))
        except Exception as exc:  # noqa: BLE001 - a failed pass fails its rows
            for sequence in [row.sequence for row, _, _ in entries] + [rider.sequence for rider in riders]:
                self._fail(result, sequence, exc)
            return
        spent = (target.seconds - seconds) * 1000
        if target.calls - calls == 1 and not riders:  # one packed pass (not the one-by-one fallback), filed under its
            # tokens; prompt chunks skip the head, so a pass that carries them would price verify tokens low
            size = self.policy.packed_size(len(entries))
            total = sum(len(tokens) for tokens in token_lists) + size - len(entries)  # with a filler token per idle row
            result.passes.append(PassCost("packed", size, total, spent))
        for (row, _, _), row_logits in zip(entries, logits[:decoding]):
            row.logits = row_logits
        self._took([row for row, _, _ in entries], result, spent, target.calls - calls)
        result.prefilled += [PrefillDone(rider.sequence, rider.start) for rider in riders]
