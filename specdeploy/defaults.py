"""Where things live when the user names nothing: the embedded demo pair and the default bundle.

One rule for every command and for the Makefile: the default bundle is $SPECDEPLOY_HOME/demo-bundle,
$SPECDEPLOY_HOME defaulting to ~/.cache/specdeploy, so `make demo` and `specdeploy run` in any shell
find the same bundle.
"""

from __future__ import annotations

import os
from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"  # the demo target/ and draft/ checkpoints ship with the package


def home() -> Path:
    """$SPECDEPLOY_HOME, else ~/.cache/specdeploy."""
    configured = os.environ.get("SPECDEPLOY_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specdeploy"


def default_bundle() -> Path:
    return home() / "demo-bundle"


def demo_checkpoints() -> tuple[str, str]:
    return str(DEMO_DIR / "target"), str(DEMO_DIR / "draft")
