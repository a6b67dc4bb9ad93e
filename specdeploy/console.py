"""The `specdeploy` command's entry point: the CLI's imports (a few tenths of a second: NumPy, click,
the runtime) run under a Ctrl-C guard, so that an early Ctrl-C ends with one line, as a later one does."""

from __future__ import annotations

import sys

from .errors import EXIT_INTERRUPTED


def main() -> None:
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(EXIT_INTERRUPTED)
    cli_main()
