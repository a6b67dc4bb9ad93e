"""A .gguf file read in one pass of its header: metadata, tensor table, and each tensor's bytes on request.

gguf's GGUFReader makes a NumPy view for every part of every metadata value: 20 s for a vocabulary
of 151,936 tokens and as many merges (Qwen 2.5) on a 2-vCPU EPYC, and transformers' GGUF loader
runs it again for the config and again for the tokenizer. This reader walks the header once
(about 0.5 s for the same file) and gives the metadata as Python values, the tensor table (name,
shape, GGML type, offset), and what transformers' loader would have made of the metadata
(`transformers_view`), so that its config and tokenizer conversions run on this one reading. The
types, their block sizes and the dequantization stay gguf's own (gguf.GGMLQuantizationType,
GGML_QUANT_SIZES, gguf.quants).

A tensor's bytes are read from the file by offset, rows at a time (not through a memory mapping:
a mapped page, once read, counts in the process's resident memory as long as the mapping lives).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SpecdeployError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
HEADER_READ = 8 << 20  # bytes of the file read at first for its header (more, four times as much, if it is longer)
MAX_HEADER = 1 << 30  # a header (metadata and tensor table) longer than this is refused, not read into memory
# GGUF's value types (gguf.GGUFValueType): scalar struct formats; 8 is a string, 9 an array
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                12: "<f8"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF's order: innermost (a row's length) first
    type_name: str  # the GGML type: F32, Q4_K, ...
    offset: int  # of its first byte in the file
    nbytes: int

    @property
    def rows(self) -> int:
        """Rows of a matrix (1 for a vector)."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def cols(self) -> int:
        return self.shape[0]


class _ShortRead(Exception):
    """The header runs past the bytes read so far."""


class _Cursor:
    def __init__(self, buffer: bytes, path: Path):
        self.buffer, self.position, self.path = buffer, 0, path

    def take(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.position)
        except struct.error:
            raise _ShortRead from None
        self.position += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        end = self.position + length
        if end > len(self.buffer):
            raise _ShortRead
        text = self.buffer[self.position:end].decode("utf-8")
        self.position = end
        return text

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item == STRING:
                return [self.string() for _ in range(count)]
            if item not in ARRAY_DTYPES:
                raise SpecdeployError(f"{self.path}: unknown GGUF array type {item}")
            dtype = np.dtype(ARRAY_DTYPES[item])
            if self.position + count * dtype.itemsize > len(self.buffer):
                raise _ShortRead
            values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.position).tolist()
            self.position += count * dtype.itemsize
            return values
        if kind not in SCALARS:
            raise SpecdeployError(f"{self.path}: unknown GGUF value type {kind}")
        value = self.take(SCALARS[kind])
        return float(value) if kind in (6, 12) else value


