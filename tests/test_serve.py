"""`specdeploy serve` against live servers on 127.0.0.1 (ephemeral ports): the OpenAI client and plain HTTP.

Servers run uvicorn in a thread of this process on the tiny test bundles. Where a test needs the
model busy (a full queue, a disconnect, a shutdown), the real generator is wrapped so that each
text piece waits at a gate the test opens (GatedModel): the output is the model's own, and the
test decides when each piece comes. Tests wait on those gates and on the server's counters, never
on the clock; the deadlines in wait_for only turn a hang into a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from click.testing import CliRunner

import specdeploy
from specdeploy.bundle import MANIFEST_NAME, file_entry
from specdeploy.cli import main
from specdeploy.serve import ServeConfig, create_app
from specdeploy.serve.server import bind

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PROMPT = "def add(a, b):\n    return"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


def paced(sequence, before_pieces):
    """A runtime Sequence whose every batch of text pieces first calls `before_pieces()` (which may wait, or raise)."""
    take = sequence.take_pieces

    def take_pieces():
        pieces = take()
        if pieces:
            before_pieces()
        return pieces

    sequence.take_pieces = take_pieces
    return sequence


class SlowModel:
    """The real generator, pausing before each step's text (for servers in another process, which a gate cannot reach)."""

    def __init__(self, generator, pause_s: float):
        self.generator, self.pause_s = generator, pause_s

    def __getattr__(self, name):
        return getattr(self.generator, name)

    def new_sequence(self, prompt, **options):
        options["streaming"] = True  # every request's text comes out as it decodes, to be paced
        return paced(self.generator.new_sequence(prompt, **options), lambda: time.sleep(self.pause_s))


class GatedModel:
    """The real generator, each of whose sequences' text waits at a gate (once per step that has some)
    until the test lets it through.

    allow(n) lets n more pieces through, open() all of them; held is how many streams wait at the
    gate now, passed how many pieces went through, streams how many generations began (sequences: their
    runtime Sequences). fail(fault) makes the waiting stream raise `fault` instead of yielding its piece."""

    def __init__(self, generator):
        self.generator = generator
        self.condition = threading.Condition()
        self.allowed, self.opened, self.held, self.passed, self.streams = 0, False, 0, 0, 0
        self.fault: BaseException | None = None
        self.sequences: list = []

    def __getattr__(self, name):
        return getattr(self.generator, name)

    def allow(self, pieces: int = 1) -> None:
        with self.condition:
            self.allowed += pieces
            self.condition.notify_all()

    def open(self) -> None:
        with self.condition:
            self.opened = True
            self.condition.notify_all()

    def fail(self, fault: BaseException) -> None:
        with self.condition:
            self.fault = fault
            self.condition.notify_all()

    def wait(self, condition, what: str) -> None:
        """Wait until condition(self) holds (checked whenever the gate's state changes)."""
        with self.condition:
            assert self.condition.wait_for(lambda: condition(self), timeout=30), \
                f"timed out waiting for {what} (held {self.held}, passed {self.passed}, allowed {self.allowed}, streams {self.streams})"

    def new_sequence(self, prompt, **options):
        options["streaming"] = True  # every request's text comes out as it decodes, to be gated
        sequence = self.generator.new_sequence(prompt, **options)
        with self.condition:
            self.streams += 1
            self.sequences.append(sequence)
        return paced(sequence, self._gate)

    def _gate(self) -> None:
        with self.condition:
            self.held += 1
            self.condition.notify_all()
            self.condition.wait_for(lambda: self.opened or self.allowed or self.fault is not None, timeout=60)
            self.held -= 1
            fault, self.fault = self.fault, None
            if fault is None and not self.opened and self.allowed:
                self.allowed -= 1
            self.passed += fault is None
            self.condition.notify_all()
        if fault is not None:
            raise fault


