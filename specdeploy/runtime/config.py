"""What a generation is asked to do (GenerationConfig), what it did (GenerationStats) and what it gave (GenerationOutput)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from ..errors import SpecdeployError
from .sampling import SamplingParams

MAX_DRAFT_TOKENS = 32
MAX_LOGPROBS = 20  # alternatives per position, as OpenAI's top_logprobs allows
SEED_LIMIT = 2**64  # seeds are 64-bit: 0 .. SEED_LIMIT - 1 (the CLI and the server take the same)
MIN_TEMPERATURE = 1e-6  # below this, logits / temperature can overflow float32
# Far past these, 1 / temperature (float32) rounds to 0, which means greedy, and a penalized logit overflows
# to +-inf; within them each row's arithmetic (penalty, then temperature) stays finite for logits up to 1e20.
MAX_TEMPERATURE = 1e6
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off; keeps tokens at least min_p times as likely as the most likely one
    repetition_penalty: float = 1.0  # 1.0: off; HF's: divides positive / multiplies negative logits of context tokens
    # OpenAI's, over the tokens generated so far (not the prompt, as vLLM counts): subtracted from a
    # token's logit once if it was generated (presence), and per time it was (frequency); -2..2, 0: off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = 0  # seeds the np.random.Generator every draw comes from
    num_draft_tokens: int = 4  # k: tokens the draft proposes per round
    speculative: bool = True  # False: target-only decoding, the baseline
    # Stop drafting early once the draft's top probability falls below this (0: always draft k).
    draft_confidence: float = 0.0
    stop: tuple[str, ...] = ()  # generation ends before the first of these strings
    # Generation also ends after any of these tokens, as after the bundle's EOS ids (a chat template's
    # end of turn: generate(messages=...) adds it).
    stop_token_ids: tuple[int, ...] = ()
    # Generate exactly max_new_tokens: EOS and stop tokens do not end it (vLLM's ignore_eos; stop
    # strings still do). For benchmarks that fix the output length.
    ignore_eos: bool = False
    # The target's log-probability of each new token (log-softmax of its raw logits, before any
    # sampling setting), with the `logprobs` most likely alternatives at each position (None: off;
    # 0: the chosen token's only). Every emitted token has its row in a verify or target pass.
    logprobs: int | None = None
    # The output held to one of these (constraint.py, through llguidance): a JSON schema (a dict or JSON
    # text), a regular expression, or a grammar (llguidance's Lark syntax, or llama.cpp's GBNF).
    json_schema: dict | str | None = field(default=None, hash=False, compare=True)
    regex: str | None = None
    grammar: str | None = None

    @property
    def constraint(self):
        """The ConstraintSpec of the fields above (None: unconstrained); more than one is refused."""
        from .constraint import spec_from_fields

        return spec_from_fields(self.json_schema, self.regex, self.grammar)

    def validate(self) -> None:
        self._check_types()
        _ = self.constraint  # one constraint at most, of the right type
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise SpecdeployError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}] "
                                  f"(got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise SpecdeployError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.min_p <= 1:
            raise SpecdeployError(f"min_p must be in [0, 1] (got {self.min_p})")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise SpecdeployError(f"repetition_penalty must be in [{low:g}, {high:g}] (got {self.repetition_penalty})")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise SpecdeployError(f"{name} must be in [-2, 2] (got {value})")
        if self.top_k < 0:
            raise SpecdeployError(f"top_k must be >= 0 (got {self.top_k})")
        if self.max_new_tokens < 0:
            raise SpecdeployError(f"max_new_tokens must be >= 0 (got {self.max_new_tokens})")
        if not 0 <= self.draft_confidence < 1:
            raise SpecdeployError(f"draft_confidence must be in [0, 1) (got {self.draft_confidence})")
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise SpecdeployError(f"num_draft_tokens must be in 1..{MAX_DRAFT_TOKENS} (got {self.num_draft_tokens})")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < SEED_LIMIT):
            raise SpecdeployError(f"seed must be an integer in 0..2**64 - 1 (got {self.seed!r})")
        if self.logprobs is not None and (type(self.logprobs) is not int or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SpecdeployError(f"logprobs must be an integer in 0..{MAX_LOGPROBS} (got {self.logprobs!r})")
        if not all(type(token) is int and token >= 0 for token in self.stop_token_ids):
            raise SpecdeployError(f"stop_token_ids must be token ids, integers >= 0 (got {self.stop_token_ids!r})")
        if "" in self.stop:  # it would stop before the first token, and no one means that
            raise SpecdeployError("stop strings must not be empty")

    def _check_types(self) -> None:
        """Each field of the type it is declared with (an integer, a number, a flag), before any range is compared."""
        for name in ("max_new_tokens", "top_k", "num_draft_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise SpecdeployError(f"{name} must be an integer (got {value!r})")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                     "draft_confidence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise SpecdeployError(f"{name} must be a number (got {value!r})")
        for name in ("speculative", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise SpecdeployError(f"{name} must be True or False (got {getattr(self, name)!r})")
        if not all(isinstance(text, str) for text in self.stop):
            raise SpecdeployError(f"stop must be a string or a list of strings (got {self.stop!r})")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=float(self.temperature), top_k=int(self.top_k), top_p=float(self.top_p),
                              min_p=float(self.min_p), repetition_penalty=float(self.repetition_penalty),
                              presence_penalty=float(self.presence_penalty),
                              frequency_penalty=float(self.frequency_penalty))


@dataclass
class GenerationStats:
    """What one generate call did; only the CLI prints it."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # target passes after the prefill (verify passes when speculative)
    drafted: int = 0
    draft_rounds: int = 0  # rounds that verified at least one draft token (the rest ran the target alone)
    accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [k]: rounds that kept draft position i
    drafted_by_position: list[int] = field(default_factory=list)  # [k]: rounds that drafted position i (at most draft_rounds)
    prefill_ms: float = 0.0
    draft_calls: int = 0  # draft forward passes during decode
    target_calls: int = 0
    draft_ms: float = 0.0  # inside the draft's ONNX Runtime calls, decode only
    target_ms: float = 0.0  # inside the target's ONNX Runtime calls, decode only
    other_ms: float = 0.0  # decode time outside both: sampling, acceptance, bookkeeping
    decode_ms: float = 0.0
    finish_reason: str = ""  # eos | length (max_new_tokens or the context limit) | stop | interrupted
    note: str = ""  # why generation ended, in words, when the reason alone does not say (the context limit)
    exact: bool = False  # the target ran exactly (load(exact=True)): greedy text independent of k and the batch
    forced_tokens: int = 0  # tokens a constraint left alone, appended without a pass choosing them

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens the run produced per round (target pass after the prefill): new_tokens / rounds. It equals
        (accepted + rounds) / rounds unless an EOS, a stop or the budget cut the last round's tokens short,
        which are not counted (bench's "tokens per round" is this, over all its runs)."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens over decode time (the prefill is reported separately)."""
        return self.new_tokens / (self.decode_ms / 1000) if self.decode_ms > 0 else 0.0

    def to_dict(self) -> dict:
        data = {k: v for k, v in self.__dict__.items()}
        data.update(acceptance_rate=self.acceptance_rate, mean_accepted_tokens=self.mean_accepted_tokens,
                    tokens_per_s=self.tokens_per_s)
        return data


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # the target's log-probability of token_id at its position
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens there, (id, logprob), most likely first


@dataclass(frozen=True)
class GenerationOutput:
    text: str
    token_ids: list[int]  # the new tokens only
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per new token when GenerationConfig.logprobs is set
