"""The servers the benchmarks start, `specdeploy serve` and llama.cpp's llama-server: a child process on a free port,
ready once /health says so."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy between us and our own server


def start_server(bundle: str, *flags: str, ready_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`specdeploy serve BUNDLE --port 0 FLAGS...`, once /health answers 200; the process and its URL.

    A server that exits first raises SystemExit("error: ...") with the last lines it logged."""
    command = [sys.executable, "-m", "specdeploy", "serve", bundle, "--port", "0", *flags]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url, said = None, []
    while url is None:
        line = process.stderr.readline()
        if not line:
            last = " | ".join(said[-3:])
            raise SystemExit(f"error: the server exited ({process.wait()}) before listening" + (f": {last}" if last else ""))
        said.append(line.strip())
        if line.startswith(tuple("0123456789")) and " serving " in line and "http://" in line:  # our log line
            url = "http://" + line.rsplit("http://", 1)[1].split()[0]
    # Keep reading the server's log (its access log) so a full pipe never blocks it.
    threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
    return process, wait_ready(process, url, ready_s)


def start_llama_server(binary: str, gguf: str, ready_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """llama.cpp's `llama-server -m GGUF -t 2 -c 4096 -np 1` on a free port (its libraries beside the binary),
    once /health answers 200; the process and its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([binary, "-m", gguf, "-t", "2", "-c", "4096", "-np", "1", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "LD_LIBRARY_PATH": os.path.dirname(os.path.abspath(binary))})
    return process, wait_ready(process, f"http://127.0.0.1:{port}", ready_s)


def wait_ready(process: subprocess.Popen, url: str, ready_s: float) -> str:
    """url once its /health answers 200; SystemExit("error: ...") if the process exits or ready_s passes first."""
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"error: the server at {url} exited ({process.returncode}) before it was ready")
        try:
            with _DIRECT.open(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return url
        except urllib.error.HTTPError as exc:  # 503 while it loads
            exc.close()
        except (urllib.error.URLError, OSError):  # not listening yet
            pass
        time.sleep(0.2)
    process.terminate()
    raise SystemExit(f"error: the server did not become ready in {ready_s:.0f} s")


def stop_server(process: subprocess.Popen, wait_s: float = 60.0) -> None:
    """SIGTERM (the server drains its requests), then SIGKILL if it has not exited within wait_s."""
    process.terminate()
    try:
        process.wait(wait_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
