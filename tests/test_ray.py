"""specdeploy on Ray Serve: a local Ray cluster on 127.0.0.1, started here, with replicas of the shipped
demo bundle. Answers equal single-process serve's; a replica killed under load leaves no request
hanging and the other keeps serving; autoscaling goes from 1 to 2 replicas under load and back.

Tests wait on events and on Ray's own status (serve.status()); the deadlines in wait_for only turn a
hang into a failure."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from starlette.testclient import TestClient

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # the local clusters below send nothing off this machine
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]' in the specdeploy clone)")
from ray import serve  # noqa: E402

from specdeploy.defaults import SHIPPED_BUNDLE  # noqa: E402
from specdeploy.ray import RayConfig, deployment  # noqa: E402
from specdeploy.serve import ServeConfig, create_app  # noqa: E402
from test_serve import stream_through_sigterm, wait_for as wait_briefly  # noqa: E402

RAY_WAIT_S = 120.0  # replicas start in seconds, but a loaded 2-core machine may take much longer


def wait_for(condition, what: str) -> None:
    wait_briefly(condition, what, timeout_s=RAY_WAIT_S)

pytestmark = pytest.mark.ray
BUNDLE = str(SHIPPED_BUNDLE)
PROMPT = "def fibonacci(n):\n"
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def replica_count(app: str) -> int:
    status = serve.status().applications.get(app)
    if status is None:
        return 0
    return sum(d.replica_states.get("RUNNING", 0) for name, d in status.deployments.items() if name == "specdeploy")


def test_the_cli_serves_on_a_local_cluster_and_drains_on_sigterm():
    """`specdeploy serve --replicas 1` starts its own local Ray cluster; SIGTERM lets the stream in flight
    finish, then the process exits 0. Runs before this module's cluster starts."""
    import queue

    command = [sys.executable, "-m", "specdeploy", "serve", BUNDLE, "--replicas", "1", "--threads-per-replica", "1",
               "--port", "0", "--host", "127.0.0.1"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr] + [lines.put("")], daemon=True).start()
    try:
        line = ""
        while "on Ray Serve" not in line:
            line = lines.get(timeout=RAY_WAIT_S)
            assert line, "the server exited before serving"
        url = line.rsplit(" on ", 1)[1].split()[0]
        body = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
        rest = stream_through_sigterm(process, url, body, timeout_s=60)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
        assert process.wait(RAY_WAIT_S) == 0
    finally:
        stop_process(process)


def stop_process(process) -> None:
    """SIGTERM first (the server stops what it started on the way out), then SIGKILL after RAY_WAIT_S."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(RAY_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.parametrize("options, message", [
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--min-replicas", "3", "--max-replicas", "2"], "1 <= min <= max"),
    (["--min-replicas", "1"], "1 <= min <= max"),
    (["--replicas", "5", "--min-replicas", "1", "--max-replicas", "2"], "outside --min-replicas"),
    (["--replicas", "2", "--threads-per-replica", str(2 * (os.cpu_count() or 1))], "this machine has"),
])
def test_bad_replica_options_get_one_error_line(options, message):
    from click.testing import CliRunner

    from specdeploy.cli import main

    result = CliRunner().invoke(main, ["serve", BUNDLE, *options])
    assert result.exit_code != 0 and result.output.count("error:") == 1 and message in result.output, result.output


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster with this machine's two CPUs and Ray Serve's proxy on a free port."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="class")
def two_replicas(cluster):
    """Two fixed replicas of the demo bundle, one thread each, under the prefix /two (both of the cluster's
    CPUs: deleted before the autoscaling test needs one)."""
    config = ServeConfig(bundle=BUNDLE, max_batch=4)
    serve.run(deployment(config, RayConfig(replicas=2, threads_per_replica=1)), name="two", route_prefix="/two")
    wait_for(lambda: replica_count("two") == 2, "two running replicas")
    yield cluster + "/two"
    serve.delete("two")


def complete(url: str, body: dict, path: str = "/v1/completions") -> dict:
    response = httpx.post(url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_text(url: str, body: dict, path: str = "/v1/completions") -> str:
    text = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[len("data: "):])["choices"][0]
                text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(text)


def replica_processes() -> list[int]:
    """The pids of this cluster's specdeploy replicas (Ray names each actor's process after its class)."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(process.info["cmdline"] or ())
        if "ServeReplica:two:specdeploy" in command:
            found.append(process.info["pid"])
    return found


