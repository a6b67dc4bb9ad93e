"""`specdeploy bench --url`: concurrent streaming clients against a running OpenAI-compatible server (ours,
llama.cpp's llama-server, vLLM, ...): generated tokens/s, time to first token, inter-token latency, failures.

A cell is one server at one concurrency: `requests` requests (default max(4, 2 x concurrency)) sent by that many
clients at a time, each taking the next request as its last one ends. Request i carries prompt i mod the number
of prompts and the seed `seed + that prompt's index`, so a prompt gets the same seed in every cell. The servers'
cells alternate (A B, then B A at the next level), so their ratios come from one run. Per cell:

- tokens/s: every generated token over the cell's wall time;
- TTFT: sending a request -> its first chunk with text;
- ITL: one chunk may carry several tokens (a speculative round), so each gap between chunks is divided by the
  tokens it brought (each chunk's `usage`, asked for with stream_options.continuous_usage_stats, vLLM's; a
  server that sends none is counted one token a chunk);
- failed: an answer other than 200, an error in the stream, a stream cut short of [DONE], an answer this client
  cannot read, or (with ignore_eos) fewer tokens than max_tokens.

The clients read the streams with aiohttp (the bench extra), whose HTTP parser is C: on a machine the client
shares with the server, what the client spends per chunk comes out of the server's cores. Nothing of the
runtime imports this module.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np

from .errors import SpecdeployError


@dataclass(frozen=True)
class LoadTestConfig:
    urls: tuple[str, ...]  # base URLs, as http://HOST:PORT (the /v1 paths are added)
    prompts: tuple  # texts (/v1/completions), or message lists with chat
    chat: bool = False  # send the prompts to /v1/chat/completions as message lists
    concurrency: tuple[int, ...] = (1, 2, 4, 8)  # concurrent clients of each cell
    requests: int | None = None  # per cell; None: max(4, 2 x concurrency)
    max_tokens: int = 128
    ignore_eos: bool = False  # "ignore_eos": true (vLLM's and llama-server's): exactly max_tokens each
    stream: bool = True  # False: whole answers (no TTFT, ITL or chunks), what streaming costs measured apart
    repeat: int = 1  # every cell this many times; the table gives medians
    seed: int = 0
    fields: dict = field(default_factory=dict)  # more body fields, as sent (temperature, top_p, num_draft_tokens, ...)
    api_key: str | None = None
    model: str | None = None  # the body's "model"; None: the first id /v1/models lists, if any

    def __post_init__(self):
        if not self.urls or not all(url.startswith(("http://", "https://")) for url in self.urls):
            raise SpecdeployError(f"a server URL is http://HOST:PORT or https://HOST:PORT (got {', '.join(self.urls) or 'none'})")
        if not self.prompts:
            raise SpecdeployError("no prompts to send")
        for name in ("requests", "max_tokens", "repeat"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise SpecdeployError(f"{name.replace('_', ' ')} must be at least 1 (got {getattr(self, name)})")
        if not self.concurrency or min(self.concurrency) < 1:
            raise SpecdeployError(f"every concurrency must be at least 1 (got {', '.join(map(str, self.concurrency))})")

    def count(self, concurrency: int) -> int:
        return self.requests or max(4, 2 * concurrency)


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # as aiohttp's session: no proxy from the environment


def headers_for(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(url: str, headers: dict) -> str | None:
    """The first model id the server's /v1/models lists (vLLM refuses a request without one), None where it lists
    none or has no such route; a server that cannot be reached fails here, before any cell."""
    request = urllib.request.Request(url + "/v1/models", headers=headers)
    try:
        with _DIRECT.open(request, timeout=30) as response:
            data = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code in (401, 403):
            raise SpecdeployError(f"{url} refused the API key ({exc.code}): pass the server's key with --api-key") from None
        return None
    except (urllib.error.URLError, OSError) as exc:
        raise SpecdeployError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    except ValueError:
        return None
    models = data.get("data") if isinstance(data, dict) else None
    first = models[0] if isinstance(models, list) and models and isinstance(models[0], dict) else {}
    return first.get("id") if isinstance(first.get("id"), str) else None


def request_bodies(prompts, count: int, *, chat: bool, max_tokens: int, stream: bool = True, ignore_eos: bool = False,
                   seed: int = 0, fields: dict | None = None) -> list[dict]:
    """`count` request bodies over the prompts in turn; "_prompt" (the prompt's index) is the client's, not sent."""
    bodies = []
    for i in range(count):
        index = i % len(prompts)
        body = {"max_tokens": max_tokens, "stream": stream, "seed": (seed + index) % 2**64, "_prompt": index,
                "messages" if chat else "prompt": prompts[index], **(fields or {})}
        if stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        if ignore_eos:
            body["ignore_eos"] = True
        bodies.append(body)
    return bodies


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One request: its text, tokens, time to first text, and (time, tokens so far) per chunk where it streams
    (a request with "stream": false has neither a first text nor chunks: its whole answer comes at once)."""
    chat = "messages" in body
    start = time.perf_counter()
    record = {"ok": False, "prompt": body["_prompt"], "text": ""}
    payload = {k: v for k, v in body.items() if not k.startswith("_")}
    marks: list[tuple[float, int]] = []  # (arrival, tokens so far) of each chunk that brought text or tokens
    streamed = bool(payload.get("stream"))
    try:
        async with session.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=payload) as response:
            if response.status != 200:
                return {**record, "status": response.status, "error": (await response.text(errors="replace"))[:200]}
            failure = await (_read_stream(response, record, marks, chat) if streamed else _read_whole(response, record, chat))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {**record, "status": f"transport: {exc!r}"[:200]}
    except Exception as exc:  # noqa: BLE001 - an answer this client cannot read (a line over aiohttp's limit,
        # a field missing) fails its request, not the run
        return {**record, "status": f"unreadable answer: {exc!r}"[:200]}
    if failure is not None:
        return {**record, **failure}
    end = time.perf_counter()
    tokens = record.get("tokens", marks[-1][1] if marks else 0)
    record.update(ok=True, tokens=tokens, latency_s=end - start, itl_s=[], chunk_gaps_s=[],
                  first_token_s=((marks[0][0] if marks else end) - start) if streamed else None)
    for (t0, n0), (t1, n1) in zip(marks, marks[1:]):
        record["chunk_gaps_s"].append(t1 - t0)
        record["itl_s"] += [(t1 - t0) / (n1 - n0)] * (n1 - n0) if n1 > n0 else [t1 - t0]
    return record


