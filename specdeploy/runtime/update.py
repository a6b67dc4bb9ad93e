"""A step's outcome settled: `update(plan, result, policy)` is the one place that accepts drafts, emits
tokens, finishes sequences, and records stats and the policy's observations for a step.

Per decoding row it applies the rejection rule (rejection.accept: Leviathan et al. 2023, Chen et
al. 2023) to the drafts it verified, or samples the target-only step's token, and emits the tokens
(the sequence stops itself at an end token, a stop string or its budget); per prefill step that
ran, it closes the step (its time, and decoding's start). Each pass's cost goes to the policy's
tables, each round's acceptance to its running estimate, and the round's time outside the engines
(the scheduler's own work and its caller's: a server detokenizes and streams each round's tokens)
is observed when the next round of the same rows starts.
"""

from __future__ import annotations

from .policy import SpeculationPolicy
from .rejection import accept
from .sequence import Sequence
from .step import RoundRecord, RowResult, StepPlan, StepResult


def update(plan: StepPlan, result: StepResult, policy: SpeculationPolicy, last_round: RoundRecord | None) -> RoundRecord | None:
    """Settle one step (see the module docstring); returns the round's record (None: no round ran)."""
    for sequence, exc in result.errors.items():
        sequence.fail(exc)
    for cost in result.passes:
        policy.observe_pass(cost)
    for done in result.prefilled:
        if not done.sequence.finished:
            _guarded(done.sequence, done.sequence.end_prefill_step, done.start)
    for row in result.rows:
        sequence = row.sequence
        if sequence.finished:
            continue
        stats = sequence.stats
        stats.target_ms += row.target_ms
        stats.target_calls += row.target_calls
        stats.draft_ms += row.draft_ms
        stats.draft_calls += row.draft_calls
        try:
            _settle_row(row, policy)
        except Exception as exc:  # noqa: BLE001 - this row's bookkeeping failed: it alone ends
            sequence.fail(exc)
    start = plan.round_start
    if start is None or not result.rows:
        return None
    if last_round is not None and last_round.start.row_ids == start.row_ids:
        outside = (start.time - last_round.start.time) - (start.engine_seconds - last_round.start.engine_seconds)
        policy.observe(policy.outside_ms[last_round.kind], last_round.rows, 1000 * outside)
    return RoundRecord("speculative" if result.speculative else "target", start, plan.round_rows)


def _settle_row(row: RowResult, policy: SpeculationPolicy) -> None:
    sequence, logits = row.sequence, row.logits
    if row.drafts:  # logits [k + 1, vocab]
        num_accepted, token = accept(sequence.sampler, row.drafts, row.draft_probs, logits, sequence.rng,
                                     sequence.target_probs)
        sequence.record_round(len(row.drafts), num_accepted)
        policy.observe_round(len(row.drafts), num_accepted)
        sequence.emit(row.drafts[:num_accepted] + [token], logits)
    else:  # logits [1, vocab]
        token = sequence.sample_target(logits[-1])
        sequence.record_round(0, 0)
        sequence.emit([token], logits[-1:])


def _guarded(sequence: Sequence, work, *arguments) -> None:
    try:
        work(*arguments)
    except Exception as exc:  # noqa: BLE001 - reported to the sequence's owner
        sequence.fail(exc)
