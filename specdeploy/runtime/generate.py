"""The generate loop's front: a Generator turns prompts into sequences and runs them on its scheduler.

A Sequence (sequence.py) owns everything one generation has; the Scheduler (scheduler.py) steps
every live sequence each iteration: draft -> verify -> accept per round, or plain target-only
decoding with the same sampling. `generate` and `stream` run one sequence, `generate_many`
several at once (batched when the generator has more than one KV slot, `max_batch`).

Invariant of each round: a sequence's context holds the prompt and every emitted token; the
target's cache holds all of it but the last token (the pending one). The draft proposes k tokens
after the context, the target runs once on [pending, x_1..x_k] (k + 1 positions) and the rejection
rule keeps num_accepted of them plus one recovered or bonus token. Rejected positions leave both
caches when the next round syncs them to the new context (truncate to the shared prefix).
"""

from __future__ import annotations

import numbers
import threading
from dataclasses import replace
from typing import Iterator

import numpy as np

from ..errors import SpecdeployError
from .chat import NO_TEMPLATE, ChatTemplate, check_messages
from .constraint import ConstraintCompiler
from .config import (MAX_DRAFT_TOKENS, MIN_TEMPERATURE, SEED_LIMIT, GenerationConfig, GenerationOutput,
                     GenerationStats, TokenLogprob)
from .drafters import Drafter
from .engine import OrtEngine
from .policy import SpeculationPolicy
from .scheduler import Scheduler
from .sequence import Sequence, Slot
from .text import TextCodec

__all__ = ["MAX_DRAFT_TOKENS", "MIN_TEMPERATURE", "SEED_LIMIT", "GenerationConfig", "GenerationOutput",
           "GenerationStats", "Generator", "Stream", "TokenLogprob"]

WARM_UP_PROMPT_TOKENS = 16  # the prefill Generator.warm_up runs: about a short prompt's length
CALIBRATION_PASSES = 3  # timed passes per shape when a batching generator measures its costs


class Stream:
    """The text pieces of one generation as they are accepted (an iterator); `output` once it has ended.

    Closing it early (or leaving the loop) ends the generation with finish reason "interrupted"."""

    def __init__(self, pieces: Iterator[str], sequence: Sequence):
        self._pieces = pieces
        self.sequence = sequence

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()

    @property
    def output(self) -> GenerationOutput | None:
        """What the generation gave (None while it runs)."""
        return self.sequence.output() if self.sequence.finished else None


