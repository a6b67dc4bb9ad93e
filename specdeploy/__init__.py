"""specdeploy: speculative decoding bundles for ONNX Runtime (and TensorRT).

    import specdeploy
    gen = specdeploy.load("bundle/", device="cpu")
    out = gen.generate("def fib(n):", max_new_tokens=64)
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

__version__ = "0.1.0"

from .errors import SpecdeployError  # noqa: E402

if TYPE_CHECKING:
    from .runtime import GenerationConfig, GenerationOutput, GenerationStats, Generator, load

# The runtime (NumPy and the engines) loads on first use of one of these names, or of a submodule, so that
# importing the package costs nothing: the command's entry point (console.py) can then catch a Ctrl-C during
# the CLI's own imports.
_RUNTIME = ("GenerationConfig", "GenerationOutput", "GenerationStats", "Generator", "load")

__all__ = ["GenerationConfig", "GenerationOutput", "GenerationStats", "Generator", "SpecdeployError", "load", "__version__"]


def __getattr__(name: str):
    if name in _RUNTIME:
        from . import runtime

        return getattr(runtime, name)
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # specdeploy.runtime, .bundle, ... as attributes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_RUNTIME))