class TestTwoReplicas:
    """Two replicas of one bundle behind Ray's proxy."""

    def test_replicas_answer_as_single_process_serve(self, two_replicas):
        greedy = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0}
        sampled = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0.8, "seed": 7}
        chat = {"messages": MESSAGES, "max_tokens": 48, "temperature": 0}
        with TestClient(create_app(ServeConfig(bundle=BUNDLE, max_batch=4))) as local:
            wait_for(lambda: local.get("/health").status_code == 200, "the local server's model")
            want = {name: local.post(path, json=body).json() for name, path, body in (
                ("greedy", "/v1/completions", greedy), ("sampled", "/v1/completions", sampled),
                ("chat", "/v1/chat/completions", chat))}
        assert complete(two_replicas, greedy)["choices"][0]["text"] == want["greedy"]["choices"][0]["text"]
        assert complete(two_replicas, sampled)["choices"][0]["text"] == want["sampled"]["choices"][0]["text"]
        got_chat = complete(two_replicas, chat, "/v1/chat/completions")
        assert got_chat["choices"][0]["message"] == want["chat"]["choices"][0]["message"]
        assert streamed_text(two_replicas, greedy) == want["greedy"]["choices"][0]["text"]
        assert streamed_text(two_replicas, chat, "/v1/chat/completions") == want["chat"]["choices"][0]["message"]["content"]
        models = httpx.get(two_replicas + "/v1/models", timeout=30).json()
        assert models["data"][0]["id"] == "demo-bundle"
        assert httpx.get(two_replicas + "/health", timeout=30).json() == {"status": "ok"}


    def test_metrics_keep_their_names_with_a_replica_label_for_each_replica(self, two_replicas):
        complete(two_replicas, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})

        def replicas_seen() -> set[str]:
            text = httpx.get(two_replicas + "/metrics", timeout=30).text
            return {line.split('replica="', 1)[1].split('"', 1)[0]
                    for line in text.splitlines() if line.startswith("specdeploy:generation_tokens_total{")}

        wait_for(lambda: len(replicas_seen()) == 2, "both replicas' samples on /metrics")
        text = httpx.get(two_replicas + "/metrics", timeout=30).text
        assert text.count("# TYPE specdeploy:generation_tokens_total counter") == 1  # one family, both replicas' samples
        generated = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("specdeploy:generation_tokens_total{")]
        assert sum(generated) >= 8


    def test_a_killed_replica_leaves_no_request_hanging_and_the_other_keeps_serving(self, two_replicas):
        pids = replica_processes()
        assert len(pids) == 2
        started = threading.Barrier(5)
        body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}

        def one_stream() -> str:
            """'done' (every token and [DONE]) or 'failed' (an error status, an error event or a cut stream)."""
            try:
                with httpx.stream("POST", two_replicas + "/v1/completions", json=body, timeout=60) as response:
                    if response.status_code != 200:
                        started.wait()
                        return "failed"
                    lines = response.iter_lines()
                    first = next(lines)
                    started.wait()
                    rest = [line for line in lines if line]
                    if rest and rest[-1] == "data: [DONE]" and '"error"' not in rest[-2] and first.startswith("data: "):
                        return "done"
                    return "failed"
            except httpx.TimeoutException:
                return "hung"  # no byte for 60 s: the request was left waiting
            except httpx.HTTPError:
                return "failed"
            except threading.BrokenBarrierError:
                return "failed"

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(one_stream) for _ in range(4)]
            started.wait(timeout=60)  # every stream has its first chunk: all four are in flight
            os.kill(pids[0], signal.SIGKILL)
            outcomes = [stream.result(timeout=90) for stream in streams]  # none may hang
        assert set(outcomes) <= {"done", "failed"} and "done" in outcomes, outcomes
        for _ in range(4):  # the other replica (and Ray's replacement) keep answering
            assert complete(two_replicas, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})["choices"][0]["text"]
        wait_for(lambda: replica_count("two") == 2, "Ray to replace the killed replica")


