"""The worker's seam onto the runtime: add a sequence, step every live one, cancel one.

The worker (worker.py) drives a backend through five members and nothing else:

    capacity                       how many sequences may be live at once
    add(prompt_ids, options, cancelled, streaming) -> sequence
                                   a new sequence; `options` are GenerationConfig keyword arguments
                                   (`ignore_eos` among them); `cancelled()` turns true once its client
                                   has gone, and the scheduler asks it once a step (so between rounds
                                   and prefill chunks), waiting or running;
                                   `streaming`: whether anyone reads its text before it ends
    step() -> list[Update]         one iteration over the live sequences: what each produced (text,
                                   and the new tokens' logprobs when asked for); an update whose
                                   `ended` is true is that sequence's last
    cancel(sequence)               the sequence leaves before the next step
    admitted_at(sequences)         when the first of them took a KV slot (None: all still wait)

SchedulerBackend puts the runtime's scheduler behind that seam: the scheduler's queue is the one
queue (a sequence waits there for a KV slot), every live sequence decodes in each step (batched up
to the generator's max_batch), and a sequence's text comes out as its rounds produce it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Update:
    """What one step did for one sequence."""

    sequence: object  # the handle add() returned
    text: str = ""  # text now safe to show ("" while a round's text is held back)
    num_new_tokens: int | None = None  # tokens generated so far (None: this backend cannot say)
    # The TokenLogprobs of the tokens generated since the sequence's previous update (logprobs asked
    # for); they may run ahead of `text`, which can hold back a piece that is not yet safe to show.
    logprobs: tuple = ()
    output: object | None = None  # the GenerationOutput, once the sequence has finished
    error: Exception | None = None  # the sequence failed (a SpecdeployError: the request's fault)
    cancelled: bool = False  # the sequence left because its cancelled() turned true

    @property
    def ended(self) -> bool:
        """The sequence is no longer live: the backend has let it go (no cancel() needed)."""
        return self.output is not None or self.error is not None or self.cancelled


class _Live:
    """One sequence on SchedulerBackend: the runtime Sequence, how many of its logprobs earlier updates
    carried, and whether an update has told of its first tokens."""

    __slots__ = ("sequence", "delivered", "started")

    def __init__(self, sequence):
        self.sequence, self.delivered, self.started = sequence, 0, False

    def new_logprobs(self, count: int) -> tuple:
        """The logprobs of tokens delivered..count (the runtime's list may hold a round's tokens past an EOS)."""
        logprobs = self.sequence.logprobs
        if logprobs is None:
            return ()
        new, self.delivered = tuple(logprobs[self.delivered : count]), count
        return new


class SchedulerBackend:
    """The generator's scheduler: each step is one of its steps (a prefill chunk or a round for every
    live sequence). Its scheduler sees cancellation between steps, so between prefill chunks and
    between rounds."""

    def __init__(self, generator):
        self.generator = generator
        self.scheduler = generator.scheduler
        self.capacity = len(self.scheduler.slots)
        self._live: list[_Live] = []

    def add(self, prompt_ids: list[int], options: dict, cancelled: Callable[[], bool],
            streaming: bool = True) -> _Live:
        """A new sequence (a request the runtime refuses, such as a prompt too long, raises here)."""
        live = _Live(self.generator.new_sequence(prompt_ids, streaming=streaming, cancelled=cancelled, **options))
        self.scheduler.submit(live.sequence)
        self._live.append(live)
        return live

    def admitted_at(self, handles: list) -> float | None:
        times = [live.sequence.admitted_at for live in handles if live is not None and live.sequence.admitted_at is not None]
        return min(times) if times else None

    def cancel(self, live: _Live) -> None:
        self.scheduler.cancel(live.sequence)
        if live in self._live:
            self._live.remove(live)

    def step(self) -> list[Update]:
        updates = []
        if self.scheduler.active:
            self.scheduler.step()
        for live in list(self._live):
            try:
                update = self._update(live)
            except Exception as exc:  # this sequence's own text, logprobs or output: it fails alone
                self.cancel(live)
                update = Update(live, error=exc)
            if update is not None:
                updates.append(update)
        return updates

    def _update(self, live: _Live) -> Update | None:
        sequence = live.sequence
        text = "".join(sequence.take_pieces())
        count = len(sequence.new_tokens)
        update = None
        if sequence.finished:
            if sequence.finish_reason == "cancelled":
                update = Update(live, num_new_tokens=count, cancelled=True)
            elif sequence.error is not None:
                update = Update(live, text, count, error=sequence.error)
            else:
                update = Update(live, text, count, live.new_logprobs(count), output=sequence.output())
            self._live.remove(live)
        elif text:
            update = Update(live, text, count, live.new_logprobs(count))
        elif count and not live.started:  # its first tokens, none shown yet (not streamed, or held back)
            update = Update(live, num_new_tokens=count)
        live.started = live.started or count > 0
        return update
