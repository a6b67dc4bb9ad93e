"""Packed passes: several sequences' passes in one ONNX Runtime run, each row exactly as alone.

ONNX Runtime's CPU GroupQueryAttention refuses a batch of several rows with several tokens each over
a past ("batch_size must be 1 when sequence_length > 1 and past context is given"), so a batched
pass over [rows, 1] is all a fused graph runs as it is. That is not enough for three passes:

- verification, k + 1 tokens per row;
- prefill chunks, which should share the pass of the rows that decode beside them rather than stall
  them for a pass of their own;
- an exact target's single tokens (OrtEngine's `exact`, min_pass_tokens 2): alone, such a token runs
  beside the previous one, since a one-row pass takes other kernels (MLAS's one-row paths, fp32
  compute in MatMulNBits) whose logits differ from verification's, where a pass of two or more tokens
  matches it bit for bit.

The packed graph is the target's own graph over one flat token axis, the rows' tokens one after another
(no padding), with each attention node split into one node per row:

    qkv [1, T, D] -> Split(axis 1, each row's length) -> GroupQueryAttention (batch 1, the row's tokens,
                     the row's cache) -> Concat(axis 1)

Everything else (the MatMuls, norms and the head) runs over every token at once. Every kernel but
attention computes each token of its input independently, and each row's attention node is the one a
pass of that sequence alone runs, so a row's logits and keys and values are bit for bit those of its
own pass (tests/test_packed.py). A row of 64 prompt tokens then costs 64 tokens beside rows of one.
For a target whose single tokens never run alone, each row's attention also runs a spare query row,
a copy of its last one at the next position (past the valid ones; `packed/spread` lays the copies out
with one Gather, `packed/own` drops their outputs): a row of one token then takes attention's
several-row kernels, as its two-token pass alone does, and the MatMuls see every token of the pass
at once, so no token runs twice. The head computes the positions in `packed/keep` only (a prefill
chunk's logits are never read; at least two positions, so that it takes its several-row kernels).

The graph is built from the bundle's graph at load (the `onnx` package edits it in memory; the
weights are the bundle's data file, read again by each graph's session), for a fixed number of rows
(one graph per size, packed_sizes): a slot without tokens in a pass of its graph computes one filler
token at its pending position (and its spare row one past it), past its valid ones, and keeps its
length.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..errors import SpecdeployError

_ATTENTION = "GroupQueryAttention"
_SPLIT_INPUTS = (0, 1, 2, 5)  # query (or packed qkv), key, value, seqlens_k: one slice per row
_PER_ROW_IO = (3, 4)  # past key and value: each row's own cache
# the rest (total_sequence_length, cos_cache, sin_cache) is the same for every row
_HEADS = ("MatMul", "MatMulNBits", "FusedMatMul")  # the op of the LM head (over [1, T, hidden])
_AFTER_HEAD = ("Mul", "Tanh", "Div", "Cast")  # what may follow it before `logits` (Gemma's softcap)
# graph inputs: each row's token count in attention (its own, and its spare row's), the spare rows'
# layout (an index into the flat tokens) and the own rows in it, the positions the head computes
LENGTHS, SPREAD, OWN, KEEP = "packed/lengths", "packed/spread", "packed/own", "packed/keep"
_ONES, _ONE32 = "packed/ones", "packed/one32"  # the Split sizes of per-row tensors ([rows] seqlens), the spare's count


def row_name(name: str, row: int) -> str:
    """A cache input or output of the packed graph: `name` for row `row` alone."""
    return f"{name}.row{row}"


def packed_graph(model_path: Path, rows: int, spare_row: bool = False) -> bytes:
    """The packed graph of the fused graph at model_path (see the module docstring), serialized; with
    spare_row, each row's attention node runs one query row more (see _split_nodes).

    Raises SpecdeployError for a graph it cannot split: one with no attention node, one whose attention
    nodes take inputs beyond the rotary caches (position ids, an attention bias), or one whose logits
    do not come from a MatMul."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    nodes = list(graph.node)
    attention = [node for node in nodes if node.op_type == _ATTENTION]
    if not attention or any(len([i for i in node.input[9:] if i]) for node in attention):
        raise SpecdeployError(f"{model_path.name}: no attention nodes a packed graph can split")
    head = _head_node(nodes)
    if head is None:
        raise SpecdeployError(f"{model_path.name}: no LM head a packed graph can find")
    graph.initializer.append(helper.make_tensor(_ONES, TensorProto.INT64, [rows], [1] * rows))
    if spare_row:
        graph.initializer.append(helper.make_tensor(_ONE32, TensorProto.INT32, [1], [1]))
    kept = f"{head.input[0]}/kept"  # the head reads the positions in packed/keep only
    nodes.insert(nodes.index(head), helper.make_node("Gather", [head.input[0], KEEP], [kept], axis=1, name="packed/keep"))
    head.input[0] = kept
    cache_io: set[str] = set()  # the cache inputs and outputs, one per row in the new graph
    new_nodes = _split_nodes(nodes, rows, cache_io, spare_row)
    del graph.node[:]
    graph.node.extend(new_nodes)
    inputs = _per_row(graph.input, rows, cache_io)
    names = [LENGTHS, KEEP] + ([SPREAD, OWN] if spare_row else [])
    inputs += [helper.make_tensor_value_info(name, TensorProto.INT64, [f"{name}_count"]) for name in names]
    ids = next(value for value in inputs if value.name == "input_ids").type.tensor_type.shape
    ids.dim[0].dim_value, ids.dim[1].dim_param = 1, "packed/tokens"  # one flat axis; the mask keeps [rows, ...]
    outputs = _per_row(graph.output, rows, cache_io)
    del graph.input[:]
    graph.input.extend(inputs)
    del graph.output[:]
    graph.output.extend(outputs)
    return model.SerializeToString()


