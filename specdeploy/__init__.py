"""specdeploy: speculative decoding bundles for ONNX Runtime (and TensorRT).

    import specdeploy
    gen = specdeploy.load("bundle/", device="cpu")
    out = gen.generate("def fib(n):", max_new_tokens=64)
"""

__version__ = "0.1.0"

from .errors import SpecdeployError  # noqa: E402
from .runtime import GenerationConfig, GenerationOutput, GenerationStats, Generator, load  # noqa: E402

__all__ = ["GenerationConfig", "GenerationOutput", "GenerationStats", "Generator", "SpecdeployError", "load", "__version__"]