def test_autoscaling_goes_from_one_replica_to_two_under_load_and_back(cluster):
    config = ServeConfig(bundle=BUNDLE, max_batch=2)
    scaling = RayConfig(replicas=1, min_replicas=1, max_replicas=2, target_ongoing_requests=1, threads_per_replica=1,
                        upscale_delay_s=0.0, downscale_delay_s=2.0)
    serve.run(deployment(config, scaling), name="auto", route_prefix="/auto")
    url = cluster + "/auto"
    assert replica_count("auto") == 1
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    load = threading.Event()

    def keep_busy():
        while not load.is_set():
            httpx.post(url + "/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        workers = [pool.submit(keep_busy) for _ in range(4)]
        try:
            wait_for(lambda: replica_count("auto") == 2, "a second replica under load")
        finally:
            load.set()
        for worker in workers:
            worker.result(timeout=120)
    wait_for(lambda: replica_count("auto") == 1, "back to one replica once idle")
    serve.delete("auto")


def test_past_every_replicas_queue_the_proxy_answers_429(cluster):
    """--max-queue bounds Ray's proxy too: with the one replica decoding, a burst gets its queue slot, the proxy's
    one place, and 429 with Retry-After for the rest. It used to hold every request, however many. (Ray counts a
    request as queued until it is assigned, so under a burst it may refuse one that the replica's queue would take:
    how many of the burst get through is not fixed, only that some do and the rest are refused.)"""
    config = ServeConfig(bundle=BUNDLE, max_batch=1, max_queue=1)
    serve.run(deployment(config, RayConfig(replicas=1, threads_per_replica=1)), name="full", route_prefix="/full")
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    holding = {**body, "max_tokens": 2000, "stream": True}  # holds the slot while the burst arrives
    with httpx.stream("POST", cluster + "/full/v1/completions", json=holding, timeout=120) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(lines).startswith("data: ")  # decoding: the replica's one batch slot is taken
        with concurrent.futures.ThreadPoolExecutor(7) as pool:
            burst = list(pool.map(lambda _: httpx.post(cluster + "/full/v1/completions", json=body, timeout=120),
                                  range(7)))
        rest = [line for line in lines if line]
    serve.delete("full")
    assert rest[-1] == "data: [DONE]" and '"error"' not in rest[-2], rest[-2:]
    statuses = sorted(answer.status_code for answer in burst)
    assert set(statuses) == {200, 429}, statuses
    assert all(answer.headers.get("retry-after") == "1" for answer in burst if answer.status_code == 429)


def test_replicas_without_the_ray_extra_get_one_error_line(tmp_path):
    script = ("import sys; sys.modules['ray'] = None\n"
              "from specdeploy.cli import main\n"
              f"sys.argv = ['specdeploy', 'serve', {BUNDLE!r}, '--replicas', '2']\n"
              "main()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "pip install '.[ray]' in the specdeploy clone" in lines[0], result.stderr

def test_the_application_builder_reads_a_config_files_arguments():
    """Ray config files (and `serve run ... key=value`) give text: it is read as each field's type, and
    replicas starts at min_replicas when only the range is given."""
    from specdeploy.errors import SpecdeployError
    from specdeploy.ray import app_builder

    assert app_builder({"bundle": BUNDLE, "max_batch": "4", "min_replicas": "1", "max_replicas": "2"}) is not None
    with pytest.raises(SpecdeployError, match="unknown arguments"):
        app_builder({"bundle": BUNDLE, "replica": 2})
    with pytest.raises(SpecdeployError, match="max_batch='four' is not a int"):
        app_builder({"bundle": BUNDLE, "max_batch": "four"})
