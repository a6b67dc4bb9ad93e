"""specdeploy's OpenAI server on Ray Serve: replicas of one bundle behind Ray's HTTP proxy.

Each replica runs `specdeploy serve`'s application (serve.create_app) over its own Generator: the
same routes (completions, chat, streaming, models, health, metrics), scheduler and worker. Ray routes
each request to a replica, restarts a replica whose health check fails, and with a minimum and a
maximum scales the count on the requests ongoing at each replica (queued there or decoding), aiming
at `target_ongoing_requests` each (default: max_batch, one full batch).

In your own Ray Serve application::

    from ray import serve
    from specdeploy.ray import RayConfig, deployment
    from specdeploy.serve import ServeConfig

    serve.run(deployment(ServeConfig(bundle="/models/bundle"), RayConfig(replicas=2)), route_prefix="/")

From a Ray Serve config file (`serve run config.yaml`, or KubeRay's RayService)::

    applications:
      - name: specdeploy
        route_prefix: /
        import_path: specdeploy.ray:app_builder
        args: {bundle: /models/bundle, min_replicas: 1, max_replicas: 4}

Health: Ray calls each replica's check_health, which fails once the replica's worker has failed to
load or died; Ray then replaces the replica. Metrics: every replica's samples keep their names and
gain a `replica` label; /metrics through the proxy answers with every live replica's samples, which
each replica publishes to the application's metrics board every METRICS_PUBLISH_S seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ray import serve
from ray.serve.handle import DeploymentHandle

from .errors import SpecdeployError
from .serve.config import ServeConfig

log = logging.getLogger("specdeploy.serve")
APP_NAME = "specdeploy"
METRICS_PUBLISH_S = 2.0  # how often each replica sends its samples to the board
METRICS_STALE_S = 3 * METRICS_PUBLISH_S  # a replica silent this long is gone from /metrics
BOARD_TIMEOUT_S = 2.0  # a board call slower than this (the board restarting): the replica's own samples
FAILED_STATES = ("failed", "crashed", "stopped")  # ModelWorker states that fail the health check


@dataclass(frozen=True)
class RayConfig:
    replicas: int = 1  # a fixed count (min_replicas/max_replicas set: the count autoscaling starts from)
    min_replicas: int | None = None  # both set: autoscale between them
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # per replica, queued or decoding (None: max_batch)
    threads_per_replica: int | None = None  # ONNX Runtime threads and Ray CPUs per replica (None: all / replicas)
    address: str | None = None  # an existing cluster ("auto", "ray://host:10001"); None: start a local one
    upscale_delay_s: float = 5.0  # Ray's autoscaling delays (its defaults, 30 and 600 s, suit slower models)
    downscale_delay_s: float = 30.0

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def check(self) -> None:
        if self.autoscaling:
            low, high = self.min_replicas, self.max_replicas
            if low is None or high is None or not 1 <= low <= high:
                raise SpecdeployError("autoscaling needs --min-replicas and --max-replicas with 1 <= min <= max "
                                      f"(got {low} and {high})")
            if not low <= self.replicas <= high:
                raise SpecdeployError(f"--replicas {self.replicas} is outside --min-replicas {low} .. --max-replicas {high}")
        elif self.replicas < 1:
            raise SpecdeployError(f"--replicas must be at least 1 (got {self.replicas})")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise SpecdeployError(f"threads per replica must be at least 1 (got {self.threads_per_replica})")
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise SpecdeployError("target ongoing requests must be positive")

    def threads(self) -> int:
        """Threads per replica: as given, or the machine's cores shared by the most replicas there may be."""
        if self.threads_per_replica is not None:
            return self.threads_per_replica
        return max(1, (os.cpu_count() or 1) // (self.max_replicas or self.replicas))


@serve.deployment(name="metrics-board", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})
class MetricsBoard:
    """The latest metric families of every replica, merged into one exposition on request."""

    def __init__(self):
        self.replicas: dict[str, tuple[float, list]] = {}  # replica id -> (when received, its metric families)

    # async: both run on the replica's event loop, one at a time (sync methods would share a thread pool)
    async def publish(self, replica: str, families: list) -> None:
        self.replicas[replica] = (time.monotonic(), families)

    async def render(self) -> bytes:
        from prometheus_client import generate_latest
        from prometheus_client.metrics_core import Metric

        now = time.monotonic()
        self.replicas = {r: (at, f) for r, (at, f) in self.replicas.items() if now - at < METRICS_STALE_S}
        merged: dict[str, Metric] = {}
        for replica in sorted(self.replicas):
            for family in self.replicas[replica][1]:
                if family.name not in merged:
                    merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name].samples.extend(family.samples)
        return generate_latest(_Families(list(merged.values())))


