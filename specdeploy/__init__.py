"""specdeploy: speculative decoding bundles for ONNX Runtime (and TensorRT).

    import specdeploy
    gen = specdeploy.load("bundle/", device="cpu")
    out = gen.generate("def fib(n):", max_new_tokens=64)
"""

__version__ = "0.1.0"

from .errors import SpecdeployError  # noqa: E402

# The runtime (NumPy and the engines) loads on first use of one of these names, so that importing the
# package costs nothing: the command's entry point (console.py) can then catch a Ctrl-C during the CLI's
# own imports.
_RUNTIME = ("GenerationConfig", "GenerationOutput", "GenerationStats", "Generator", "load")

__all__ = ["GenerationConfig", "GenerationOutput", "GenerationStats", "Generator", "SpecdeployError", "load", "__version__"]


def __getattr__(name: str):
    if name in _RUNTIME:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'specdeploy' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_RUNTIME))
