"""How long a well-behaved client's 2-token request takes while hostile clients load the server.

Starts `specdeploy serve BUNDLE` (the checkout's package: run it from the checkout's root),
then, for each scenario, keeps the hostile load running while a second client sends 2-token
completions one after another, and reports their latency against the same requests on an idle
server:

  huge-prompts   8 clients each sending a 1 MB prompt again and again (each refused: past the context)
  trickle        30 connections sending a header line every 2 s
  slow-bodies    30 requests whose bodies stop short of their Content-Length
  idle-flood     400 connections opened and left silent

    python -m benchmarks.hostile_load BUNDLE --requests 10 --json-out hostile.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

import httpx

from .servers import start_server, stop_server

SHORT = {"prompt": "def f(x):", "max_tokens": 2, "temperature": 0}
SCENARIOS = ("huge-prompts", "trickle", "slow-bodies", "idle-flood")


def latencies(url: str, count: int) -> list[float]:
    out = []
    with httpx.Client(timeout=120) as client:
        for _ in range(count):
            start = time.perf_counter()
            response = client.post(url + "/v1/completions", json=SHORT)
            out.append(time.perf_counter() - start)
            if response.status_code != 200:
                raise SystemExit(f"the short request got {response.status_code}: {response.text[:200]}")
    return out


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def huge_prompts(url: str, stop: threading.Event) -> list[threading.Thread]:
    body = json.dumps({"prompt": "word " * 200_000, "max_tokens": 2}).encode()  # 1 MB

    def client() -> None:
        with httpx.Client(timeout=300) as session:
            while not stop.is_set():
                session.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})

    return [threading.Thread(target=client, daemon=True) for _ in range(8)]


def _reconnecting(url: str, stop: threading.Event, conversation, count: int) -> list[threading.Thread]:
    """count clients, each holding a connection through conversation(connection) and opening another once the
    server closes it, until stop."""
    def client() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(address(url), timeout=60) as connection:
                    conversation(connection)
            except OSError:
                pass  # closed by the server: open another

    return [threading.Thread(target=client, daemon=True) for _ in range(count)]


def trickle(url: str, stop: threading.Event) -> list[threading.Thread]:
    def conversation(connection) -> None:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        while not stop.is_set():
            stop.wait(2.0)
            connection.sendall(b"X-Slow: 1\r\n")

    return _reconnecting(url, stop, conversation, 30)


def slow_bodies(url: str, stop: threading.Event) -> list[threading.Thread]:
    def conversation(connection) -> None:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        connection.recv(4096)  # the server's answer, or its close

    return _reconnecting(url, stop, conversation, 30)


def idle_flood(url: str, stop: threading.Event) -> list[threading.Thread]:
    def client() -> None:
        held = []
        while not stop.is_set():
            held = [connection for connection in held if connection.fileno() != -1]
            while len(held) < 400 and not stop.is_set():
                try:
                    held.append(socket.create_connection(address(url), timeout=30))
                except OSError:
                    break
            stop.wait(0.5)
        for connection in held:
            connection.close()

    return [threading.Thread(target=client, daemon=True)]


def summary(values: list[float]) -> dict:
    return {"p50_s": round(statistics.median(values), 3), "max_s": round(max(values), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--requests", type=int, default=10, help="short requests per scenario")
    parser.add_argument("--warm-s", type=float, default=3.0, help="seconds the hostile load runs before measuring")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--serve-arg", action="append", default=[], help="an argument for `specdeploy serve` (repeatable)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    process, url = start_server(args.bundle, *args.serve_arg)
    results = {"bundle": args.bundle, "cpu_count": os.cpu_count(), "scenarios": {}}
    try:
        latencies(url, 3)  # the first requests' shapes
        idle = latencies(url, args.requests)
        results["idle"] = summary(idle)
        print(f"idle: p50 {results['idle']['p50_s']} s, max {results['idle']['max_s']} s", flush=True)
        for name in args.scenarios.split(","):
            stop = threading.Event()
            threads = globals()[name.replace("-", "_")](url, stop)
            for thread in threads:
                thread.start()
            time.sleep(args.warm_s)
            loaded = latencies(url, args.requests)
            stop.set()
            result = summary(loaded)
            result["added_max_s"] = round(result["max_s"] - results["idle"]["p50_s"], 3)
            results["scenarios"][name] = result
            print(f"{name}: p50 {result['p50_s']} s, max {result['max_s']} s (+{result['added_max_s']} s over idle)", flush=True)
            time.sleep(2.0)  # the load's connections close
    finally:
        stop_server(process)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
