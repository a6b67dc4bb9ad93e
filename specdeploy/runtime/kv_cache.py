"""KV caches and the one operation speculative decoding needs from them: truncate to n.

Two layouts, named by the manifest's `kv_cache.shared_buffer`:

- shared buffer (the fused graphs): one preallocated [1, kv_heads, capacity, head_dim] tensor per
  layer's keys and values. Each pass gets the buffer as its past input and the same buffer as its
  present output; GroupQueryAttention writes the new positions in place. Accepting tokens and
  rejecting them are both a change of `length` (only a prompt shared between sequences is copied,
  once: copy_prefix). KVSlots holds many such caches as rows of one buffer per layer.
- concat (optimum's graphs): `past_key_values.N.key` of [1, kv_heads, past, head_dim] in,
  `present.N.key` of [1, kv_heads, past + n, head_dim] out. The cache keeps the presents a pass
  returned as OrtValues and binds them as the next pass's past as they are; rejected positions
  are cut off (one copy) when the next pass reads the past.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np


def lazy_zeros(shape: tuple, dtype) -> np.ndarray:
    """Zeros whose pages are mapped as they are first written, 4 KiB at a time, so that a cache's memory
    grows with the context it holds. NumPy asks Linux for 2 MiB pages on large arrays (madvise
    MADV_HUGEPAGE): a first write at position p of one head's [capacity, head_dim] rows then maps 2 MiB,
    which at a capacity of 8,192 positions and 64 dimensions is the whole row. Here the memory is an
    anonymous map advised MADV_NOHUGEPAGE (other systems: plain np.zeros)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_NOHUGEPAGE") or count == 0:
        return np.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)


def ort_value(array: np.ndarray, device: str):
    """An OrtValue holding array on device (what IO binding takes); on the CPU it shares array's memory."""
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy(array, device, 0)


