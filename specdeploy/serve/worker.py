"""The model worker: one thread owns the Generator and runs requests one after another from a bounded queue.

Generation never runs on the event loop, so /health and /metrics answer during a long request.
Each request is a Job; the worker hands its events to the job's asyncio queue from its thread:
("piece", text) while streaming, then ("done", Finished) or ("error", ApiError). A cancelled job
(its client went away) leaves the queue at once, or, when running, stops at its next text piece:
closing the stream ends the generate loop before its next round.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..errors import SpecdeployError
from .metrics import Metrics
from .protocol import ApiError

log = logging.getLogger("specdeploy.serve")
LATENCY_SMOOTHING = 0.2  # weight of the newest request in the running mean behind Retry-After


@dataclass(frozen=True)
class Finished:
    output: object  # the GenerationOutput
    queue_s: float  # arrival -> the model took it
    first_token_s: float  # arrival -> the first text piece
    latency_s: float  # arrival -> the last token


class Job:
    """One request's prompt and options, and the channel its results come back on."""

    def __init__(self, prompt: str | list[int], options: dict, streaming: bool):
        self.prompt, self.options, self.streaming = prompt, options, streaming
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.arrived = time.perf_counter()

    def post(self, kind: str, value) -> None:
        """From the worker thread: put one event on the job's queue."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass


class ModelWorker:
    """Loads the model in its thread, then serves jobs in arrival order; at most `max_queue` wait."""

    def __init__(self, load: Callable[[], object], max_queue: int, metrics: Metrics,
                 on_fatal: Callable[[str], None] | None = None):
        self._load, self.max_queue, self.metrics, self._on_fatal = load, max_queue, metrics, on_fatal
        self.generator = None
        self.state = "loading"  # loading | ready | failed | stopped
        self.error: str | None = None
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._mean_latency_s = 1.0
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._main, name="specdeploy-model", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise ApiError: 503 while loading or stopped, 429 (with Retry-After) when full."""
        with self._condition:
            if self.state != "ready":
                raise ApiError(503, f"the model is {self.state}", kind="server_error", code="model_not_ready")
            if len(self._waiting) >= self.max_queue and (self._running is not None or self._waiting):
                retry_after = max(1, math.ceil(self._mean_latency_s * (len(self._waiting) + 1)))
                raise ApiError(429, f"the server is busy: {len(self._waiting)} requests are waiting; retry later",
                               kind="requests", code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})
            self._waiting.append(job)
            self.metrics.waiting.set(len(self._waiting))
            self._condition.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job from the queue, or stop it at its next piece."""
        job.cancelled.set()
        with self._condition:
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.waiting.set(len(self._waiting))
                self.metrics.finished.labels("abort").inc()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel what is left and wait (up to timeout_s) for the thread to end."""
        with self._condition:
            self.state = "stopped" if self.state != "failed" else self.state
            for job in list(self._waiting) + ([self._running] if self._running else []):
                job.cancelled.set()
            self._waiting.clear()
            self.metrics.waiting.set(0)
            self._condition.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _main(self) -> None:
        started = time.perf_counter()
        try:
            self.generator = self._load()
        except Exception as exc:  # a bundle that will not load: the server cannot serve
            with self._condition:
                self.state, self.error = "failed", str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.error("the model did not load: %s", self.error)
            if self._on_fatal is not None:
                self._on_fatal(self.error)
            return
        with self._condition:
            if self.state == "loading":
                self.state = "ready"
        log.info("model ready in %.1fs", time.perf_counter() - started)
        while True:
            with self._condition:
                while not self._waiting and self.state == "ready":
                    self._condition.wait()
                if self.state != "ready":
                    return
                job = self._running = self._waiting.popleft()
                self.metrics.waiting.set(len(self._waiting))
            self.metrics.running.set(1)
            try:
                self._serve(job)
            finally:
                with self._condition:
                    self._running = None
                self.metrics.running.set(0)

    def _serve(self, job: Job) -> None:
        started = time.perf_counter()
        first = None
        try:
            pieces = self.generator.stream(job.prompt, **job.options)
            try:
                for piece in pieces:
                    first = first or time.perf_counter()
                    if job.streaming:
                        job.post("piece", piece)
                    if job.cancelled.is_set():
                        break
            finally:
                pieces.close()  # stops the generate loop before its next round
        except SpecdeployError as exc:
            job.post("error", ApiError(400, str(exc)))
            return
        except Exception as exc:  # a bug or a runtime failure: answer 500, keep serving
            log.exception("generation failed")
            job.post("error", ApiError(500, f"generation failed: {exc}", kind="server_error"))
            return
        if job.cancelled.is_set():
            self.metrics.finished.labels("abort").inc()
            return
        ended = time.perf_counter()
        output = self.generator.last_output
        done = Finished(output=output, queue_s=started - job.arrived, first_token_s=(first or ended) - job.arrived,
                        latency_s=ended - job.arrived)
        self._observe(done)
        job.post("done", done)

    def _observe(self, done: Finished) -> None:
        stats = done.output.stats
        self.metrics.observe_output(stats, finish_reason(stats.finish_reason))
        self.metrics.queue_time.observe(done.queue_s)
        self.metrics.time_to_first_token.observe(done.first_token_s)
        self.metrics.e2e_latency.observe(done.latency_s)
        service_s = done.latency_s - done.queue_s
        self._mean_latency_s += LATENCY_SMOOTHING * (service_s - self._mean_latency_s)


def finish_reason(reason: str) -> str:
    """The runtime's finish reason in OpenAI's words: eos/stop -> "stop", length/context -> "length"."""
    return "stop" if reason in ("eos", "stop") else "length"