class LiveServer:
    """create_app on uvicorn in a thread, listening on a free port of 127.0.0.1."""

    def __init__(self, config: ServeConfig, load=None, wait_ready: bool = True):
        self.app = create_app(config, load)
        self.service = self.app.state.service
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        if wait_ready:
            wait_for(lambda: httpx.get(self.url + "/health").status_code == 200, "the model to load")

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=30)

    def metric(self, line_start: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
        return 0.0

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def chat_bundle(tmp_path_factory, agreeing_bundle) -> Path:
    """The agreeing bundle, its tokenizer_config.json given a chat template."""
    out = tmp_path_factory.mktemp("chat") / "bundle"
    shutil.copytree(agreeing_bundle, out)
    config_path = out / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["tokenizer"]["files"] = [file_entry(out, out / entry["path"]).__dict__ for entry in manifest["tokenizer"]["files"]]
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="module")
def server(chat_bundle):
    live = LiveServer(ServeConfig(bundle=str(chat_bundle), model_name="tiny"))
    yield live
    live.close()


@pytest.fixture(scope="module")
def keyed_server(agreeing_bundle):
    """No chat template; an API key; a small body limit."""
    live = LiveServer(ServeConfig(bundle=str(agreeing_bundle), api_key="secret", max_body_bytes=4096))
    yield live
    live.close()


@pytest.fixture
def gated_server(agreeing_bundle):
    """One request may wait behind the running one; every text piece waits for the test (server.model)."""
    model = GatedModel(specdeploy.load(agreeing_bundle))
    live = LiveServer(ServeConfig(bundle=str(agreeing_bundle), max_queue=1), load=lambda: model)
    live.model = model
    yield live
    model.open()
    live.close()


def run_cli_json(bundle, *args) -> dict:
    result = CliRunner().invoke(main, ["run", str(bundle), "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_greedy_completion_equals_specdeploy_run_streamed_or_not(server, chat_bundle):
    expected = run_cli_json(chat_bundle, "--prompt", PROMPT, "--max-new-tokens", "40", "--temperature", "0")
    client = server.client()
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    assert response.choices[0].text == expected["text"]
    assert response.usage.completion_tokens == len(expected["token_ids"])
    assert response.usage.prompt_tokens == expected["stats"]["prompt_tokens"]
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.choices[0].finish_reason == ("length" if len(expected["token_ids"]) == 40 else "stop")
    extension = response.model_extra["specdeploy"]
    assert extension["speculative"] and extension["drafted_tokens"] > 0
    assert extension["tokens_per_round"] == pytest.approx(expected["stats"]["mean_accepted_tokens"])
    assert len(extension["accepted_by_position"]) == 4

    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == response.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == response.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_options_match_the_runtime(server, chat_bundle):
    client = server.client()
    expected = run_cli_json(chat_bundle, "--prompt", PROMPT, "--max-new-tokens", "30", "--temperature", "0",
                            "--stop", "\n", "--no-speculative")
    stopped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stop="\n",
                                        extra_body={"speculative": False})
    assert stopped.choices[0].text == expected["text"]
    assert stopped.model_extra["specdeploy"]["drafted_tokens"] == 0
    # A prompt of token ids is the same prompt.
    ids = specdeploy.load(chat_bundle).codec.encode(PROMPT)
    by_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    # Sampling: a seed reproduces, and no seed is a fresh one each request.
    sampled = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=5,
                                         extra_body={"top_k": 50, "num_draft_tokens": 2}) for _ in range(2)]
    assert sampled[0].choices[0].text == sampled[1].choices[0].text
    assert len(sampled[0].model_extra["specdeploy"]["accepted_by_position"]) == 2
    seeds = {client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1).model_extra["specdeploy"]["seed"]
             for _ in range(3)}
    assert len(seeds) == 3


def test_chat_renders_the_template_as_transformers_does(server, chat_bundle):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_bundle / "tokenizer")
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    expected = specdeploy.load(chat_bundle).generate(list(ids), max_new_tokens=30, temperature=0)
    client = server.client()
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == response.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError, match="unknown role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "tool", "content": "x"}])