class _Families:
    """A collector of fixed families (generate_latest takes a registry or a collector)."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return iter(self.families)


@serve.ingress()
class SpecdeployServer:
    """One replica: the bundle's Generator, loaded before the replica takes requests, under create_app."""

    async def __init__(self, config: ServeConfig, threads: int, board: DeploymentHandle):
        from .runtime import SessionConfig, load
        from .serve import create_app

        self.replica = serve.get_replica_context().replica_id.unique_id
        session = SessionConfig(device=config.device, shared_threads=True, intra_op_threads=threads, weights_in_memory=True)
        generator = await asyncio.to_thread(load, config.bundle, device=config.device, drafter=config.drafter,
                                            session=session, max_batch=config.max_batch, exact=config.exact)
        self.board = board
        self.server_app = create_app(config, load=lambda: generator, metric_labels={"replica": self.replica},
                                     render_metrics=self._merged_metrics)
        self.service = self.server_app.state.service
        self._publisher = asyncio.get_running_loop().create_task(self._publish_metrics())

    def __serve_build_asgi_app__(self):
        return self.server_app

    async def _publish(self) -> None:
        await asyncio.wait_for(self.board.publish.remote(self.replica, self.service.metrics.families()), BOARD_TIMEOUT_S)

    async def _merged_metrics(self) -> bytes:
        """/metrics: every live replica's samples from the board (this replica's own if the board fails)."""
        try:
            await self._publish()
            return await asyncio.wait_for(self.board.render.remote(), BOARD_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - metrics must not fail because the board restarts
            log.warning("metrics board unavailable (%s): this replica's samples only", type(exc).__name__)
            return self.service.metrics.render()

    async def _publish_metrics(self) -> None:
        while True:
            try:
                await self._publish()
            except Exception as exc:  # noqa: BLE001 - the board may be restarting; try again next time
                log.debug("metrics board: %s", exc)
            await asyncio.sleep(METRICS_PUBLISH_S)

    def check_health(self) -> None:
        """Ray's health check: fails once the worker failed to load or died, so that Ray replaces the replica."""
        worker = self.service.worker
        if worker.state in FAILED_STATES:
            raise RuntimeError(f"replica {self.replica}: the model worker is {worker.state}: {worker.error}")


def deployment(config: ServeConfig, ray_config: RayConfig = RayConfig()):
    """The Ray Serve application for config: a bound SpecdeployServer deployment (and its metrics board),
    ready for serve.run(...) or as the target of an application builder."""
    from .serve.server import check_config

    ray_config.check()
    config = dataclasses.replace(config, bundle=str(Path(config.bundle).expanduser().resolve()))  # replicas' cwd differs
    check_config(config)
    threads = ray_config.threads()
    options = {
        "name": "specdeploy",
        # our own queue answers 429 past max_queue: Ray's router may send a replica that many at most
        "max_ongoing_requests": config.max_batch + config.max_queue,
        # and Ray's proxy holds at most max_queue more while every replica is full, then answers 429 too
        # (without a bound it held them all, and no client ever got a 429); Ray's least is one
        "max_queued_requests": max(1, config.max_queue),
        "backpressure_config": {"status_code": 429, "retry_after_s": 1},
        "graceful_shutdown_timeout_s": config.drain_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        "ray_actor_options": {"num_cpus": threads},
    }
    if ray_config.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": ray_config.min_replicas, "max_replicas": ray_config.max_replicas,
            "initial_replicas": ray_config.replicas,
            "target_ongoing_requests": ray_config.target_ongoing_requests or config.max_batch,
            "upscale_delay_s": ray_config.upscale_delay_s, "downscale_delay_s": ray_config.downscale_delay_s,
            # the shortest window Ray accepts: longer than its replicas' 10 s metrics push
            "look_back_period_s": 15.0,
        }
    else:
        options["num_replicas"] = ray_config.replicas
    return serve.deployment(**options)(SpecdeployServer).bind(config, threads, MetricsBoard.bind())


