#!/usr/bin/env python3
"""ONNX Runtime's attention operators for a batch of verify rows: one attention layer, timed and compared.

A rows pass (runtime/rows.py) runs one GroupQueryAttention node per row, because ONNX Runtime's CPU
GroupQueryAttention refuses a batch of several rows with several tokens each over a past. This
script times the ways around that on one attention layer of a bundle target's shape (heads, KV
heads, head size and rotary caches from its genai_config.json and model.onnx's rotary caches),
for `--rows` rows of T tokens each over ragged pasts (row i's past: P - 3i), at every T in
--tokens and P in --pasts:

- `rows`: one GroupQueryAttention node per row over the row's own KV buffer of --capacity positions,
  written in place (past and present bound to the same buffer), with the rotary inside the node.
  This is what a rows graph runs.
- `mha`: one com.microsoft MultiHeadAttention node over the rows padded to [rows, T], its past
  [rows, heads, P, head size] (it takes no KV heads: the cache holds every query head's keys), an
  attention bias masking each row's unused past positions, and RotaryEmbedding nodes first.
- `attention23`: one ONNX Attention node (opset 23) with kv_num_heads, the same layout with the
  KV heads, the same mask, and RotaryEmbedding nodes first.

Both batched operators concatenate the past and the new keys into a new present tensor each call,
where the rows graph writes a row's new keys in its buffer: the past they read here is handed in
contiguous, as a pool of slot buffers could not give it without a copy per call (not timed here).

Per cell: the median ms per call (--repeat calls after 3 warm ones; every operator on the global
thread pool of --threads threads, as the runtime runs), and the largest difference of any row's
output from the same row's pass alone (one GroupQueryAttention node of batch 1: what `generate`
runs): 0 means bit for bit, which a rows pass needs for its rows to decode as they do alone.

    .venv/bin/python scripts/attention_ops.py BUNDLE [--rows 8] [--tokens 1,2,5] [--pasts 64,256,1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

FLOAT, INT32, INT64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64


def layer_shape(bundle: Path) -> dict:
    """Heads, KV heads, head size and the rotary caches of the bundle's target (fused graph)."""
    decoder = json.loads((bundle / "target" / "genai_config.json").read_text())["model"]["decoder"]
    model = onnx.load(str(bundle / "target" / "model.onnx"), load_external_data=False)
    caches = {i.name: i for i in model.graph.initializer if i.name in ("cos_cache", "sin_cache")}
    if len(caches) != 2:
        raise SystemExit(f"error: {bundle}/target/model.onnx has no rotary caches (not a fused graph)")
    rotary = [a.i for n in model.graph.node if n.op_type == "GroupQueryAttention" for a in n.attribute
              if a.name == "rotary_interleaved"]
    return {"heads": decoder["num_attention_heads"], "kv_heads": decoder["num_key_value_heads"],
            "head_size": decoder["head_size"], "interleaved": rotary[0] if rotary else 0,
            "cos": onnx.numpy_helper.to_array(caches["cos_cache"], base_dir=str(bundle / "target")),
            "sin": onnx.numpy_helper.to_array(caches["sin_cache"], base_dir=str(bundle / "target"))}


