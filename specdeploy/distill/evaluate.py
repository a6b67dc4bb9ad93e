"""The held-out acceptance estimate: greedy agreement, and accepted tokens per round at k.

Vocabulary: at draft step s of a round the draft proposes one token; it is *accepted* under greedy
verification when it equals the target's greedy choice there and every earlier proposal of the
round was accepted. `agreement[s - 1, i]` says whether the step-s proposal made at index i equals
the target's; a round that starts at index i has its step s at index i + s - 1 (teacher forcing:
on the target's own greedy text the context of an accepted proposal is exactly the text).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def accepted_counts(agreement: np.ndarray, num_draft_tokens: int) -> np.ndarray:
    """Accepted proposals of the round starting at each index: [rounds] ints in 0..k.

    agreement [steps, length] bool; with one row (a draft whose proposal does not depend on its
    step, as a model draft under teacher forcing) that row serves every step. Only rounds whose k
    steps all fall inside the sequence are counted."""
    steps, length = agreement.shape
    rounds = length - num_draft_tokens + 1
    if rounds <= 0:
        return np.zeros(0, dtype=np.int64)
    alive = np.ones(rounds, dtype=bool)
    counts = np.zeros(rounds, dtype=np.int64)
    for step in range(1, num_draft_tokens + 1):
        row = agreement[min(step, steps) - 1]
        alive &= row[step - 1 : step - 1 + rounds]
        counts += alive
    return counts


def acceptance_by_position(counts: np.ndarray, num_draft_tokens: int) -> list[float]:
    """P(proposal s accepted | proposals 1..s-1 accepted), s = 1..k, from the rounds' accepted counts."""
    rates = []
    for step in range(1, num_draft_tokens + 1):
        reached = int((counts >= step - 1).sum())
        rates.append(float((counts >= step).sum() / reached) if reached else 0.0)
    return rates


@dataclass(frozen=True)
class Score:
    agreement: float            # step-1 greedy agreement over all held-out positions
    accepted_per_round: float   # mean accepted proposals per round at k (the bonus token not counted)
    by_position: tuple[float, ...]
    positions: int
    rounds: int


@dataclass(frozen=True)
class Evaluation:
    overall: Score
    by_kind: dict[str, Score] = field(default_factory=dict)  # chat | code | text

    def to_dict(self) -> dict:
        def one(score: Score) -> dict:
            return {"agreement": round(score.agreement, 4), "accepted_per_round": round(score.accepted_per_round, 4),
                    "acceptance_by_position": [round(r, 4) for r in score.by_position], "positions": score.positions}
        return {**one(self.overall), "by_kind": {kind: one(score) for kind, score in self.by_kind.items()}}


def score(agreements: list[np.ndarray], num_draft_tokens: int) -> Score:
    """Pool sequences: agreements, each [steps, length] bool."""
    first = np.concatenate([a[0] for a in agreements]) if agreements else np.zeros(0, dtype=bool)
    counts = np.concatenate([accepted_counts(a, num_draft_tokens) for a in agreements]) if agreements else np.zeros(0)
    return Score(agreement=float(first.mean()) if first.size else 0.0,
                 accepted_per_round=float(counts.mean()) if counts.size else 0.0,
                 by_position=tuple(acceptance_by_position(counts, num_draft_tokens)),
                 positions=int(first.size), rounds=int(counts.size))


def evaluate(agreements_by_kind: dict[str, list[np.ndarray]], num_draft_tokens: int) -> Evaluation:
    pooled = [a for kind in agreements_by_kind for a in agreements_by_kind[kind]]
    return Evaluation(overall=score(pooled, num_draft_tokens),
                      by_kind={kind: score(a, num_draft_tokens) for kind, a in agreements_by_kind.items()})
