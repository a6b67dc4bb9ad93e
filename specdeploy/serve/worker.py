"""The model worker: one thread owns the model and steps its backend; requests wait in a bounded queue.

Generation never runs on the event loop, so /health and /metrics answer during a long request.
Each request is a Job (job.py) of n choices, one backend sequence each (n > 1: one prompt, n
seeds). The worker hands every job that arrives to the backend at its next step, where the
scheduler's queue holds its sequences until KV slots free (the one queue and the one admission);
`max_queue` bounds the jobs that wait there or here. It posts each job's events from its thread.

Every job gets its terminal event, whatever happens:
- an exception while serving it (the runtime's, or the worker's own bookkeeping: metrics, timings)
  fails that job, 400 when the request was at fault and 500 otherwise, and the loop goes on; one
  choice failing fails its job, whose other choices leave the backend;
- an exception that escapes the loop all the same ends the worker: its state turns "crashed" (/health
  answers 503 with the reason), and every job it held or that arrives later gets an error;
- stop() (shutdown) answers every job left, queued or running, with a 503.
A cancelled job (its client went away) leaves the worker's queue at once; once handed to the
backend, the scheduler ends its sequences at its next step (it asks each sequence's `cancelled()`
once a step), and the job is answered from their updates.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Callable

from ..errors import SpecdeployError
from .backend import SchedulerBackend, Update
from .job import Finished, Job, Piece, finish_reason, gone, shutting_down
from .metrics import Metrics
from .protocol import ApiError

log = logging.getLogger("specdeploy.serve")
LATENCY_SMOOTHING = 0.2  # weight of the newest request in the running mean behind Retry-After


class ModelWorker:
    """Loads the model in its thread, then serves jobs in arrival order; at most `max_queue` wait.

    backend: builds the worker's backend from the loaded generator (see backend.py)."""

    def __init__(self, load: Callable[[], object], max_queue: int, metrics: Metrics,
                 on_fatal: Callable[[str], None] | None = None, backend: Callable[[object], object] = SchedulerBackend):
        self._load, self.max_queue, self.metrics, self._on_fatal = load, max_queue, metrics, on_fatal
        self._make_backend = backend
        self.generator = None
        self.backend = None
        self.state = "loading"  # loading | ready | failed (did not load) | crashed (the worker died) | stopped
        self.error: str | None = None
        self._waiting: deque[Job] = deque()
        self._live: list[Job] = []
        self._mean_latency_s = 1.0
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._main, name="specdeploy-model", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_loaded(self, timeout_s: float | None = None) -> bool:
        """Wait (up to timeout_s) until the model has loaded or failed to, or the worker stopped; whether it
        is ready. For a host that submits jobs itself: submit() refuses them until then."""
        with self._condition:
            self._condition.wait_for(lambda: self.state != "loading", timeout_s)
            return self.state == "ready"

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait (up to timeout_s) until the worker's thread has ended, after stop(), a crash or a failed load:
        every job it held answered and its gauges final. Whether it has."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def unavailable(self) -> ApiError | None:
        """The 503 to answer while the worker takes no requests; None once it does."""
        state = self.state
        if state == "ready":
            return None
        if state == "crashed":
            return ApiError(503, self.error, kind="server_error", code="model_crashed")
        if state == "stopped":
            return shutting_down()
        return ApiError(503, f"the model is {state}", kind="server_error", code="model_not_ready")

    def submit(self, job: Job) -> None:
        """Queue a job, or raise ApiError: 503 unless ready, 429 (with Retry-After) when the queue is full."""
        with self._condition:
            refusal = self.unavailable()
            if refusal is not None:
                raise refusal
            capacity = self.backend.capacity
            if self._queued(job) > self.max_queue:
                waiting = self._waiting_jobs()
                retry_after = max(1, math.ceil(self._mean_latency_s * (waiting + 1) / capacity))
                raise ApiError(429, f"the server is busy: {waiting} waiting for a slot (--max-queue {self.max_queue}); "
                                    "retry later",
                               kind="requests", code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})
            self._waiting.append(job)
            self.metrics.waiting.set(self._waiting_jobs())
            self._condition.notify()

    def _queued(self, job: Job) -> int:
        """With `job` added: the waiting jobs that would not start at the next admission (max_queue bounds them).
        A job waits until the scheduler gives one of its sequences a KV slot."""
        started = [live for live in self._live if live.started is not None]
        free = self.backend.capacity - sum(live.slots for live in started)
        queued = 0
        for waiting in [*(live for live in self._live if live.started is None), *self._waiting, job]:
            if queued == 0 and (waiting.n <= free or free == self.backend.capacity):
                free -= waiting.n
            else:  # in arrival order: once one waits, every later one does
                queued += 1
        return queued

    def _waiting_jobs(self) -> int:
        """Jobs no sequence of which has a KV slot yet: those the worker holds and those the scheduler queues."""
        return len(self._waiting) + sum(live.started is None for live in self._live)

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job from the queue, or let it leave the backend before the next step."""
        job.cancelled.set()
        with self._condition:
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.waiting.set(self._waiting_jobs())
                self._count_ended("abort", job.end("error", gone()))

    def fail(self, job: Job, error: ApiError) -> None:
        """The server failed the job outside the worker (a chunk it could not format): answered with error, its
        unfinished choices counted as errors; it leaves the backend as a cancelled job does."""
        self._count_ended("error", job.end("error", error))
        self.cancel(job)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Answer every job left, queued or running, with 503; wait (up to timeout_s) for the thread to end."""
        with self._condition:
            if self.state in ("loading", "ready"):
                self.state = "stopped"
            jobs = list(self._waiting) + list(self._live)
            self._waiting.clear()
            self._condition.notify_all()
        for job in jobs:  # answered before it is marked cancelled: the worker then finds it ended, not abandoned
            self._count_ended("abort", job.end("error", shutting_down()))
            job.cancelled.set()
        self.metrics.waiting.set(0)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _main(self) -> None:
        if not self._load_model():
            return
        try:
            self._loop()
        except BaseException as exc:  # the loop itself failed: say so instead of leaving jobs waiting
            self._crash(exc)
        finally:
            with self._condition:
                live, self._live = self._live, []
            for job in live:
                self._release(job)
            try:
                self._count()  # nothing decodes now, nothing waits
            except Exception:
                log.exception("updating the gauges failed")

    def _load_model(self) -> bool:
        started = time.perf_counter()
        try:
            self.generator = self._load()
            self.generator.end_of_turn_ids  # found once here, not by the threads that read it per request
            self.backend = self._make_backend(self.generator)
        except BaseException as exc:  # a bundle that will not load (or a loader that exits): the server cannot serve
            with self._condition:
                self.state, self.error = "failed", str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                self._condition.notify_all()
            log.error("the model did not load: %s", self.error)
            if self._on_fatal is not None:
                self._on_fatal(self.error)
            return False
        with self._condition:
            if self.state == "loading":
                self.state = "ready"
            self._condition.notify_all()
        log.info("model ready in %.1fs", time.perf_counter() - started)
        return True

    def _loop(self) -> None:
        while True:
            admitted = self._admit()
            if admitted is None:
                return
            for job in admitted:
                self._guarded(job, self._start, job)
            self._step()

    def _admit(self) -> list[Job] | None:
        """The jobs that go to the backend now, every one that arrived (waiting while there is nothing to
        do): the scheduler's queue is where they wait for KV slots. None: stop."""
        with self._condition:
            while not self._waiting and not self._live and self.state == "ready":
                self._condition.wait()
            if self.state != "ready":
                return None
            admitted = list(self._waiting)
            self._waiting.clear()
            self._live.extend(admitted)
            return admitted

    def _start(self, job: Job) -> None:
        for options in job.choices:  # appended one by one: a refusal releases those already added
            job.sequences.append(self.backend.add(job.prompt_ids, options, job.cancelled.is_set,
                                                  streaming=job.streaming))

    def _step(self) -> None:
        with self._condition:
            live = [job for job in self._live if job.live]  # a cancelled job's sequences leave in the step
        if not live:
            return
        try:
            updates = self.backend.step()
        except Exception as exc:  # no one sequence's fault: every live one fails
            for job in live:
                self._fail(job, exc)
            return
        admitted = [job for job in live if job.started is None]
        for job in admitted:  # the model took it when the scheduler gave its first sequence a slot
            job.started = self.backend.admitted_at(job.sequences)
        if any(job.started is not None for job in admitted):
            self._count()
        by_sequence = {id(handle): (job, index) for job in live for index, handle in enumerate(job.sequences)
                       if handle is not None}
        for update in updates:
            job, index = by_sequence.get(id(update.sequence), (None, 0))
            if job is not None and job.sequences and job.sequences[index] is update.sequence:
                self._guarded(job, self._deliver, job, index, update)

    def _deliver(self, job: Job, index: int, update: Update) -> None:
        now = time.perf_counter()
        if update.ended:
            job.sequences[index] = None  # the backend has let it go
        if update.text or (update.num_new_tokens and not job.streaming):  # not streamed: its first tokens
            job.first_text[index] = job.first_text[index] or now
        if update.text and job.streaming:
            job.post("piece", Piece(index, update.text, update.num_new_tokens, update.logprobs))
        if update.error is not None:
            self._fail(job, update.error)
        elif update.cancelled:
            self._abort(job)
        elif update.output is not None:
            done = Finished(index=index, output=update.output, queue_s=job.started - job.arrived,
                            first_token_s=(job.first_text[index] or now) - job.arrived, latency_s=now - job.arrived)
            if not job.finish(done):  # shutdown answered it already
                self._retire(job)
                return
            stats = update.output.stats
            self.metrics.observe_output(stats, finish_reason(stats.finish_reason), first_choice=index == 0)
            if job.streaming:
                job.post("choice", done)
            if not job.unfinished():
                self._retire(job)
                self._observe(job)
                job.end("done", tuple(job.finished))

    def _guarded(self, job: Job, action, *args) -> None:
        """Run one job's part of the loop; an exception fails that job alone."""
        try:
            action(*args)
        except Exception as exc:
            self._fail(job, exc)

    def _fail(self, job: Job, exc: Exception) -> None:
        if isinstance(exc, SpecdeployError):  # the runtime refused the request (a prompt too long...)
            error = ApiError(400, str(exc))
        else:
            log.error("a request failed", exc_info=exc)
            error = ApiError(500, f"internal error: {exc}", kind="server_error")
        self._retire(job)
        self._count_ended("error", job.end("error", error))

    def _abort(self, job: Job) -> None:
        """A job whose client went away (or that shutdown answered already) leaves, every choice of it."""
        self._retire(job)
        self._count_ended("abort", job.end("error", gone()))

    def _retire(self, job: Job) -> None:
        with self._condition:
            if job in self._live:
                self._live.remove(job)
        self._release(job)
        self._count()

    def _release(self, job: Job) -> None:
        """Let the backend drop the job's sequences that it still holds."""
        for index, sequence in enumerate(job.sequences):
            job.sequences[index] = None
            if sequence is not None:
                try:
                    self.backend.cancel(sequence)
                except Exception:
                    log.exception("releasing a sequence failed")

    def _count_ended(self, reason: str, choices: int | None) -> None:
        """Choices that ended without an output of their own (Job.end's count; None: the job had ended already)."""
        if choices:
            self.metrics.finished.labels(reason).inc(choices)

    def _count(self) -> None:
        with self._condition:
            waiting = self._waiting_jobs()
            running = len(self._live) - sum(live.started is None for live in self._live)
        self.metrics.waiting.set(waiting)
        self.metrics.running.set(running)

    def _crash(self, exc: BaseException) -> None:
        reason = f"the model worker stopped: {type(exc).__name__}: {exc}"
        log.critical(reason, exc_info=exc)
        with self._condition:
            if self.state == "ready":
                self.state, self.error = "crashed", reason
            waiting, live = list(self._waiting), list(self._live)
            self._waiting.clear()
        ended = 0  # choices the crash ends
        for job in live:
            if job.started is None:  # still queued for a slot
                waiting.append(job)
                continue
            ended += job.end("error", ApiError(500, reason, kind="server_error")) or 0
            job.cancelled.set()
        for job in waiting:
            ended += job.end("error", ApiError(503, reason, kind="server_error", code="model_crashed")) or 0
        try:
            self.metrics.waiting.set(0)
            self._count_ended("error", ended)
        except Exception:
            pass

    def _observe(self, job: Job) -> None:
        """The request's timings, once its last choice has ended (each choice's tokens were counted as it ended)."""
        queue_s = job.finished[0].queue_s
        latency_s = max(done.latency_s for done in job.finished)
        self.metrics.queue_time.observe(queue_s)
        self.metrics.time_to_first_token.observe(min(done.first_token_s for done in job.finished))
        self.metrics.e2e_latency.observe(latency_s)
        self._mean_latency_s += LATENCY_SMOOTHING * (latency_s - queue_s - self._mean_latency_s)
