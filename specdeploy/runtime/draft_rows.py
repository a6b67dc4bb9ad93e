"""Drafting for several sequences at once: `propose_many`, the batched form of Drafter.propose.

Each row's proposal is its own: a row whose own work fails (its lookup, its draft's catch-up, the
choice of one of its tokens) gets that exception in place of its proposal, and the other rows go
on as if it had never been there; only a failed batched pass fails the rows it ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .drafters import Drafter, DraftRow
from .hybrid import HybridDrafter
from .sampling import Sampler

Proposal = tuple[list[int], "np.ndarray | None"]


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's ask of propose_many: Drafter.propose's arguments."""

    drafter: Drafter  # on the sequence's own slot's cache
    context: list[int]
    num_tokens: int
    sampler: Sampler
    rng: np.random.Generator
    min_confidence: float = 0.0
    # The request's own k within its budget (None: num_tokens): a hybrid's lookup, which drafts at no cost, may
    # propose up to this where the policy cut num_tokens to what the draft model's rounds pay for.
    most: int | None = None

    def propose(self, drafter: Drafter | None = None) -> Proposal:
        """drafter (default: the request's own).propose."""
        return (drafter or self.drafter).propose(self.context, self.num_tokens, self.sampler, self.rng, self.min_confidence)


def propose_many(requests: list[DraftRequest], steps: list[tuple[int, float]] | None = None) -> list[Proposal | Exception]:
    """Drafter.propose for several sequences at once, one request per sequence. Returns each request's
    (tokens, probabilities), or the exception its own work raised.

    A hybrid's lookup offers first (HybridDrafter.offer: it proposes alone where a copy is under way, else
    its tokens are what its model row follows where the first draft token agrees); the
    draft model's rows then step together, one batched pass per draft position (run_batch), each row
    choosing its tokens and stopping as ModelDrafter.propose does (DraftRow, one for each). `steps` gets
    (rows, engine seconds) of each batched step; a catch-up (after target-only rounds) is no step."""
    results: list = [None] * len(requests)
    model_rows = []
    for index, request in enumerate(requests):
        drafter = request.drafter
        follow = []
        if isinstance(drafter, HybridDrafter):
            offer = _own(drafter.offer, request.context, request.num_tokens, request.sampler, request.rng, request.most)
            if isinstance(offer, Exception) or offer[0] is not None:
                results[index] = offer if isinstance(offer, Exception) else offer[0]
                continue
            drafter, follow = drafter.model_drafter, offer[1]
        if getattr(drafter, "batched", False):
            model_rows.append((index, request, drafter, follow))
        else:
            results[index] = _own(request.propose, drafter)
    if len(model_rows) == 1:
        index, request, drafter, follow = model_rows[0]
        results[index] = _own(drafter.propose, request.context, request.num_tokens, request.sampler, request.rng,
                              request.min_confidence, follow)
    elif model_rows:
        _propose_model_rows(model_rows, results, steps)
    return results


def _own(work, *arguments, **keywords):
    """work(...), or the exception it raised: one row's failure, kept from its neighbours."""
    try:
        return work(*arguments, **keywords)
    except Exception as exc:  # noqa: BLE001 - reported in that row's place
        return exc


def _propose_model_rows(model_rows: list[tuple[int, DraftRequest, Drafter, list[int]]], results: list,
                        steps: list[tuple[int, float]] | None) -> None:
    """model_rows: (index, request, the model drafter that proposes for it, its lookup's tokens to follow)."""
    engine = model_rows[0][2].engine
    rows, indices = [], {}
    for index, request, drafter, follow in model_rows:
        row = _own(drafter.start_row, request.context, request.num_tokens, request.sampler, request.rng,
                   request.min_confidence, follow)
        if isinstance(row, DraftRow):
            if row.logits is not None:
                row.logits = row.logits.copy()  # the next row's catch-up may overwrite it
            rows.append(row)
            indices[row] = index
        else:
            results[index] = row if isinstance(row, Exception) else ([], None)
    stepping = [row for row in rows if row.logits is None]
    while True:
        features = {row: _own(row.drafter.step_features) for row in stepping}
        failed = [(row, exc) for row, exc in features.items() if isinstance(exc, Exception)]
        for row, exc in failed:
            rows, stepping = _drop(rows, [row], exc, results, indices), [other for other in stepping if other is not row]
        if stepping:
            seconds = engine.seconds
            inputs = [features[row] for row in stepping]
            logits = _own(engine.run_batch, [row.pending for row in stepping], [row.drafter.cache for row in stepping],
                          inputs if inputs[0] is not None else None)
            if isinstance(logits, Exception):  # the pass's rows fail with it
                rows = _drop(rows, stepping, logits, results, indices)
            else:
                if steps is not None:
                    steps.append((len(stepping), engine.seconds - seconds))
                for row, row_logits in zip(stepping, logits):
                    row.logits = _own(row.drafter.widen, row_logits)
                    if isinstance(row.logits, Exception):
                        rows = _drop(rows, [row], row.logits, results, indices)
        stepping, failed = [], []
        for row in rows:
            if row.logits is not None:
                more = _own(row.choose)
                if isinstance(more, Exception):
                    failed.append((row, more))
                elif more:
                    stepping.append(row)
                row.logits = None
        for row, exc in failed:
            rows = _drop(rows, [row], exc, results, indices)
        if not stepping:
            break
    for row in rows:
        results[indices[row]] = row.result()


def _drop(rows: list[DraftRow], failed: list[DraftRow], exc: Exception, results: list, indices: dict) -> list[DraftRow]:
    """rows without `failed`, whose results are exc."""
    for row in failed:
        results[indices[row]] = exc
    return [row for row in rows if row not in failed]
