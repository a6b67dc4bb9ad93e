"""Where an export reads one model from: a Hugging Face folder through PyTorch, or a GGUF file in place.

Both answer the same four questions, so the pipeline never asks which it has:
- `structure()`: the transformers model whose modules and config decide the graph (a GGUF's has no
  weights in memory);
- `weights(keep_blocks)`: the fused graph's weights source (`TorchWeights` below, gguf_weights.GgufWeights);
- `load()`: the model with every weight in memory, for optimum's graph;
- `reference()`: the model the parity check runs (a GGUF's reads one module's weights at a time).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from . import convert, gguf_weights
from .gguf_file import GgufFile


class TorchWeights:
    """A PyTorch module's own parameters as the graph reads them: float32 arrays by their state-dict names."""

    def __init__(self, model):
        self.model = model

    def array(self, name: str) -> np.ndarray:
        return self.model.get_parameter(name).detach().float().numpy()

    def matrix(self, name: str) -> np.ndarray:
        """A Linear's weight [out, in]."""
        return self.array(name)

    def norm(self, name: str, offset: float) -> np.ndarray:
        """An RMS norm's weight plus offset (Gemma's 1)."""
        return self.array(name) + np.float32(offset)

    def tied_head(self) -> bool:
        """The LM head is the embedding table itself."""
        head, embed = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        return head is not None and head.weight is embed.weight


class FolderSource:
    """A Hugging Face checkpoint folder; PyTorch maps its safetensors weights for each use and lets them go after."""

    gguf = None

    def __init__(self, path: Path, role: str, trust_remote_code: bool):
        self.path, self.role, self.trust_remote_code = path, role, trust_remote_code

    def load(self):
        return convert.load_torch_model(self.path, self.role, self.trust_remote_code)

    structure = reference = load

    def weights(self, keep_blocks: bool = False):
        return TorchWeights(self.load())


class GgufSource:
    """A .gguf file whose tensors are the model's weights, read where they lie (gguf_weights.py)."""

    def __init__(self, path: Path, config):
        self.path = Path(path)
        self.tensors = gguf_weights.GgufTensors(GgufFile(self.path), config)
        self.gguf: gguf_weights.GgufWeights | None = None  # the last weights source given out: what it kept

    def structure(self):
        return gguf_weights.skeleton(self.tensors.config)

    def load(self):
        return gguf_weights.load_model(self.tensors)

    def reference(self):
        return gguf_weights.streamed_model(self.tensors)

    def weights(self, keep_blocks: bool = False):
        self.gguf = gguf_weights.GgufWeights(self.tensors, self.structure(), keep_blocks)
        return self.gguf

    def sha256(self) -> str:
        digest = hashlib.sha256()
        with open(self.path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 22), b""):
                digest.update(chunk)
        return digest.hexdigest()


def model_source(checkpoint, role: str, trust_remote_code: bool):
    """The checkpoint's source: its GGUF file where the weights are read from one, else its folder."""
    if checkpoint.gguf_file is not None:
        return GgufSource(checkpoint.gguf_file, checkpoint.config)
    return FolderSource(checkpoint.path, role, trust_remote_code)
