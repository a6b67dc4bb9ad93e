"""Constrained decoding: output held to a JSON schema, a regular expression or a grammar.

llguidance (the library llama.cpp and vLLM use; it imports neither torch nor transformers, which the
runtime never loads) compiles the constraint and gives, at each position, the tokens that keep the text
a prefix of the constrained language. Every row a sampler forms (a draft step, a verify row, a
target-only step) has the other tokens set to -inf before any sampling setting, so the draft's and the
target's distributions are both the masked, renormalized ones and the accept rule (rejection.py) runs
on them unchanged: the output is an exact sample of the constrained target distribution, and greedy
output equals constrained target-only output token for token.

A round reads the mask after the context and the drafts before each row (`disallowed(extras)`): the
matcher consumes the drafts tentatively and keeps each depth's mask, so a verify row reuses the mask
its draft step computed. `commit(tokens)` rolls the tentative tokens back and consumes what the round
emitted. Where the constraint leaves one token only, that token has probability 1 under the
constrained target: `forced()` gives such a run, which the sequence appends without a pass (the next
pass computes their cache entries, as it does a round's pending token).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..errors import SpecdeployError

KINDS = ("json_schema", "regex", "grammar")
COMPILED_KEPT = 64  # constraints kept compiled (a server sees the same schema again and again)
# Whitespace a JSON output may hold between two of its tokens: enough to indent it (a newline and 31
# spaces), and bounded, so that a model cannot pad an object forever (llguidance's default is unbounded).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"


@dataclass(frozen=True)
class ConstraintSpec:
    """What the output must match: a JSON schema (JSON text), a regular expression, or a grammar in
    llguidance's Lark syntax (a `start:` rule) or llama.cpp's GBNF (converted by llguidance)."""

    kind: str  # json_schema | regex | grammar
    text: str

    def grammar(self) -> str:
        """The constraint as llguidance's grammar text."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except ValueError as exc:
                raise SpecdeployError(f"json_schema is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise SpecdeployError(f"json_schema must be a JSON object (got {type(schema).__name__})")
            return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        try:
            lark = any_to_lark(self.text)  # llama.cpp's GBNF becomes Lark; Lark stays as it is
        except Exception as exc:  # noqa: BLE001 - the converter raises several types for a grammar it cannot read
            raise SpecdeployError(f"grammar: not Lark, and not GBNF either: {str(exc).splitlines()[0]}") from None
        return LLMatcher.grammar_from_lark(lark)


def spec_from_fields(json_schema, regex, grammar) -> ConstraintSpec | None:
    """The one constraint among GenerationConfig's three fields (None: unconstrained); more than one is refused."""
    given = {kind: value for kind, value in zip(KINDS, (json_schema, regex, grammar)) if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise SpecdeployError(f"one constraint at a time: got {' and '.join(given)}")
    kind, value = next(iter(given.items()))
    if kind == "json_schema" and isinstance(value, dict):
        value = json.dumps(value)
    if not isinstance(value, str) or not value:
        raise SpecdeployError(f"{kind} must be a non-empty string{' or a dict' if kind == 'json_schema' else ''} "
                              f"(got {value!r})")
    return ConstraintSpec(kind, value)


class ConstraintCompiler:
    """The bundle's tokenizer as llguidance reads it (made once, on the first constrained request: about
    0.2 s for 49k tokens, 0.8 s for 152k) and the constraints compiled against it: the last COMPILED_KEPT
    are kept as untouched matchers, and a sequence gets a copy (9 us against 1.4 ms for a 30-field schema
    compiled afresh), so a server's check on the prompt thread compiles once for the model thread too."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids):
        self.tokenizer_json, self.vocab_size, self.eos_token_ids = tokenizer_json, vocab_size, sorted(eos_token_ids)
        self._tokenizer = None
        self._compiled: OrderedDict[ConstraintSpec, object] = OrderedDict()
        self._lock = threading.Lock()  # the server's prompt threads and its model thread share this compiler

    def llg_tokenizer(self):
        """The llguidance.LLTokenizer of the bundle's tokenizer (made on first use)."""
        if self._tokenizer is None:
            try:
                import llguidance
            except ImportError:
                raise SpecdeployError("constrained output needs llguidance, a dependency of specdeploy: "
                                      "pip install 'llguidance>=1.9,<2'") from None
            self._tokenizer = llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_ids or None)
        return self._tokenizer

    def constraint(self, spec: ConstraintSpec) -> "Constraint":
        """A new matcher of spec at the start of the output; a constraint llguidance cannot compile is refused."""
        with self._lock:
            prototype = self._compiled.get(spec)
            if prototype is not None:
                self._compiled.move_to_end(spec)
                return Constraint(prototype.deep_copy(), self.vocab_size, self.eos_token_ids)
        prototype = self._compile(spec)
        with self._lock:
            self._compiled[spec] = prototype
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
            return Constraint(prototype.deep_copy(), self.vocab_size, self.eos_token_ids)

    def _compile(self, spec: ConstraintSpec):
        from llguidance import LLMatcher

        tokenizer = self.llg_tokenizer()
        grammar = spec.grammar()
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise SpecdeployError(f"{spec.kind}: {error.splitlines()[0]}")
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise SpecdeployError(f"{spec.kind}: {matcher.get_error().splitlines()[0]}")
        return matcher


class Constraint:
    """One sequence's matcher: the masks of a round by depth, and the tokens it has emitted."""

    def __init__(self, matcher, vocab_size: int, end_ids):
        from llguidance.numpy import allocate_token_bitmask

        self.matcher, self.vocab_size = matcher, vocab_size
        self.ended = False  # it consumed an end token: it takes nothing more
        # End tokens are never consumed tentatively: a generation ends at one, and a matcher rolled back
        # over one does not return to where it was.
        self.end_ids = frozenset(end_ids)
        self._bitmask = allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32
        self._ahead: list[int] = []  # drafts consumed tentatively after the emitted tokens
        self._masks: list[np.ndarray] = []  # [depth]: disallowed [vocab] bool after the emitted tokens + _ahead[:depth]
        self._row = np.empty(vocab_size, dtype=np.float32)  # [vocab] the masked row `apply` returns

    def _mask_here(self) -> np.ndarray:
        """Disallowed tokens [vocab] in the matcher's present state."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size]
        return bits == 0

    def disallowed(self, extras) -> np.ndarray | None:
        """Disallowed tokens [vocab] bool after the emitted tokens and extras; None where an extra token was
        itself disallowed (a row no accepted draft reaches) or ends the generation (a row whose token is
        never kept)."""
        extras = list(extras)
        common = 0
        while common < min(len(extras), len(self._ahead)) and extras[common] == self._ahead[common]:
            common += 1
        if common < len(self._ahead):
            self.matcher.rollback(len(self._ahead) - common)
            del self._ahead[common:], self._masks[common + 1 :]
        if not self._masks:
            self._masks.append(self._mask_here())
        for token in extras[common:]:
            if not 0 <= token < self.vocab_size or self._masks[-1][token] or token in self.end_ids:
                return None
            if not self.matcher.consume_token(token):  # allowed, yet refused: the row is treated as unreachable
                return None
            self._ahead.append(token)
            self._masks.append(self._mask_here())
        return self._masks[len(extras)]

    def apply(self, logits: np.ndarray, extras=()) -> np.ndarray:
        """logits [vocab] with the disallowed tokens at -inf, in a row the next call reuses (logits are left as
        they are: logprobs read the raw rows)."""
        np.copyto(self._row, logits, casting="unsafe")
        self._mask(self._row, extras)
        return self._row

    def apply_rows(self, logits: np.ndarray, drafts: list[int]) -> np.ndarray:
        """Rows [k + 1, vocab] of a verify pass, row i masked after drafts[:i] (a fresh array); a row past a
        disallowed draft is left as it is (the scan stops before it)."""
        rows = np.array(logits, dtype=np.float32)
        for i in range(len(rows)):
            if not self._mask(rows[i], drafts[:i]):
                break
        return rows

    def _mask(self, row: np.ndarray, extras) -> bool:
        """row [vocab] with the tokens disallowed after extras at -inf, in place; False where the row is one
        no kept draft reaches (left as it is)."""
        disallowed = self.disallowed(extras)
        if disallowed is not None:
            row[disallowed] = -np.inf
        return disallowed is not None

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, in order, the constraint allows after the emitted tokens."""
        for count, token in enumerate(tokens):
            disallowed = self.disallowed(tokens[:count])
            if disallowed is None or not 0 <= token < self.vocab_size or disallowed[token]:
                return count
        return len(tokens)

    def commit(self, tokens: list[int]) -> int:
        """The round emitted tokens (each one the constraint allowed): the matcher moves past them, up to the
        end token that completes the constraint; returns how many it took (the rest are dropped)."""
        if self._ahead:
            self.matcher.rollback(len(self._ahead))
        self._ahead, self._masks = [], []
        for count, token in enumerate(tokens):
            if self.matcher.is_stopped() and token not in self.end_ids:
                return count
            if not self.matcher.consume_token(token):
                raise SpecdeployError(f"the constraint refused token {token} it had allowed: "
                                      f"{self.matcher.get_error().splitlines()[0]}")
            if token in self.end_ids:
                self.ended = True
                return count + 1
        return len(tokens)

    def forced(self) -> int | None:
        """The one token the constraint allows next, or None where it allows several (or none)."""
        allowed = np.flatnonzero(~self.disallowed(()))
        return int(allowed[0]) if len(allowed) == 1 else None

    @property
    def done(self) -> bool:
        """The constraint is complete: only an end token may follow (or one did: see `ended`)."""
        return self.matcher.is_stopped()