def test_openais_message_forms_render_as_their_plain_equivalents(server):
    """A developer message is the system message; content parts are their texts, joined."""
    plain = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "def add(a, b):"}]
    text = [{"type": "text", "text": "Answer "}, {"type": "text", "text": "briefly."}]
    parts = [{"role": "developer", "content": text}, {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]}]
    answers = [httpx.post(server.url + "/v1/chat/completions", timeout=30,
                          json={"messages": messages, "max_tokens": 12, "temperature": 0}).json()
               for messages in (plain, parts)]
    assert answers[0]["usage"]["prompt_tokens"] == answers[1]["usage"]["prompt_tokens"] > 0
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]


def sse_chunks(url: str, body: dict) -> list[dict]:
    """A stream's chunks, parsed, up to (not including) [DONE]."""
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}


def content_of(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice["text"] if "text" in choice else choice["delta"].get("content") or ""


def test_continuous_usage_stats_put_usage_on_the_chunks(server):
    for path, request in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        chunks = sse_chunks(server.url + path, {**request, "max_tokens": 24, "temperature": 0, "stream": True,
                                                "stream_options": CONTINUOUS_USAGE})
        final = chunks[-1]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] >= 1
        finishing = chunks[-2]
        assert finishing["choices"][0]["finish_reason"] and finishing["usage"] == final["usage"]
        known = [chunk["usage"] for chunk in chunks if chunk["usage"] is not None]
        prompt_tokens = final["usage"]["prompt_tokens"]
        assert all(u["prompt_tokens"] == prompt_tokens and u["total_tokens"] == prompt_tokens + u["completion_tokens"]
                   for u in known), path
        if path.endswith("chat/completions"):  # the role chunk: nothing generated yet
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert chunks[0]["usage"]["completion_tokens"] == 0
    # As vLLM: continuous_usage_stats alone (without include_usage) adds nothing.
    chunks = sse_chunks(server.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True,
                                                         "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in chunk for chunk in chunks)


def test_continuous_usage_counts_the_tokens_behind_each_chunk(server, chat_bundle):
    generator = specdeploy.load(chat_bundle)
    ids = generator.generate(PROMPT, max_new_tokens=24, temperature=0).token_ids
    chunks = sse_chunks(server.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                         "stream": True, "stream_options": CONTINUOUS_USAGE})
    text, counts = "", []
    for chunk in chunks[:-2]:  # the text chunks (then the finishing one and the usage chunk)
        text += content_of(chunk)
        count = chunk["usage"]["completion_tokens"]
        assert generator.codec.decode(ids[:count]).startswith(text)  # the text so far came from that many tokens
        counts.append(count)
    # Counts never fall; the pieces of one round share the round's count.
    assert counts and counts == sorted(counts) and 1 <= counts[0] and counts[-1] <= len(ids)
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)


@pytest.fixture(scope="module")
def eos_server(chat_bundle):
    """The chat bundle, its generator told that a token of PROMPT's greedy completion (its third new one,
    or the first new token after it) is an EOS: a completion of PROMPT ends early."""
    generator = specdeploy.load(chat_bundle)
    ids = generator.generate(PROMPT, max_new_tokens=24, temperature=0).token_ids
    position = next(i for i, token in enumerate(ids) if i >= 2 and token not in ids[:i])
    generator.eos_token_ids = generator.eos_token_ids | {ids[position]}
    live = LiveServer(ServeConfig(bundle=str(chat_bundle)), load=lambda: generator)
    live.eos_position = position
    yield live
    live.close()


