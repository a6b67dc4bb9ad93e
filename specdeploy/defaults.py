"""What the user gets by naming nothing: the bundle a command runs, the embedded demo pair, the
drafter, the server's settings. The one definition of each: the CLI and ServeConfig read them here
(this module imports only the manifest's names, so the CLI reads the server's defaults without
importing the serve extra).

The bundle a command runs without one named: the default bundle, $SPECDEPLOY_HOME/demo-bundle
($SPECDEPLOY_HOME defaulting to ~/.cache/specdeploy), where `specdeploy export` with no --out writes;
until one is exported there, the demo pair's bundle that ships with the package (SHIPPED_BUNDLE),
so that an install without the export extra runs `specdeploy run` and `bench` with no argument.
"""
from __future__ import annotations

import os
from pathlib import Path

from .manifest import MANIFEST_NAME

DEMO_DIR = Path(__file__).parent / "demo"  # the demo target/ and draft/ checkpoints ship with the package
SHIPPED_BUNDLE = DEMO_DIR / "demo-bundle"  # and the pair exported (scripts/ship_demo_bundle.py writes it)
DRAFTER = "hybrid"  # the draft model, continued by prompt lookup where the text repeats (runtime.hybrid.HybridDrafter)

# The most a command reads of one input (--prompt-file, --prompt -, --chat -, --prompts, --messages): far
# more text than any bundle's context holds, and a bound on what /dev/zero or a runaway pipe can take.
MAX_INPUT_BYTES = 16 << 20

# `specdeploy serve` and ServeConfig
SERVE_HOST = "127.0.0.1"
SERVE_PORT = 8000
SERVE_MAX_QUEUE = 64  # requests that may wait for a free batch slot; one more answers 429
# Requests decoded together (docs/performance.md, "The server under load", measures 8 against 1).
SERVE_MAX_BATCH = 8
SERVE_MAX_BODY_BYTES = 1 << 20  # request bodies over this answer 413
SERVE_DRAIN_TIMEOUT_S = 30.0  # on SIGTERM, in-flight requests get this long to finish
SERVE_HEADER_TIMEOUT_S = 10.0  # a request's headers must arrive whole within this of its first byte (or the connection)
SERVE_BODY_TIMEOUT_S = 30.0  # and its body within this of its headers; else 408
SERVE_MAX_CONNECTIONS = 512  # open connections (and requests in flight); one more answers 503


def home() -> Path:
    """$SPECDEPLOY_HOME, else ~/.cache/specdeploy."""
    configured = os.environ.get("SPECDEPLOY_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specdeploy"


def default_bundle() -> Path:
    """Where `specdeploy export` writes without --out."""
    return home() / "demo-bundle"


def bundle_to_run() -> Path:
    """The bundle a command runs when none is named: the default bundle once exported, else the shipped one."""
    exported = default_bundle()
    return exported if (exported / MANIFEST_NAME).is_file() else SHIPPED_BUNDLE


def demo_checkpoints() -> tuple[str, str]:
    return str(DEMO_DIR / "target"), str(DEMO_DIR / "draft")
