"""The request fields clients send, exact under speculation: `logprobs` / `top_logprobs` in OpenAI's
completions and chat layouts, streamed or not, equal to the Python API's for the same request; `n`
choices, each what `generate` gives its seed (choice i: seed + i), streamed interleaved with their
own index and finishing chunk; bad values answered 400 naming the field; a disconnect cancels
every choice and one failing choice fails the request.

Servers run in this process on the tiny chat bundle (test_serve.py). Tests wait on the gates of
GatedModel and on the server's counters, never on the clock.
"""

from __future__ import annotations

import httpx
import pytest

import specdeploy
from specdeploy.runtime.config import SEED_LIMIT
from specdeploy.serve import ServeConfig
from test_serve import (MESSAGES, PROMPT, GatedModel, LiveServer, cancelled, chat_bundle,  # noqa: F401 (a fixture)
                        sse_chunks, wait_for)

from specdeploy.runtime.config import TokenLogprob
from specdeploy.runtime.token_text import TokenText
from specdeploy.serve.logprobs import ChoiceLogprobs

ABORTED = 'specdeploy:request_finished_total{finished_reason="abort"}'
SAMPLED = {"temperature": 1.0, "top_p": 0.9, "seed": 11}


def test_token_bytes_are_the_tokenizers_own(tokenizer_dir):
    from tokenizers import Tokenizer, decoders, models

    byte_level = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))  # GPT-2's byte alphabet
    names = TokenText(byte_level)
    for token_id in range(byte_level.get_vocab_size()):
        expected = byte_level.decode([token_id], skip_special_tokens=False)
        assert names.bytes(token_id).decode("utf-8", errors="replace") == expected, token_id
    assert names.text(byte_level.token_to_id("\u0124")) == "bytes:\\x82"  # a lone continuation byte
    vocab = {"<unk>": 0, "<0xE2>": 1, "<0x80>": 2, "<0x99>": 3, "\u2581hi": 4, "there": 5}  # SentencePiece style
    pieces = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    pieces.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    names = TokenText(pieces)
    assert [names.bytes(i) for i in (4, 5, 1)] == [b" hi", b"there", b"\xe2"]
    assert b"".join(names.bytes(i) for i in (4, 1, 2, 3)).decode() == pieces.decode([4, 1, 2, 3]) == " hi\u2019"


class FakeTokens:
    special = frozenset({9})
    leading_strip = 0

    def bytes(self, token_id: int) -> bytes:
        return {1: b"ab", 2: b"\xdd", 3: b"Q", 4: b"\xe2", 5: b"\x80", 6: b"\x99x", 9: b"</s>"}[token_id]


def test_a_choices_tokens_leave_with_the_text_they_make():
    stream = ChoiceLogprobs(FakeTokens())
    entry = {i: TokenLogprob(i, -1.0) for i in (1, 2, 3, 4, 5, 6, 9)}
    stream.add([entry[1], entry[2]])  # "ab", then a byte that may start a character
    assert [(e.token_id, start) for e, start in stream.take(2)] == [(1, 0)]  # the open byte waits
    stream.add([entry[3], entry[4], entry[5]])  # "Q" shows the byte was not a character's start: "\ufffdQ"
    assert [(e.token_id, start) for e, start in stream.take(4)] == [(2, 2), (3, 3)]
    stream.add([entry[6], entry[9]])  # "\x99x" completes the open character: "\u2019x"; then an EOS, no text
    assert [(e.token_id, start) for e, start in stream.take(5)] == []  # "\u2019" sent, "x" not yet
    assert [(e.token_id, start) for e, start in stream.take(6)] == [(4, 4), (5, 4), (6, 4), (9, 6)]
    assert stream.rest([entry[1]] * 7) == []  # everything taken; rest() adds what add() has not seen


@pytest.fixture(scope="module")
def generator(chat_bundle):
    return specdeploy.load(chat_bundle)


@pytest.fixture(scope="module")
def batched(chat_bundle):
    """The server's default: up to 8 sequences decode together."""
    live = LiveServer(ServeConfig(bundle=str(chat_bundle)))
    yield live
    live.close()