def _model(nodes, inputs, outputs, initializers) -> bytes:
    graph = helper.make_graph(nodes, "attention", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model.SerializeToString()


def _value(name: str, kind=FLOAT):
    return helper.make_tensor_value_info(name, kind, None)


def _caches(shape: dict) -> list:
    return [onnx.numpy_helper.from_array(shape["cos"], "cos_cache"), onnx.numpy_helper.from_array(shape["sin"], "sin_cache")]


def gqa_graph(shape: dict, rows: int) -> bytes:
    """The rows graph's attention: packed qkv [1, tokens, ...] split by rows, one GQA node per row, concatenated."""
    nodes = [helper.make_node("Split", ["qkv", "lengths"], [f"qkv{r}" for r in range(rows)], axis=1),
             helper.make_node("Split", ["seqlens", "ones"], [f"seqlens{r}" for r in range(rows)], axis=0)]
    inputs = [_value("qkv"), _value("lengths", INT64), _value("seqlens", INT32), _value("total", INT32)]
    outputs = [_value("y")]
    for r in range(rows):
        nodes.append(helper.make_node(
            "GroupQueryAttention", [f"qkv{r}", "", "", f"past_key{r}", f"past_value{r}", f"seqlens{r}", "total",
                                    "cos_cache", "sin_cache"], [f"y{r}", f"present_key{r}", f"present_value{r}"],
            domain="com.microsoft", num_heads=shape["heads"], kv_num_heads=shape["kv_heads"], do_rotary=1,
            rotary_interleaved=shape["interleaved"], scale=shape["head_size"] ** -0.5, local_window_size=-1))
        inputs += [_value(f"past_key{r}"), _value(f"past_value{r}")]
        outputs += [_value(f"present_key{r}"), _value(f"present_value{r}")]
    nodes.append(helper.make_node("Concat", [f"y{r}" for r in range(rows)], ["y"], axis=1))
    ones = helper.make_tensor("ones", INT64, [rows], [1] * rows)
    return _model(nodes, inputs, outputs, _caches(shape) + [ones])


def batched_graph(shape: dict, op: str) -> bytes:
    """One batched attention node (`mha` or `attention23`) over [rows, T], with RotaryEmbedding first."""
    heads, kv_heads = shape["heads"], shape["kv_heads"]
    rotary = [helper.make_node("RotaryEmbedding", [name, "positions", "cos_cache", "sin_cache"], [f"{name}_rotated"],
                               domain="com.microsoft", interleaved=shape["interleaved"], num_heads=count)
              for name, count in (("q", heads), ("k", heads if op == "mha" else kv_heads))]
    if op == "mha":
        attention = helper.make_node("MultiHeadAttention", ["q_rotated", "k_rotated", "v", "", "", "mask", "past_key",
                                                            "past_value"], ["y", "present_key", "present_value"],
                                     domain="com.microsoft", num_heads=heads, scale=shape["head_size"] ** -0.5)
    else:
        attention = helper.make_node("Attention", ["q_rotated", "k_rotated", "v", "mask", "past_key", "past_value"],
                                     ["y", "present_key", "present_value"], q_num_heads=heads, kv_num_heads=kv_heads,
                                     scale=shape["head_size"] ** -0.5)
    inputs = [_value(n) for n in ("q", "k", "v", "mask", "past_key", "past_value")] + [_value("positions", INT64)]
    return _model(rotary + [attention], inputs, [_value(n) for n in ("y", "present_key", "present_value")], _caches(shape))


class Case:
    """One cell's data: rows x tokens of q, k, v and each row's past (row i: past - 3i positions)."""

    def __init__(self, shape: dict, rows: int, tokens: int, past: int, capacity: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        heads, kv_heads, size = shape["heads"], shape["kv_heads"], shape["head_size"]
        self.rows, self.tokens, self.capacity = rows, tokens, capacity
        self.pasts = [past - 3 * r for r in range(rows)]
        self.q = rng.standard_normal((rows, tokens, heads * size), dtype=np.float32)
        self.k = rng.standard_normal((rows, tokens, kv_heads * size), dtype=np.float32)
        self.v = rng.standard_normal((rows, tokens, kv_heads * size), dtype=np.float32)
        self.past_k = rng.standard_normal((rows, kv_heads, past, size), dtype=np.float32)
        self.past_v = rng.standard_normal((rows, kv_heads, past, size), dtype=np.float32)
        for r, length in enumerate(self.pasts):  # a row's positions past its own hold nothing of it
            self.past_k[r, :, length:] = 0.0
            self.past_v[r, :, length:] = 0.0

    def buffers(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Row `row`'s KV buffers [1, kv_heads, capacity, head size], its past in the first positions."""
        shape = (1, self.past_k.shape[1], self.capacity, self.past_k.shape[3])
        keys, values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        keys[0, :, : self.pasts[row]] = self.past_k[row, :, : self.pasts[row]]
        values[0, :, : self.pasts[row]] = self.past_v[row, :, : self.pasts[row]]
        return keys, values


def _ortvalue(array: np.ndarray):
    return ort.OrtValue.ortvalue_from_numpy(array, "cpu", 0)


def bind_gqa(session, case: Case, rows: list[int]):
    """A binding of the rows graph (or, with one row, the lone pass) over `rows` of the case; keeps its buffers."""
    qkv = np.concatenate([np.concatenate([case.q[r], case.k[r], case.v[r]], axis=-1) for r in rows])[None]
    keep = [qkv, np.full(len(rows), case.tokens, np.int64),
            np.array([case.pasts[r] + case.tokens - 1 for r in rows], np.int32), np.array(case.capacity, np.int32)]
    binding = session.io_binding()
    for name, array in zip(("qkv", "lengths", "seqlens", "total"), keep):
        binding.bind_ortvalue_input(name, _ortvalue(array))
    for index, r in enumerate(rows):
        for kind, buffer in zip(("key", "value"), case.buffers(r)):
            keep.append(buffer)
            value = _ortvalue(buffer)
            binding.bind_ortvalue_input(f"past_{kind}{index}", value)
            binding.bind_ortvalue_output(f"present_{kind}{index}", value)  # in place, as the rows graph runs
    out = np.empty((1, len(rows) * case.tokens, case.q.shape[2]), np.float32)
    binding.bind_ortvalue_output("y", _ortvalue(out))
    return binding, out, keep


def bind_batched(session, case: Case, shape: dict, op: str):
    rows, tokens, past = case.rows, case.tokens, case.past_k.shape[2]
    repeat = shape["heads"] // shape["kv_heads"] if op == "mha" else 1  # MHA's cache holds every query head
    k = case.k.reshape(rows, tokens, shape["kv_heads"], -1).repeat(repeat, axis=2).reshape(rows, tokens, -1)
    v = case.v.reshape(rows, tokens, shape["kv_heads"], -1).repeat(repeat, axis=2).reshape(rows, tokens, -1)
    past_k, past_v = case.past_k.repeat(repeat, axis=1), case.past_v.repeat(repeat, axis=1)
    # an additive mask [rows, 1, T, past + T]: each row sees its own past and its tokens up to itself
    mask = np.full((rows, 1, tokens, past + tokens), -np.inf, np.float32)
    positions = np.empty((rows, tokens), np.int64)
    for r, length in enumerate(case.pasts):
        mask[r, 0, :, :length] = 0.0
        for t in range(tokens):
            mask[r, 0, t, past : past + t + 1] = 0.0
            positions[r, t] = length + t
    keep = [case.q, k, v, mask, past_k, past_v, positions]
    binding = session.io_binding()
    for name, array in zip(("q", "k", "v", "mask", "past_key", "past_value", "positions"), keep):
        binding.bind_ortvalue_input(name, _ortvalue(array))
    out = np.empty(case.q.shape, np.float32)
    presents = [np.empty(past_k.shape[:2] + (past + tokens, past_k.shape[3]), np.float32) for _ in range(2)]
    binding.bind_ortvalue_output("y", _ortvalue(out))
    binding.bind_ortvalue_output("present_key", _ortvalue(presents[0]))
    binding.bind_ortvalue_output("present_value", _ortvalue(presents[1]))
    return binding, out, keep + presents


def timed(session, binding, repeat: int) -> float:
    for _ in range(3):
        session.run_with_iobinding(binding)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", default="1,2,5", help="tokens per row, comma-separated")
    parser.add_argument("--pasts", default="64,256,1024", help="the first row's past, comma-separated")
    parser.add_argument("--capacity", type=int, default=2048, help="positions of each row's KV buffer (rows)")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: one per core)")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    shape = layer_shape(args.bundle)
    ort.set_default_logger_severity(3)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    sessions = {name: ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"]) for name, graph in
                (("rows", gqa_graph(shape, args.rows)), ("alone", gqa_graph(shape, 1)),
                 ("mha", batched_graph(shape, "mha")), ("attention23", batched_graph(shape, "attention23")))}
    print(f"{args.bundle.name}: {shape['heads']} heads, {shape['kv_heads']} KV heads, head size {shape['head_size']}; "
          f"{args.rows} rows; ms per call (largest difference from each row's pass alone)")
    print("| tokens per row | past | rows (a GQA node per row) | mha | attention23 |")
    print("|---:|---:|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        for past in map(int, args.pasts.split(",")):
            case = Case(shape, args.rows, tokens, past, args.capacity)
            alone = []
            for r in range(args.rows):
                binding, out, _keep = bind_gqa(sessions["alone"], case, [r])
                sessions["alone"].run_with_iobinding(binding)
                alone.append(out[0].copy())
            alone = np.stack(alone)  # [rows, T, hidden]
            cells = []
            for name in ("rows", "mha", "attention23"):
                if name == "rows":
                    binding, out, _keep = bind_gqa(sessions[name], case, list(range(args.rows)))
                else:
                    binding, out, _keep = bind_batched(sessions[name], case, shape, name)
                ms = timed(sessions[name], binding, args.repeat)
                difference = float(np.abs(out.reshape(alone.shape) - alone).max())
                cells.append(f"{ms:.3f} ({difference:.1e})" if difference else f"{ms:.3f} (0)")
            print(f"| {tokens} | {past} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
