"""The worker's seam onto the runtime: add a sequence, step every live one, cancel one.

The worker (worker.py) drives a backend through four members and nothing else:

    capacity                       how many sequences may be live at once
    add(prompt_ids, options, cancelled, streaming) -> sequence
                                   a new sequence; `options` are GenerationConfig keyword arguments
                                   (`ignore_eos` among them); `cancelled()` turns true once its client
                                   has gone, and the runtime checks it between rounds and prefill chunks;
                                   `streaming`: whether anyone reads its text before it ends
    step() -> list[Update]         one iteration over the live sequences: what each produced; an
                                   update whose `ended` is true is that sequence's last
    cancel(sequence)               the sequence leaves before the next step

SequentialBackend puts today's runtime behind that seam: one sequence at a time, stepped one text
piece at a time through Generator.stream. A batching scheduler replaces it behind the same members.
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
    output: object | None = None  # the GenerationOutput, once the sequence has finished
    error: Exception | None = None  # the sequence failed (a SpecdeployError: the request's fault)
    cancelled: bool = False  # the sequence left because its cancelled() turned true

    @property
    def ended(self) -> bool:
        """The sequence is no longer live: the backend has let it go (no cancel() needed)."""
        return self.output is not None or self.error is not None or self.cancelled


class _Sequence:
    """One request on SequentialBackend: its Stream, started on its first step."""

    def __init__(self, prompt_ids: list[int], options: dict, cancelled: Callable[[], bool]):
        self.prompt_ids, self.options, self.cancelled = prompt_ids, options, cancelled
        self.stream = None


class SequentialBackend:
    """One sequence at a time over Generator.stream; each step runs the generate loop to its next text piece.

    Generator.stream returns at text pieces only, so cancellation is seen before the prefill and
    after each piece; a prefill and rounds whose text is held back (a possible stop string) run
    to their end. The pieces of one round come out together, after it: a piece's token count is
    the sequence's after that round."""

    capacity = 1

    def __init__(self, generator):
        self.generator = generator
        self._live: _Sequence | None = None

    def add(self, prompt_ids: list[int], options: dict, cancelled: Callable[[], bool],
            streaming: bool = True) -> _Sequence:
        """A sequence to step (its text is streamed either way: a stream is the runtime's only stepwise call)."""
        if self._live is not None:
            raise RuntimeError("SequentialBackend runs one sequence at a time")
        self._live = _Sequence(prompt_ids, options, cancelled)
        return self._live

    def cancel(self, sequence: _Sequence) -> None:
        if sequence.stream is not None:
            sequence.stream.close()  # ends the generation before its next round
        if self._live is sequence:
            self._live = None

    def step(self) -> list[Update]:
        sequence = self._live
        if sequence is None:
            return []
        if sequence.stream is None and sequence.cancelled():  # gone before its prefill: nothing runs
            self.cancel(sequence)
            return [Update(sequence, cancelled=True)]
        try:
            if sequence.stream is None:  # the runtime's refusal of a request (a prompt too long) raises here
                sequence.stream = self.generator.stream(sequence.prompt_ids, **sequence.options)
            piece = next(sequence.stream)
        except StopIteration:
            self._live = None
            output = sequence.stream.output
            return [Update(sequence, num_new_tokens=output.stats.new_tokens, output=output)]
        except Exception as exc:
            self.cancel(sequence)
            return [Update(sequence, error=exc)]
        count = len(sequence.stream.sequence.new_tokens)
        if sequence.cancelled():
            self.cancel(sequence)
            return [Update(sequence, text=piece, num_new_tokens=count, cancelled=True)]
        return [Update(sequence, text=piece, num_new_tokens=count)]