def test_ignore_eos_generates_exactly_max_tokens(eos_server):
    client = eos_server.client()
    stopped = client.completions.create(model="x", prompt=PROMPT, max_tokens=30, temperature=0)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == eos_server.eos_position + 1
    ignoring = client.completions.create(model="x", prompt=PROMPT, max_tokens=30, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert ignoring.choices[0].finish_reason == "length" and ignoring.usage.completion_tokens == 30
    assert ignoring.choices[0].text.startswith(stopped.choices[0].text)
    chunks = sse_chunks(eos_server.url + "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}})
    assert "".join(content_of(c) for c in chunks if c["choices"]) == ignoring.choices[0].text
    assert chunks[-1]["usage"]["completion_tokens"] == 30
    # Chat: the end of turn does not end the reply either.
    reply = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=30, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 30
    # The next request that does not ask for it stops at EOS again.
    again = client.completions.create(model="x", prompt=PROMPT, max_tokens=30, temperature=0)
    assert again.usage.completion_tokens == eos_server.eos_position + 1


def test_chat_without_a_template_is_a_400(keyed_server):
    with pytest.raises(openai.BadRequestError, match="no chat template") as caught:
        keyed_server.client("secret").chat.completions.create(model="x", messages=MESSAGES)
    assert caught.value.code == "no_chat_template"


def test_models_health_metrics_and_unknown_routes(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert server.client().models.retrieve("tiny") == models.data[0]  # OpenAI's retrieve
    other = httpx.get(server.url + "/v1/models/gpt-4o")
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    for name in ("specdeploy:requests_total", "specdeploy:prompt_tokens_total", "specdeploy:generation_tokens_total",
                 "specdeploy:time_to_first_token_seconds_bucket", "specdeploy:e2e_request_latency_seconds_bucket",
                 "specdeploy:num_requests_waiting", "specdeploy:spec_decode_num_drafts_total",
                 "specdeploy:spec_decode_num_draft_tokens_total", "specdeploy:spec_decode_num_accepted_tokens_total",
                 'specdeploy:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'):
        assert name in metrics.text, name
    assert server.metric('specdeploy:requests_total{endpoint="/v1/completions",status="200"}') >= 1
    assert server.metric("specdeploy:generation_tokens_total") >= 8
    drafts = server.metric("specdeploy:spec_decode_num_draft_tokens_total")
    accepted = server.metric("specdeploy:spec_decode_num_accepted_tokens_total")
    by_position = server.metric('specdeploy:spec_decode_num_accepted_tokens_per_pos_total{position="0"}')
    assert drafts > 0 and 0 <= by_position <= accepted <= drafts
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


@pytest.mark.parametrize("body, message", [
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "top_p": 2}, "top_p"),
    ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
    ({"prompt": PROMPT, "n": 0}, "n must be"),
    ({"prompt": PROMPT, "logprobs": 6}, "logprobs must be"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": PROMPT, "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": PROMPT, "frobnicate": 1}, "unrecognized request argument"),
    ({"prompt": [PROMPT, PROMPT]}, "one prompt per request"),
    ({"prompt": [1, 2, 10**6]}, "token ids must be in"),
    ({"prompt": "x " * 400, "stream": True}, "max context"),
    ({"prompt": PROMPT, "num_draft_tokens": 99}, "num_draft_tokens"),
    ({"prompt": PROMPT, "seed": -1}, "seed"),
    ({"prompt": PROMPT, "stop": [1]}, "stop"),
    ({"prompt": PROMPT, "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": PROMPT, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, "continuous_usage_stats"),
    ({"max_tokens": 3}, "prompt is required"),
])
def test_invalid_parameters_are_400s_with_openai_error_bodies(server, body, message):
    response = httpx.post(server.url + "/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert not response.headers["content-type"].startswith("text/event-stream")


def test_sampling_extensions_pass_through_by_name(server):
    for name, value in (("min_p", 0.05), ("repetition_penalty", 1.1), ("top_k", 5)):
        response = httpx.post(server.url + "/v1/completions",
                              json={"prompt": PROMPT, "max_tokens": 4, "seed": 1, name: value})
        assert response.status_code == 200, response.text
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "min_p": 1.5})
    assert bad.status_code == 400 and "min_p" in bad.json()["error"]["message"]


def test_api_key_and_body_limit(keyed_server):
    url = keyed_server.url + "/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 2}
    assert httpx.post(url, json=body).status_code == 401
    wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        keyed_server.client("nope").completions.create(model="x", prompt=PROMPT, max_tokens=2)
    assert keyed_server.client("secret").completions.create(model="x", prompt=PROMPT, max_tokens=2).usage
    assert httpx.get(keyed_server.url + "/health").status_code == 200  # probes need no key
    headers = {"Authorization": "Bearer secret"}
    large = httpx.post(url, json={"prompt": "x" * 5000}, headers=headers)
    assert large.status_code == 413 and large.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(url, content=(b"x" * 1024 for _ in range(8)),  # no Content-Length
                         headers={**headers, "Content-Type": "application/json"})
    assert chunked.status_code == 413


def test_health_is_503_while_the_model_loads(agreeing_bundle):
    release = threading.Event()

    def load():
        release.wait(10)
        return specdeploy.load(agreeing_bundle)

    live = LiveServer(ServeConfig(bundle=str(agreeing_bundle)), load=load, wait_ready=False)
    try:
        health = httpx.get(live.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        refused = httpx.post(live.url + "/v1/completions", json={"prompt": PROMPT})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_not_ready"
        release.set()
        wait_for(lambda: httpx.get(live.url + "/health").status_code == 200, "the model to load")
    finally:
        release.set()
        live.close()


def test_full_queue_answers_429_and_health_answers_meanwhile(gated_server):
    url, model = gated_server.url, gated_server.model
    model.allow(1)
    with long_stream(gated_server):
        model.wait(lambda m: m.held == 1, "the stream to wait for its second piece")  # generating now
        queued = {}
        waiter = threading.Thread(target=lambda: queued.update(response=httpx.post(
            url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=30)))
        waiter.start()
        wait_for(lambda: gated_server.metric("specdeploy:num_requests_waiting") == 1, "a queued request")
        assert httpx.get(url + "/health").status_code == 200  # answered while the model holds a piece
        assert gated_server.metric("specdeploy:num_requests_running") == 1
        full = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
        assert full.json()["error"]["code"] == "rate_limit_exceeded"
        assert "1 waiting for a slot" in full.json()["error"]["message"]  # the queued one, not the running one
        assert not queued  # still waiting behind the stream
    wait_for(lambda: cancelled(gated_server), "the server to see the disconnect")
    model.open()  # the stream's next piece finds it cancelled; the queued request runs
    waiter.join(30)
    assert queued["response"].status_code == 200
    assert gated_server.metric('specdeploy:requests_total{endpoint="/v1/completions",status="429"}') == 1


ABORTED = 'specdeploy:request_finished_total{finished_reason="abort"}'


@contextlib.contextmanager
def long_stream(server):
    """A greedy 200-token completion stream, open once its first piece has come; yields its lines."""
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            yield lines


def cancelled(server) -> bool:
    """Whether every sequence generating on the server's GatedModel has been cancelled (its client went away):
    the scheduler asks each one's `cancelled()` at its next step."""
    with server.model.condition:
        live = [sequence for sequence in server.model.sequences if not sequence.finished]
    return bool(live) and all(sequence.cancelled() for sequence in live)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(gated_server):
    model = gated_server.model
    aborted = gated_server.metric(ABORTED)
    model.allow(1)
    with long_stream(gated_server):
        model.wait(lambda m: m.held == 1, "the stream to wait for its second piece")
    wait_for(lambda: cancelled(gated_server), "the server to see the disconnect")
    model.allow(1)  # one more piece: the generation stops there, before another round
    wait_for(lambda: gated_server.metric(ABORTED) == aborted + 1, "the generation to stop")
    assert model.passed == 2 and model.held == 0
    assert gated_server.metric("specdeploy:num_requests_running") == 0
    model.open()
    after = gated_server.client().completions.create(model="x", prompt=PROMPT, max_tokens=3, temperature=0)
    assert after.usage.completion_tokens >= 1


DRAIN_SCRIPT = """
import logging, sys, time
logging.basicConfig(level=logging.INFO)  # serve() logs through the program's logging, as a library should
sys.path.insert(0, {tests!r})
import specdeploy
from specdeploy.serve import ServeConfig, serve
from test_serve import SlowModel
serve(ServeConfig(bundle={bundle!r}, port=0, drain_timeout_s={drain}),
      load=lambda: SlowModel(specdeploy.load({bundle!r}), pause_s=0.03))
"""


@contextlib.contextmanager
def server_process(bundle, drain_timeout_s: float):
    """A server in its own process (pieces take 30 ms), so SIGTERM reaches it as it would in production."""
    script = DRAIN_SCRIPT.format(tests=str(Path(__file__).parent), bundle=str(bundle), drain=drain_timeout_s)
    process = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "SPECDEPLOY_SHARED_THREADS": "0"})
    try:
        line = ""
        while "http://" not in line:
            line = process.stderr.readline()
            assert line, "the server exited before listening"
        url = line.split("on ", 1)[1].split()[0]
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, "the model to load", timeout_s=30)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stderr.close()


