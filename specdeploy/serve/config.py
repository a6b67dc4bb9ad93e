"""The server's one configuration dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    bundle: str  # the bundle folder to serve
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the one chosen is logged)
    max_queue: int = 64  # requests that may wait for a free batch slot; one more answers 429
    # Requests decoded together (KV slots); above one, the scheduler speculates where measured costs say
    # it pays. 8 measured best on the 2-vCPU machine of docs/performance.md ("Serving many users").
    max_batch: int = 8
    num_draft_tokens: int = 4  # k for requests that do not set num_draft_tokens
    drafter: str = "hybrid"  # hybrid | model | prompt-lookup
    device: str = "cpu"  # cpu | cuda | tensorrt
    api_key: str | None = None  # when set, /v1/* requires "Authorization: Bearer <api_key>"
    max_body_bytes: int = 1 << 20  # request bodies over this answer 413
    drain_timeout_s: float = 30.0  # on SIGTERM, in-flight requests get this long to finish
    model_name: str | None = None  # the id /v1/models lists (default: the bundle folder's name)