@pytest.fixture(scope="module")
def serial(chat_bundle):
    """One KV slot: each choice runs alone, as generate runs it."""
    live = LiveServer(ServeConfig(bundle=str(chat_bundle), max_batch=1))
    yield live
    live.close()


def post(server, path: str, body: dict) -> dict:
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def token_text(generator, token_id: int) -> str | None:
    """The tokenizer's own text of one token (None where it is not whole UTF-8 characters)."""
    text = generator.codec.tokenizer.decode([token_id], skip_special_tokens=False)
    return None if "\ufffd" in text else text


def check_completion_layout(layout: dict, expected, generator, top: int) -> None:
    """A completions `logprobs` object against the runtime's TokenLogprobs for the same request."""
    entries = expected.logprobs
    assert layout["token_logprobs"] == pytest.approx([e.logprob for e in entries], abs=1e-4)
    for name, entry in zip(layout["tokens"], entries):
        assert token_text(generator, entry.token_id) in (None, name)
    for best, entry in zip(layout["top_logprobs"], entries):  # the `top` likeliest, then the token itself (OpenAI's)
        chosen = [] if entry.token_id in [token_id for token_id, _ in entry.top] else [entry.logprob]
        assert len(best) == top + len(chosen)
        assert list(best.values()) == pytest.approx([logprob for _, logprob in entry.top] + chosen, abs=1e-4)
    offsets = layout["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(expected.text)
    for index, offset in enumerate(offsets):  # where the prefix decodes to whole characters, exactly its length
        prefix = generator.codec.decode(expected.token_ids[:index])
        if "\ufffd" not in prefix:
            assert offset == len(prefix)


def check_chat_layout(layout: dict, expected, generator, top: int) -> None:
    """A chat `logprobs` object: the same values, each token's bytes the tokenizer's."""
    content = layout["content"]
    assert [c["logprob"] for c in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    special = generator.codec.added_token_ids()
    text_bytes = b"".join(bytes(c["bytes"]) for c, e in zip(content, expected.logprobs) if e.token_id not in special)
    assert text_bytes.decode("utf-8", errors="replace") == expected.text  # the bytes are the text's
    for item, entry in zip(content, expected.logprobs):
        assert token_text(generator, entry.token_id) in (None, item["token"])
        assert len(item["top_logprobs"]) == top
        assert [t["logprob"] for t in item["top_logprobs"]] == pytest.approx([lp for _, lp in entry.top], abs=1e-4)
        assert all(isinstance(t["token"], str) and isinstance(t["bytes"], list) for t in item["top_logprobs"])


def merged(chunks: list[dict], index: int, chat: bool) -> tuple[str, dict]:
    """One choice's text and logprobs, put together from a stream's chunks."""
    text, layout = "", {"content": []} if chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                       "text_offset": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            for key, values in (choice["logprobs"] or {}).items():
                layout[key] += values
    return text, layout


@pytest.mark.parametrize("settings", [{"temperature": 0}, SAMPLED], ids=["greedy", "sampled"])
def test_completion_logprobs_are_the_runtimes_streamed_or_not(batched, generator, settings):
    expected = generator.generate(PROMPT, max_new_tokens=24, logprobs=3, **settings)
    body = {"prompt": PROMPT, "max_tokens": 24, "logprobs": 3, **settings}
    [choice] = post(batched, "/v1/completions", body)["choices"]
    assert choice["text"] == expected.text
    check_completion_layout(choice["logprobs"], expected, generator, top=3)
    chunks = sse_chunks(batched.url + "/v1/completions", {**body, "stream": True})
    text, layout = merged(chunks, 0, chat=False)
    assert text == expected.text and layout == choice["logprobs"]
    sent = 0
    for chunk in chunks:  # a chunk carries the tokens whose text it completes
        text, layout = chunk["choices"][0]["text"], chunk["choices"][0]["logprobs"] or {}
        assert all(sent <= offset <= sent + len(text) for offset in layout.get("text_offset", [])) or not text
        if text and not any(name.startswith("bytes:") for name in layout.get("tokens", [])):
            assert "".join(layout["tokens"]) == text
        sent += len(text)
    # logprobs=0: the chosen tokens' only
    [bare] = post(batched, "/v1/completions", {**body, "logprobs": 0})["choices"]
    assert bare["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"]
    assert bare["logprobs"]["top_logprobs"] == [{name: logprob} for name, logprob in
                                                zip(bare["logprobs"]["tokens"], bare["logprobs"]["token_logprobs"])]
    assert post(batched, "/v1/completions", {**body, "logprobs": None})["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("settings", [{"temperature": 0}, SAMPLED], ids=["greedy", "sampled"])
def test_chat_logprobs_are_the_runtimes_streamed_or_not(batched, generator, settings):
    expected = generator.generate(messages=MESSAGES, max_new_tokens=24, logprobs=2, **settings)
    body = {"messages": MESSAGES, "max_tokens": 24, "logprobs": True, "top_logprobs": 2, **settings}
    [choice] = post(batched, "/v1/chat/completions", body)["choices"]
    assert choice["message"]["content"] == expected.text
    check_chat_layout(choice["logprobs"], expected, generator, top=2)
    if settings["temperature"] == 0:  # greedy: each token is its position's most likely
        assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in choice["logprobs"]["content"])
    chunks = sse_chunks(batched.url + "/v1/chat/completions", {**body, "stream": True})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["choices"][0]["logprobs"] is None
    text, layout = merged(chunks, 0, chat=True)
    assert text == expected.text and layout == choice["logprobs"]
    # logprobs without top_logprobs: no alternatives
    [bare] = post(batched, "/v1/chat/completions", {**body, "top_logprobs": None})["choices"]
    assert [c["top_logprobs"] for c in bare["logprobs"]["content"]] == [[]] * len(expected.token_ids)


def test_n_choices_are_each_what_generate_gives_their_seed(serial, generator):
    seed = SEED_LIMIT - 2  # choices 2 and 3 wrap around to seeds 0 and 1
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": seed, "n": 4, "logprobs": 1}
    response = post(serial, "/v1/completions", body)
    choices = response["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert len({c["text"] for c in choices}) == 4
    expected = [generator.generate(PROMPT, max_new_tokens=16, temperature=1.0, seed=(seed + i) % SEED_LIMIT,
                                   logprobs=1) for i in range(4)]
    for choice, alone in zip(choices, expected):
        assert choice["text"] == alone.text
        check_completion_layout(choice["logprobs"], alone, generator, top=1)
    usage = response["usage"]
    assert usage["prompt_tokens"] == len(generator.codec.encode(PROMPT))  # the prompt, once
    assert usage["completion_tokens"] == sum(len(alone.token_ids) for alone in expected)
    extension = response["specdeploy"]
    assert [c["seed"] for c in extension["choices"]] == [seed, seed + 1, 0, 1]
    assert extension["drafted_tokens"] == sum(c["drafted_tokens"] for c in extension["choices"])
    # Streamed: the same choices, each ending with its own finishing chunk, then usage and [DONE].
    chunks = sse_chunks(serial.url + "/v1/completions", {**body, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    for index, alone in enumerate(expected):
        text, layout = merged(chunks, index, chat=False)
        assert text == alone.text and layout == choices[index]["logprobs"]
    finishing = [chunk for chunk in chunks if chunk["choices"] and chunk["choices"][0]["finish_reason"]]
    assert sorted(chunk["choices"][0]["index"] for chunk in finishing) == [0, 1, 2, 3]
    assert [chunk["specdeploy"]["seed"] for chunk in sorted(finishing, key=lambda c: c["choices"][0]["index"])] \
        == [seed, seed + 1, 0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage


def test_n_choices_decode_together_each_exact(batched, generator):
    greedy = generator.generate(PROMPT, max_new_tokens=20, temperature=0, logprobs=0)
    response = post(batched, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "n": 4,
                                                 "logprobs": 0})
    for choice in response["choices"]:  # greedy: every choice is run's output, token for token
        assert choice["text"] == greedy.text
        assert choice["logprobs"]["token_logprobs"] == pytest.approx([e.logprob for e in greedy.logprobs], abs=1e-4)
    sampled = post(batched, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 3,
                                                "n": 4})
    assert len({c["text"] for c in sampled["choices"]}) == 4
    # No seed: each choice draws its own.
    unseeded = post(batched, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 3})
    assert len({c["seed"] for c in unseeded["specdeploy"]["choices"]}) == 3


def test_n_chat_choices_stream_interleaved_with_their_index(batched, generator):
    expected = generator.generate(messages=MESSAGES, max_new_tokens=24, temperature=0)
    chunks = sse_chunks(batched.url + "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "n": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    roles = [chunk["choices"][0]["index"] for chunk in chunks if chunk["choices"]
             and chunk["choices"][0]["delta"].get("role") == "assistant"]
    assert roles == [0, 1, 2]  # each choice opens with the assistant's role
    for index in range(3):
        mine = [i for i, chunk in enumerate(chunks) if chunk["choices"] and chunk["choices"][0]["index"] == index]
        ends = [i for i in mine if chunks[i]["choices"][0]["finish_reason"]]
        assert ends == [mine[-1]]  # one finishing chunk, after the choice's last text
        assert merged(chunks, index, chat=True)[0] == expected.text
    indices = [chunk["choices"][0]["index"] for chunk in chunks if chunk["choices"]]
    assert indices != sorted(indices)  # interleaved: the choices decoded together
    assert chunks[-1]["usage"]["completion_tokens"] == 3 * len(expected.token_ids)
    assert chunks[-1]["usage"]["prompt_tokens"] == len(generator.encode_chat(MESSAGES))


def test_the_openai_client_reads_choices_and_logprobs(batched):
    client = batched.client()
    out = client.completions.create(model="x", prompt=PROMPT, max_tokens=8, n=2, seed=1, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) == len(c.logprobs.text_offset) >= 1
               for c in out.choices)
    # Greedy, so that the stream is the same reply (sampled choices decoding together are exact samples,
    # not always the same ones: see docs/serve.md on seed).
    reply = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=8, n=2, temperature=0,
                                           logprobs=True, top_logprobs=3)
    assert all(len(t.top_logprobs) == 3 and t.bytes for c in reply.choices for t in c.logprobs.content)
    streamed: dict[int, list] = {0: [], 1: []}
    for chunk in client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=8, n=2, temperature=0,
                                                logprobs=True, top_logprobs=3, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.logprobs.content if choice.logprobs else []
    for choice in reply.choices:  # the same tokens; rows from passes of other shapes agree within 1e-4
        assert [t.token for t in streamed[choice.index]] == [t.token for t in choice.logprobs.content]
        assert [t.logprob for t in streamed[choice.index]] == pytest.approx(
            [t.logprob for t in choice.logprobs.content], abs=1e-4)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": 17}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": "2"}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": True}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "top_logprobs": 2}, "top_logprobs"),  # chat's field
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 20, "stream": True}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["ok", "x" * 1001]}, "stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": ""}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 400}]}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "max_completion_tokens": -3}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
])
def test_bad_field_values_are_400s_naming_the_field(batched, path, body, param):
    response = httpx.post(batched.url + path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.fixture
def gated(chat_bundle):
    """A server whose every text piece waits at the test's gate (server.model)."""
    model = GatedModel(specdeploy.load(chat_bundle, max_batch=8))
    live = LiveServer(ServeConfig(bundle=str(chat_bundle)), load=lambda: model)
    live.model = model
    yield live
    model.open()
    live.close()


def test_a_disconnect_cancels_every_choice(gated):
    model, aborted = gated.model, gated.metric(ABORTED)
    model.allow(3)  # one step's pieces for each choice: a gate holds the worker inside a step
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "n": 3, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", gated.url + "/v1/completions", json=body) as response:
            assert next(response.iter_lines()).startswith("data: ")
            model.wait(lambda m: m.held == 1, "the next piece to wait at the gate")
    wait_for(lambda: cancelled(gated), "the server to see the disconnect")
    model.open()
    wait_for(lambda: gated.metric(ABORTED) == aborted + 3, "all three choices to stop")
    assert model.streams == 3 and gated.metric("specdeploy:num_requests_running") == 0
    assert not gated.service.worker.backend.scheduler.active  # no sequence left decoding
    after = post(gated, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "n": 2})
    assert len(after["choices"]) == 2


