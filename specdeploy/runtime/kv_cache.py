"""KV caches and the one operation speculative decoding needs from them: truncate to n.

The exported graphs (optimum's layout) take `past_key_values.N.key` of [1, kv_heads, past, head_dim]
and return `present.N.key` of [1, kv_heads, past + n, head_dim]. The cache keeps the presents a
pass returned as ONNX Runtime OrtValues, on whatever device the pass left them, and binds them as
the next pass's past as they are: nothing is copied while draft tokens are being accepted.
Rejecting draft tokens only lowers the valid length; the stale positions are cut off (one copy)
when the next pass reads the past.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: np.dtype, capacity: int,
                 device: str = "cpu"):
        import onnxruntime as ort

        self._ort = ort
        self.num_layers = num_layers
        self.capacity = capacity
        self.device = device
        self._backing: list[np.ndarray] = []  # NumPy buffers that CPU OrtValues made by _from_numpy point into
        empty = self._from_numpy(np.zeros((1, num_kv_heads, 0, head_dim), dtype=dtype))
        self.tensors: list = [empty] * (2 * num_layers)  # OrtValues: key 0, value 0, key 1, ... [1, kv_heads, stored, head_dim]
        self.stored = 0  # positions the tensors hold
        self.length = 0  # valid positions; stored ones past it are stale

    def past(self) -> list:
        """Keys and values of the valid positions, [1, kv_heads, length, head_dim] each, in layer order."""
        if self.stored != self.length:
            self._cut()
        return self.tensors

    def update(self, presents: list) -> None:
        """Take the presents a forward pass returned (OrtValues); they hold the past plus the new positions."""
        self.tensors = presents
        self._backing = []  # the presents own their memory; the past they were computed from may go
        self.stored = self.length = presents[0].shape()[2]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    def _from_numpy(self, array: np.ndarray):
        """A C-level OrtValue (what IO binding takes and returns) of array on the cache's device.

        On the CPU it points into array's memory, so the array is kept alive beside it."""
        self._backing.append(array)
        return self._ort.OrtValue.ortvalue_from_numpy(array, self.device, 0)._ortvalue

    def _cut(self) -> None:
        # On the CPU .numpy() is a view and only the slice is copied; on a GPU it is a round trip,
        # paid once per rejection.
        old, self._backing = self.tensors, []
        self.tensors = [self._from_numpy(np.ascontiguousarray(t.numpy()[:, :, : self.length])) for t in old]
        self.stored = self.length