def _head_node(nodes: list):
    """The node that computes the logits from the final hidden states (a MatMul of some kind), or None."""
    producers = {output: node for node in nodes for output in node.output}
    node = producers.get("logits")
    while node is not None and node.op_type in _AFTER_HEAD:
        node = producers.get(node.input[0])
    return node if node is not None and node.op_type in _HEADS else None


def _split_nodes(nodes: list, rows: int, cache_io: set[str], spare_row: bool) -> list:
    """The graph's nodes with each attention node split by rows.

    spare_row: each row's attention runs its last query, key and value row twice, one position after
    the pass's last (a pending position, past the valid ones, as filler is), and keeps the outputs of
    the pass's positions. One token's attention then takes the kernels' several-row path, which a pass
    of two or more tokens alone takes; the MatMuls around it see every token of the pass at once already."""
    from onnx import helper

    split: dict[str, list[str]] = {}  # a tensor split by rows -> its row slices
    new_nodes: list = []

    def slices(name: str, index: int) -> list[str]:
        if name not in split:
            split[name] = [f"{name}/row{r}" for r in range(rows)]
            sizes, axis = (_ONES, 0) if index == 5 else (LENGTHS, 1)  # seqlens_k: [rows]; the rest [1, T, ...]
            new_nodes.append(helper.make_node("Split", [name, sizes], split[name], axis=axis, name=f"{name}/split_rows"))
        return split[name]

    spare: dict[str, str] = {}  # a tensor -> it with its spare rows (spare_row)

    def with_spare(name: str, index: int) -> str:
        """The attention input `name` with the spare rows: each row's last token again after its own (query,
        key, value: packed/spread), or one more in each row's count (seqlens_k, index 5)."""
        if name not in spare:
            spare[name] = f"{name}/spare"
            if index == 5:
                new_nodes.append(helper.make_node("Add", [name, _ONE32], [spare[name]], name=f"{name}/count"))
            else:
                new_nodes.append(helper.make_node("Gather", [name, SPREAD], [spare[name]], axis=1, name=f"{name}/spare"))
        return spare[name]

    for node in nodes:
        if node.op_type == _ATTENTION:
            row_inputs = {i: slices(with_spare(node.input[i], i) if spare_row else node.input[i], i)
                          for i in _SPLIT_INPUTS if node.input[i]}
            cache_io.update(node.input[i] for i in _PER_ROW_IO)
            cache_io.update(node.output[1:3])
            output = f"{node.output[0]}/spare" if spare_row else node.output[0]
            outputs = []
            for r in range(rows):
                inputs = list(node.input[:9])
                for i, names in row_inputs.items():
                    inputs[i] = names[r]
                for i in _PER_ROW_IO:
                    inputs[i] = row_name(node.input[i], r)
                outputs.append(f"{output}/row{r}")
                row_node = helper.make_node(_ATTENTION, inputs, [outputs[-1]] + [row_name(o, r) for o in node.output[1:3]],
                                            name=f"{node.name}/row{r}", domain=node.domain)
                row_node.attribute.extend(node.attribute)
                new_nodes.append(row_node)
            new_nodes.append(helper.make_node("Concat", outputs, [output], axis=1, name=f"{node.name}/rows"))
            if spare_row:  # every row's own tokens
                new_nodes.append(helper.make_node("Gather", [output, OWN], [node.output[0]], axis=1, name=f"{node.name}/own"))
        else:
            new_nodes.append(node)
    return new_nodes


