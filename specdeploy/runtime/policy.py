"""The speculation policy: how many draft tokens a batched round proposes, and whether its target passes
share one packed pass, from costs measured as the rounds run (see SpeculationPolicy)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecdeployError
from .packed import packed_size
from .sequence import Sequence
from .step import PassCost

POLICIES = ("auto", "always", "never")
# Rounds the auto policy lets pass target-only before one round of a single draft token: rows that
# never draft never measure their acceptance, and a stale estimate would keep them target-only for good.
PROBE_EVERY = 16


@dataclass(frozen=True)
class PassChoice:
    """The cheapest target passes for a round (SpeculationPolicy.choose_passes)."""

    cost: float  # ms, as measured (0: nothing measured yet)
    together: bool  # every row in one packed pass
    verify_shared: bool  # else: the verify rows in one packed pass (False: a pass each)
    plain_shared: bool  # and the target-only rows in one packed pass (False: one batched step)


class SpeculationPolicy:
    """How many draft tokens the rows of a round may propose (0: target-only), from measured costs.

    The rule (after SmartSpec, Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large
    Language Models Using Goodput"): for a batch of B rows whose acceptance rates are a_i, a
    round of k draft tokens emits sum_i (1 - a_i^(k+1)) / (1 - a_i) tokens in about
    min(B * verify_ms[k + 1], packed_ms[R][B * (k + 1) + R - B]) + k * draft_ms[B] (a verify pass per
    row, or one pass of the smallest packed graph of R >= B rows, packed.py, whose cost is filed under the
    tokens it runs, a filler token per idle row included; and k batched draft steps), and a
    target-only round emits B tokens in target_ms[B] (one batched pass; an exact target's rows, whose
    single tokens never run alone, in packed_ms[R][R] where that is less). Each kind of round also
    costs its time outside the engines until the next round (sampling, acceptance, bookkeeping,
    and a server's detokenizing and streaming: outside_ms, measured as rounds run), which a
    target-only round pays per token and a speculative round shares among the tokens it emits;
    with a small model it decides. The k in 0..K with the most tokens per
    millisecond wins. Engine costs come from `calibrate` (passes timed at load) and are refreshed
    as rounds run; a row's acceptance is its own running mean, starting from the
    scheduler's. After PROBE_EVERY target-only rounds in a row, one round drafts a single token,
    so that the estimates follow the text. A lone row on an exact or a rounded target
    (choose_alone) takes the choice too (a sampled one only where the target is not exact): on an exact target (OrtEngine's `exact`) any k, 0 included,
    since its passes of every length give each token the same bits; otherwise a k of 1 or more, since
    passes of two tokens or more agree bit for bit whatever their length where a one-token pass does
    not, so that its text is the same run after run. A
    sampled row's random numbers depend on its draft lengths: on an exact target it keeps its request's
    k, so that a seed gives one sample whatever the batch (draft_lengths leaves it its k); on a target
    that is not exact it takes the choice as a greedy row does, each round still an exact sample of the
    target's distribution as its verify pass computes it. "always" speculates with each request's k,
    "never" never does."""

    def __init__(self, mode: str = "auto"):
        if mode not in POLICIES:
            raise SpecdeployError(f"unknown speculation policy {mode!r} (choose from {', '.join(POLICIES)})")
        self.mode = mode
        self.target_ms: dict[int, float] = {}  # rows -> one batched target step
        self.draft_ms: dict[int, float] = {}  # rows -> one batched draft step
        self.verify_ms: dict[int, float] = {}  # tokens -> one verify pass of one row
        # graph rows -> tokens in the pass (filler tokens included) -> one pass of that packed graph (packed.py)
        self.packed_ms: dict[int, dict[int, float]] = {}
        self.packed_sizes: list[int] = []  # the target's packed graphs (none: it runs a pass per row)
        # Target-only rows join packed passes: an exact target, whose single tokens never run alone, has packed
        # graphs with a spare attention row (packed.py), where its batched step would run a pass per row.
        self.single_packed = False
        # The target is exact (OrtEngine): every pass computes each token with the same bits, so a lone row may
        # run target-only rounds too; the policy chooses for greedy rows only.
        self.exact = False
        # A lone row takes the policy's k (else its request's): on an exact or a rounded (fp16, quantized)
        # target, where it pays (a weak draft at k = 1); on an fp32 one it measured below a fixed k = 4.
        self.choose_alone = False
        # round kind ("target", "speculative") -> rows -> one round's time outside the engines
        self.outside_ms: dict[str, dict[int, float]] = {"target": {}, "speculative": {}}
        self.acceptance = 0.6  # the running mean over every round, a new row's starting estimate
        self.target_rounds = 0  # target-only rounds the auto policy chose since it last let rows draft

    def draft_lengths(self, rows: list[Sequence]) -> tuple[list[int], int]:
        """Each row's draft tokens this round (0: a target-only step), and how many rows want drafts: its request's k within its budget and
        context (Sequence.num_draft_tokens), limited by the policy where the policy may choose. It limits
        greedy rows; a sampled row's random numbers depend on its draft lengths, so on an exact target it
        keeps its request's k and a seed gives one sample; on a target that is not exact the policy
        limits sampled rows too. ("never" still means never.)"""
        wanted, limited, greedy = [], [], []
        for row in rows:
            k = row.num_draft_tokens()
            wanted.append(k)
            if k > 0:
                limited.append(row)
                if row.sampler.greedy:
                    greedy.append(row)
        speculative = len(limited)
        if self.mode == "never":
            return [0] * len(rows), speculative
        if self.exact:
            limited = greedy
        if not limited:
            return wanted, speculative
        limit = self.draft_limit(limited, max(wanted))
        return [row.num_draft_tokens(limit) if k > 0 and (not self.exact or row.sampler.greedy) else k
                for row, k in zip(rows, wanted)], speculative

    def draft_limit(self, rows: list[Sequence], max_k: int) -> int:
        if self.mode != "auto" or max_k == 0:
            return max_k if self.mode != "never" else 0
        count = len(rows)
        if count == 1 and not self.choose_alone:
            return max_k
        # Alone and not exact: no target-only round, whose one-token pass rounds unlike a verify pass; passes of
        # two tokens or more agree bit for bit at every length, so the k chosen never changes the text.
        least = 1 if count == 1 and not self.exact else 0
        target = self.choose_passes(0, count, 1).cost  # a target-only round's passes
        if target <= 0:  # nothing measured yet
            return max_k
        best_k, best_rate = 0, count / (target + (_nearest(self.outside_ms["target"], count) or 0.0))
        if least:
            best_rate = 0.0
        outside = _nearest(self.outside_ms["speculative"], count) or 0.0
        for k in range(1, max_k + 1):
            # no draft step measured: a drafter without a model (prompt lookup), or one not timed yet
            verify, draft = _nearest(self.verify_ms, k + 1), _nearest(self.draft_ms, count) or 0.0
            if verify is None:
                return max_k
            passes = self.choose_passes(count, 0, k + 1).cost
            if passes + k * draft + outside <= 0:  # nothing measured yet
                return max_k
            tokens = sum(_row_tokens(row, k, self.acceptance) for row in rows)
            rate = tokens / (passes + k * draft + outside)
            if rate > best_rate:
                best_k, best_rate = k, rate
        self.target_rounds = 0 if best_k else self.target_rounds + 1
        if self.target_rounds > PROBE_EVERY:
            self.target_rounds = 0
            return 1
        return best_k

    def choose_passes(self, verify_rows: int, plain_rows: int, tokens: int) -> PassChoice:
        """The cheapest target passes for a round of verify rows (`tokens` each, the longest) and plain rows
        (target-only, one token each). A packed pass runs each row's own tokens, one after another; apart,
        the verify rows take one packed pass or a pass each, and the plain rows one packed pass (a target
        whose single tokens join them, single_packed) or one batched step. A packed pass not measured yet
        is taken, at the cost of the passes it replaces."""
        packed = bool(self.packed_sizes)
        joined = packed and verify_rows + plain_rows > 1 and (self.single_packed or not plain_rows)  # one pass can hold them
        together = self.packed_cost(verify_rows + plain_rows, verify_rows * tokens + plain_rows) if joined else None
        verify = verify_rows * (_nearest(self.verify_ms, tokens) or 0.0)
        verify_shared = packed and verify_rows > 1
        if verify_shared:
            shared = self.packed_cost(verify_rows, verify_rows * tokens)
            verify_shared = shared is None or shared < verify
            verify = verify if shared is None else min(shared, verify)
        plain = (_nearest(self.target_ms, plain_rows) or 0.0) if plain_rows else 0.0
        plain_shared = packed and self.single_packed and plain_rows > 1
        if plain_shared:
            shared = self.packed_cost(plain_rows, plain_rows)
            plain_shared = shared is None or not plain or shared < plain
            plain = plain if shared is None else min(shared, plain or shared)
        apart = verify + plain
        if joined and (together is None or together < apart):
            return PassChoice(apart if together is None else together, True, False, False)
        return PassChoice(apart, False, verify_shared, plain_shared)

    def packed_size(self, count: int) -> int | None:
        """The packed graph a pass of `count` rows runs (None: no graph)."""
        return packed_size(self.packed_sizes, count)

    def packed_cost(self, count: int, tokens: int) -> float | None:
        """One packed pass of `count` rows of `tokens` in all, as measured (None: not yet)."""
        size = self.packed_size(count)
        return _nearest(self.packed_ms.get(size, {}), tokens + size - count) if size is not None else None

    def observe(self, table: dict[int, float], size: int, ms: float) -> None:
        """Fold a timed pass into the cost table (a running mean that follows the machine's load)."""
        old = table.get(size)
        table[size] = ms if old is None else 0.8 * old + 0.2 * ms

    def observe_pass(self, cost: PassCost) -> None:
        """Fold one timed pass (the runner's) into its table."""
        if cost.kind == "target":
            self.observe(self.target_ms, cost.rows, cost.ms)
        elif cost.kind == "draft":
            self.observe(self.draft_ms, cost.rows, cost.ms)
        elif cost.kind == "verify":
            self.observe(self.verify_ms, cost.tokens, cost.ms)
        else:
            self.observe(self.packed_ms.setdefault(cost.rows, {}), cost.tokens, cost.ms)

    def observe_round(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            self.acceptance = 0.95 * self.acceptance + 0.05 * (num_accepted / num_drafted)


def _nearest(table: dict[int, float], size: int) -> float | None:
    if not table:
        return None
    if size in table:
        return table[size]
    key = min(table, key=lambda known: (abs(known - size), -known))
    return table[key] * size / key if key < size else table[key]


def _acceptance(row: Sequence, prior: float) -> float:
    drafted, ended_at = row.stats.drafted, row.ended_at
    accepted = sum(count * accepted for accepted, count in enumerate(ended_at))
    # A row's own rate once it has drafted a few tokens; the scheduler's before.
    return (accepted + 8 * prior) / (drafted + 8)


def _row_tokens(row: Sequence, k: int, prior: float) -> float:
    """Tokens a round of k drafts is expected to emit for this row: 1 + sum over j <= k of the chance that
    its first j drafts are kept, each draft's chance given the ones before it kept from the row's own
    rounds (blended with its acceptance while they are few). Acceptance comes in runs (a repeated span,
    a predictable stretch of code), so the i.i.d. formula undercounts; and a position no round has
    tested yet (drafts longer than the row has proposed) takes the row's acceptance."""
    rate = _acceptance(row, prior)
    expected, survive = 1.0, 1.0
    for position in range(1, k + 1):
        reached = row.reached[position] if position < len(row.reached) else 0
        kept = row.kept[position] if position < len(row.kept) else 0
        survive *= (kept + 8 * rate) / (reached + 8)
        expected += survive
    return expected
