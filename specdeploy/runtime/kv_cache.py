"""KV caches and the one operation speculative decoding needs from them: truncate to n.

The exported graphs (optimum's layout) take `past_key_values.N.key` of [1, kv_heads, past, head_dim]
and return `present.N.key` of [1, kv_heads, past + n, head_dim]. The cache keeps the presents it
was handed and a valid length; rejecting draft tokens only lowers the length, and the stale
positions are dropped when the next step reads the past.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: np.dtype, capacity: int):
        self.num_layers = num_layers
        self.capacity = capacity
        empty = np.zeros((1, num_kv_heads, 0, head_dim), dtype=dtype)
        self.keys: list[np.ndarray] = [empty] * num_layers  # each [1, kv_heads, stored, head_dim]
        self.values: list[np.ndarray] = [empty] * num_layers
        self.length = 0  # valid positions; stored ones past it are stale

    def past(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Key and value of the valid positions, contiguous: [1, kv_heads, length, head_dim] each."""
        key, value = self.keys[layer], self.values[layer]
        if key.shape[2] != self.length:
            key = self.keys[layer] = np.ascontiguousarray(key[:, :, : self.length])
            value = self.values[layer] = np.ascontiguousarray(value[:, :, : self.length])
        return key, value

    def update(self, keys: list[np.ndarray], values: list[np.ndarray], owners: list | None = None) -> None:
        """Take the presents a forward pass returned; they hold the past plus the new positions.

        `owners` keeps alive whatever owns their memory (ONNX Runtime's OrtValues)."""
        self.keys, self.values = keys, values
        self._owners = owners
        self.length = keys[0].shape[2]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length
