"""The lean runtime: NumPy over ONNX Runtime sessions. It never imports torch, transformers or optimum."""

from .generate import GenerationConfig, GenerationOutput, GenerationStats, Generator
from .loader import load

__all__ = ["GenerationConfig", "GenerationOutput", "GenerationStats", "Generator", "load"]