class FailingChoice:
    """The real generator, whose `which`-th sequence fails in its first round (one choice of a request)."""

    def __init__(self, generator, which: int):
        self.generator, self.which, self.made = generator, which, 0

    def __getattr__(self, name):
        return getattr(self.generator, name)

    def new_sequence(self, prompt, **options):
        sequence = self.generator.new_sequence(prompt, **options)
        self.made += 1
        if self.made == self.which:
            def emit(tokens, logits=None):
                raise RuntimeError("injected choice failure")

            sequence.emit = emit
        return sequence


def test_one_failing_choice_fails_the_request(chat_bundle):
    model = FailingChoice(specdeploy.load(chat_bundle, max_batch=8), which=2)
    live = LiveServer(ServeConfig(bundle=str(chat_bundle)), load=lambda: model)
    try:
        failed = httpx.post(live.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 30, "n": 3}, timeout=30)
        assert failed.status_code == 500 and "injected choice failure" in failed.json()["error"]["message"]
        assert not live.service.worker.backend.scheduler.active  # the other choices left too
        assert httpx.get(live.url + "/health").json() == {"status": "ok"}
        assert len(post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 2})["choices"]) == 2
    finally:
        live.close()


def sentencepiece_tokenizer(decoder: str):
    """A SentencePiece-style tokenizer. Llama 2's tokenizer.json decoder ends with Strip(" ", 1, 0), newer
    ones are Metaspace(prepend_scheme="first"): both drop the leading space of whatever they decode, a
    single token included; Gemma's keeps it."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "\u2581hi": 1, "\u2581there": 2, "\u2581": 3, "1": 4}
    pieces = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    pieces.decoder = {"llama2": decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)]), "gemma": decoders.Sequence(steps),
                      "metaspace": decoders.Metaspace(replacement="\u2581", prepend_scheme="first")}[decoder]
    return pieces


@pytest.mark.parametrize("decoder", ["llama2", "metaspace"])
def test_sentencepiece_token_bytes_keep_their_space(decoder):
    """docs/serve.md: a token's bytes are the tokenizer's own, SentencePiece's \u2581 as a space."""
    pieces = sentencepiece_tokenizer(decoder)
    assert pieces.decode([1, 2]) == "hi there"
    names = TokenText(pieces)
    assert names.bytes(2) == b" there"


