"""Hostile input the server and the CLI must survive: a bundle changed under a running server, requests a
web page could forge, ambiguous credentials, inputs without end, an --out that cannot be replaced.

Each case gets a clear answer (a status with an OpenAI-style body, or one `error:` line) and leaves the
process serving; docs/reliability.md lists them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import httpx
import pytest
from click.testing import CliRunner

from specdeploy.cli import main
from specdeploy.defaults import MAX_INPUT_BYTES
from specdeploy.serve import ServeConfig
from test_serve import PROMPT, LiveServer

BODY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}


@pytest.fixture
def live(agreeing_bundle):
    server = LiveServer(ServeConfig(bundle=str(agreeing_bundle), api_key="sk-test"))
    yield server
    server.close()


def auth(key: str = "sk-test") -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_weights_changed_in_place_under_a_running_server_cannot_crash_it(tmp_path, agreeing_bundle):
    """serve reads the weights into memory: a truncated or overwritten data file (cp, rsync --inplace) leaves
    the loaded model as it was, where a mapped file would fault the next pass (SIGBUS)."""
    bundle = tmp_path / "bundle"
    shutil.copytree(agreeing_bundle, bundle)
    server = LiveServer(ServeConfig(bundle=str(bundle)))
    try:
        before = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30)
        for data in bundle.glob("*/model.onnx.data"):
            with open(data, "r+b") as handle:
                handle.truncate(1000)
        after = httpx.post(server.url + "/v1/completions", json=BODY, timeout=30)
        assert before.status_code == after.status_code == 200
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.close()


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_declared_json_is_refused_415(live, content_type):
    """A cross-origin "simple" request (text/plain, a form, no type) needs no preflight: it must not generate."""
    headers = {**auth(), **({"Content-Type": content_type} if content_type else {})}
    response = httpx.post(live.url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}', headers=headers)
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_media_type"
    ok = httpx.post(live.url + "/v1/completions", json=BODY, headers={**auth(), "Content-Type": "application/json; charset=utf-8"},
                    timeout=30)
    assert ok.status_code == 200


def test_two_authorization_headers_are_refused_whichever_comes_first(live):
    for keys in (["sk-test", "wrong"], ["wrong", "sk-test"], ["sk-test", "sk-test"]):
        headers = [("Authorization", f"Bearer {key}") for key in keys] + [("Content-Type", "application/json")]
        response = httpx.post(live.url + "/v1/completions", content=b'{"prompt": "x"}', headers=headers)
        assert response.status_code == 400, keys
        assert "more than one Authorization header" in response.json()["error"]["message"]


def test_a_trailing_slash_is_not_found_rather_than_redirected_by_the_host_header(live):
    response = httpx.post(live.url + "/v1/completions/", json=BODY, headers={**auth(), "Host": "evil.example"})
    assert response.status_code == 404 and "location" not in response.headers


@pytest.mark.parametrize("key", ["ключ", "caf\u00e9", "tab\there"])
def test_an_api_key_no_header_can_carry_is_refused_at_startup(agreeing_bundle, key):
    result = CliRunner().invoke(main, ["serve", str(agreeing_bundle), "--api-key", key, "--port", "0"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: the API key must be printable ASCII")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("how", ["--prompt-file", "--prompt -", "--chat -", "--messages"])
def test_an_input_without_end_is_read_up_to_a_cap(agreeing_bundle, how):
    """/dev/zero as a prompt: one error line naming the cap, after reading at most the cap (a subprocess
    whose address space is limited to well under what an unbounded read would take)."""
    option, _, value = how.partition(" ")
    args = [option, value or "/dev/zero"]
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
    command = [sys.executable, "-c", limit + "from specdeploy.cli import main; main()", "run", str(agreeing_bundle), *args]
    with open("/dev/zero", "rb") as zeros:
        result = subprocess.run(command, stdin=zeros, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-500:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert f"longer than {MAX_INPUT_BYTES >> 20} MiB" in lines[0]


def test_export_force_into_an_immutable_out_fails_before_any_work(tmp_path, agreeing_bundle):
    out = tmp_path / "bundle"
    shutil.copytree(agreeing_bundle, out)
    if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (not root, or a file system without inode flags)")
    try:
        result = CliRunner().invoke(main, ["export", "--target", "nowhere", "--out", str(out), "--force"])
    finally:
        subprocess.run(["chattr", "-i", str(out)], check=True)
    assert result.exit_code == 2, result.output
    assert "is immutable" in result.stderr and "nothing was touched" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


class ConfiguredServer(LiveServer):
    """LiveServer on the uvicorn settings `serve` uses (serve.server.uvicorn_config): deadlines, connection cap."""

    def __init__(self, config: ServeConfig):
        import threading

        import uvicorn

        from specdeploy.serve.app import create_app
        from specdeploy.serve.server import bind, uvicorn_config
        from test_serve import wait_for

        self.app = create_app(config)
        self.service = self.app.state.service
        self.sock = bind("127.0.0.1", 0)
        port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn_config(self.app, config, port))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the server to listen")
        wait_for(lambda: httpx.get(self.url + "/health").status_code == 200, "the model to load")


@pytest.fixture
def strict(agreeing_bundle):
    server = ConfiguredServer(ServeConfig(bundle=str(agreeing_bundle), header_timeout_s=1.0, body_timeout_s=1.0,
                                          max_connections=4))
    yield server
    server.close()


def raw(url: str):
    import socket

    host, port = url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=20)
    return connection


def read_all(connection) -> bytes:
    data = b""
    while chunk := connection.recv(4096):
        data += chunk
    return data


def test_headers_that_trickle_past_the_deadline_get_408_and_the_connection_closes(strict):
    connection = raw(strict.url)
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and the rest never comes
    answer = read_all(connection)  # the server closes it: recv returns b""
    connection.close()
    assert answer.startswith(b"HTTP/1.1 408")
    silent = raw(strict.url)  # connected, nothing sent
    assert read_all(silent).startswith(b"HTTP/1.1 408")
    silent.close()
    assert httpx.post(strict.url + "/v1/completions", json=BODY, timeout=30).status_code == 200


def test_a_body_shorter_than_its_content_length_gets_408(strict):
    connection = raw(strict.url)
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    answer = connection.recv(4096)
    connection.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer


def test_connections_past_the_cap_get_503(strict):
    held = [raw(strict.url) for _ in range(4)]  # open, sending nothing (each closes at its header deadline)
    try:
        from test_serve import wait_for

        wait_for(lambda: len(strict.server.server_state.connections) >= 4, "the connections to be open")
        assert httpx.get(strict.url + "/health", timeout=20).status_code == 503
    finally:
        for connection in held:
            connection.close()


def test_a_huge_prompt_is_tokenized_on_a_thread_of_its_own(live, monkeypatch):
    """Prompts past LARGE_PROMPT_CHARS take the large-prompt thread: short requests keep the prompt threads."""
    import threading

    from specdeploy.serve import app

    threads = []
    generator = live.service.worker.generator
    prompt_ids = generator.prompt_ids  # what the prompt threads call to tokenize a prompt
    monkeypatch.setattr(generator, "prompt_ids", lambda prompt: threads.append(threading.current_thread().name)
                        or prompt_ids(prompt))
    huge = {"prompt": "x " * (app.LARGE_PROMPT_CHARS // 2 + 1), "max_tokens": 2}
    assert httpx.post(live.url + "/v1/completions", json=huge, headers=auth(), timeout=60).status_code == 400
    assert httpx.post(live.url + "/v1/completions", json=BODY, headers=auth(), timeout=30).status_code == 200
    assert threads[0].startswith("specdeploy-large-prompt") and threads[1].startswith("specdeploy-prompt")
