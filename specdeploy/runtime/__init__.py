"""The lean runtime: NumPy over ONNX Runtime sessions. It never imports torch, transformers or optimum.

What other parts of specdeploy use (the export's parity check runs the exported graphs through
`OrtEngine.run`) is exported here; the modules behind it are the runtime's own business.
"""

from .engine import OrtEngine
from .session import SessionConfig, global_pool_active
from .generate import GenerationConfig, GenerationOutput, GenerationStats, Generator
from .loader import load

__all__ = ["GenerationConfig", "GenerationOutput", "GenerationStats", "Generator", "OrtEngine", "SessionConfig",
           "global_pool_active", "load"]
