"""The scheduler: many sequences stepped together (continuous batching), each exactly as it would run alone.

One `step` is three calls, each the one owner of its part (step.py holds the records between them):

    plan = self.schedule()              # this module: what runs
    result = self.runner.execute(plan)  # runner.py: the passes
    self.update(plan, result)           # update.py: what came of them

`schedule` decides what runs this step:
  1. sequences whose `cancelled()` turned true end (asked once a step, waiting or running); waiting
     sequences take free KV slots (the slot whose caches share the longest prefix with the prompt
     first), up to the generator's slots: the one queue and the one admission, a server's included;
  2. every sequence still prefilling takes one prefill step (a chunk of the target's prompt and a
     step of its draft's; runner.py); a sequence whose prompt another is prefilling now waits, then
     copies that slot's positions (a donor);
  3. every prefilled sequence decodes one round, with the draft length the policy gives it
     (SpeculationPolicy.draft_lengths; 0: a target-only step).
Finished sequences leave after `update`; their slots keep their caches for a later prompt's prefix.

Whether a round speculates, and with how many draft tokens, is the policy's choice: at a large
batch a verify pass per row can cost more than it saves, where one batched target pass serves every
row. A batched row computes as a one-token pass alone does, bit for bit; a verify row as a
multi-token pass, which differs from it in the last bits (more for fp16 and quantized targets). So
the choice changes speed, and a greedy output only where that rounding splits a near-tie, as
speculative against target-only decoding alone can; every round samples the target's distribution
as its pass computes it. An exact target (OrtEngine's `exact`) runs every row as a multi-token pass,
so that nothing about the batch or k changes a greedy output, and a sampled row keeps its request's
k, so that the same seed gives the sample it gives alone, whatever its neighbours.
"""

from __future__ import annotations

import time
from collections import deque

from .policy import SpeculationPolicy
from .runner import Runner
from .sequence import Sequence, Slot, shared_prefix
from .step import Decode, Prefill, RoundRecord, RoundStart, StepPlan, StepResult
from .update import update

class Scheduler:
    """Steps every live sequence of one generator each iteration; see the module docstring.

    One thread drives a scheduler (the generate loop, or a server's worker). `submit` and `cancel`
    take effect between steps."""

    def __init__(self, target, slots: list[Slot], policy: SpeculationPolicy | None = None):
        self.target = target
        self.slots = slots
        self.free: list[Slot] = list(slots)
        self.policy = policy or SpeculationPolicy("always" if len(slots) == 1 else "auto")
        packed = getattr(getattr(slots[0].target_cache, "pool", None), "packed_pass", None)
        self.policy.packed_sizes = packed.sizes if packed is not None else []
        self.policy.single_packed = bool(packed is not None and packed.spare)
        self.policy.exact = getattr(target, "exact", False)
        spec = getattr(target, "spec", None)
        rounded = spec is not None and (spec.quantize != "none" or spec.dtype != "fp32")
        self.policy.choose_alone = self.policy.exact or rounded
        self.runner = Runner(target, self.policy)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.last_round: RoundRecord | None = None  # for the next round's cost outside the engines (update.py)
        self._cancelled: list[Sequence] = []  # those schedule() ended, for this step's return

    @property
    def active(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def cancel(self, sequence: Sequence, reason: str = "cancelled") -> None:
        """End a sequence now (before its next step); its slot frees at once."""
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        sequence.finish(reason)
        self._retire()

    def step(self) -> list[Sequence]:
        """One iteration; returns the sequences that ended in it."""
        plan = self.schedule()
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # out of the step: the prompts it was prefilling are cut
            for work in plan.prefill:
                work.sequence.fail(exc)
            raise
        return self.update(plan, result)

    def schedule(self) -> StepPlan:
        """What this step runs (see the module docstring)."""
        self._drop_cancelled()
        self._admit()
        prefilling, decode = [], []
        for sequence in self.running:
            if not sequence.prefilled:
                prefilling.append(sequence)
            elif not sequence.finished:
                decode.append(sequence)
        prefill, ready = self._plan_prefill(prefilling) if prefilling else ([], [])
        if ready:  # in the order they run
            decode = [s for s in self.running if s in ready or s in decode]
        for sequence in list(decode):
            try:
                sequence.sampler.sync(sequence.context)  # its penalties' context (nothing to do without one)
            except Exception as exc:  # noqa: BLE001 - fails this sequence only
                sequence.fail(exc)
                decode.remove(sequence)
        if not decode:
            return StepPlan(prefill, [], None)
        lengths, wanting = self.policy.draft_lengths(decode)
        start = RoundStart(tuple(map(id, decode)), time.perf_counter(), self._engine_seconds(decode))
        return StepPlan(prefill, list(map(Decode, decode, lengths)), start, wanting or len(decode))

    def update(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """Settle the step (update.py); returns the sequences that ended in it."""
        self.last_round = update(plan, result, self.policy, self.last_round)
        ended, self._cancelled = self._cancelled + self._retire(), []
        return ended

    def _plan_prefill(self, prefilling: list[Sequence]) -> tuple[list[Prefill], list[Sequence]]:
        """One prefill step for each prefilling sequence: those under way first, then those starting. A
        starting sequence whose prompt another is prefilling (or starts this step) waits, then copies that
        slot's positions; one may copy another slot's (a donor) that holds more of its prompt. Returns the
        steps, and the sequences they leave prefilled without a pass (a prompt held whole, and no draft
        to prefill): those decode in this step too."""
        plan, ready = [Prefill(s) for s in prefilling if s.target_started], []
        writing = [s.context[:-1] for s in prefilling if s.target_prefilling]  # prompts whose positions are being written
        for sequence in prefilling:
            prompt = sequence.context[:-1]
            if sequence.target_started or prompt in writing:
                continue
            donor, held = self._donor(sequence)
            plan.append(Prefill(sequence, donor))
            if held < len(prompt):  # it runs chunks of its own
                writing.append(prompt)
            elif sequence.drafter is None:
                ready.append(sequence)
        return plan, ready

    def _donor(self, sequence: Sequence):
        """Another slot's target cache that holds more of this sequence's prompt than its own (or None), and
        how much of the prompt the better of the two holds."""
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
        return best, best_length

    def _engine_seconds(self, rows: list[Sequence]) -> float:
        """Seconds the target and the rows' draft engine have spent in their passes so far."""
        for row in rows:
            draft = getattr(row.drafter, "engine", None)
            if draft is not None:
                return self.target.seconds + draft.seconds
        return self.target.seconds

    def _drop_cancelled(self) -> None:
        """End the sequences whose `cancelled()` turned true (asked once a step), waiting or running."""
        gone = False
        for queue in (self.waiting, self.running):
            for sequence in queue:
                if sequence.cancelled is not None and not sequence.finished and sequence.cancelled():
                    sequence.finish("cancelled")
                    gone = True
        if gone:
            self._cancelled += [s for s in self.waiting if s.finished]
            self.waiting = deque(s for s in self.waiting if not s.finished)
            self._cancelled += self._retire()

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
        done = []
        for sequence in self.running:
            if sequence.finished:
                done.append(sequence)
        if done:
            self.running = [s for s in self.running if not s.finished]
            self.free.extend(s.slot for s in done)
            self.free.sort(key=lambda slot: slot.index)
        if not self.running:
            self.last_round = None  # what comes before the next round (idle time, a new prompt) is no round's cost
        return done
