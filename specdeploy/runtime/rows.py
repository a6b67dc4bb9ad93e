"""Row passes: several sequences' multi-token passes in one ONNX Runtime run, each row exactly as alone.

ONNX Runtime's CPU GroupQueryAttention refuses a batch of several rows with several tokens each over
a past ("batch_size must be 1 when sequence_length > 1 and past context is given"), so a batched
pass over [rows, 1] is all a fused graph runs as it is. That is not enough for two passes:

- verification, k + 1 tokens per row;
- a quantized (or fp16) target's single tokens (OrtEngine's min_pass_tokens): alone, such a token
  runs beside the previous one, since one-token attention sums its values in another order (MLAS's
  one-row kernel), which moves an int8 model's logits by up to 0.7 and splits greedy near-ties in 7
  of 10 SmolLM2 outputs of 128 tokens, where a pass of two or more tokens matches verification bit
  for bit.

The rows graph is the target's own graph with each attention node split into one node per row:

    qkv [rows, S, D] -> Split(axis 0) -> GroupQueryAttention (batch 1, S tokens, row r's cache) -> Concat

Everything else (the MatMuls, norms and the head) runs over all rows at once. Every kernel but
attention computes each row of its input independently, and each row's attention node is the one a
pass of that sequence alone runs, so a row's logits and keys and values are bit for bit those of
its own pass (tests/test_rows.py). For a target whose single tokens never run alone, each row's
attention also runs a spare query row, a copy of its last one at the next position (past the valid
ones): a row of one token then takes attention's several-row kernels, as its two-token pass alone
does, and the MatMuls see every row of the pass at once, so no token runs twice. The graph is built
from the bundle's graph at load (the `onnx` package edits it in memory; the weights are the bundle's
data file, read again by each graph's session), for a fixed number of rows (one graph per size,
rows_sizes): a slot without tokens in a pass of its graph computes filler tokens at its pending
positions, past its valid ones, and keeps its length.
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
_ONES = "rows/ones"  # the Split sizes
_END, _AXIS, _LAST, _ZERO, _ONE32 = "rows/end", "rows/axis", "rows/last", "rows/zero", "rows/one32"  # the spare row's Slices and count


def row_name(name: str, row: int) -> str:
    """A cache input or output of the rows graph: `name` for row `row` alone."""
    return f"{name}.row{row}"


def rows_graph(model_path: Path, rows: int, spare_row: bool = False) -> bytes:
    """The rows graph of the fused graph at model_path (see the module docstring), serialized; with
    spare_row, each row's attention node runs one query row more (see _split_nodes).

    Raises SpecdeployError for a graph it cannot split: one with no attention node, or one whose
    attention nodes take inputs beyond the rotary caches (position ids, an attention bias)."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    nodes = list(graph.node)
    attention = [node for node in nodes if node.op_type == _ATTENTION]
    if not attention or any(len([i for i in node.input[9:] if i]) for node in attention):
        raise SpecdeployError(f"{model_path.name}: no attention nodes a rows graph can split")
    graph.initializer.append(helper.make_tensor(_ONES, TensorProto.INT64, [rows], [1] * rows))
    if spare_row:
        graph.initializer.extend([helper.make_tensor(_END, TensorProto.INT64, [1], [np.iinfo(np.int64).max]),
                                  helper.make_tensor(_AXIS, TensorProto.INT64, [1], [1]),
                                  helper.make_tensor(_LAST, TensorProto.INT64, [1], [-1]),
                                  helper.make_tensor(_ZERO, TensorProto.INT64, [1], [0]),
                                  helper.make_tensor(_ONE32, TensorProto.INT32, [1], [1])])
    cache_io: set[str] = set()  # the cache inputs and outputs, one per row in the new graph
    new_nodes = _split_nodes(nodes, rows, cache_io, spare_row)
    del graph.node[:]
    graph.node.extend(new_nodes)
    inputs = _per_row(graph.input, rows, cache_io)
    outputs = _per_row(graph.output, rows, cache_io)
    del graph.input[:]
    graph.input.extend(inputs)
    del graph.output[:]
    graph.output.extend(outputs)
    return model.SerializeToString()


