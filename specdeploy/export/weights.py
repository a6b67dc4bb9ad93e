"""A model's external weights, one at a time: read where they lie, written as they are made.

`onnx.load` reads every weight of a model into its protobuf, and saving a rewritten model then
holds the old weights and the new ones together, beside PyTorch's copy. Here a model's initializers are read from its data file one at a time
(DataReader) and new ones go straight into a data file (DataWriter), so building a graph
(fused.py) or rewriting one (quantize.py) holds about one weight in memory at a time.

Tensors of MIN_EXTERNAL_BYTES or more are external, the rest stay in the protobuf (as
`convert.save_model` decides); large ones start on 4 KiB boundaries, where ONNX Runtime can map
them directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import numpy as np

MIN_EXTERNAL_BYTES = 1024
PAGE_ALIGNED_BYTES = 65536  # tensors this large start on a 4 KiB boundary, smaller ones on 64 bytes


def is_external(tensor) -> bool:
    from onnx import TensorProto

    return tensor.HasField("data_location") and tensor.data_location == TensorProto.EXTERNAL


class DataReader:
    """The initializers of a model loaded without its external data (`onnx.load(..., load_external_data=False)`),
    as arrays read from their data files on request.

    Read, not memory-mapped: a mapped page that has been read counts in the process's resident
    memory until the whole mapping goes, so reading every weight through a map would hold the
    whole file resident by the end, however little of it is in use."""

    def __init__(self, model_dir: Path):
        self._dir = Path(model_dir)
        self._files: dict[str, object] = {}

    def _external(self, tensor) -> tuple[object, int, int]:
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info["location"]
        if location not in self._files:
            self._files[location] = open(self._dir / location, "rb")
        handle = self._files[location]
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else os.fstat(handle.fileno()).st_size - offset
        return handle, offset, length

    def raw(self, tensor) -> np.ndarray:
        """The tensor's bytes as stored, [nbytes] uint8."""
        if not is_external(tensor):
            return np.frombuffer(tensor.raw_data, dtype=np.uint8)
        handle, offset, length = self._external(tensor)
        return self._read(handle, offset, length)

    @staticmethod
    def _read(handle, offset: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.uint8)
        view, done = memoryview(out), 0
        while done < length:
            count = os.preadv(handle.fileno(), [view[done:]], offset + done)
            if count == 0:
                raise ValueError(f"{handle.name}: ends before byte {offset + length}")
            done += count
        return out

    def array(self, tensor, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """The tensor as an array of its dtype and shape, or only its rows start:stop along the first axis."""
        from onnx import helper, numpy_helper

        if not is_external(tensor):
            whole = (numpy_helper.to_array(tensor) if not tensor.HasField("raw_data")  # typed fields (int64_data, ...)
                     else self._view(tensor, np.frombuffer(tensor.raw_data, dtype=np.uint8), tuple(tensor.dims)))
            return whole if start is None and stop is None else whole[start:stop]
        dims = tuple(tensor.dims)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
        row_bytes = int(np.prod(dims[1:], dtype=np.int64)) * dtype.itemsize if dims else dtype.itemsize
        first, last, _ = slice(start, stop).indices(dims[0] if dims else 1)
        handle, offset, _ = self._external(tensor)
        last = max(first, last)
        raw = self._read(handle, offset + first * row_bytes, (last - first) * row_bytes)
        return self._view(tensor, raw, (last - first, *dims[1:]) if dims else ())

    @staticmethod
    def _view(tensor, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        from onnx import helper

        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")
        return raw.view(dtype).reshape(shape)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()


class DataWriter:
    """Tensors written one by one into the data file at path; each call returns the TensorProto that points
    at its bytes (named `location` in the graph, by default the file's own name)."""

    def __init__(self, path: Path, location: str | None = None):
        self.path = Path(path)
        self.location = location or self.path.name
        self._file = open(self.path, "wb")

    def _start(self, nbytes: int) -> int:
        alignment = 4096 if nbytes >= PAGE_ALIGNED_BYTES else 64
        offset = -(-self._file.tell() // alignment) * alignment
        self._file.write(b"\0" * (offset - self._file.tell()))
        return offset

    def _proto(self, name: str, dims, data_type: int, offset: int, nbytes: int):
        from onnx import TensorProto

        tensor = TensorProto(name=name, dims=list(dims), data_type=data_type)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(offset)), ("length", str(nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        return tensor

    def array(self, name: str, array: np.ndarray):
        """An array as an initializer: inline below MIN_EXTERNAL_BYTES, else its bytes in the file (no copy)."""
        from onnx import helper, numpy_helper

        array = np.ascontiguousarray(array)
        if array.nbytes < MIN_EXTERNAL_BYTES:
            return numpy_helper.from_array(array, name)
        offset = self._start(array.nbytes)
        self._file.write(memoryview(array).cast("B"))
        return self._proto(name, array.shape, helper.np_dtype_to_tensor_dtype(array.dtype), offset, array.nbytes)

    def rows(self, name: str, dtype, shape: tuple[int, ...], pieces: Iterable[np.ndarray]):
        """One tensor [shape] written as consecutive pieces along its first axis (row chunks), never held whole."""
        from onnx import helper

        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        offset = self._start(nbytes)
        for piece in pieces:
            piece = np.ascontiguousarray(piece, dtype=dtype)
            self._file.write(memoryview(piece).cast("B"))
        if self._file.tell() - offset != nbytes:
            raise ValueError(f"{name}: the pieces hold {self._file.tell() - offset} bytes, the shape {shape} {nbytes}")
        return self._proto(name, shape, helper.np_dtype_to_tensor_dtype(dtype), offset, nbytes)

    def copy(self, tensor, raw: np.ndarray):
        """An existing initializer whose stored bytes are raw ([nbytes] uint8): into the file when large, else inline."""
        from onnx import TensorProto

        if raw.nbytes < MIN_EXTERNAL_BYTES:
            if not is_external(tensor):
                return tensor
            inline = TensorProto(name=tensor.name, dims=list(tensor.dims), data_type=tensor.data_type)
            inline.raw_data = raw.tobytes()
            return inline
        offset = self._start(raw.nbytes)
        self._file.write(memoryview(np.ascontiguousarray(raw)).cast("B"))
        return self._proto(tensor.name, tensor.dims, tensor.data_type, offset, raw.nbytes)

    def close(self) -> None:
        self._file.close()
        self.path.chmod(0o644)  # open() honours the umask; a bundle is for others to read
