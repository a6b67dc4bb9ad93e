"""What the user gets by naming nothing: the default bundle and the embedded demo pair, the drafter,
the server's settings. The one definition of each: the CLI and ServeConfig read them here (this module imports nothing of the package, so the CLI reads the server's defaults without
importing the serve extra).

One rule for every command and for the Makefile: the default bundle is $SPECDEPLOY_HOME/demo-bundle,
$SPECDEPLOY_HOME defaulting to ~/.cache/specdeploy, so `make demo` and `specdeploy run` in any shell
find the same bundle.
"""

from __future__ import annotations

import os
from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"  # the demo target/ and draft/ checkpoints ship with the package
DRAFTER = "hybrid"  # prompt lookup when the text repeats, else the draft model (see runtime.drafters.HybridDrafter)

# `specdeploy serve` and ServeConfig
SERVE_HOST = "127.0.0.1"
SERVE_PORT = 8000
SERVE_MAX_QUEUE = 64  # requests that may wait for a free batch slot; one more answers 429
# Requests decoded together: 8 measured best on the 2-vCPU machine of docs/performance.md ("Serving many users").
SERVE_MAX_BATCH = 8
SERVE_MAX_BODY_BYTES = 1 << 20  # request bodies over this answer 413
SERVE_DRAIN_TIMEOUT_S = 30.0  # on SIGTERM, in-flight requests get this long to finish


def home() -> Path:
    """$SPECDEPLOY_HOME, else ~/.cache/specdeploy."""
    configured = os.environ.get("SPECDEPLOY_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specdeploy"


def default_bundle() -> Path:
    return home() / "demo-bundle"


def demo_checkpoints() -> tuple[str, str]:
    return str(DEMO_DIR / "target"), str(DEMO_DIR / "draft")