def _split_nodes(nodes: list, rows: int, cache_io: set[str], spare_row: bool) -> list:
    """The graph's nodes with each attention node split by rows.

    spare_row: each row's attention runs its last query, key and value row twice, one position after
    the pass's last (a pending position, past the valid ones and any padding, as filler is), and keeps
    the outputs of the pass's positions. One token's attention then takes the kernels' several-row
    path, which a pass of two or more tokens alone takes; the MatMuls around it see every row of the
    pass at once already."""
    from onnx import helper

    split: dict[str, list[str]] = {}  # a tensor split by rows -> its row slices
    new_nodes: list = []

    def slices(name: str) -> list[str]:
        if name not in split:
            split[name] = [f"{name}/row{r}" for r in range(rows)]
            new_nodes.append(helper.make_node("Split", [name, _ONES], split[name], axis=0, name=f"{name}/split_rows"))
        return split[name]

    spare: dict[str, str] = {}  # a tensor -> it with its spare row (spare_row)

    def with_spare(name: str, index: int) -> str:
        """The attention input `name` with the spare row: its last token again after its own (query, key,
        value), or one more in the count (seqlens_k, index 5)."""
        if name not in spare:
            spare[name] = f"{name}/spare"
            if index == 5:
                new_nodes.append(helper.make_node("Add", [name, _ONE32], [spare[name]], name=f"{name}/count"))
            else:
                last = f"{name}/last"
                new_nodes.append(helper.make_node("Slice", [name, _LAST, _END, _AXIS], [last], name=f"{name}/last"))
                new_nodes.append(helper.make_node("Concat", [name, last], [spare[name]], axis=1, name=f"{name}/spare"))
        return spare[name]

    for node in nodes:
        if node.op_type == _ATTENTION:
            row_inputs = {i: slices(with_spare(node.input[i], i) if spare_row else node.input[i])
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
            new_nodes.append(helper.make_node("Concat", outputs, [output], axis=0, name=f"{node.name}/rows"))
            if spare_row:  # every row's own tokens
                new_nodes.append(helper.make_node("Slice", [output, _ZERO, _LAST, _AXIS], [node.output[0]],
                                                  name=f"{node.name}/own"))
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


def rows_sizes(slots: int) -> list[int]:
    """The rows graphs a pool of `slots` gets: 2, 4, 8, ... below slots, and slots itself."""
    sizes, size = [], 2
    while size < slots:
        sizes.append(size)
        size *= 2
    return sizes + [slots]


def rows_size(sizes: list[int], count: int) -> int | None:
    """The rows graph (of `sizes`) a pass of `count` rows runs: the smallest of count rows or more."""
    return next((size for size in sizes if size >= count), None)


class RowsPass:
    """The rows graphs of one engine over one KVSlots pool: one per size in rows_sizes(slots), so that a
    pass of n rows runs the smallest graph of n rows or more (slots not given fill the rest). Each
    graph is a session of its own, with the target's weights: a pool of 8 slots holds them 3 more times.

    `slots` then `run`: see OrtEngine.run_rows, their one caller."""

    def __init__(self, engine, pool, model_path: Path, config):
        import onnxruntime as ort

        from .kv_cache import ort_value
        from .session import session_options

        self.engine, self.pool, self.sizes = engine, pool, rows_sizes(pool.num_slots)
        # An engine whose single tokens never run alone (min_pass_tokens > 1) gets graphs with a spare
        # attention row, so that a pass of single tokens computes each as its own two-token pass does.
        self.spare = int(engine.min_pass_tokens > 1)
        spec = engine.spec
        options = session_options(config, spec)
        # The graph comes as bytes: its weights are the bundle's data file beside model_path.
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(model_path.parent))
        self._sessions = {}
        for size in self.sizes:
            graph = rows_graph(model_path, size, spare_row=bool(self.spare))
            try:
                self._sessions[size] = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
            except Exception as exc:
                raise SpecdeployError(f"ONNX Runtime cannot load the rows graph of {model_path}: "
                                      f"{str(exc).splitlines()[0]}") from None
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
        self._outputs: dict[tuple[int, int], tuple] = {}  # (size, S) -> buffers and OrtValues

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

    def _buffers(self, size: int, length: int):
        key = (size, length)
        if key not in self._outputs:
            engine = self.engine
            ids = np.zeros((size, length), dtype=np.int64)
            logits = np.empty((size, length, engine.columns), dtype=engine._logits_dtype)
            features = (np.empty((size, length, engine.feature_size), dtype=np.float32)
                        if engine.features is not None else None)
            self._outputs[key] = (ids, logits, features, self._ort_value(ids, "cpu"), self._ort_value(logits, "cpu"),
                                  self._ort_value(features, "cpu") if features is not None else None)
        return self._outputs[key]

    def slots(self, token_lists: list, caches: list) -> tuple[int, ...] | None:
        """The slots of one pass over these lists: theirs, and the first others with room for filler
        (None where a row it runs, given or filler, lacks room for its tokens and the spare row)."""
        length = max(len(tokens) for tokens in token_lists) + self.spare
        for cache in caches:
            if cache.length + length > cache.capacity:
                return None
        size = rows_size(self.sizes, len(caches))
        given = {cache.slot_index for cache in caches}
        fillers = [index for index, cache in enumerate(self.pool.caches)
                   if index not in given and cache.length + length <= cache.capacity][: size - len(given)]
        if len(given) + len(fillers) < size:
            return None
        return tuple(sorted(given.union(fillers)))

    def run(self, token_lists: list, caches: list, slots: tuple[int, ...]) -> list[np.ndarray]:
        """One pass over `slots` (from slots()); see OrtEngine.run_rows."""
        engine, pool = self.engine, self.pool
        size, length = len(slots), max(len(tokens) for tokens in token_lists)
        ids, logits, features, ids_value, logits_value, features_value = self._buffers(size, length)
        given = {cache.slot_index: tokens for cache, tokens in zip(caches, token_lists)}
        firsts, mask = {}, self._masks[size]
        for row, slot in enumerate(slots):
            cache = pool.caches[slot]
            tokens = given.get(slot)
            first = cache.length
            if tokens is None:  # filler at the pending positions, past the valid ones
                ids[row] = 0
            else:
                ids[row, : len(tokens)] = tokens
                ids[row, len(tokens) :] = tokens[-1]  # padding after the row's own tokens (causal: no effect on them)
            firsts[slot] = (row, first)
            cache.mask_to(first + length)
            if size < pool.num_slots:
                mask[row] = pool.mask[slot]
        binding = self._binding(slots)
        binding.bind_ortvalue_input("input_ids", ids_value)
        binding.bind_ortvalue_output("logits", logits_value)
        if features_value is not None:
            binding.bind_ortvalue_output(engine.features, features_value)
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
        for cache, tokens in zip(caches, token_lists):
            (row, first), count = firsts[cache.slot_index], len(tokens)
            if features is not None:
                cache.features[first : first + count] = features[row, :count]
            cache.length += count
            cache.tokens += list(tokens)
            cache.mask_to(cache.length)
            rows_out = logits[row, :count]
            out.append(rows_out if engine._float32_logits else rows_out.astype(np.float32))
        return out
