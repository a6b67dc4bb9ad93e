"""`serve(config)`: the application on uvicorn, with a listening socket bound first and a draining SIGTERM.

SIGTERM (or Ctrl-C) closes the listening socket, answers 503 to any request still arriving on an
open connection, and gives in-flight requests `drain_timeout_s` to finish. Then the worker
answers what is left, a 503 for a request still queued and an error event for a stream, and
uvicorn gets DRAIN_GRACE_S more to send those answers before it cuts connections off. A second
Ctrl-C quits at once.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import socket
import sys
import threading
from typing import Callable

import uvicorn

from ..bundle import load_manifest
from ..errors import SpecdeployError
from ..runtime.loader import DRAFTERS, drafter_for
from ..runtime.session import SessionConfig, check_device, check_exact, providers_for
from .app import create_app
from .config import ServeConfig
from .protocol import ApiError, parse_request

log = logging.getLogger("specdeploy.serve")
DRAIN_GRACE_S = 2.0  # after the drain deadline: time to send the answers the worker gave what was left


def check_config(config: ServeConfig) -> None:
    """Refuse a bad configuration before anything listens (the model itself loads once the server is up)."""
    manifest = load_manifest(config.bundle)
    check_device(config.device)  # here too for Ray, whose replicas' machines find their own providers
    if config.drafter not in DRAFTERS:
        raise SpecdeployError(f"unknown drafter '{config.drafter}' (choose from {', '.join(DRAFTERS)})")
    drafter_for(manifest, config.drafter, config.bundle)  # 'model' on a bundle without a draft model is refused here
    if config.exact:
        check_exact(manifest.target)
    try:  # the options a request that sets none starts from, through the requests' own validation
        parse_request({"prompt": ""}, "completion", config.num_draft_tokens, manifest.max_context)
    except ApiError as exc:
        raise SpecdeployError(exc.message) from None
    if config.max_queue < 0 or config.max_body_bytes < 1 or config.drain_timeout_s < 0:
        raise SpecdeployError("max queue and drain timeout must be >= 0, the body limit >= 1 byte")
    if not (config.header_timeout_s > 0 and config.body_timeout_s > 0 and config.max_connections >= 1):
        raise SpecdeployError("the header and body timeouts must be > 0 seconds, max connections >= 1")
    if not 1 <= config.max_batch <= MAX_BATCH:
        raise SpecdeployError(f"max batch must be in 1..{MAX_BATCH} (got {config.max_batch})")
    if config.api_key is not None and not config.api_key.strip():
        raise SpecdeployError("the API key is empty")
    if config.api_key is not None and not all(" " <= c <= "~" for c in config.api_key):
        # HTTP headers carry bytes that servers read as Latin-1 and clients write as ASCII: another character
        # could never be sent the same way twice, and no request would authenticate.
        raise SpecdeployError("the API key must be printable ASCII (letters, digits, punctuation, spaces): "
                              "an HTTP header cannot carry other characters reliably")


MAX_BATCH = 256  # KV slots one server may hold


def bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        raise SpecdeployError(f"cannot listen on {host}:{port}: {exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app, config: ServeConfig, port: int) -> uvicorn.Config:
    """uvicorn's settings for the app: a deadline on each request's headers, a cap on open connections
    (uvicorn answers 503 past it), and logging left to the program (the CLI's: cli_support)."""
    return uvicorn.Config(app, host=config.host, port=port, log_level="info", log_config=None,
                          timeout_graceful_shutdown=config.drain_timeout_s + DRAIN_GRACE_S,
                          http=header_deadline_protocol(config.header_timeout_s), limit_concurrency=config.max_connections)


def header_deadline_protocol(timeout_s: float) -> type:
    """uvicorn's HTTP protocol (the one it picks, httptools or h11), with a deadline on each request's
    headers: a client that has not sent them whole within timeout_s of connecting, or of the first
    byte after its last response, gets 408 and the connection closes. Without it, a client that
    trickles a header line every few seconds holds its connection, and a task, for good."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderDeadline(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline = self.loop.call_later(timeout_s, self._too_slow)

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and self._between_requests():
                self._deadline = self.loop.call_later(timeout_s, self._too_slow)
            super().data_received(data)
            if self._deadline is not None and not self._between_requests():  # its headers are in
                self._deadline.cancel()
                self._deadline = None

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            cycle = self.cycle  # uvicorn's request in progress, once its headers are parsed
            return cycle is None or cycle.response_complete

        def _too_slow(self) -> None:
            self._deadline = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

    return HeaderDeadline


def serve(config: ServeConfig, load: Callable[[], object] | None = None) -> None:
    """Serve until SIGTERM or Ctrl-C; raises SpecdeployError if the model fails to load.

    load: builds the Generator (default: specdeploy.load with the config's device and drafter)."""
    check_config(config)
    try:  # a fatal signal (a crash in native code) still writes why, and where, to stderr
        faulthandler.enable(file=sys.__stderr__)
    except (AttributeError, OSError, ValueError):  # no stderr with a file descriptor (an embedding host)
        pass
    providers_for(SessionConfig(device=config.device))  # this machine's onnxruntime runs the device (a replica's may not)
    sock = bind(config.host, config.port)
    port = sock.getsockname()[1]
    app = create_app(config, load)
    service = app.state.service
    server = DrainingServer(uvicorn_config(app, config, port))
    server.on_drain = lambda: _drain(service, config.drain_timeout_s)
    service.on_fatal = lambda message: setattr(server, "should_exit", True)
    log.info("serving %s as '%s' on http://%s:%d (model loading; /health answers 200 once ready)",
             config.bundle, service.model, config.host, port)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if service.worker.state == "failed":
        raise SpecdeployError(f"the model did not load: {service.worker.error}")


def _drain(service, timeout_s: float) -> None:
    if service.draining:
        return
    service.draining = True
    log.info("shutting down: new requests are refused; in-flight requests have %gs to finish", timeout_s)
    deadline = threading.Timer(timeout_s, service.worker.stop)  # then every request left gets its answer
    deadline.daemon = True
    deadline.start()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose exit signal first marks the service as draining; the process then exits 0."""

    def on_drain(self) -> None:  # replaced by serve()
        pass

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        self.should_exit = True
        self.on_drain()
