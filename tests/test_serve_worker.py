"""The serve worker cannot die silently: a failure answers its request and the loop goes on, a dead
worker says so on /health and answers its queue, shutdown answers every request left, prompts are
prepared off the event loop; and SchedulerBackend's seam (cancellation before the prefill and
between rounds, requests decoded together, the end of a sequence, a refused request).

Tests wait on the gates of GatedModel (test_serve.py) and on the server's counters, never on the clock.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

import specdeploy
from specdeploy.errors import SpecdeployError
from specdeploy.serve import ServeConfig
from specdeploy.serve.backend import SchedulerBackend
from test_serve import MESSAGES, PROMPT, GatedModel, LiveServer, chat_bundle, wait_for  # noqa: F401 (a fixture)

WAITING = "specdeploy:num_requests_waiting"


class WorkerKilled(BaseException):
    """Not an Exception: it passes every per-request guard, as nothing should but something might."""


class HeldBackend(SchedulerBackend):
    """The scheduler's backend, whose first step waits until the test sets `released`, and then does nothing: the
    worker comes back for the jobs submitted meanwhile, so that they reach the scheduler before its first
    step, as jobs queued together do."""

    def __init__(self, generator):
        super().__init__(generator)
        self.released = threading.Event()
        self.held = True

    def step(self):
        if self.held:
            assert self.released.wait(30), "the test never released the backend"
            self.held = False
            return []
        return super().step()


def post_in_thread(url: str, body: dict, answers: dict, name: str) -> threading.Thread:
    thread = threading.Thread(target=lambda: answers.update({name: httpx.post(url + "/v1/completions", json=body,
                                                                              timeout=30)}))
    thread.start()
    return thread


@pytest.fixture
def gated(agreeing_bundle):
    """A server whose model waits at a gate before each text piece (server.model); four may queue."""
    model = GatedModel(specdeploy.load(agreeing_bundle))
    live = LiveServer(ServeConfig(bundle=str(agreeing_bundle), max_queue=4), load=lambda: model)
    live.model = model
    yield live
    model.open()
    live.close()


def test_a_bookkeeping_exception_fails_its_request_and_the_loop_goes_on(agreeing_bundle, monkeypatch):
    live = LiveServer(ServeConfig(bundle=str(agreeing_bundle)))
    try:
        metrics = live.service.metrics
        observe, failures = metrics.observe_output, []

        def observe_once(stats, reason, **options):
            if not failures:
                failures.append(reason)
                raise RuntimeError("injected metrics failure")
            observe(stats, reason, **options)

        monkeypatch.setattr(metrics, "observe_output", observe_once)
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        failed = httpx.post(live.url + "/v1/completions", json=body)
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["type"] == "server_error" and "injected metrics failure" in error["message"]
        assert httpx.post(live.url + "/v1/completions", json=body).status_code == 200
        # A stream already begun ends with the error as an event.
        failures.clear()
        with httpx.stream("POST", live.url + "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert "injected metrics failure" in json.loads(lines[-2][len("data: "):])["error"]["message"]
        assert len(failures) == 1
        assert httpx.get(live.url + "/health").json() == {"status": "ok"}
        assert httpx.post(live.url + "/v1/completions", json=body).status_code == 200
    finally:
        live.close()


def test_a_dead_worker_turns_health_503_and_answers_its_queue(gated):
    url, model, answers = gated.url, gated.model, {}
    running = post_in_thread(url, {"prompt": PROMPT, "max_tokens": 50, "temperature": 0}, answers, "running")
    model.wait(lambda m: m.held == 1, "the first request to generate")
    queued = post_in_thread(url, {"prompt": PROMPT, "max_tokens": 3}, answers, "queued")
    wait_for(lambda: gated.metric(WAITING) == 1, "a queued request")
    model.fail(WorkerKilled("injected"))
    running.join(30)
    queued.join(30)
    assert answers["running"].status_code == 500 and "WorkerKilled" in answers["running"].json()["error"]["message"]
    assert answers["queued"].status_code == 503 and answers["queued"].json()["error"]["code"] == "model_crashed"
    health = httpx.get(url + "/health")
    assert health.status_code == 503
    assert health.json()["status"] == "crashed" and "WorkerKilled: injected" in health.json()["error"]
    later = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert later.status_code == 503 and later.json()["error"]["code"] == "model_crashed"
    assert model.streams == 1  # nothing ran after the worker died


def test_a_load_that_dies_past_every_exception_guard_still_fails_the_server():
    """A loader that raises a BaseException (SystemExit from a library, say) turns the state to "failed"
    and calls on_fatal, as a bundle that will not load does; /health does not stay at "loading"."""
    from specdeploy.serve.metrics import Metrics
    from specdeploy.serve.worker import ModelWorker

    def load():
        raise WorkerKilled("injected at load")

    fatal = []
    worker = ModelWorker(load, max_queue=1, metrics=Metrics(), on_fatal=fatal.append)
    worker.start()
    assert not worker.wait_loaded(30)
    assert worker.join(30)  # its thread has ended
    assert worker.state == "failed" and fatal == ["injected at load"] == [worker.error]
    assert worker.unavailable().status == 503


def test_a_choice_that_ended_frees_its_slot_for_the_next_request(agreeing_bundle):
    """Two KV slots, a request of n=2 whose first choice ends at once and whose second runs long, and a
    request waiting behind it: the waiting one starts when the first choice ends, not when the whole
    request does; and its output is what it is alone."""
    import asyncio

    from specdeploy.serve.metrics import Metrics
    from specdeploy.serve.job import Job
    from specdeploy.serve.worker import ModelWorker

    generator = specdeploy.load(agreeing_bundle, max_batch=2, exact=True)  # a seed's sample whatever the batch
    base = dict(max_new_tokens=24, temperature=1.0, stop=("\n",))
    lengths = [len(generator.generate(PROMPT, seed=seed, **base).token_ids) for seed in range(40)]
    seed = next(s for s in range(39) if lengths[s] <= 4 and lengths[s + 1] == 24)  # short, then long
    alone = generator.generate(PROMPT, seed=seed + 1, **base).token_ids
    prompt_ids = generator.codec.encode(PROMPT)

    async def scenario():
        worker = ModelWorker(lambda: generator, max_queue=4, metrics=Metrics(), backend=HeldBackend)
        worker.start()
        assert worker.wait_loaded(30) and worker.backend.capacity == 2
        pair = Job(prompt_ids, [dict(base, seed=seed), dict(base, seed=seed + 1)], streaming=False)
        after = Job(prompt_ids, [dict(base, seed=seed + 1)], streaming=False)
        worker.submit(pair)
        worker.submit(after)  # both queued before the first step: the pair takes both slots first
        worker.backend.released.set()
        try:
            return pair, await pair.events.get(), after, await after.events.get()
        finally:
            worker.stop()
            assert worker.join(30)

    pair, (kind, pair_done), after, (after_kind, after_done) = asyncio.run(scenario())
    assert kind == after_kind == "done"
    assert [len(done.output.token_ids) for done in pair_done] == [lengths[seed], 24]
    assert after.started < pair.arrived + pair_done[1].latency_s  # it joined while the long choice ran
    assert pair_done[1].output.token_ids == after_done[0].output.token_ids == alone


def test_a_prompt_the_model_cannot_take_is_a_400_before_it_queues(gated):
    """A prompt past the context (OpenAI's code context_length_exceeded) or with ids outside the vocabulary is
    refused when it is read, naming the field: a full queue answers it 400, not 429."""
    url, model, answers = gated.url, gated.model, {}
    threads = [post_in_thread(url, {"prompt": PROMPT, "max_tokens": 50, "temperature": 0}, answers, "running")]
    model.wait(lambda m: m.held == 1, "the first request to generate")
    threads += [post_in_thread(url, {"prompt": PROMPT, "max_tokens": 2}, answers, f"queued{i}") for i in range(4)]
    wait_for(lambda: gated.metric(WAITING) == 4, "a full queue")
    assert httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 429
    for path, body, param, code in (
            ("/v1/completions", {"prompt": "x " * 400}, "prompt", "context_length_exceeded"),
            ("/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt", None)):
        response = httpx.post(url + path, json={**body, "max_tokens": 2})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, code), error
    model.open()
    for thread in threads:
        thread.join(30)
    assert all(answer.status_code == 200 for answer in answers.values())


def test_shutdown_answers_every_request_left(gated):
    url, model, answers = gated.url, gated.model, {}
    model.allow(1)
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        model.wait(lambda m: m.held == 1, "the stream to wait for its second piece")
        queued = [post_in_thread(url, {"prompt": PROMPT, "max_tokens": 3}, answers, "plain"),
                  post_in_thread(url, {**body, "max_tokens": 3}, answers, "stream")]
        wait_for(lambda: gated.metric(WAITING) == 2, "two queued requests")
        stopper = threading.Thread(target=gated.service.worker.stop)
        stopper.start()  # returns once the worker's thread ends: after the gate opens below
        rest = [line for line in lines if line]
    for thread in queued:
        thread.join(30)
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "shutting_down"
    for name in ("plain", "stream"):  # the stream had not begun: a plain 503
        assert answers[name].status_code == 503 and answers[name].json()["error"]["code"] == "shutting_down", name
    assert httpx.get(url + "/health").json()["status"] == "stopped"
    model.open()
    stopper.join(30)
    assert not stopper.is_alive() and model.streams == 1


def test_prompts_are_prepared_off_the_event_loop_and_the_model_thread(chat_bundle):
    generator = specdeploy.load(chat_bundle)
    entered, release, threads = threading.Event(), threading.Event(), []

    class SlowTemplate:
        def __getattr__(self, name):
            return getattr(generator, name)

        def encode_chat(self, messages):
            threads.append(threading.current_thread().name)
            entered.set()
            release.wait(30)
            return generator.encode_chat(messages)

    live = LiveServer(ServeConfig(bundle=str(chat_bundle)), load=SlowTemplate)
    try:
        answers = {}
        chat = threading.Thread(target=lambda: answers.update(reply=httpx.post(
            live.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}, timeout=30)))
        chat.start()
        assert entered.wait(30)
        assert httpx.get(live.url + "/health").status_code == 200  # the loop answers while the template renders
        assert httpx.get(live.url + "/metrics").status_code == 200
        release.set()
        chat.join(30)
        assert answers["reply"].status_code == 200
        assert threads[0].startswith("specdeploy-prompt")
    finally:
        release.set()
        live.close()


def run_to_end(backend, sequence) -> list:
    updates = []
    while not (updates and updates[-1].ended):
        for update in backend.step():  # a prefill chunk, or a round whose text is held back, has none
            assert update.sequence is sequence
            updates.append(update)
    assert backend.step() == []
    return updates


def test_the_backend_runs_a_sequence_to_its_end(agreeing_bundle):
    generator = specdeploy.load(agreeing_bundle)
    expected = generator.generate(PROMPT, max_new_tokens=12, temperature=0)
    backend = SchedulerBackend(generator)
    ids = generator.codec.encode(PROMPT)
    sequence = backend.add(ids, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": False}, lambda: False)
    updates = run_to_end(backend, sequence)
    assert "".join(u.text for u in updates) == expected.text
    assert updates[-1].output.token_ids == expected.token_ids
    counts = [u.num_new_tokens for u in updates]
    assert counts == sorted(counts) and counts[-1] == len(expected.token_ids)
    # Logprobs come with the updates, the new tokens' each time; together they are the output's.
    with_logprobs = backend.add(ids, {"max_new_tokens": 12, "temperature": 0, "logprobs": 2}, lambda: False)
    updates = run_to_end(backend, with_logprobs)
    assert sum((u.logprobs for u in updates), ()) == tuple(updates[-1].output.logprobs)
    assert len(updates[-1].output.logprobs) == len(expected.token_ids)
    with pytest.raises(SpecdeployError, match="max context"):  # a request the runtime refuses: add raises
        backend.add(ids * 200, {"max_new_tokens": 4}, lambda: False)


def test_the_backend_decodes_requests_together(agreeing_bundle):
    generator = specdeploy.load(agreeing_bundle, max_batch=3)
    backend = SchedulerBackend(generator)
    assert backend.capacity == 3
    prompts = [PROMPT, "import os\n", "class A:"]
    expected = [generator.generate(p, max_new_tokens=10).token_ids for p in prompts]
    handles = [backend.add(generator.codec.encode(p), {"max_new_tokens": 10}, lambda: False) for p in prompts]
    outputs, steps = {}, 0
    while len(outputs) < 3:
        for update in backend.step():
            if update.ended:
                outputs[handles.index(update.sequence)] = update.output.token_ids
        steps += 1
    assert [outputs[i] for i in range(3)] == expected
    assert steps < sum(len(e) for e in expected)  # the rounds were shared, not taken in turn


def test_the_backend_checks_cancellation_before_the_prefill_and_between_rounds(agreeing_bundle):
    model = GatedModel(specdeploy.load(agreeing_bundle))
    model.open()
    backend = SchedulerBackend(model)
    ids = model.codec.encode(PROMPT)
    options = {"max_new_tokens": 40, "temperature": 0}
    gone = backend.add(ids, options, lambda: True)
    [update] = backend.step()
    assert update.sequence is gone and update.cancelled and update.ended and update.num_new_tokens == 0
    assert gone.sequence.slot is None  # nothing ran: not even the prefill
    cancel = threading.Event()
    live = backend.add(ids, options, cancel.is_set)
    first = []
    while not first:
        first = backend.step()
    assert first[0].text and not first[0].ended
    cancel.set()
    [second] = backend.step()
    assert second.cancelled and second.ended and second.num_new_tokens == first[0].num_new_tokens
    assert live.sequence.finish_reason == "cancelled" and backend.step() == []
