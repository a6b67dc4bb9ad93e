"""`specdeploy bench --url` (specdeploy/load_test.py): concurrent streaming clients against a running server.

The client's reading of answers is checked against canned event streams (an aiohttp test server); the whole
command against a live server of ours on the tiny chat bundle (test_serve's fixture)."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner

from specdeploy import load_test
from specdeploy.cli import main
from test_serve import chat_bundle, server  # noqa: F401 (fixtures)


def _streamed_request(body: str) -> dict:
    """one_request against a server that answers with this event-stream body."""
    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def answer(request: web.Request) -> web.Response:
        return web.Response(text=body, content_type="text/event-stream")

    async def request() -> dict:
        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        async with TestServer(app) as test_server, aiohttp.ClientSession() as session:
            return await load_test.one_request(session, str(test_server.make_url("")).rstrip("/"),
                                               {"_prompt": 0, "prompt": "x", "stream": True})

    return asyncio.run(request())


def test_an_answer_the_client_cannot_read_fails_its_request_not_the_run():
    """A data line over aiohttp's line limit (LineTooLong, no ClientError) or a chunk without the fields the client
    reads: that request fails, and the cell goes on (it used to raise through gather and lose the run)."""
    for body in ("data: " + "x" * 600_000 + "\n\ndata: [DONE]\n\n", 'data: {"choices": [{"text": "a"}], "usage": {"prompt_tokens": 1}}\n\n'):
        record = _streamed_request(body)
        assert record["ok"] is False and record["status"].startswith("unreadable answer"), record


def test_a_data_line_that_is_not_json_fails_its_request_not_the_run():
    chunk = {"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}
    for bad in ("data: <html>busy</html>", "data: [1, 2]"):
        record = _streamed_request(f"data: {json.dumps(chunk)}\n\n{bad}\n\ndata: [DONE]\n\n")
        assert record["ok"] is False and "not" in record["status"] and bad[6:] in record["error"]


@pytest.mark.parametrize("done", [True, False])
def test_a_stream_cut_short_is_a_failed_request(done):
    """A stream that ends cleanly without [DONE] (a server that dropped it mid-reply) is a failure, not a
    shorter success that raises the cell's rate."""
    chunk = {"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}
    record = _streamed_request(f"data: {json.dumps(chunk)}\n\n" + ("data: [DONE]\n\n" if done else ""))
    assert record["ok"] is done and record["text"] == "ab"


def test_a_chunk_of_several_tokens_spreads_its_gap_over_them():
    """ITL: the gap before a chunk that brought three tokens counts three times, a third each."""
    chunks = [{"choices": [{"index": 0, "text": text}], "usage": {"completion_tokens": tokens}}
              for text, tokens in (("a", 1), ("bcd", 4))]
    record = _streamed_request("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")
    assert record["ok"] and record["tokens"] == 4 and record["usage_per_chunk"] is True
    assert len(record["itl_s"]) == 3 and len(set(record["itl_s"])) == 1 and len(record["chunk_gaps_s"]) == 1
    figures = load_test.cell_figures([record], 1.0, max_tokens=4, ignore_eos=True)
    assert figures["failed"] == 0 and figures["tokens_per_chunk"] == 2.0 and figures["tokens_per_s"] == 4.0
    figures = load_test.cell_figures([record], 1.0, max_tokens=8, ignore_eos=True)  # short of max_tokens: failed
    assert figures["failed"] == 1 and figures["ttft_p50_s"] is None and figures["itl_p50_ms"] is None


def test_bench_url_measures_a_running_server(server):
    """Every cell's requests answered, each one's tokens counted from the chunks' usage (ignore_eos: exactly
    --max-new-tokens), the served model's name sent, completions and chat alike."""
    for chat in ([], ["--chat"]):
        result = CliRunner().invoke(main, ["bench", "--url", server.url, "--concurrency", "1,2", "--requests", "2",
                                           "--max-new-tokens", "4", "--ignore-eos", "--temperature", "0.8", "--json", *chat])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["models"] == {server.url: "tiny"} and report["chat"] is bool(chat)
        assert [(c["concurrency"], c["requests"], c["failed"], c["generated_tokens"]) for c in report["cells"]] == [
            (1, 2, 0, 8), (2, 2, 0, 8)], report["cells"]
        assert all(c["usage_per_chunk"] and c["ttft_p50_s"] > 0 and c["tokens_per_s"] > 0 for c in report["cells"])
    result = CliRunner().invoke(main, ["bench", "--url", server.url + "/", "--concurrency", "2", "--max-new-tokens", "2",
                                       "--repeat", "2", "-k", "2"])
    assert result.exit_code == 0, result.output
    assert "medians of 2 repeats" in result.stdout and "num_draft_tokens 2" in result.stdout
    assert f"| {server.url} | 2 | 8 |" in result.stdout  # 2 repeats of max(4, 2 x 2) requests


def test_whole_answers_are_counted_from_their_usage(server):
    """"stream": false (the load test's --no-stream): each answer's tokens from its usage, and no time to first
    token, inter-token latency or chunk figures made up for it; completions and chat alike."""
    for chat, prompts in ((False, ["def f(x):", "class A:"]), (True, [[{"role": "user", "content": "Hi"}]])):
        bodies = load_test.request_bodies(prompts, 2, chat=chat, max_tokens=4, stream=False, ignore_eos=True,
                                          fields={"temperature": 0.0})
        assert all("stream_options" not in body for body in bodies)
        records, wall_s = asyncio.run(load_test.run_cell(server.url, {}, bodies, 2))
        figures = load_test.cell_figures(records, wall_s, max_tokens=4, ignore_eos=True)
        assert (figures["failed"], figures["generated_tokens"]) == (0, 8), figures["failures"]
        assert figures["latency_p50_s"] > 0 and figures["usage_per_chunk"] is None
        assert figures["ttft_p50_s"] is None and figures["tokens_per_chunk"] is None and figures["itl_p50_ms"] is None
        assert all(record["text"] for record in records)


def test_failed_requests_are_counted_and_noted(monkeypatch):
    async def refused(url, headers, bodies, concurrency):
        return [{"ok": False, "prompt": b["_prompt"], "text": "", "status": 503, "error": "busy"} for b in bodies], 0.5

    monkeypatch.setattr(load_test, "served_model", lambda url, headers: None)
    monkeypatch.setattr(load_test, "run_cell", refused)
    result = CliRunner().invoke(main, ["bench", "--url", "http://127.0.0.1:9", "--concurrency", "1", "--json"])
    assert result.exit_code == 0, result.output
    (cell,) = json.loads(result.stdout.strip().splitlines()[-1])["cells"]
    assert (cell["requests"], cell["failed"], cell["tokens_per_s"], cell["ttft_p50_s"]) == (4, 4, 0.0, None)
    assert "note: 4 of 4 requests failed (first: 503)" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "2"], "--concurrency: only with --url"),
    (["--ignore-eos", "--api-key", "k"], "--ignore-eos, --api-key: only with --url"),
    (["bundle", "--url", "http://127.0.0.1:9"], "drop BUNDLE"),
    (["--url", "http://127.0.0.1:9", "--exact", "--plot", "x.png"], "drop --exact, --plot"),
    (["--url", "http://127.0.0.1:9", "-k", "2,4"], "-k is one number"),
    (["--url", "http://127.0.0.1:9", "--concurrency", "0"], "every level must be at least 1"),
    (["--url", "127.0.0.1:9"], "http://HOST:PORT"),
    (["--url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9"),  # before any cell
])
def test_bench_options_of_the_other_mode_are_one_error_line(args, message):
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr


def test_bench_url_without_the_bench_extra_names_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "aiohttp", None)  # as on an install without the extra
    monkeypatch.delitem(sys.modules, "specdeploy.load_test")
    result = CliRunner().invoke(main, ["bench", "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "needs the bench extra (aiohttp is not installed): pip install '.[bench]'" in result.stderr