class _Cache:
    """What both layouts share: the tokens a cache holds, and rollback as a shorter valid length.

    `tokens` are the tokens whose keys and values the cache holds, `length` its valid positions;
    they agree between passes (`OrtEngine.run` appends to both). Each cache is one sequence's;
    a batched pass over KVSlots rows keeps one length per row (GroupQueryAttention's per-row
    sequence lengths come from the mask's per-row sum)."""

    shared_buffer: bool

    def __init__(self, num_layers: int, capacity: int, device: str = "cpu"):
        self.num_layers = num_layers
        self.capacity = capacity
        self.device = device
        self.length = 0  # valid positions
        self.tokens: list[int] = []

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` positions (the keys and values after them are stale from here on)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        del self.tokens[length:]
        self.length = length

    def truncate_to_prefix(self, context: list[int], min_rest: int = 0, start: int = 0) -> list[int]:
        """Truncate to the longest prefix shared with context, leaving at least min_rest of its tokens
        out; returns the tokens of context the cache lacks (what the next pass runs). It compares
        the tokens: for a new prompt on a cache that may hold an earlier one (a reused prefix). A
        sequence that appends to its context knows how far the two agree: `start`, where the comparison
        begins (tokens[:start] == context[:start] is the caller's word)."""
        limit = max(0, min(len(self.tokens), len(context) - min_rest))
        start = min(start, limit)
        shared = limit
        if self.tokens[start:limit] != context[start:limit]:
            shared = next(i for i in range(start, limit) if self.tokens[i] != context[i])
        if shared < self.length:
            self.truncate(shared)
        return context[shared:]

    def reset(self) -> None:
        """Empty (the next pass starts at position 0)."""
        self.tokens = []
        self.length = 0


class KVCache(_Cache):
    """optimum's layout: the past grows by concatenation inside the graph."""

    shared_buffer = False

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: np.dtype, capacity: int,
                 device: str = "cpu"):
        super().__init__(num_layers, capacity, device)
        self._shape = (1, num_kv_heads, 0, head_dim)
        self._dtype = dtype
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._backing: list[np.ndarray] = []  # NumPy buffers that CPU OrtValues made by _from_numpy point into
        empty = self._from_numpy(np.zeros(self._shape, dtype=self._dtype))
        self.tensors: list = [empty] * (2 * self.num_layers)  # key 0, value 0, key 1, ... [1, kv_heads, stored, head_dim]
        self.stored = 0  # positions the tensors hold; those past self.length are stale

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

    def _from_numpy(self, array: np.ndarray):
        self._backing.append(array)
        return ort_value(array, self.device)

    def _cut(self) -> None:
        # On the CPU .numpy() is a view and only the slice is copied; on a GPU it is a round trip,
        # paid once per rejection.
        # The old tensors may themselves point into NumPy arrays of a previous cut (when no pass
        # succeeded since): those stay alive until the copies are made.
        old, old_backing, self._backing = self.tensors, self._backing, []
        self.tensors = [self._from_numpy(np.ascontiguousarray(t.numpy()[:, :, : self.length])) for t in old]
        self.stored = self.length
        del old_backing


class SharedKVCache(_Cache):
    """The fused graphs' layout: fixed buffers that every pass reads and writes in place.

    On the CPU the cache also owns the pass's attention mask, as wide as the buffers: ones over the
    positions a pass sees, zeros after. The fused graph reads only its sum (GroupQueryAttention's
    sequence lengths; its buffers are capacity-wide anyway), so the logits are bit for bit those of
    a mask exactly as wide as the context, and the mask is bound once, like the buffers, then
    written in place: no binding per pass."""

    shared_buffer = True
    pool: "KVSlots | None" = None  # the KVSlots this cache is a row of, if any
    slot_index = 0

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: np.dtype, capacity: int,
                 device: str = "cpu", slot: tuple | None = None, feature_size: int = 0):
        """slot: (buffers, mask, features) views of one row of a KVSlots pool ([1, kv_heads, capacity, head_dim]
        each, [1, capacity] and [capacity, feature_size] or None); None allocates this cache's own.
        feature_size: rows of a feature output kept per position (`features` [capacity, F]; 0: none)."""
        super().__init__(num_layers, capacity, device)
        shape = (1, num_kv_heads, capacity, head_dim)
        self.mask = self.mask_value = None
        # The engine's feature output, row p for position p, valid below `length` as the keys and values are
        # (an eagle draft reads the target's); in host memory on every device, lazily mapped as the buffers.
        self.features = slot[2] if slot is not None else (
            lazy_zeros((capacity, feature_size), np.float32) if feature_size else None)
        slot = slot[:2] if slot is not None else None
        if device == "cpu":
            # lazy_zeros maps untouched pages lazily: memory grows with the context actually used.
            self._backing, self.mask = slot if slot is not None else (
                [lazy_zeros(shape, dtype) for _ in range(2 * num_layers)], np.zeros((1, capacity), dtype=np.int64))
            self.tensors = [ort_value(a, device) for a in self._backing]
            self._mask_row = self.mask[0]  # [capacity]: a 1-D index is the cheapest write
            self.mask_value = ort_value(self.mask, device)
            self._mask_length = 0  # the mask's leading ones
        else:
            import onnxruntime as ort

            self.tensors = [ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, 0)
                            for _ in range(2 * num_layers)]

    def mask_to(self, total: int) -> None:
        """Ones over the first `total` positions of the mask, zeros after (for a pass that ends at total)."""
        ones = self._mask_length
        if total == ones + 1:  # the next token: the draft's every step
            self._mask_row[ones] = 1
        elif total > ones:
            self.mask[0, ones:total] = 1
        elif total < ones:
            self.mask[0, total:ones] = 0
        self._mask_length = total

    def past(self) -> list:
        return self.tensors

    def copy_prefix(self, source: "SharedKVCache", length: int) -> None:
        """Hold source's first `length` positions (keys, values and tokens), as if this cache had run
        them: sequences with one prompt prefill it once. CPU buffers only."""
        if not (self.device == source.device == "cpu") or length > source.length:
            raise ValueError("copy_prefix needs two CPU caches and a length the source holds")
        for mine, theirs in zip(self._backing, source._backing):
            mine[:, :, :length] = theirs[:, :, :length]
        if self.features is not None and source.features is not None:
            self.features[:length] = source.features[:length]
        self.tokens = source.tokens[:length]
        self.length = length


class KVSlots:
    """The KV caches of many sequences in one buffer per layer, for passes over several at once.

    Keys and values of layer i live in [slots, kv_heads, capacity, head_dim] arrays and the masks
    in one [slots, capacity] array; `caches[i]` is a SharedKVCache over row i (views: a pass of
    that sequence alone binds them as any cache). A batched pass binds the first n rows of
    everything (`prefix(n)`): one token per row, each row written at its own length, as
    GroupQueryAttention reads per-row lengths from the mask's row sums. CPU only."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: np.dtype, capacity: int,
                 slots: int, feature_size: int = 0):
        shape = (slots, num_kv_heads, capacity, head_dim)
        self.num_slots, self.capacity = slots, capacity
        self.buffers = [lazy_zeros(shape, dtype) for _ in range(2 * num_layers)]  # [slots, kv_heads, capacity, head_dim]
        self.mask = np.zeros((slots, capacity), dtype=np.int64)  # [slots, capacity]
        # [slots, capacity, F]: each row's feature buffer (see SharedKVCache), and a batched pass's [slots, 1, F] output
        self.features = lazy_zeros((slots, capacity, feature_size), np.float32) if feature_size else None
        self._feature_out = np.zeros((slots, 1, feature_size), dtype=np.float32) if feature_size else None
        self._feature_values: dict[int, object] = {}
        self.caches = [SharedKVCache(num_layers, num_kv_heads, head_dim, dtype, capacity, "cpu",
                                     slot=([b[i : i + 1] for b in self.buffers], self.mask[i : i + 1],
                                           self.features[i] if feature_size else None))
                       for i in range(slots)]
        for index, cache in enumerate(self.caches):
            cache.pool, cache.slot_index = self, index
        self._prefixes: dict[int, tuple[list, object]] = {}
        self.packed_pass = None  # the target's packed graph over these slots (packed.py), set by OrtEngine.new_slots

    def feature_rows(self, rows: int):
        """The OrtValue a batched pass over the first `rows` slots writes its feature rows to ([rows, 1, F])."""
        value = self._feature_values.get(rows)
        if value is None:
            value = self._feature_values[rows] = ort_value(self._feature_out[:rows], "cpu")
        return value

    def place_features(self, slot_indices: list[int], lengths: list[int]) -> None:
        """After a batched pass: slot i's feature row to its position lengths[i] (its new token's)."""
        for index, length in zip(slot_indices, lengths):
            self.features[index, length] = self._feature_out[index, 0]

    def mask_next(self, rows: int, open_: bool) -> None:
        """The first `rows` slots' masks over their valid positions and the next one (open_: for a batched
        pass that writes each row's next position), or back over their valid positions."""
        for cache in self.caches[:rows]:
            cache.mask_to(cache.length + open_)

    def prefix(self, rows: int) -> tuple[list, object]:
        """OrtValues over the first `rows` slots: each layer's buffers, and the mask."""
        values = self._prefixes.get(rows)
        if values is None:
            values = self._prefixes[rows] = ([ort_value(b[:rows], "cpu") for b in self.buffers],
                                             ort_value(self.mask[:rows], "cpu"))
        return values
