"""The records of one decoding step: what the scheduler plans, what the runner gives back.

A step is three calls (scheduler.py):

    plan = scheduler.schedule()          # StepPlan: which sequences prefill, which decode, with how many drafts
    result = runner.execute(plan)        # StepResult: the passes run, each row's drafts and target logits
    scheduler.update(plan, result)       # acceptance, emitted tokens, finishes, stats and the policy's costs

Nothing else passes between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sequence import Sequence


@dataclass(frozen=True)
class Prefill:
    """One prefill step of a sequence: its target's next chunk (the runner takes it from what the cache
    lacks) and its draft's next prefill step."""

    sequence: Sequence
    donor: object | None = None  # another slot's target cache holding more of the prompt: its positions are copied first


@dataclass(frozen=True)
class Decode:
    """One round of a prefilled sequence: its pending token and up to `num_draft_tokens` drafts (0: a
    target-only step)."""

    sequence: Sequence
    num_draft_tokens: int


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


@dataclass(frozen=True)
class StepPlan:
    """What one step runs: prefill steps and decoding rounds (a sequence is in one of them at most)."""

    prefill: list[Prefill]
    decode: list[Decode]
    round_start: RoundStart | None  # None: no round (prefill only)
    round_rows: int = 0  # the rows the round's cost is filed under (those that want drafts, else all)


@dataclass(frozen=True)
class PassCost:
    """One timed pass, for the policy's cost tables (SpeculationPolicy.observe_pass)."""

    kind: str  # "target" (a batched step), "draft" (a batched draft step), "verify" (one row's pass), "packed" (packed.py)
    rows: int  # rows in the pass (a packed pass: its graph's rows)
    tokens: int  # tokens in the pass (a packed pass: filler tokens included)
    ms: float


@dataclass
class RowResult:
    """One decoding row's round: the drafts it proposed (none: a target-only step) and the target's
    logits over its pending token and drafts, with what its passes cost."""

    sequence: Sequence
    drafts: list[int] = field(default_factory=list)
    draft_probs: np.ndarray | None = None  # [len(drafts), vocab], None for greedy drafts
    logits: np.ndarray | None = None  # [len(drafts) + 1, vocab]: None until (or unless) its target pass ran
    target_ms: float = 0.0
    target_calls: int = 0
    draft_ms: float = 0.0
    draft_calls: int = 0


@dataclass(frozen=True)
class PrefillDone:
    """A prefill step that ran; it began at `start` (perf_counter)."""

    sequence: Sequence
    start: float


@dataclass
class StepResult:
    """What a step's passes gave. Rows whose work failed are in `errors` (their neighbours went on)."""

    rows: list[RowResult] = field(default_factory=list)
    prefilled: list[PrefillDone] = field(default_factory=list)
    passes: list[PassCost] = field(default_factory=list)
    errors: dict[Sequence, Exception] = field(default_factory=dict)
    speculative: bool = False  # some row verified drafts