async def _read_stream(response, record: dict, marks: list, chat: bool) -> dict | None:
    """Read an event stream into record and marks; a failure's status and error, or None."""
    counted = 0  # tokens so far when the server sends no usage per chunk: one a chunk with text
    record["usage_per_chunk"] = False
    finished = False  # the stream's [DONE]: one that ends without it was cut short, not served
    async for raw in response.content:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        finished = finished or line == "data: [DONE]"
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        now = time.perf_counter()
        try:
            chunk = json.loads(line[len("data: "):])
        except ValueError:  # this request failed, not the run
            return {"status": "a data line that is not JSON", "error": line[:200]}
        if not isinstance(chunk, dict):
            return {"status": "a data line that is not a JSON object", "error": line[:200]}
        if "error" in chunk:
            return {"status": "stream error", "error": str(chunk["error"])[:200]}
        choice = chunk["choices"][0] if chunk.get("choices") else {}
        text = ((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or ""
        record["text"] += text
        usage = chunk.get("usage")
        if choice and usage:
            record["usage_per_chunk"] = record["usage_per_chunk"] or bool(text)  # usage beside text: every chunk
            so_far = usage["completion_tokens"]
        else:
            counted += bool(text)
            so_far = counted
        if (so_far > (marks[-1][1] if marks else 0)) or (text and not marks):
            marks.append((now, so_far))
        if usage and not choice:  # the closing usage chunk
            record["tokens"] = usage["completion_tokens"]
        if "specdeploy" in chunk:
            record["extension"] = chunk["specdeploy"]
    return None if finished else {"status": "stream ended without [DONE]"}


async def _read_whole(response, record: dict, chat: bool) -> dict | None:
    """Read a whole (non-streamed) answer into record; a failure's status and error, or None."""
    body = await response.text(errors="replace")
    try:
        answer = json.loads(body)
    except ValueError:
        return {"status": "an answer that is not JSON", "error": body[:200]}
    if not isinstance(answer, dict) or not answer.get("choices") or not isinstance(answer.get("usage"), dict):
        return {"status": "an answer without choices and usage", "error": str(answer)[:200]}
    choice = answer["choices"][0]
    record["text"] = ((choice.get("message") or {}).get("content") if chat else choice.get("text")) or ""
    record["tokens"], record["usage_per_chunk"] = answer["usage"]["completion_tokens"], None
    if "specdeploy" in answer:
        record["extension"] = answer["specdeploy"]
    return None


async def run_cell(url: str, headers: dict, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    """Send every body with `concurrency` clients at a time; the records and the wall time."""
    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    records: list[dict] = []
    # A connection per request: a server that closes an idle kept-alive connection (llama-server does) would
    # otherwise fail the next request sent on it.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    # No limit on a whole request (one may wait long in a sequential server's queue), 900 s between reads.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60.0, sock_read=900.0)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as session:
        async def client_loop() -> None:
            while not queue.empty():
                records.append(await one_request(session, url, queue.get_nowait()))

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall_s = time.perf_counter() - start
    return records, wall_s


def percentile(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def cell_figures(records: list[dict], wall_s: float, max_tokens: int, ignore_eos: bool) -> dict:
    """One cell's figures; a figure no request measured is None (0 would read as an instant one)."""
    ok = [r for r in records if r["ok"] and (not ignore_eos or r["tokens"] == max_tokens)]
    failures = [r.get("status", f"{r.get('tokens')} tokens") for r in records if r not in ok]
    first = [r["first_token_s"] for r in ok if r["first_token_s"] is not None]  # streamed requests only
    itl = [g for r in ok for g in r["itl_s"]]
    extensions = [r["extension"] for r in ok if "extension" in r]  # specdeploy's own counts, where it serves
    drafted = sum(e.get("drafted_tokens", 0) for e in extensions)
    tokens = sum(r["tokens"] for r in records if r["ok"])
    return {
        "requests": len(records), "failed": len(failures), "failures": failures[:5], "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s, "generated_tokens": tokens,
        "ttft_p50_s": percentile(first, 50), "ttft_p99_s": percentile(first, 99),
        "itl_p50_ms": _ms(percentile(itl, 50)), "itl_p99_ms": _ms(percentile(itl, 99)),
        "chunk_gap_p50_ms": _ms(percentile([g for r in ok for g in r["chunk_gaps_s"]], 50)),
        "tokens_per_chunk": sum(r["tokens"] for r in ok) / sum(len(r["chunk_gaps_s"]) + 1 for r in ok) if first else None,
        "usage_per_chunk": all(r["usage_per_chunk"] for r in ok) if first else None,
        "latency_p50_s": percentile([r["latency_s"] for r in ok], 50),
        "acceptance_rate": sum(e.get("accepted_tokens", 0) for e in extensions) / drafted if drafted else None,
    }


def run_load_test(config: LoadTestConfig, progress=None) -> dict:
    """Every cell of every server, the servers alternating; the report (config and cells) as data."""
    headers = headers_for(config.api_key)
    models = {url: config.model or served_model(url, headers) for url in config.urls}  # every server reached first
    cells = []
    for repeat in range(config.repeat):
        for turn, level in enumerate(config.concurrency):
            for url in config.urls if (turn + repeat) % 2 == 0 else config.urls[::-1]:
                model = {"model": models[url]} if models[url] else {}
                bodies = request_bodies(config.prompts, config.count(level), chat=config.chat, max_tokens=config.max_tokens,
                                        stream=config.stream, ignore_eos=config.ignore_eos, seed=config.seed,
                                        fields={**model, **config.fields})
                records, wall_s = asyncio.run(run_cell(url, headers, bodies, level))
                cell = {"url": url, "concurrency": level, "repeat": repeat,
                        **cell_figures(records, wall_s, config.max_tokens, config.ignore_eos)}
                cells.append(cell)
                if progress:
                    progress(f"{url} concurrency {level}: {cell['tokens_per_s']:.1f} tok/s, {cell['failed']} failed")
    order = {url: i for i, url in enumerate(config.urls)}
    cells.sort(key=lambda c: (order[c["url"]], c["concurrency"], c["repeat"]))
    settings = {k: v for k, v in asdict(config).items() if k not in ("prompts", "api_key")}
    return {**settings, "models": models, "prompts": len(config.prompts), "cells": cells}


def _fixed(value: float | None, digits: int, scale: float = 1.0) -> str:
    return "" if value is None else f"{scale * value:.{digits}f}"


def load_test_table(report: dict) -> str:
    """The report as a Markdown table: one row per server and concurrency, medians over the repeats."""
    lines = [f"{report['max_tokens']}-token outputs{' (ignore_eos)' if report['ignore_eos'] else ''}"
             f"{'' if report['stream'] else ', not streamed'}, {report['prompts']} "
             f"{'chat' if report['chat'] else 'completion'} prompts"
             + (f", {', '.join(f'{k} {v}' for k, v in report['fields'].items())}" if report["fields"] else "")
             + (f"; medians of {report['repeat']} repeats" if report["repeat"] > 1 else ""), "",
             "| server | streams | requests | gen tok/s | p50 TTFT ms | p99 TTFT ms | p50 ITL ms | p99 ITL ms | tokens/chunk "
             "| acceptance | failed |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    groups: dict = {}
    for cell in report["cells"]:
        groups.setdefault((cell["url"], cell["concurrency"]), []).append(cell)
    for (url, level), group in groups.items():
        figure = {key: median(c[key] for c in group) for key in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_ms",
                                                                 "itl_p99_ms", "tokens_per_chunk", "acceptance_rate")}
        lines.append(f"| {url} | {level} | {sum(c['requests'] for c in group)} | {_fixed(figure['tokens_per_s'], 1)} | "
                     f"{_fixed(figure['ttft_p50_s'], 0, 1000)} | {_fixed(figure['ttft_p99_s'], 0, 1000)} | "
                     f"{_fixed(figure['itl_p50_ms'], 1)} | {_fixed(figure['itl_p99_ms'], 1)} | "
                     f"{_fixed(figure['tokens_per_chunk'], 2)} | {_fixed(figure['acceptance_rate'], 2)} | "
                     f"{sum(c['failed'] for c in group)} |")
    return "\n".join(lines)
