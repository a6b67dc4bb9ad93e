"""`specdeploy distill`: train a draft (a small LM, or an EAGLE head) on the target's own distribution.

Importing this package imports no torch; `distill` does, when it is called.
"""

from .config import DistillConfig


def distill(config: DistillConfig, report=lambda event: None, stop=None):
    """See pipeline.distill."""
    from .pipeline import distill as run

    return run(config, report, stop)


__all__ = ["DistillConfig", "distill"]