@pytest.mark.parametrize("decoder", ["llama2", "metaspace", "gemma"])
def test_sentencepiece_offsets_are_in_the_text_the_decoder_writes(decoder):
    """The choice's text drops the leading space where the decoder does; each token's text_offset is
    where it starts in that text, and a stream's chunk carries its tokens, not one chunk late."""
    pieces = sentencepiece_tokenizer(decoder)
    ids = [3, 3, 1, 2, 3, 4]
    stream = ChoiceLogprobs(TokenText(pieces))
    sent = []
    for count in range(1, len(ids) + 1):
        stream.add([TokenLogprob(ids[count - 1], -1.0)])
        text = pieces.decode(ids[:count])
        sent += stream.take(len(text))
        assert len(sent) == count, (count, text)
    assert [start for _, start in sent] == [len(pieces.decode(ids[:i])) for i in range(len(ids))]


def test_prompt_tokens_metric_counts_a_shared_prompt_once(batched):
    """usage counts the prompt of n choices once (they share one prefill), and so does vLLM's prompt_tokens_total."""
    before = batched.metric("specdeploy:prompt_tokens_total")
    response = post(batched, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "n": 4})
    counted = batched.metric("specdeploy:prompt_tokens_total") - before
    assert counted == response["usage"]["prompt_tokens"], (counted, response["usage"])


def test_completion_top_logprobs_always_hold_the_sampled_token(batched):
    """OpenAI's legacy completions: "The API will always return the logprob of the sampled token, so there may be
    up to logprobs+1 elements" in each top_logprobs entry (vLLM does the same); logprobs=0 gives the sampled token's."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 11}
    for count in (1, 0):
        layout = post(batched, "/v1/completions", {**body, "logprobs": count})["choices"][0]["logprobs"]
        for token, logprob, best in zip(layout["tokens"], layout["token_logprobs"], layout["top_logprobs"]):
            assert len(best) <= count + 1
            assert token in best and best[token] == pytest.approx(logprob, abs=1e-6), (count, token, best)