def _per_row(values, rows: int, cache_io: set[str]) -> list:
    """Graph inputs or outputs with each cache tensor replaced by one of batch 1 per row."""
    import onnx

    kept = []
    for value in values:
        if value.name not in cache_io:
            kept.append(value)
            continue
        for r in range(rows):
            copy = onnx.ValueInfoProto()
            copy.CopyFrom(value)
            copy.name = row_name(value.name, r)
            copy.type.tensor_type.shape.dim[0].dim_value = 1
            kept.append(copy)
    return kept


def packed_sizes(slots: int) -> list[int]:
    """The packed graphs a pool of `slots` gets: 2, 4, 8, ... below slots, and slots itself."""
    sizes, size = [], 2
    while size < slots:
        sizes.append(size)
        size *= 2
    return sizes + [slots]


def packed_size(sizes: list[int], count: int) -> int | None:
    """The packed graph (of `sizes`) a pass of `count` rows runs: the smallest of count rows or more."""
    return next((size for size in sizes if size >= count), None)


class PackedPass:
    """The packed graphs of one engine over one KVSlots pool: one per size in packed_sizes(slots), so that a
    pass of n rows runs the smallest graph of n rows or more (slots not given fill the rest). Each
    graph is a session of its own, with the target's weights: a pool of 8 slots holds them 3 more times.

    `slots` then `run`: see OrtEngine.run_packed, their one caller."""

    def __init__(self, engine, pool, model_path: Path, config):
        from .kv_cache import ort_value
        from .session import open_packed_session

        self.engine, self.pool, self.sizes = engine, pool, packed_sizes(pool.num_slots)
        # An engine whose single tokens never run alone (min_pass_tokens > 1) gets graphs with a spare
        # attention row, so that a pass of single tokens computes each as its own two-token pass does.
        self.spare = int(engine.min_pass_tokens > 1)
        spec = engine.spec
        self._sessions = {size: open_packed_session(packed_graph(model_path, size, spare_row=bool(self.spare)), model_path,
                                                    spec, config, engine.weights) for size in self.sizes}
        kv = spec.kv_cache
        # (past, present, pool buffer index) of every cache tensor
        self._names = [(name % i, present % i, 2 * i + j) for i in range(spec.num_layers)
                       for j, (name, present) in enumerate(((kv.past_key, kv.present_key), (kv.past_value, kv.present_value)))]
        self._ort_value = ort_value
        self._row_values: dict[tuple[int, int], object] = {}  # (buffer, slot) -> an OrtValue over that slot's row
        self._bindings: dict[tuple[int, ...], object] = {}  # the slots of a pass -> its binding
        # A graph smaller than the pool reads the masks of its slots from its own [size, capacity] copy.
        self._masks = {size: np.zeros((size, pool.capacity), dtype=np.int64) for size in self.sizes}
        self._mask_values = {size: ort_value(pool.mask if size == pool.num_slots else mask, "cpu")
                             for size, mask in self._masks.items()}
        # The flat token ids [1, T], the logits [1, K, vocab] and features [1, T, F] of a pass: buffers that
        # grow to the longest pass, with an OrtValue over the first T (or K) rows of each, made on first use.
        self._ids = self._logits = self._features = None
        self._views: dict[tuple[str, int], object] = {}
        self._grow(64, 64)

    def _grow(self, tokens: int, kept: int) -> None:
        engine = self.engine
        if self._ids is None or tokens > self._ids.shape[1]:
            tokens = max(tokens, 2 * (self._ids.shape[1] if self._ids is not None else 0))
            self._ids = np.zeros((1, tokens), dtype=np.int64)
            if engine.features is not None:
                self._features = np.empty((1, tokens, engine.feature_size), dtype=np.float32)
            self._views = {key: value for key, value in self._views.items() if key[0] == "logits"}
        if self._logits is None or kept > self._logits.shape[1]:
            kept = max(kept, 2 * (self._logits.shape[1] if self._logits is not None else 0))
            self._logits = np.empty((1, kept, engine.columns), dtype=engine.logits_dtype)
            self._views = {key: value for key, value in self._views.items() if key[0] != "logits"}

    def _view(self, name: str, count: int):
        """An OrtValue over the first `count` rows of the ids, logits or features buffer."""
        value = self._views.get((name, count))
        if value is None:
            buffer = {"ids": self._ids, "logits": self._logits, "features": self._features}[name]
            value = self._views[(name, count)] = self._ort_value(buffer[:, :count], "cpu")
        return value

    def _binding(self, slots: tuple[int, ...]):
        binding = self._bindings.get(slots)
        if binding is None:
            binding = self._bindings[slots] = self._sessions[len(slots)].io_binding()
            for row, slot in enumerate(slots):
                for past, present, buffer in self._names:
                    value = self._row_values.get((buffer, slot))
                    if value is None:
                        value = self._row_values[(buffer, slot)] = self._ort_value(self.pool.buffers[buffer][slot : slot + 1], "cpu")
                    binding.bind_ortvalue_input(row_name(past, row), value)
                    binding.bind_ortvalue_output(row_name(present, row), value)
            binding.bind_ortvalue_input("attention_mask", self._mask_values[len(slots)])
        return binding

    def slots(self, token_lists: list, caches: list) -> tuple[int, ...] | None:
        """The slots of one pass over these lists: theirs, and the first others with room for a filler token
        (None where a row it runs, given or filler, lacks room for its tokens and the spare row)."""
        for tokens, cache in zip(token_lists, caches):
            if cache.length + len(tokens) + self.spare > cache.capacity:
                return None
        size = packed_size(self.sizes, len(caches))
        given = {cache.slot_index for cache in caches}
        fillers = [index for index, cache in enumerate(self.pool.caches)
                   if index not in given and cache.length + 1 + self.spare <= cache.capacity][: size - len(given)]
        if len(given) + len(fillers) < size:
            return None
        return tuple(sorted(given.union(fillers)))

    def run(self, token_lists: list, caches: list, slots: tuple[int, ...], wanted: list[int]) -> list[np.ndarray]:
        """One pass over `slots` (from slots()); see OrtEngine.run_packed."""
        engine, pool, spare = self.engine, self.pool, self.spare
        size = len(slots)
        given = {cache.slot_index: (tokens, want) for cache, tokens, want in zip(caches, token_lists, wanted)}
        rows = [given.get(slot, ([0], 0)) for slot in slots]  # a filler: one token at its pending position
        lengths = np.array([len(tokens) for tokens, _ in rows], dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        total = int(offsets[-1])
        wants = np.array([want for _, want in rows], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(wants)))  # each row's first kept position among the logits
        keep = np.concatenate([np.arange(offsets[r + 1] - want, offsets[r + 1]) for r, want in enumerate(wants)])
        if len(keep) < 2:  # the head's several-row kernels, as in every pass alone
            keep = np.concatenate((keep, np.zeros(2 - len(keep), dtype=np.int64)))
        self._grow(total, len(keep))
        ids, mask = self._ids, self._masks[size]
        firsts = {}
        for row, slot in enumerate(slots):
            cache = pool.caches[slot]
            ids[0, offsets[row] : offsets[row + 1]] = rows[row][0]
            firsts[slot] = (row, cache.length)
            cache.mask_to(cache.length + int(lengths[row]))
            if size < pool.num_slots:
                mask[row] = pool.mask[slot]
        binding = self._binding(slots)
        binding.bind_ortvalue_input("input_ids", self._view("ids", total))
        binding.bind_cpu_input(LENGTHS, lengths + spare)
        binding.bind_cpu_input(KEEP, keep)
        if spare:  # each row's tokens then its last one again; then the own rows of that layout
            last = offsets[1:] - 1
            spread = np.insert(np.arange(total, dtype=np.int64), offsets[1:], last)
            binding.bind_cpu_input(SPREAD, spread)
            binding.bind_cpu_input(OWN, np.delete(np.arange(total + size, dtype=np.int64), offsets[1:] + np.arange(size)))
        binding.bind_ortvalue_output("logits", self._view("logits", len(keep)))
        if self._features is not None:
            binding.bind_ortvalue_output(engine.features, self._view("features", total))
        begin = time.perf_counter()
        try:
            self._sessions[size].run_with_iobinding(binding)
        finally:
            engine.seconds += time.perf_counter() - begin
            engine.calls += 1
            for slot in slots:
                if slot not in given:
                    pool.caches[slot].mask_to(pool.caches[slot].length)
        out = []
        for cache, tokens, want in zip(caches, token_lists, wanted):
            (row, first), count = firsts[cache.slot_index], len(tokens)
            if self._features is not None:
                cache.features[first : first + count] = self._features[0, offsets[row] : offsets[row] + count]
            cache.length += count
            cache.tokens += list(tokens)
            cache.mask_to(cache.length)
            rows_out = self._logits[0, starts[row] : starts[row] + want]
            out.append(rows_out if engine.float32_logits else rows_out.astype(np.float32))
        return out