def _listed(value, name: str, what: str) -> tuple:
    """A list option as a tuple (None: empty); anything else, a falsy 0 or False included, is refused."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise SpecdeployError(f"{name} must be {what} (got {value!r:.60})")
    return tuple(value)


class Generator:
    """A target (and a drafter) with their KV slots and a scheduler; `generate`, `stream` and
    `generate_many` run sequences on it. One thread drives a generator.

    max_batch: KV slots, the sequences that decode together (1: one at a time, each slot's caches
    kept between calls so that a repeated prefix is reused). Sequences share passes on fused graphs
    on the CPU (OrtEngine.new_slots); elsewhere they take turns, pass by pass."""

    def __init__(self, target: OrtEngine, drafter: Drafter | None, codec: TextCodec, max_context: int,
                 eos_token_ids: tuple[int, ...], manifest=None, chat_template: ChatTemplate | None = None,
                 max_batch: int = 1, policy: str = "auto"):
        if max_batch < 1:
            raise SpecdeployError(f"max_batch must be >= 1 (got {max_batch})")
        self.manifest = manifest  # the bundle's Manifest, when loaded from one
        self.chat_template = chat_template  # the tokenizer's, for generate(messages=...); None: it has none
        self._end_of_turn_ids: tuple[int, ...] | None = None  # found on first use (see end_of_turn_ids)
        self.target = target
        self.codec = codec
        self.max_context = max_context
        self.max_batch = max_batch
        self.eos_token_ids = frozenset(eos_token_ids)
        self.slots = self._make_slots(target, drafter, max_context, max_batch)
        self.target_cache = self.slots[0].target_cache
        self.drafter = self.slots[0].drafter
        self.scheduler = Scheduler(target, self.slots, SpeculationPolicy(policy))
        self._compiler, self._compiler_lock = None, threading.Lock()  # constraints' (made on first use)

    @property
    def exact(self) -> bool:
        """Whether the target runs exactly (load(exact=True), OrtEngine): greedy output is then the same
        token for token whatever k, the drafter and the batch, and a seed gives one sample."""
        return self.target.exact

    @staticmethod
    def _make_slots(target, drafter, max_context: int, max_batch: int) -> list[Slot]:
        """max_batch slots; their caches are rows of one KVSlots per model where the engine can batch
        (fused graphs on the CPU), else caches of their own, which run_batch runs one by one."""
        if max_batch == 1:
            cache = target.new_cache(max_context)
            return [Slot(0, cache, drafter.with_target(cache) if drafter is not None else None)]

        def caches(engine) -> list:
            pool = engine.new_slots(max_batch, max_context)
            return pool.caches if pool is not None else [engine.new_cache(max_context) for _ in range(max_batch)]

        target_caches = caches(target)
        engine = drafter.engine if drafter is not None else None
        draft_caches = caches(engine) if engine is not None else [None] * max_batch
        return [Slot(i, target_caches[i], drafter.for_cache(draft_caches[i], target_caches[i]) if drafter is not None
                     else None) for i in range(max_batch)]

    def reset(self) -> None:
        """Forget the cached prefixes (the next call prefills from scratch, as a fresh process would)."""
        for slot in self.slots:
            slot.target_cache.reset()
            if slot.drafter is not None:
                slot.drafter.reset()

    def warm_up(self) -> None:
        """Run once each kind of pass a first request runs, then forget them (the caches empty, no output kept).

        ONNX Runtime's first run of a session, and of each set of input shapes, costs several times a
        later one (allocations, memory patterns, threads waking). Warming runs a short prefill, target
        steps (target-only decoding), draft steps and verify passes of the default k (speculative
        decoding, greedy and sampled), so a first request runs as fast as the ones after it. A
        generator whose speculation policy chooses draft lengths (batching, or a lone greedy row of an
        exact or rounded target: SpeculationPolicy) also times its passes for it (calibrate)."""
        vocab, k = self.target.spec.vocab_size, GenerationConfig.num_draft_tokens
        new_tokens = 2 * (k + 1)
        length = max(1, min(WARM_UP_PROMPT_TOKENS, self.max_context - new_tokens - 1))  # a context of 2 takes 1
        prompt = [(1 + 31 * i) % vocab for i in range(length)]  # any ids: the numbers are thrown away
        self.generate(prompt, max_new_tokens=2, speculative=False)
        if self.drafter is not None:
            self.generate(prompt, max_new_tokens=new_tokens, num_draft_tokens=k)
            self.generate(prompt, max_new_tokens=k + 1, num_draft_tokens=k, temperature=1.0)
        policy = self.scheduler.policy
        k = min(k, self.max_context - length - 1)  # a short context times the passes it can run
        if k >= 1 and (self.max_batch > 1 or (policy.mode == "auto" and policy.choose_alone and self.drafter is not None)):
            self.calibrate(prompt, k)
        self.reset()

    def calibrate(self, prompt: list[int], num_draft_tokens: int) -> None:
        """Time a batched target step and a batched draft step at every batch size, a verify pass of
        every length up to num_draft_tokens + 1 and a packed pass (packed.py) of each length a round can
        take, into the speculation policy's tables."""
        import time

        k = num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise SpecdeployError(f"num_draft_tokens must be an integer in 1..{MAX_DRAFT_TOKENS} (got {k!r})")
        prompt = self.prompt_ids(prompt)  # text or ids, checked as a request's
        if self.scheduler.active:  # it times passes in every slot's caches
            live = len(self.scheduler.waiting) + len(self.scheduler.running)
            raise SpecdeployError(f"calibrate would overwrite the KV caches of the {live} sequence(s) generating now: "
                                  "finish or close their streams first")
        if len(prompt) + k + 1 > self.max_context:
            raise SpecdeployError(f"a calibration prompt of {len(prompt)} tokens leaves no room for {k + 1} more")
        policy, target = self.scheduler.policy, self.target
        caches = [slot.target_cache for slot in self.slots]
        for cache in caches:
            target.prefill(prompt, cache)

        def timed(run) -> float:
            run()  # the first run of a shape is not typical
            start = time.perf_counter()
            for _ in range(CALIBRATION_PASSES):
                run()
            return (time.perf_counter() - start) * 1000 / CALIBRATION_PASSES

        length = len(prompt)
        for rows in range(1, self.max_batch + 1):
            policy.target_ms[rows] = timed(lambda: _step_back(target, caches[:rows], length))
        for tokens in range(2, num_draft_tokens + 2):
            policy.verify_ms[tokens] = timed(lambda: _verify_back(target, caches[0], prompt, tokens))
        single = 1 if policy.single_packed else 2  # target-only rows of one token each join packed passes
        for size in policy.packed_sizes:
            table = policy.packed_ms.setdefault(size, {})
            for tokens in range(single, num_draft_tokens + 2):  # filed under the pass's tokens, as rounds file it
                table[size * tokens] = timed(lambda: _packed_back(target, caches[:size], prompt, tokens))
        engine = self.drafter.engine if self.drafter is not None else None
        if engine is None:
            return
        models = [getattr(slot.drafter, "model_drafter", slot.drafter) for slot in self.slots]
        for model in models:
            model.prefill(prompt)  # an eagle head reads the target's features of the prompt, prefilled above
        for rows in range(1, self.max_batch + 1):
            policy.draft_ms[rows] = timed(lambda: _draft_step_back(models[:rows]))

    def _config(self, kwargs) -> GenerationConfig:
        stop = kwargs.pop("stop", None)
        stop = _listed(stop if not isinstance(stop, str) else (stop,), "stop", "a string or a list of strings")
        stop_token_ids = _listed(kwargs.pop("stop_token_ids", None), "stop_token_ids", "a list of token ids")
        try:
            config = GenerationConfig(stop=stop, stop_token_ids=stop_token_ids, **kwargs)
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
            raise SpecdeployError(f"this bundle's tokenizer has no chat template ({NO_TEMPLATE}): "
                                  "pass a prompt instead of messages")
        text = self.chat_template.render(check_messages(messages))
        return self.codec.encode(text, add_special_tokens=False)

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The chat template's end-of-turn token: generate(messages=...) stops there as at EOS. The first
        special token the template writes after a reply, else its first added token that is not blank (a
        turn marker the tokenizer added without flagging it special); () without a template or either."""
        if self._end_of_turn_ids is None:
            ids: tuple[int, ...] = ()
            tail = self.chat_template.end_of_turn_text() if self.chat_template is not None else ""
            if tail:
                written = self.codec.encode(tail, add_special_tokens=False)
                for kind in (self.codec.added_token_ids(), self.codec.added_token_ids(special=False)):
                    ids = ids or tuple(t for t in written if t in kind)[:1]
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

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids (text encoded with the tokenizer's special tokens), checked as a request
        checks them: ids in the vocabulary, fewer than max_context of them (SpecdeployError otherwise)."""
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt)
        else:
            sequence = isinstance(prompt, (list, tuple)) or isinstance(prompt, np.ndarray) and prompt.ndim == 1
            ids = list(prompt) if sequence else None
            if ids is None or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
                raise SpecdeployError(f"a prompt is text or a list of token ids (got {type(prompt).__name__} {prompt!r:.60})")
            ids = [int(t) for t in ids] or self.codec.encode("")
        vocab = self.codec.spec.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise SpecdeployError(f"prompt token ids must be in 0..{vocab - 1}")
        if len(ids) >= self.max_context:
            raise SpecdeployError(
                f"the prompt has {len(ids)} tokens; the bundle's max context is {self.max_context} (including new tokens)"
            )
        return ids

    def new_sequence(self, prompt: str | list[int], *, streaming: bool = True, cancelled=None, **kwargs) -> Sequence:
        """A sequence for self.scheduler to run (submit it there), with generate's arguments; a server's
        worker steps the scheduler itself and reads each sequence's pieces and output. cancelled: a
        callable that turns true once nobody wants the sequence (its client went away); the scheduler
        asks it once per step and ends the sequence ("cancelled") before it runs again."""
        sequence = self._sequence(prompt, self._config(kwargs), streaming)
        sequence.cancelled = cancelled
        return sequence

    def _sequence(self, prompt, config: GenerationConfig, streaming: bool) -> Sequence:
        spec = config.constraint
        sequence = Sequence(self.prompt_ids(prompt), config, self.codec, self.eos_token_ids, self.max_context,
                            self.target.spec.vocab_size, streaming=streaming,
                            constraint=None if spec is None else self.constraint_compiler().constraint(spec))
        sequence.stats.exact = self.exact
        return sequence

    def check_constraint(self, options: dict) -> None:
        """Compile the constraint among generate's options (if any) against this bundle's tokenizer: a
        SpecdeployError where the constraint library refuses it (a server checks before it queues a request)."""
        spec = self._config(dict(options)).constraint
        if spec is not None:
            self.constraint_compiler().constraint(spec)

    def constraint_compiler(self) -> ConstraintCompiler:
        """The bundle's tokenizer as the constraint library reads it, ending where a generation ends (EOS, the
        chat template's end of turn)."""
        with self._compiler_lock:
            if self._compiler is None:
                ends = self.eos_token_ids | set(self.end_of_turn_ids)
                self._compiler = ConstraintCompiler(self.codec.tokenizer.to_str(), self.target.spec.vocab_size, ends)
            return self._compiler

    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               **kwargs) -> Stream:
        """Text pieces as tokens are accepted (a Stream; its `output` once it ends); same arguments as generate."""
        prompt, config = self._request(prompt, messages, kwargs)
        sequence = self._sequence(prompt, config, streaming=True)
        return Stream(self._pieces(sequence), sequence)

    def _pieces(self, sequence: Sequence) -> Iterator[str]:
        self.scheduler.submit(sequence)
        try:
            while True:  # pieces first: another caller's steps may have added some while this one yielded
                pieces = sequence.take_pieces()
                if pieces:
                    yield from pieces
                elif sequence.finished:
                    break
                else:
                    self.scheduler.step()
        except BaseException as exc:  # Ctrl-C or a stream closed early (keep what came out), or an error: free the slot
            self.scheduler.cancel(sequence, _reason(exc))
            raise
        if sequence.error is not None:
            raise sequence.error

    def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 **kwargs) -> GenerationOutput:
        """Generate from a prompt (text or token ids), or from messages ([{"role", "content"}, ...], rendered
        by the tokenizer's chat template; the reply ends at its end of turn). See GenerationConfig for
        the other arguments."""
        prompt, config = self._request(prompt, messages, kwargs)
        return self._run_all([self._sequence(prompt, config, streaming=False)])[0]

    def generate_many(self, prompts: list, *, seeds: list[int | None] | None = None, **kwargs) -> list[GenerationOutput]:
        """Generate from several prompts (texts or id lists) with the same settings, decoding up to
        max_batch of them together; outputs in the prompts' order. Each is an exact sample of what
        generate gives it alone; on an exact generator greedy text is the same token for token, and
        a seed gives the same sample (scheduler.py). seeds: one per prompt (default: the seed
        argument for every prompt)."""
        config = self._config(dict(kwargs))
        if not isinstance(prompts, (list, tuple)) or (seeds is not None and not isinstance(seeds, (list, tuple))):
            raise SpecdeployError("prompts and seeds must be lists (one seed per prompt)")
        if seeds is not None and len(seeds) != len(prompts):
            raise SpecdeployError(f"seeds must give one seed per prompt ({len(prompts)}), got {len(seeds)}")
        configs = [config] if seeds is None else [replace(config, seed=seed) for seed in seeds]
        for each in configs:
            each.validate()
        return self._run_all([self._sequence(prompt, configs[i % len(configs)], streaming=False)
                              for i, prompt in enumerate(prompts)])

    def _run_all(self, sequences: list[Sequence]) -> list[GenerationOutput]:
        for sequence in sequences:
            self.scheduler.submit(sequence)
        try:
            for sequence in sequences:
                while not sequence.finished:
                    self.scheduler.step()
        except BaseException as exc:  # Ctrl-C, or an error out of a step: none of them keeps its slot
            for sequence in sequences:
                self.scheduler.cancel(sequence, _reason(exc))
            raise
        for sequence in sequences:
            if sequence.error is not None:
                raise sequence.error
        return [sequence.output() for sequence in sequences]


