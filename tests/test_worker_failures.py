"""The worker's gauges after a crash or a shutdown, and one sequence's failure inside a batched step.

Tests wait on the gates of GatedModel and on events, never on the clock.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

import specdeploy
from specdeploy.serve import ServeConfig
from specdeploy.serve.metrics import Metrics
from specdeploy.serve.protocol import ApiError
from specdeploy.serve.job import Finished, Job, shutting_down
from specdeploy.serve.worker import ModelWorker
from test_serve import PROMPT, GatedModel, LiveServer
from test_serve_worker import HeldBackend, WorkerKilled, post_in_thread

RUNNING = "specdeploy:num_requests_running"
WAITING = "specdeploy:num_requests_waiting"


@pytest.mark.parametrize("ending", ["crash", "shutdown"])
def test_running_gauge_reads_zero_once_the_worker_has_ended(agreeing_bundle, ending):
    """docs/serve.md: num_requests_running is the requests decoding now. A worker that died, or a shutdown that
    answered every request, leaves none decoding; the gauge kept counting the request it had ended."""
    model = GatedModel(specdeploy.load(agreeing_bundle))
    live = LiveServer(ServeConfig(bundle=str(agreeing_bundle), max_queue=4), load=lambda: model)
    try:
        answers = {}
        running = post_in_thread(live.url, {"prompt": PROMPT, "max_tokens": 50, "temperature": 0}, answers, "running")
        model.wait(lambda m: m.held == 1, "the request to generate")
        assert live.metric(RUNNING) == 1
        if ending == "crash":
            model.fail(WorkerKilled("injected"))
        else:
            stopper = threading.Thread(target=live.service.worker.stop)
            stopper.start()
        running.join(30)
        assert answers["running"].status_code == (500 if ending == "crash" else 503)
        model.open()
        if ending == "shutdown":
            stopper.join(30)
        assert live.service.worker.join(30)  # the worker's thread has ended, its cleanup done
        if ending == "crash":
            assert httpx.get(live.url + "/health").json()["status"] == "crashed"
        assert live.metric(RUNNING) == 0 and live.metric(WAITING) == 0
        reason = "error" if ending == "crash" else "abort"  # the request's one choice, counted once
        assert live.metric(f'specdeploy:request_finished_total{{finished_reason="{reason}"}}') == 1
    finally:
        model.open()
        live.close()


class FailingOutput:
    """The real generator, whose first sequence raises when the runtime builds its GenerationOutput."""

    def __init__(self, generator):
        self.generator, self.made = generator, 0

    def __getattr__(self, name):
        return getattr(self.generator, name)

    def new_sequence(self, prompt, **options):
        sequence = self.generator.new_sequence(prompt, **options)
        self.made += 1
        if self.made == 1:
            def output():
                raise RuntimeError("injected output failure")

            sequence.output = output
        return sequence


def test_one_sequences_failure_in_a_batched_step_fails_its_request_alone(agreeing_bundle):
    """docs/serve.md: an exception while serving a request, in the runtime or in the server's own
    bookkeeping, fails that request alone. Two requests decode together; building the first one's
    output fails: the second still gets its own output."""
    generator = FailingOutput(specdeploy.load(agreeing_bundle, max_batch=2))
    alone = generator.generator.generate(PROMPT, max_new_tokens=8, temperature=0).token_ids
    ids = generator.codec.encode(PROMPT)

    metrics = Metrics()

    async def scenario():
        worker = ModelWorker(lambda: generator, max_queue=4, metrics=metrics, backend=HeldBackend)
        worker.start()
        assert worker.wait_loaded(30) and worker.backend.capacity == 2
        failing = Job(ids, [dict(max_new_tokens=2, temperature=0)], streaming=False)
        healthy = Job(ids, [dict(max_new_tokens=8, temperature=0)], streaming=False)
        worker.submit(failing)
        worker.submit(healthy)  # both queued before the first step: they start, and decode, together
        worker.backend.released.set()
        try:
            return await failing.events.get(), await healthy.events.get()
        finally:
            worker.stop()
            assert worker.join(30)

    (failing_kind, failure), (healthy_kind, healthy_value) = asyncio.run(scenario())
    assert failing_kind == "error" and failure.status == 500 and "injected output failure" in failure.message
    assert healthy_kind == "done", getattr(healthy_value, "message", healthy_value)
    assert healthy_value[0].output.token_ids == alone
    ended = {reason: metrics.registry.get_sample_value("specdeploy:request_finished_total", {"finished_reason": reason})
             for reason in ("error", "length", "abort")}
    assert ended == {"error": 1.0, "length": 1.0, "abort": None}  # the failed choice counts once, as an error


def test_a_job_the_server_fails_outside_the_worker_counts_its_choices_as_errors(agreeing_bundle):
    """A chunk the event loop could not format fails its request (a 500): its choices count as `error`, not as the
    `abort` of a client that left, when the stream's end then cancels the job."""
    generator = specdeploy.load(agreeing_bundle)
    metrics = Metrics()

    async def scenario():
        worker = ModelWorker(lambda: generator, max_queue=4, metrics=metrics, backend=HeldBackend)
        worker.start()
        assert worker.wait_loaded(30)
        job = Job(generator.codec.encode(PROMPT), [dict(max_new_tokens=4, temperature=0)] * 2, streaming=True)
        worker.submit(job)  # it generates nothing before the backend is released
        worker.fail(job, ApiError(500, "internal error: injected", kind="server_error"))
        worker.cancel(job)  # as the stream's end does
        try:
            return await job.events.get()
        finally:
            worker.backend.released.set()  # the cancelled job leaves the backend; then the worker stops
            worker.stop()
            assert worker.join(30)

    kind, error = asyncio.run(scenario())
    assert kind == "error" and error.status == 500
    ended = {reason: metrics.registry.get_sample_value("specdeploy:request_finished_total", {"finished_reason": reason})
             for reason in ("error", "abort")}
    assert ended == {"error": 2.0, "abort": None}


def test_each_choice_ends_once_whichever_thread_ends_it():
    """Shutdown ends a job on another thread while the worker may be recording a choice's output: the job's lock
    lets each choice end once, so it is counted under one finish reason."""
    async def scenario():
        job = Job([1, 2, 3], [{}, {}], streaming=True)
        ended = lambda index: Finished(index=index, output=None, queue_s=0.0, first_token_s=0.0, latency_s=0.0)  # noqa: E731
        assert job.finish(ended(0))  # the worker records the first choice's output
        assert job.end("error", shutting_down()) == 1  # shutdown ends the job: one choice left unfinished
        assert not job.finish(ended(1))  # the second's output, a moment late, is not recorded
        assert job.end("done", ()) is None and job.unfinished() == 1
        return await job.events.get()

    kind, error = asyncio.run(scenario())
    assert kind == "error" and error.status == 503


def test_a_chunk_that_fails_to_format_ends_the_stream_with_an_error_and_done(agreeing_bundle, monkeypatch):
    """docs/serve.md: an error after a stream began is an error event, then [DONE]. A failure while formatting a
    chunk on the event loop (Responder.piece) ended the stream with neither."""
    from specdeploy.serve import responses

    def broken(self, value):
        raise RuntimeError("injected formatting failure")

    monkeypatch.setattr(responses.Responder, "piece", broken)
    live = LiveServer(ServeConfig(bundle=str(agreeing_bundle)))
    try:
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and "injected formatting failure" in lines[-2], lines[-3:]
        answer = httpx.post(live.url + "/v1/completions", json={**body, "stream": False}, timeout=60)
        assert answer.status_code == 200  # the server goes on
    finally:
        live.close()
