"""The export stage: Hugging Face checkpoints -> ONNX (optimum) -> fp16 / quantized -> a validated bundle."""

from .config import DTYPES, GRAPHS, QUANTIZE, ExportConfig

__all__ = ["DTYPES", "GRAPHS", "QUANTIZE", "ExportConfig", "export_bundle"]


def __getattr__(name: str):
    """export_bundle on first use: the CLI reads this package's choices without loading the pipeline."""
    if name == "export_bundle":
        from .pipeline import export_bundle

        return export_bundle
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