def app_builder(args: dict):
    """Ray Serve's application builder (import_path: specdeploy.ray:app_builder): args holds ServeConfig's
    and RayConfig's fields by name (bundle is required; host, port and address belong to the cluster).
    Values given as text (`serve run ... max_batch=4`) are read as their field's type; replicas defaults
    to min_replicas when autoscaling."""
    serve_fields = {f.name: f for f in dataclasses.fields(ServeConfig) if f.name not in ("host", "port")}
    ray_fields = {f.name: f for f in dataclasses.fields(RayConfig) if f.name != "address"}
    unknown = set(args) - set(serve_fields) - set(ray_fields)
    if unknown or "bundle" not in args:
        raise SpecdeployError(f"specdeploy.ray:app_builder: bundle is required; unknown arguments: {sorted(unknown)}")
    values = {name: _typed(name, value, {**serve_fields, **ray_fields}[name]) for name, value in args.items()}
    if "replicas" not in values and values.get("min_replicas") is not None:
        values["replicas"] = values["min_replicas"]
    config = ServeConfig(**{k: v for k, v in values.items() if k in serve_fields})
    return deployment(config, RayConfig(**{k: v for k, v in values.items() if k in ray_fields}))


def _typed(name: str, value, field):
    """A config file's value as its field's type (text from the command line; None stays None)."""
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    if kind.startswith("str") and value is not None and not isinstance(value, str):
        # YAML's `api_key: 012345` arrives as 5349: text made from it would not be what the file says
        raise SpecdeployError(f"specdeploy.ray:app_builder: {name}={value!r} is not text: write it in quotes "
                              f"in the config file")
    if not isinstance(value, str) or kind.startswith("str"):
        return value
    try:
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
    except ValueError:
        raise SpecdeployError(f"specdeploy.ray:app_builder: {name}={value!r} is not a {kind.split(' ')[0]}") from None
    return value


def serve_already_running(status, local: bool) -> bool:
    """Whether Ray Serve already runs on the cluster (its proxy then keeps its own host and port). On a joined
    cluster an application of ours already there is refused: serving would replace it, exiting delete it."""
    if not local and APP_NAME in status.applications:
        raise SpecdeployError(f"an application named '{APP_NAME}' already runs on this cluster: serving would replace "
                              f"it and exiting would delete it (serve.delete('{APP_NAME}') removes it)")
    return bool(status.proxies)


def serve_on_ray(config: ServeConfig, ray_config: RayConfig) -> None:
    """`specdeploy serve --replicas N`: the deployment on a Ray cluster (ray_config.address, or a local one
    with this machine's cores), Ray's proxy on config.host:config.port, until SIGTERM or Ctrl-C; then the
    application is deleted (each replica finishes its in-flight requests within drain_timeout_s). A local
    cluster and its Ray Serve stop with it; a cluster joined with an address keeps running, with its other
    applications. SIGTERM or Ctrl-C while the replicas start stops the start the same way."""
    import signal
    import socket
    import threading

    import ray

    application = deployment(config, ray_config)  # every check before anything starts
    local = ray_config.address is None
    if local:
        cores, wanted = os.cpu_count() or 1, (ray_config.max_replicas or ray_config.replicas) * ray_config.threads()
        if wanted > cores:
            raise SpecdeployError(f"{ray_config.max_replicas or ray_config.replicas} replicas of {ray_config.threads()} "
                                  f"threads need {wanted} cores; this machine has {cores} (a local cluster's replicas "
                                  "each take their threads' cores: lower --replicas or --threads-per-replica)")
    port = config.port
    if port == 0:  # Ray's proxy takes a fixed port: pick a free one
        with socket.socket() as probe:
            probe.bind((config.host, 0))
            port = probe.getsockname()[1]
    stop = threading.Event()

    def interrupt(signum, frame):  # while starting: unwind through the finally below
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    # "local": a new cluster even where $RAY_ADDRESS or a `ray start` cluster would be joined
    ray.init(address="local" if local else ray_config.address, num_cpus=os.cpu_count() if local else None,
             include_dashboard=False, log_to_driver=True)
    try:
        running = serve_already_running(serve.status(), local)
        serve.start(http_options={"host": config.host, "port": port})
        serve.run(application, name=APP_NAME, route_prefix="/")
        for sig in previous:
            signal.signal(sig, lambda *_: stop.set())
        scaling = (f"{ray_config.min_replicas}..{ray_config.max_replicas} replicas" if ray_config.autoscaling
                   else f"{ray_config.replicas} replica{'s' if ray_config.replicas > 1 else ''}")
        where = ("the cluster's own Ray Serve proxy (Serve already ran there: --host and --port do not apply)"
                 if running else f"http://{config.host}:{port}")
        log.info("serving %s on Ray Serve (%s, %d threads each) on %s", config.bundle, scaling, ray_config.threads(),
                 where)
        stop.wait()
        log.info("shutting down: replicas finish their in-flight requests (at most %gs)", config.drain_timeout_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            serve.delete(APP_NAME)
        finally:
            if local:
                serve.shutdown()
            ray.shutdown()
