"""The generate loop: draft -> verify -> accept, or plain target-only decoding with the same sampling.

Invariant of each round: `context` holds the prompt and every emitted token; the target's cache
holds all of it but the last token (the pending one). The draft proposes k tokens after the
context, the target runs once on [pending, x_1..x_k] (k + 1 positions) and the rejection rule
keeps num_accepted of them plus one recovered or bonus token. Rejected positions leave both
caches when the next round syncs them to the new context (truncate to the shared prefix).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np

from ..errors import SpecdeployError
from .chat import ChatTemplate, check_messages
from .drafters import Drafter
from .engine import OrtEngine
from .rejection import accept
from .sampling import BlockGenerator, Sampler, SamplingParams
from .text import TextCodec, TextStream

MAX_DRAFT_TOKENS = 32
SEED_LIMIT = 2**64  # seeds are 64-bit: 0 .. SEED_LIMIT - 1 (the CLI and the server take the same)
MIN_TEMPERATURE = 1e-6  # below this, logits / temperature can overflow float32
WARM_UP_PROMPT_TOKENS = 16  # the prefill Generator.warm_up runs: about a short prompt's length


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off; keeps tokens at least min_p times as likely as the most likely one
    repetition_penalty: float = 1.0  # 1.0: off; HF's: divides positive / multiplies negative logits of context tokens
    seed: int | None = 0  # seeds the np.random.Generator every draw comes from
    num_draft_tokens: int = 4  # k: tokens the draft proposes per round
    speculative: bool = True  # False: target-only decoding, the baseline
    # Stop drafting early once the draft's top probability falls below this (0: always draft k).
    draft_confidence: float = 0.0
    stop: tuple[str, ...] = ()  # generation ends before the first of these strings
    # Generation also ends after any of these tokens, as after the bundle's EOS ids (a chat template's
    # end of turn: generate(messages=...) adds it).
    stop_token_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < float("inf")):
            raise SpecdeployError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise SpecdeployError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.min_p <= 1:
            raise SpecdeployError(f"min_p must be in [0, 1] (got {self.min_p})")
        if not 0 < self.repetition_penalty < float("inf"):
            raise SpecdeployError(f"repetition_penalty must be a positive finite number (got {self.repetition_penalty})")
        if self.top_k < 0:
            raise SpecdeployError(f"top_k must be >= 0 (got {self.top_k})")
        if self.max_new_tokens < 0:
            raise SpecdeployError(f"max_new_tokens must be >= 0 (got {self.max_new_tokens})")
        if not 0 <= self.draft_confidence < 1:
            raise SpecdeployError(f"draft_confidence must be in [0, 1) (got {self.draft_confidence})")
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise SpecdeployError(f"num_draft_tokens must be in 1..{MAX_DRAFT_TOKENS} (got {self.num_draft_tokens})")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < SEED_LIMIT):
            raise SpecdeployError(f"seed must be None or an integer in 0..2**64 - 1 (got {self.seed!r})")
        if not all(type(token) is int and token >= 0 for token in self.stop_token_ids):
            raise SpecdeployError(f"stop_token_ids must be token ids, integers >= 0 (got {self.stop_token_ids!r})")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=float(self.temperature), top_k=int(self.top_k), top_p=float(self.top_p),
                              min_p=float(self.min_p), repetition_penalty=float(self.repetition_penalty))


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
    prefill_ms: float = 0.0
    draft_calls: int = 0  # draft forward passes during decode
    target_calls: int = 0
    draft_ms: float = 0.0  # inside the draft's ONNX Runtime calls, decode only
    target_ms: float = 0.0  # inside the target's ONNX Runtime calls, decode only
    other_ms: float = 0.0  # decode time outside both: sampling, acceptance, bookkeeping
    decode_ms: float = 0.0
    finish_reason: str = ""  # eos | length (max_new_tokens or the context limit) | stop | interrupted
    note: str = ""  # why generation ended, in words, when the reason alone does not say (the context limit)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per target pass, the corrected/bonus token included: (accepted + rounds) / rounds."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

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
class GenerationOutput:
    text: str
    token_ids: list[int]  # the new tokens only
    stats: GenerationStats


class Generator:
    """A target (and a drafter) with their caches; `generate` and `stream` run the loop."""

    def __init__(self, target: OrtEngine, drafter: Drafter | None, codec: TextCodec, max_context: int,
                 eos_token_ids: tuple[int, ...], manifest=None, chat_template: ChatTemplate | None = None):
        self.manifest = manifest  # the bundle's Manifest, when loaded from one
        self.chat_template = chat_template  # the tokenizer's, for generate(messages=...); None: it has none
        self._end_of_turn_ids: tuple[int, ...] | None = None  # found on first use (see end_of_turn_ids)
        self.last_output: GenerationOutput | None = None  # set when a generate or stream call ends
        self.target = target
        self.target_cache = target.new_cache(max_context)  # kept between calls: a repeated prefix is reused
        self.drafter = drafter
        self.codec = codec
        self.max_context = max_context
        self.eos_token_ids = frozenset(eos_token_ids)

    def reset(self) -> None:
        """Forget the cached prefixes (the next call prefills from scratch, as a fresh process would)."""
        self.target_cache.reset()
        if self.drafter is not None:
            self.drafter.reset()

    def warm_up(self) -> None:
        """Run once each kind of pass a first request runs, then forget them (the caches empty, no output kept).

        ONNX Runtime's first run of a session, and of each set of input shapes, costs several times a
        later one (allocations, memory patterns, threads waking). Warming runs a short prefill, target
        steps (target-only decoding), draft steps and verify passes of the default k (speculative
        decoding, greedy and sampled), so a first request runs as fast as the ones after it."""
        vocab, k = self.target.spec.vocab_size, GenerationConfig.num_draft_tokens
        new_tokens = 2 * (k + 1)
        length = max(2, min(WARM_UP_PROMPT_TOKENS, self.max_context - new_tokens - 1))
        prompt = [(1 + 31 * i) % vocab for i in range(length)]  # any ids: the numbers are thrown away
        self.generate(prompt, max_new_tokens=2, speculative=False)
        if self.drafter is not None:
            self.generate(prompt, max_new_tokens=new_tokens, num_draft_tokens=k)
            self.generate(prompt, max_new_tokens=k + 1, num_draft_tokens=k, temperature=1.0)
        self.reset()
        self.last_output = None

    def _config(self, kwargs) -> GenerationConfig:
        stop = kwargs.pop("stop", None)
        if isinstance(stop, str):
            stop = (stop,)
        stop_token_ids = kwargs.pop("stop_token_ids", None)
        try:
            config = GenerationConfig(stop=tuple(stop or ()), stop_token_ids=tuple(stop_token_ids or ()), **kwargs)
        except TypeError as exc:
            raise SpecdeployError(str(exc)) from None
        config.validate()
        if config.speculative and self.drafter is None:
            raise SpecdeployError("this generator has no drafter; pass speculative=False")
        vocab = self.codec.spec.vocab_size
        if any(token >= vocab for token in config.stop_token_ids):
            raise SpecdeployError(f"stop_token_ids must be in 0..{vocab - 1}")
        return config

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A conversation's prompt ids: the tokenizer's chat template rendered with add_generation_prompt
        (as transformers' apply_chat_template renders it), tokenized without added special tokens."""
        if self.chat_template is None:
            raise SpecdeployError("this bundle's tokenizer has no chat template (no chat_template.jinja, and "
                                  "tokenizer_config.json names none): pass a prompt instead of messages")
        text = self.chat_template.render(check_messages(messages))
        return self.codec.encode(text, add_special_tokens=False)

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The chat template's end-of-turn token (() without a template, or when it writes no special token
        after a reply): generate(messages=...) stops there as at EOS."""
        if self._end_of_turn_ids is None:
            ids: tuple[int, ...] = ()
            tail = self.chat_template.end_of_turn_text() if self.chat_template is not None else ""
            if tail:
                special = self.codec.special_token_ids()
                ids = tuple(t for t in self.codec.encode(tail, add_special_tokens=False) if t in special)[:1]
            self._end_of_turn_ids = ids
        return self._end_of_turn_ids

    def _request(self, prompt, messages, kwargs) -> tuple[str | list[int], GenerationConfig]:
        """The prompt (text or ids) and config of one call: a prompt, or messages through the chat template."""
        if (prompt is None) == (messages is None):
            raise SpecdeployError("pass a prompt or messages (one of them)")
        config = self._config(kwargs)
        if messages is None:
            return prompt, config
        ids = self.encode_chat(messages)
        extra = tuple(t for t in self.end_of_turn_ids if t not in config.stop_token_ids)
        return ids, replace(config, stop_token_ids=config.stop_token_ids + extra)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt)
        else:
            ids = [int(t) for t in prompt] or self.codec.encode("")
        vocab = self.codec.spec.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise SpecdeployError(f"prompt token ids must be in 0..{vocab - 1}")
        if len(ids) >= self.max_context:
            raise SpecdeployError(
                f"the prompt has {len(ids)} tokens; the bundle's max context is {self.max_context} (including new tokens)"
            )
        return ids

    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               **kwargs) -> Iterator[str]:
        """Yield text pieces as tokens are accepted; same arguments as generate."""
        prompt, config = self._request(prompt, messages, kwargs)
        run = self._run(prompt, config, streaming=True)
        try:
            for item in run:
                if isinstance(item, str):
                    yield item
        finally:
            run.close()  # a stream closed early still sets last_output (finish_reason "interrupted")

    def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 **kwargs) -> GenerationOutput:
        """Generate from a prompt (text or token ids), or from messages ([{"role", "content"}, ...], rendered
        by the tokenizer's chat template; the reply ends at its end of turn). See GenerationConfig for
        the other arguments."""
        prompt, config = self._request(prompt, messages, kwargs)
        for _ in self._run(prompt, config, streaming=False):
            pass
        return self.last_output

    def _run(self, prompt, config: GenerationConfig, streaming: bool) -> Iterator[str]:
        prompt_ids = self._prompt_ids(prompt)
        stats = GenerationStats(prompt_tokens=len(prompt_ids),
                                accepted_by_position=[0] * (config.num_draft_tokens if config.speculative else 0))
        # Text is decoded token by token only when someone reads it that way (streaming or stop strings).
        text = TextStream(self.codec, config.stop) if streaming or config.stop else None
        budget = min(config.max_new_tokens, self.max_context - len(prompt_ids))
        new_tokens: list[int] = []
        finish, stopped_by = "length", None
        end_ids = self.eos_token_ids.union(config.stop_token_ids) if config.stop_token_ids else self.eos_token_ids
        rounds = self._rounds(prompt_ids, budget, config, stats)
        try:
            for round_tokens in rounds:
                for token in round_tokens:
                    new_tokens.append(token)
                    if token in end_ids:
                        finish = "eos"
                        break
                    if text is not None:
                        piece = text.push(token)
                        if piece and streaming:
                            yield piece
                        if text.stopped:
                            finish = "stop"
                            break
                else:
                    continue
                break
        except (KeyboardInterrupt, GeneratorExit) as exc:  # Ctrl-C, or a stream closed early: keep what came out
            finish, stopped_by = "interrupted", exc
        finally:
            rounds.close()  # settles the timing stats now, not when garbage-collected
        if text is not None:
            piece = text.finish()
            if piece and streaming and stopped_by is None:
                yield piece
            output_text = text.text
        else:
            output_text = self.codec.decode(new_tokens)
        stats.new_tokens = len(new_tokens)
        stats.finish_reason = finish
        if finish == "length" and budget < config.max_new_tokens:
            stats.note = f"stopped at the bundle's max context of {self.max_context} tokens (prompt {len(prompt_ids)} + {budget} new)"
        self.last_output = GenerationOutput(text=output_text, token_ids=new_tokens, stats=stats)
        if isinstance(stopped_by, KeyboardInterrupt):
            raise stopped_by

    def _rounds(self, prompt_ids: list[int], budget: int, config: GenerationConfig,
                stats: GenerationStats) -> Iterator[list[int]]:
        """Yield the tokens of each round until `budget` tokens are out (the caller may stop earlier)."""
        rng = BlockGenerator(config.seed)  # default_rng(seed)'s numbers, cheaper to take
        drafter = self.drafter if config.speculative else None
        engines = [self.target] + ([drafter.engine] if drafter is not None and drafter.engine is not None else [])
        target, target_cache = self.target, self.target_cache
        context = list(prompt_ids)
        # The target's distributions of a round, written in place ([k + 1, vocab]; unused when greedy).
        vocab = target.spec.vocab_size
        sampler = Sampler(config.sampling, vocab)  # every row of this call is processed through it
        greedy = sampler.greedy
        target_probs = None if greedy else np.empty((config.num_draft_tokens + 1, vocab), dtype=np.float32)

        start = time.perf_counter()
        target.prefill(context[:-1], target_cache)
        if drafter is not None:
            drafter.prefill(context[:-1])
        stats.prefill_ms = (time.perf_counter() - start) * 1000

        engine_start = [(e.seconds, e.calls) for e in engines]
        decode_start = time.perf_counter()
        generated = rounds = drafted = 0
        k, draft_confidence = config.num_draft_tokens, config.draft_confidence
        ended_at = [0] * (k + 1)  # [i]: rounds that accepted exactly i draft tokens (stats, counted at the end)
        try:
            while generated < budget:
                room = self.max_context - len(context)  # the verify pass adds k + 1 positions to len(context) - 1
                num_draft = min(k, budget - generated - 1, room) if drafter else 0
                sampler.sync(context)  # the repetition penalty's context (nothing to do without one)
                drafts, draft_probs = (drafter.propose(context, num_draft, sampler, rng, draft_confidence)
                                       if num_draft > 0 else ([], None))
                if drafts:
                    pending = target_cache.truncate_to_prefix(context, min_rest=1)  # [context[-1]]: the cache holds the rest
                    logits = target.run(pending + drafts, target_cache)[-(len(drafts) + 1):]  # [k+1, vocab]
                    num_accepted, token = accept(sampler, drafts, draft_probs, logits, rng, target_probs)
                    drafted += len(drafts)
                    ended_at[num_accepted] += 1
                    new = drafts[:num_accepted] + [token]
                else:
                    logits = target.logits_after(context, target_cache)  # [vocab]
                    token = sampler.argmax(logits) if greedy else sampler.sample(logits, rng.random(), target_probs[0])
                    new = [token]
                rounds += 1
                context.extend(new)
                generated += len(new)
                yield new
        finally:
            stats.decode_ms = (time.perf_counter() - decode_start) * 1000
            stats.rounds, stats.drafted, stats.draft_rounds = rounds, drafted, sum(ended_at)
            stats.accepted = sum(count * accepted for accepted, count in enumerate(ended_at))
            if config.speculative:
                stats.accepted_by_position = [sum(ended_at[position + 1 :]) for position in range(k)]
            spent = [(e.seconds - s) * 1000 for e, (s, _) in zip(engines, engine_start)]
            calls = [e.calls - c for e, (_, c) in zip(engines, engine_start)]
            stats.target_ms, stats.target_calls = spent[0], calls[0]
            if len(spent) > 1:
                stats.draft_ms, stats.draft_calls = spent[1], calls[1]
            stats.other_ms = max(0.0, stats.decode_ms - sum(spent))