def test_sigterm_finishes_in_flight_requests_and_refuses_new_ones(agreeing_bundle):
    with server_process(agreeing_bundle, drain_timeout_s=10) as (process, url):
        body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)
            wait_for(lambda: _refused(url), "new connections to be refused", timeout_s=5)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] in ("stop", "length")
        assert process.wait(15) == 0


def stream_through_sigterm(process, url: str, body: dict, timeout_s: float = 30) -> list[str]:
    """A streamed completion whose first chunk has come when the server gets SIGTERM; the lines after it."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        process.send_signal(signal.SIGTERM)
        return [line for line in lines if line]


def test_sigterm_answers_requests_left_at_the_drain_deadline(agreeing_bundle):
    with server_process(agreeing_bundle, drain_timeout_s=0.5) as (process, url):
        body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}  # 178 pieces of 30 ms at least
        received = stream_through_sigterm(process, url, body)
        assert received[-1] == "data: [DONE]"
        error = json.loads(received[-2][len("data: "):])["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_error"
        assert not any('"finish_reason": "' in line for line in received)  # cut off, not finished
        assert process.wait(10) == 0


def _refused(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 503
    except httpx.TransportError:
        return True


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """Send a POST over a plain socket and return the socket, so that a test can hang up whenever it likes."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    connection = socket.create_connection((host, int(port)))
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return connection