class GgufFile:
    """One .gguf file: `metadata` (key -> value; arrays as lists), `tensors` (name -> TensorInfo), in file order."""

    def __init__(self, path: Path):
        import gguf

        self.path = Path(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as handle:
            if handle.read(4) != MAGIC:
                raise SpecdeployError(f"{self.path}: not a GGUF file (no GGUF magic at its start)")
            length = HEADER_READ
            while True:  # the header is read whole, in one or a few reads: a vocabulary makes it a few MB
                handle.seek(0)
                buffer = handle.read(length)
                try:
                    self._read_header(_Cursor(buffer, self.path), gguf)
                    break
                except _ShortRead:
                    if length >= size:
                        raise SpecdeployError(f"{self.path}: the GGUF header ends early (truncated file)") from None
                    if length >= MAX_HEADER:
                        raise SpecdeployError(f"{self.path}: the GGUF header runs past {MAX_HEADER >> 20} MB "
                                              "(a corrupt length in it)") from None
                    length *= 4
        self.architecture = self.metadata.get("general.architecture")
        self._handle = open(self.path, "rb")

    def _read_header(self, cursor: _Cursor, gguf) -> None:
        cursor.position = 4
        self.version = cursor.take("<I")
        if self.version not in (2, 3):
            raise SpecdeployError(f"{self.path}: GGUF version {self.version} (this reader takes 2 and 3, little-endian)")
        count, kv_count = cursor.take("<Q"), cursor.take("<Q")
        self.metadata: dict[str, object] = {}
        self.types: dict[str, tuple[int, ...]] = {}  # key -> its value type (and an array's item type)
        for _ in range(kv_count):
            key, kind = cursor.string(), cursor.take("<I")
            start = cursor.position
            self.metadata[key] = cursor.value(kind)
            self.types[key] = (kind, struct.unpack_from("<I", cursor.buffer, start)[0]) if kind == ARRAY else (kind,)
        infos = []
        for _ in range(count):
            name, dims = cursor.string(), cursor.take("<I")
            shape = tuple(cursor.take("<Q") for _ in range(dims))
            kind, offset = cursor.take("<I"), cursor.take("<Q")
            try:
                type_name = gguf.GGMLQuantizationType(kind).name
            except ValueError:
                raise SpecdeployError(f"{self.path}: tensor {name} has an unknown GGML type {kind}") from None
            infos.append((name, shape, type_name, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cursor.position // alignment) * alignment
        size = os.path.getsize(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_name, offset in infos:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
            nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
            if data_start + offset + nbytes > size:
                raise SpecdeployError(f"{self.path}: tensor {name} runs past the end of the file (truncated file)")
            self.tensors[name] = TensorInfo(name, shape, type_name, data_start + offset, nbytes)

    def close(self) -> None:
        self._handle.close()

    def raw_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of a tensor as stored, [stop - start, bytes a row] uint8."""
        tensor = self.tensors[name]
        row_bytes = tensor.nbytes // tensor.rows
        out = np.empty((stop - start) * row_bytes, dtype=np.uint8)
        view, done, offset = memoryview(out), 0, tensor.offset + start * row_bytes
        while done < len(out):
            count = os.preadv(self._handle.fileno(), [view[done:]], offset + done)
            if count == 0:
                raise SpecdeployError(f"{self.path}: ends inside tensor {name}")
            done += count
        return out.reshape(stop - start, row_bytes)


def transformers_view(file: GgufFile) -> dict:
    """What transformers' `load_gguf_checkpoint(path, return_tensors=False)` makes of the metadata: the `config`,
    `tokenizer` and `tokenizer_config` dicts its GGUF config and tokenizer conversions read (transformers 4.57)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, GGUF_TO_TRANSFORMERS_MAPPING

    architecture = str(file.metadata.get("general.architecture"))
    name = file.metadata.get("general.name")
    updated = architecture
    if "llama" in architecture and name is not None and "mistral" in str(name):  # llama.cpp names Mistral llama
        updated = "mistral"
    elif "t5" in architecture:
        raise SpecdeployError(f"{file.path}: a T5 GGUF is not a causal language model")
    updated = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(architecture, updated)
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES and updated not in GGUF_SUPPORTED_ARCHITECTURES:
        raise SpecdeployError(f"{file.path}: transformers' GGUF loader does not read the architecture '{architecture}'")
    parsed: dict = {key: {} for key in GGUF_TO_TRANSFORMERS_MAPPING}
    if "stablelm" in architecture:
        names = list(file.tensors)
        parsed["config"]["use_qkv_bias"] = any(b in n for n in names for b in ("attn_q.bias", "attn_k.bias", "attn_v.bias"))
        parsed["config"]["use_parallel_residual"] = not any("ffn_norm" in n for n in names)
    parsed["config"]["tie_word_embeddings"] = "output.weight" not in file.tensors or architecture in ("falcon", "bloom")
    for key, value in file.metadata.items():
        key = key.replace(architecture, updated)
        prefix, _, config_key = key.partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # as transformers unwraps one-element values
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        for parameter, renames in GGUF_TO_TRANSFORMERS_MAPPING.items():
            if prefix in renames and config_key in renames[prefix]:
                renamed = renames[prefix][config_key]
                if renamed not in (-1, None):
                    parsed[parameter][renamed] = value
    if parsed["config"].get("model_type") == "gemma3":  # a Gemma 3 GGUF holds the text model only
        parsed["config"]["model_type"] = "gemma3_text"
    if "vocab_size" not in parsed["config"] and "tokens" in parsed["tokenizer"]:
        parsed["config"]["vocab_size"] = len(parsed["tokenizer"]["tokens"])
    return parsed
