"""`specdeploy serve`: the OpenAI-compatible server over a bundle, alone or as Ray Serve replicas."""

from __future__ import annotations

import click

from . import defaults
from .cli_options import DEFAULTS, DEVICE_OPTION, DRAFTER_OPTION, EXACT_OPTION, resolve_bundle
from .errors import SpecdeployError, install_hint


@click.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--host", default=defaults.SERVE_HOST, show_default=True,
              help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=defaults.SERVE_PORT, show_default=True, help="0 picks a free port (it is logged).")
@click.option("--max-queue", type=int, default=defaults.SERVE_MAX_QUEUE, show_default=True,
              help="Requests that may wait for a free batch slot; one more answers 429.")
@click.option("--max-batch", type=int, default=defaults.SERVE_MAX_BATCH, show_default=True,
              help="Requests decoded together (1 serves one at a time).")
@click.option("--num-draft-tokens", "-k", type=int, default=DEFAULTS.num_draft_tokens, show_default=True,
              help="k for requests that do not set num_draft_tokens.")
@DRAFTER_OPTION
@DEVICE_OPTION
@EXACT_OPTION
@click.option("--api-key", envvar="SPECDEPLOY_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1/* (also read from $SPECDEPLOY_API_KEY).")
@click.option("--max-body-bytes", type=int, default=defaults.SERVE_MAX_BODY_BYTES, show_default=True,
              help="Larger request bodies get 413.")
@click.option("--drain-timeout", type=float, default=defaults.SERVE_DRAIN_TIMEOUT_S, show_default=True,
              help="Seconds in-flight requests get to finish after SIGTERM.")
@click.option("--header-timeout", type=float, default=defaults.SERVE_HEADER_TIMEOUT_S, show_default=True,
              help="Seconds a request's headers may take to arrive whole; a slower client is disconnected.")
@click.option("--body-timeout", type=float, default=defaults.SERVE_BODY_TIMEOUT_S, show_default=True,
              help="Seconds a request's body may take after its headers; a slower one gets 408.")
@click.option("--max-connections", type=int, default=defaults.SERVE_MAX_CONNECTIONS, show_default=True,
              help="Open connections at most; one more gets 503.")
@click.option("--model-name", default=None, help="The model id to list (default: the bundle folder's name).")
@click.option("--replicas", type=int, default=None, help="Serve through Ray Serve with this many replicas (the ray extra).")
@click.option("--min-replicas", type=int, default=None, help="With --max-replicas: Ray Serve autoscales between them.")
@click.option("--max-replicas", type=int, default=None, help="With --min-replicas: the most replicas Ray Serve scales to.")
@click.option("--threads-per-replica", type=int, default=None,
              help="ONNX Runtime threads (and Ray CPUs) per replica. Default: the cores / the most replicas.")
@click.option("--ray-address", default=None, help="Join this Ray cluster (default: start a local one).")
def serve(bundle, host, port, max_queue, max_batch, num_draft_tokens, drafter, device, exact, api_key, max_body_bytes,
          drain_timeout, header_timeout, body_timeout, max_connections, model_name, replicas, min_replicas, max_replicas,
          threads_per_replica, ray_address) -> None:
    """Serve a bundle over an OpenAI-compatible HTTP API (BUNDLE defaults to the demo bundle)."""
    try:
        from .serve import ServeConfig, serve as run_server
    except ImportError as exc:
        raise SpecdeployError(f"serving needs the serve extra ({install_hint('serve')}): {exc}") from None
    config = ServeConfig(bundle=resolve_bundle(bundle), host=host, port=port, max_queue=max_queue, max_batch=max_batch,
                         num_draft_tokens=num_draft_tokens, drafter=drafter, device=device, exact=exact, api_key=api_key,
                         max_body_bytes=max_body_bytes, drain_timeout_s=drain_timeout, header_timeout_s=header_timeout,
                         body_timeout_s=body_timeout, max_connections=max_connections, model_name=model_name)
    ray_options = (replicas, min_replicas, max_replicas, threads_per_replica, ray_address)
    if all(option is None for option in ray_options):
        return run_server(config)
    try:
        from .ray import RayConfig, serve_on_ray
    except ImportError as exc:
        raise SpecdeployError(f"--replicas needs the ray extra ({install_hint('ray')}): {exc}") from None
    serve_on_ray(config, RayConfig(replicas=replicas if replicas is not None else min_replicas or 1, min_replicas=min_replicas,
                                   max_replicas=max_replicas, threads_per_replica=threads_per_replica,
                                   address=ray_address))
