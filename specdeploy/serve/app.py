"""The ASGI application: OpenAI routes, /health and /metrics over one ModelWorker.

Request flow: auth (when an API key is set) -> the body, read up to the size limit -> validation
(400s) -> the chat template and the tokenizer, on the prompt threads -> the worker's queue (429
when full), one job for the request's n choices -> the first event, raced against the client
going away. Streaming starts only once generation has begun, so an invalid prompt is still a
plain 400. A client that goes away cancels every choice; one choice failing fails the request.

The prompt threads share the worker's tokenizer: the `tokenizers` library encodes and decodes
through a shared, read-only borrow of it, and nothing in the server changes its settings
(truncation, padding), so the worker's decoding and these threads' encoding may overlap.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
from pathlib import Path
from typing import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..bundle import load_manifest
from ..errors import SpecdeployError
from .chat import NO_TEMPLATE, load_chat_template
from .config import ServeConfig
from .logprobs import LazyTokenText
from .metrics import Metrics
from .protocol import ApiError, GenerationRequest, parse_request
from .responses import Responder
from .job import Job
from .worker import ModelWorker

log = logging.getLogger("specdeploy.serve")
PROMPT_THREADS = 2  # render chat templates and tokenize prompts, off the event loop and the model's thread
# Prompts of more characters than this take a thread of their own (tokenizing 1 MB takes about a second), so
# that a few huge prompts, refused or not, cannot hold every prompt thread while short requests wait.
LARGE_PROMPT_CHARS = 64 << 10


class ClientGone(Exception):
    """The client closed its connection before the response began."""


class Service:
    """What the routes share: the config, the worker, the metrics and the chat template."""

    def __init__(self, config: ServeConfig, load: Callable[[], object], metric_labels: dict[str, str] | None = None):
        manifest = load_manifest(config.bundle)
        self.config = config
        self.model = config.model_name or Path(config.bundle).resolve().name
        self.max_context = manifest.max_context
        self.created = _epoch(manifest.created)
        self.chat_template = load_chat_template(Path(config.bundle) / manifest.tokenizer.path)
        self.metrics = Metrics(metric_labels)
        self.worker = ModelWorker(load, config.max_queue, self.metrics, on_fatal=self.fatal)
        self.token_text = LazyTokenText(lambda: self.worker.generator.codec.tokenizer)  # names logprobs' tokens
        self.prompt_threads = concurrent.futures.ThreadPoolExecutor(PROMPT_THREADS, "specdeploy-prompt")
        self.large_prompt_threads = concurrent.futures.ThreadPoolExecutor(1, "specdeploy-large-prompt")
        self.draining = False
        self.on_fatal: Callable[[str], None] | None = None  # set by the server: stop serving

    def fatal(self, message: str) -> None:
        if self.on_fatal is not None:
            self.on_fatal(message)

    def check_access(self, request: Request) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", kind="server_error", code="shutting_down")
        key = self.config.api_key
        if key is not None:
            given = request.headers.getlist("authorization")
            if len(given) > 1:
                raise ApiError(400, "the request has more than one Authorization header", code="invalid_api_key")
            given = given[0] if given else ""
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                raise ApiError(401, "invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    async def read_json(self, request: Request):
        # JSON only: a form or text/plain POST is a "simple" cross-origin request that any web page can send
        # without a preflight, which would let it use a local server that has no --api-key.
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json" and not (media_type.startswith("application/") and media_type.endswith("+json")):
            raise ApiError(415, f"the request body must be JSON (Content-Type: application/json), not "
                                f"{media_type or 'an unnamed type'}", code="unsupported_media_type")
        limit = self.config.max_body_bytes
        too_large = ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        try:
            async with asyncio.timeout(self.config.body_timeout_s):  # a body shorter than its Content-Length ends here
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise too_large
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                           code="request_timeout") from None
        try:
            parsed = json.loads(body)
            # JSON's \uXXXX escapes can write a lone surrogate, which is no text: refused here, before a
            # tokenizer or an error message echoing the field meets it.
            json.dumps(parsed, ensure_ascii=False).encode("utf-8")
        except RecursionError:
            raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
        except UnicodeEncodeError:
            raise ApiError(400, "the request body holds a lone surrogate (a \\uXXXX escape of half a pair): not text") from None
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        return parsed


def _epoch(iso_time: str) -> int:
    """The manifest's creation time (ISO 8601) in Unix seconds, as /v1/models reports it; 0 if unreadable."""
    import datetime

    try:
        return int(datetime.datetime.fromisoformat(iso_time).timestamp())
    except (TypeError, ValueError):
        return 0


