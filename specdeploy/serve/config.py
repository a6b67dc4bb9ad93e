"""The server's one configuration dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from .. import defaults
from ..runtime.config import GenerationConfig


@dataclass(frozen=True)
class ServeConfig:
    bundle: str  # the bundle folder to serve
    host: str = defaults.SERVE_HOST
    port: int = defaults.SERVE_PORT  # 0: any free port (the one chosen is logged)
    max_queue: int = defaults.SERVE_MAX_QUEUE  # requests that may wait for a free batch slot; one more answers 429
    # Requests decoded together (KV slots); above one, the scheduler speculates where measured costs say
    # it pays.
    max_batch: int = defaults.SERVE_MAX_BATCH
    num_draft_tokens: int = GenerationConfig.num_draft_tokens  # k for requests that do not set num_draft_tokens
    drafter: str = defaults.DRAFTER  # hybrid | model | prompt-lookup
    device: str = "cpu"  # cpu | cuda | tensorrt
    # Greedy text independent of k and the batch, a seed's sample independent of the batch (load(exact=True)),
    # for target-only speed.
    exact: bool = False
    api_key: str | None = None  # when set, /v1/* requires "Authorization: Bearer <api_key>"
    max_body_bytes: int = defaults.SERVE_MAX_BODY_BYTES  # request bodies over this answer 413
    drain_timeout_s: float = defaults.SERVE_DRAIN_TIMEOUT_S  # on SIGTERM, in-flight requests get this long to finish
    # Slow clients: a request's headers must arrive whole within header_timeout_s (else the connection
    # closes), its body within body_timeout_s more (else 408); at most max_connections are open at once.
    header_timeout_s: float = defaults.SERVE_HEADER_TIMEOUT_S
    body_timeout_s: float = defaults.SERVE_BODY_TIMEOUT_S
    max_connections: int = defaults.SERVE_MAX_CONNECTIONS
    model_name: str | None = None  # the id /v1/models lists (default: the bundle folder's name)