def test_a_client_that_gives_up_in_the_queue_leaves_it_and_never_runs(gated_server):
    model = gated_server.model
    aborted = gated_server.metric(ABORTED)
    model.allow(1)
    with long_stream(gated_server) as lines:
        model.wait(lambda m: m.held == 1, "the stream to wait for its second piece")
        impatient = raw_post(gated_server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
        wait_for(lambda: gated_server.metric("specdeploy:num_requests_waiting") == 1, "a queued request")
        impatient.close()  # gone before the model took it
        wait_for(lambda: gated_server.metric("specdeploy:num_requests_waiting") == 0, "the queue to empty")
        assert gated_server.metric(ABORTED) == aborted + 1
        assert gated_server.metric("specdeploy:num_requests_running") == 1  # the stream is still generating
        model.allow(1)
        assert next(line for line in lines if line).startswith("data: ")
    model.open()
    after = gated_server.client().completions.create(model="x", prompt=PROMPT, max_tokens=3, temperature=0)
    assert after.usage.completion_tokens >= 1
    assert model.streams == 2  # the stream and the last request: the one that left the queue never ran


def test_the_serve_command_refuses_bad_input_in_one_line(tmp_path, agreeing_bundle):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cases = [(["serve", str(tmp_path / "missing")], "bundle not found"),
             (["serve", str(agreeing_bundle), "--drafter", "magic"], "'magic' is not one of"),
             (["serve", str(agreeing_bundle), "-k", "0"], "num_draft_tokens"),
             (["serve", str(agreeing_bundle), "--max-queue", "-1"], "max queue"),
             (["serve", str(agreeing_bundle), "--port", str(taken.getsockname()[1])], "cannot listen")]
    try:
        for args, message in cases:
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 2, (args, result.output)
            assert result.stderr.startswith("error: ") and message in result.stderr, (args, result.stderr)
            assert len(result.stderr.strip().splitlines()) == 1
    finally:
        taken.close()


def test_a_bundle_that_fails_to_load_stops_the_server_with_an_error(tmp_path, agreeing_bundle):
    broken = tmp_path / "broken"
    shutil.copytree(agreeing_bundle, broken)
    model = broken / "target" / "model.onnx"
    model.write_bytes(b"\0" * model.stat().st_size)  # same size: the manifest check passes, ONNX Runtime refuses
    result = subprocess.run([sys.executable, "-m", "specdeploy", "serve", str(broken), "--port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: the model did not load")
    assert "Traceback" not in result.stderr


def _post_raw(server, path: str, body) -> httpx.Response:
    """POST a JSON body as json.dumps writes it (ASCII, lone surrogates escaped as \\udXXX: valid JSON)."""
    return httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=30)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "def f(x):\udc80", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2}),
])
def test_a_lone_surrogate_in_the_prompt_is_a_400(server, path, body):
    response = _post_raw(server, path, body)
    assert response.status_code == 400, response.text


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "bad\udc80": 1}),  # "unrecognized request argument: bad\udc80"
    ("/v1/chat/completions", {"messages": [{"role": "x\udc80", "content": "hi"}]}),  # "unknown role 'x\udc80'"
])
def test_an_error_message_echoing_a_lone_surrogate_is_a_400_with_a_json_body(server, path, body):
    response = _post_raw(server, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_deeply_nested_body_is_a_400(server):
    body = "[" * 50_000 + "]" * 50_000  # 100 kB, under the body limit
    response = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == 400, response.text


@pytest.mark.parametrize("extreme", [
    {"temperature": 1e300},  # 1/T would round to 0 in float32 (greedy)
    {"repetition_penalty": 1e-45},  # a positive logit / 1e-45 would be inf
], ids=["temperature", "repetition_penalty"])
def test_sampling_values_out_of_range_are_400s(server, extreme):
    response = httpx.post(server.url + "/v1/completions",
                          json={"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 1, **extreme}, timeout=30)
    assert response.status_code == 400, response.text


def test_time_to_first_token_of_a_plain_response_is_not_its_whole_latency(server):
    """docs/serve.md's example response (not streamed): time_to_first_token_ms 31.6 beside decode_ms 471.7."""
    body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    streamed = [json.loads(line[len("data: "):]) for line in httpx.post(
        server.url + "/v1/completions", json={**body, "stream": True}, timeout=30).text.splitlines()
        if line.startswith("data: {")]
    ext = [c for c in streamed if c.get("specdeploy")][-1]["specdeploy"]
    assert ext["time_to_first_token_ms"] < ext["queue_ms"] + ext["prefill_ms"] + ext["decode_ms"] / 2  # streamed: holds
    ext = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["specdeploy"]
    assert ext["time_to_first_token_ms"] < ext["queue_ms"] + ext["prefill_ms"] + ext["decode_ms"] / 2, ext



def test_a_top_k_past_the_vocabulary_keeps_every_token_as_zero_does(server):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 5}
    huge = httpx.post(server.url + "/v1/completions", json={**body, "top_k": 2**63}, timeout=30)
    assert huge.status_code == 200, huge.text
    off = httpx.post(server.url + "/v1/completions", json={**body, "top_k": 0}, timeout=30).json()
    assert huge.json()["choices"][0]["text"] == off["choices"][0]["text"]