def create_app(config: ServeConfig, load: Callable[[], object] | None = None,
               metric_labels: dict[str, str] | None = None,
               render_metrics: Callable[[], Awaitable[bytes]] | None = None) -> Starlette:
    """The server application for `config`; `load` builds the Generator (default: specdeploy.load).
    metric_labels: added to every sample on /metrics (a replica's {"replica": id} under Ray Serve);
    render_metrics: what /metrics answers (default: this server's own samples; Ray Serve: every replica's)."""
    if load is None:
        from ..runtime import load as load_bundle

        def load():
            # Weights in memory: a bundle file changed in place under a running server cannot crash it.
            return load_bundle(config.bundle, device=config.device, drafter=config.drafter, max_batch=config.max_batch,
                               exact=config.exact, weights_in_memory=True)

    service = Service(config, load, metric_labels)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.worker.start()
        yield
        await asyncio.to_thread(service.worker.stop)  # answers whatever is left with 503
        service.prompt_threads.shutdown(wait=False, cancel_futures=True)
        service.large_prompt_threads.shutdown(wait=False, cancel_futures=True)

    async def completions(request: Request) -> Response:
        return await _generate(service, request, "completion")

    async def chat_completions(request: Request) -> Response:
        return await _generate(service, request, "chat")

    async def models(request: Request) -> Response:
        service.check_access(request)
        return JSONResponse({"object": "list", "data": [_model_object(service)]})

    async def model(request: Request) -> Response:
        service.check_access(request)
        return JSONResponse(_model_object(service, request.path_params["name"]))

    async def health(request: Request) -> Response:
        state = "draining" if service.draining else service.worker.state  # see ModelWorker.state
        body = {"status": "ok" if state == "ready" else state}
        if service.worker.error:
            body["error"] = service.worker.error
        return JSONResponse(body, status_code=200 if state == "ready" else 503)

    async def metrics(request: Request) -> Response:
        body = await render_metrics() if render_metrics is not None else service.metrics.render()
        return Response(body, media_type=service.metrics.content_type)

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{name:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.router.redirect_slashes = False  # /v1/completions/ is a 404, not a redirect built from the Host header
    app.state.service = service
    return CountRequests(app, service.metrics, {route.path for route in routes})


def _model_object(service: Service, name: str | None = None) -> dict:
    """The served model as /v1/models lists it; with a name (OpenAI's retrieve), 404 model_not_found unless it is its id."""
    if name is not None and name != service.model:
        raise ApiError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
    return {"id": service.model, "object": "model", "created": service.created, "owned_by": "specdeploy",
            "max_model_len": service.max_context}


async def _generate(service: Service, request: Request, kind: str) -> Response:
    service.check_access(request)
    refusal = service.worker.unavailable()
    if refusal is not None:
        raise refusal
    try:
        body = await service.read_json(request)
    except ClientDisconnect:
        return Response(status_code=499)  # nobody reads it; the status shows in the request metrics
    parsed = parse_request(body, kind, service.config.num_draft_tokens, service.max_context)
    loop = asyncio.get_running_loop()
    threads = service.large_prompt_threads if _prompt_chars(parsed) > LARGE_PROMPT_CHARS else service.prompt_threads
    prompt_ids, options = await loop.run_in_executor(threads, _prepare, service, parsed)
    choices = [{**options, "seed": seed} for seed in parsed.seeds]
    tokens = None
    if options.get("logprobs") is not None:  # built once, on a prompt thread: a large tokenizer's JSON
        tokens = await loop.run_in_executor(service.prompt_threads, service.token_text.get)
    responder = Responder(service.model, parsed.chat, choices, parsed.include_usage, parsed.continuous_usage,
                          prompt_tokens=len(prompt_ids), tokens=tokens)
    job = Job(prompt_ids, choices, streaming=parsed.stream)
    service.worker.submit(job)
    try:
        first_kind, value = await _first_event(job, request)
    except ClientGone:
        service.worker.cancel(job)
        return Response(status_code=499)  # nobody reads it; the status shows in the request metrics
    except BaseException:
        service.worker.cancel(job)
        raise
    if first_kind == "error":
        raise value
    if first_kind == "done" and not parsed.stream:
        return JSONResponse(responder.body(value))
    return StreamingResponse(_events(service, job, responder, (first_kind, value)), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _prompt_chars(parsed: GenerationRequest) -> int:
    """The characters of text a request's prompt holds (a chat's contents), which its tokenizing costs."""
    if isinstance(parsed.prompt, str):
        return len(parsed.prompt)
    if parsed.chat:
        return sum(len(str(message.get("content") or "")) for message in parsed.prompt if isinstance(message, dict))
    return 0


def _prepare(service: Service, parsed: GenerationRequest) -> tuple[list[int], dict]:
    """On a prompt thread: the prompt's token ids (a chat rendered by its template), checked against the
    vocabulary and the context before the request queues, and the job's options."""
    generator, options, param = service.worker.generator, parsed.options, "messages" if parsed.chat else "prompt"
    if parsed.chat and service.chat_template is None:
        raise ApiError(400, f"the model '{service.model}' has no chat template ({NO_TEMPLATE}); use /v1/completions",
                       code="no_chat_template")
    try:
        if parsed.chat:
            # A reply ends at the template's end-of-turn token, as generate(messages=...) does (unless ignore_eos).
            ids, options = generator.encode_chat(parsed.prompt), {**options, "stop_token_ids": generator.end_of_turn_ids}
        else:  # text or token ids; an empty list of ids is the empty prompt, as the runtime takes it
            ids = parsed.prompt if parsed.prompt and not isinstance(parsed.prompt, str) else parsed.prompt or ""
        ids = generator.prompt_ids(ids)
    except SpecdeployError as exc:
        too_long = "max context" in str(exc)
        raise ApiError(400, str(exc), param=param, code="context_length_exceeded" if too_long else None) from None
    try:  # compiled here, on this thread, so that a constraint the library refuses is the client's 400
        generator.check_constraint(options)
    except SpecdeployError as exc:
        raise ApiError(400, str(exc), param=parsed.constraint_param) from None
    return ids, options


async def _first_event(job: Job, request: Request):
    """The job's first event, unless the client disconnects first (ClientGone)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    event = asyncio.ensure_future(job.events.get())
    try:
        done, _ = await asyncio.wait({watcher, event}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if event in done:
        return event.result()
    event.cancel()
    raise ClientGone


async def _events(service: Service, job: Job, responder: Responder, first):
    """The SSE body: pieces as they come, each choice's finishing chunk, [DONE]. Leaving early (disconnect)
    cancels the job, every choice of it."""
    try:
        kind, value = first
        yield responder.first()
        while True:
            try:
                if kind == "piece":
                    chunk = responder.piece(value)
                elif kind == "choice":
                    chunk = responder.finish(value)
                elif kind == "done":
                    chunk = responder.end(value)
                else:
                    chunk = responder.error(value.body())
            except Exception as exc:  # formatting a chunk failed: the stream still ends with an error and [DONE]
                log.exception("a stream's chunk failed")
                error = ApiError(500, f"internal error: {exc}", kind="server_error")
                service.worker.fail(job, error)
                yield responder.error(error.body())
                return
            yield chunk
            if kind not in ("piece", "choice"):
                return
            kind, value = await job.events.get()
    finally:
        service.worker.cancel(job)


async def _api_error(request: Request, exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = {"error": {"message": f"{request.method} {request.url.path}: {exc.detail}", "type": kind, "param": None,
                      "code": None}}
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed: %r", request.method, request.url.path, exc)
    body = {"error": {"message": f"internal error: {exc}", "type": "server_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=500)


class CountRequests:
    """ASGI middleware: counts every HTTP answer by endpoint and status code."""

    def __init__(self, app, metrics: Metrics, endpoints: set[str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        endpoint = path if path in self.endpoints else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def route_path(scope) -> str:
    """The request's path within the application: a mount's or proxy's prefix (root_path) taken off."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path
