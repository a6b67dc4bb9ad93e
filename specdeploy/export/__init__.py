"""The export stage: Hugging Face checkpoints -> ONNX (optimum) -> fp16 / quantized -> a validated bundle."""

from .config import DTYPES, QUANTIZE, ExportConfig
from .pipeline import export_bundle

__all__ = ["DTYPES", "QUANTIZE", "ExportConfig", "export_bundle"]
