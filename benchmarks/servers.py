"""`specdeploy serve` as the benchmarks start it: a child process on a free port, ready once /health says so."""

from __future__ import annotations

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
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        try:
            with _DIRECT.open(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return process, url
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