def _reason(exc: BaseException) -> str:
    return "interrupted" if isinstance(exc, (KeyboardInterrupt, GeneratorExit)) else "error"


def _step_back(engine: OrtEngine, caches: list, length: int) -> None:
    """One batched step over caches, then each back to `length` (calibration)."""
    engine.run_batch([1] * len(caches), caches)
    for cache in caches:
        cache.truncate(length)


def _packed_back(engine: OrtEngine, caches: list, prompt: list[int], tokens: int) -> None:
    """One packed pass of `tokens` after the prompt in every cache, then each back (calibration)."""
    engine.run_packed([prompt[-tokens:]] * len(caches), caches)
    for cache in caches:
        cache.truncate(len(prompt))


def _verify_back(engine: OrtEngine, cache, prompt: list[int], tokens: int) -> None:
    engine.run(prompt[-tokens:], cache)
    cache.truncate(len(prompt))


def _draft_step_back(drafters: list) -> None:
    """One batched draft step after each drafter's prefilled context, then each back (calibration)."""
    caches = [drafter.cache for drafter in drafters]
    lengths = [cache.length for cache in caches]
    features = [drafter.step_features() for drafter in drafters]
    drafters[0].engine.run_batch([1] * len(caches), caches, features if features[0] is not None else None)
    for cache, length in zip(caches, lengths):
        cache.truncate(length)
