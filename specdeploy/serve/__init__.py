"""`specdeploy serve`: an OpenAI-compatible HTTP server over one loaded bundle (the `serve` extra).

    from specdeploy.serve import ServeConfig, serve
    serve(ServeConfig(bundle="bundle/", port=8000))

`create_app(config)` returns the ASGI application for any other ASGI server.
"""

from .app import create_app
from .config import ServeConfig
from .server import serve

__all__ = ["ServeConfig", "create_app", "serve"]
