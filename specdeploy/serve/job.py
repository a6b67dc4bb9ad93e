"""A request as the model worker serves it: a Job of n choices, the channel its events come back on, and
what each choice gives (Finished, Piece).

The worker (worker.py) posts a job's events from its thread onto the job's asyncio queue: while
streaming, ("piece", Piece) and ("choice", Finished) as each choice ends, then one terminal event,
("done", the choices' Finished in index order) or ("error", ApiError). `end` posts the terminal
event once, whichever thread gets there first.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from .protocol import ApiError


@dataclass(frozen=True)
class Finished:
    """One choice, once it has ended."""

    index: int  # the choice's index, 0..n-1
    output: object  # the GenerationOutput
    queue_s: float  # arrival -> the model took the request
    first_token_s: float  # arrival -> this choice's first text piece (not streamed: its first tokens)
    latency_s: float  # arrival -> this choice's last token


@dataclass(frozen=True)
class Piece:
    index: int  # the choice it belongs to
    text: str
    num_new_tokens: int | None  # tokens generated so far, this piece's included (None: the backend cannot say)
    logprobs: tuple = ()  # TokenLogprobs of the tokens generated since the choice's previous piece


class Job:
    """One request's prompt and its choices' options, and the channel its results come back on."""

    def __init__(self, prompt_ids: list[int], choices: list[dict], streaming: bool):
        self.prompt_ids, self.choices, self.streaming = prompt_ids, choices, streaming  # choices: options each
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.arrived = time.perf_counter()
        self.started: float | None = None  # the model took it
        self.first_text: list[float | None] = [None] * len(choices)
        self.sequences: list = []  # the backend's handles, by choice (None once the backend let it go)
        self.finished: list[Finished | None] = [None] * len(choices)
        self._ended = False
        self._end_lock = threading.Lock()

    @property
    def n(self) -> int:
        return len(self.choices)

    @property
    def slots(self) -> int:
        """The sequences it has or will have in the backend: its n choices less those that have ended."""
        return self.n - sum(handle is None for handle in self.sequences)

    @property
    def live(self) -> bool:
        """Some choice of it is live in the backend."""
        return any(handle is not None for handle in self.sequences)

    def unfinished(self) -> int:
        return sum(done is None for done in self.finished)

    @property
    def ended(self) -> bool:
        return self._ended

    def post(self, kind: str, value) -> None:
        """From any thread but the loop's: put one event on the job's queue."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    def end(self, kind: str, value) -> int | None:
        """Post the terminal event ("done" or "error") unless one was posted already (None then); returns the
        choices it ends unfinished, counted under the lock that finish() takes, so that each choice ends once."""
        with self._end_lock:
            if self._ended:
                return None
            self._ended = True
            unfinished = self.unfinished()
        self.post(kind, value)
        return unfinished

    def finish(self, done: Finished) -> bool:
        """Record one choice's end, unless the job has ended already (shutdown answered it): False then."""
        with self._end_lock:
            if self._ended:
                return False
            self.finished[done.index] = done
            return True


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", kind="server_error", code="shutting_down")


def gone() -> ApiError:
    """The terminal event of a job whose client went away (nobody reads it; it marks the job answered)."""
    return ApiError(499, "the client closed the connection", code="client_closed_request")


def finish_reason(reason: str) -> str:
    """The runtime's finish reason in OpenAI's words: eos/stop -> "stop", length -> "length"."""
    return "stop" if reason in ("eos", "stop") else "length"
