"""Weight-only int8 / int4 quantization, the embedding and the LM head included.

Every MatMul with a constant weight becomes ONNX Runtime's MatMulNBits (its own quantizer, blocks of
`block_size` along the input dimension, symmetric), and so does every Gemm with one (GPT-2's projections
in optimum's graphs: MatMulNBits and an Add of the bias). The token embedding and the LM head are the
largest tensors of a small model with a large vocabulary (SmolLM2-135M: 49,152 x 576, more bytes
than all its layers at int4), and ONNX Runtime's quantizer leaves both in fp32: the embedding is a
Gather, and a tied head reads the embedding table transposed. So this module quantizes the table
itself, once, in MatMulNBits' layout:

    data    [vocab, n_blocks, block_size * bits / 8] uint8   (two int4 values a byte, low nibble first)
    scales  [vocab, n_blocks] float32

and points both users at that one tensor, as onnxruntime-genai's builder does for tied weights:

    Gather(table, input_ids)        -> GatherBlockQuantized(data, input_ids, scales) [-> Slice the padding]
    FusedMatMul(hidden, table^T)    -> MatMulNBits(hidden, data, scales)      (tied head: stored once)
    MatMul(hidden, Transpose(table)) -> the same                              (optimum's tied head)

An untied head is a plain MatMul, which the quantizer takes with the rest.

Nothing holds the whole model: the graph is read without its weights, ORT's quantizer gets one
MatMul and its weight at a time, the table is quantized in row chunks, and every result goes
straight into a new data file (weights.py): the same tensors, bit for bit, as one pass of ORT's
quantizer over the whole loaded graph, in a fraction of its memory (docs/performance.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import SpecdeployError
from .blocks import pack_codes, unpack_codes

MS = "com.microsoft"
BLOCK_SIZE = 32
# accuracy_level 4: ONNX Runtime multiplies in int8 (activations quantized per block on the fly) with
# its VNNI / AVX-512 kernels; level 0 dequantizes to fp32 first. Measured in docs/performance.md.
ACCURACY_LEVEL = 4
# Embedding rows quantized at a time: the table is never copied whole (Gemma 3's 262,144 x 640 fp32
# table is 0.67 GB, and one-piece quantization made five temporaries of its size).
EMBEDDING_CHUNK_ROWS = 8192


def quantize_blockwise(weight: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric round-to-nearest blocks along each row, as ONNX Runtime's MatMulNBits quantizer makes them.

    weight: [rows, cols] float32 (for a MatMul weight, rows are its output features).
    Returns data [rows, n_blocks, block_size * bits // 8] uint8 and scales [rows, n_blocks] float32.
    Each block's scale is its value of largest magnitude divided by -2**(bits - 1), so that value
    maps to the lowest code exactly; codes are stored offset by 2**(bits - 1) (the default zero point
    of MatMulNBits and GatherBlockQuantized). Columns past `cols` in the last block are stored as 0."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    rows, cols = weight.shape
    num_blocks = -(-cols // block_size)
    padded = np.zeros((rows, num_blocks * block_size), dtype=np.float32)
    padded[:, :cols] = weight
    blocks = padded.reshape(rows, num_blocks, block_size)  # [rows, n_blocks, block]
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]  # [rows, n_blocks]
    offset = 1 << (bits - 1)
    scales = (largest / -offset).astype(np.float32)
    inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales != 0)
    codes = np.clip(np.rint(blocks * inverse[..., None]) + offset, 0, 2 * offset - 1).astype(np.uint8)
    codes.reshape(rows, -1)[:, cols:] = 0
    return pack_codes(codes, bits), scales


def dequantize_blockwise(data: np.ndarray, scales: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """The float rows [rows, cols] that quantize_blockwise's data and scales stand for."""
    data = unpack_codes(data, bits)
    values = (data.astype(np.float32) - (1 << (bits - 1))) * scales[..., None]
    return values.reshape(data.shape[0], -1)[:, :cols]


def quantize_weights(path: Path, bits: int, block_size: int = BLOCK_SIZE, accuracy_level: int = ACCURACY_LEVEL,
                     chunk_rows: int = EMBEDDING_CHUNK_ROWS) -> None:
    """Quantize the model at path in place: embedding and head here, every other MatMul with ORT's quantizer.

    One weight at a time (see the module docstring): the graph is read without its weights, each
    weight is read from the data file and its quantized form written to a new one, which
    replaces the old at the end. chunk_rows: embedding rows quantized at a time."""
    import onnx

    from .convert import weights_path
    from .weights import DataReader, DataWriter

    model = onnx.load(path, load_external_data=False)
    graph = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        raise SpecdeployError(f"{path}: weight-only quantization takes graphs without subgraphs (If, Loop, Scan)")
    partial = path.with_name(path.name + ".data.partial")
    reader, writer = DataReader(path.parent), DataWriter(partial, location=path.name + ".data")
    try:
        written: dict[str, object] = {}  # name -> TensorProto in the new data file
        _quantize_embedding(graph, reader, writer, written, bits, block_size, accuracy_level, chunk_rows)
        _quantize_matmuls(model, reader, writer, written, bits, block_size, accuracy_level)
        _quantize_gemms(graph, reader, writer, written, bits, block_size, accuracy_level)
        used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        # Unused initializers go (the fp32 table, the quantized MatMuls' weights), as ORT's quantizer cleans them.
        dropped = {t.name for t in graph.initializer if t.name not in used}
        kept = [writer.copy(t, reader.raw(t)) for t in graph.initializer if t.name in used and t.name not in written]
        kept += [t for name, t in written.items() if name in used]
        inputs = [i for i in graph.input if i.name not in dropped]  # an old IR lists initializers as inputs too
        del graph.initializer[:]
        graph.initializer.extend(kept)
        del graph.input[:]
        graph.input.extend(inputs)
    finally:
        writer.close()
        reader.close()
    if any(n.domain == MS for n in graph.node) and not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS, 1))
    data = weights_path(path)  # the old data file goes; the new one takes its name
    partial.rename(data)
    onnx.save_model(model, path)  # the graph only: its initializers point into the data file


def _quantize_matmuls(model, reader, writer, written: dict, bits: int, block_size: int, accuracy_level: int) -> None:
    """Every MatMul with a constant weight, through ONNX Runtime's MatMulNBitsQuantizer one node at a time:
    the same quantizer, the same node and weight as a whole-graph pass (bit-equal, tests/test_quantize.py)."""
    import onnx
    from onnx import helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    # Where ORT's quantizer looks for the rank of a MatMul's input A (_get_static_rank): inputs, value_info, outputs.
    infos: dict[str, object] = {}
    for info in (*graph.input, *graph.value_info, *graph.output):
        infos.setdefault(info.name, info)
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, bits=bits,
                                          accuracy_level=accuracy_level)
    new_nodes = []
    for node in graph.node:
        weight = initializers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None:
            new_nodes.append(node)
            continue
        single = numpy_helper.from_array(reader.array(weight), weight.name)  # this weight alone, in memory a while
        a_info = infos.get(node.input[0]) or helper.make_tensor_value_info(node.input[0], weight.data_type, None)
        one = helper.make_model(
            helper.make_graph([node], "one-matmul", [a_info],
                              [helper.make_tensor_value_info(node.output[0], weight.data_type, None)], [single]),
            opset_imports=list(model.opset_import))
        quantizer = MatMulNBitsQuantizer(one, bits=bits, block_size=block_size, is_symmetric=True,
                                         accuracy_level=accuracy_level, algo_config=config)
        quantizer.process()
        result = quantizer.model.model.graph
        for made in result.node:  # copies: a reference to a node would keep its whole one-node model alive
            copy = onnx.NodeProto()
            copy.CopyFrom(made)
            new_nodes.append(copy)
        for tensor in result.initializer:
            if tensor.name not in written and tensor.name != weight.name:
                written[tensor.name] = writer.copy(tensor, reader.raw(tensor))
            elif tensor.name == weight.name:  # left as it was (a shape the quantizer skips)
                written.setdefault(tensor.name, writer.copy(weight, reader.raw(weight)))
    del graph.node[:]
    graph.node.extend(new_nodes)


def _quantize_embedding(graph, reader, writer, written: dict, bits: int, block_size: int, accuracy_level: int,
                        chunk_rows: int) -> None:
    """The input_ids Gather onto a quantized table, and a tied head (FusedMatMul, transB) onto the same one.

    The table is read from the data file and quantized chunk_rows rows at a time (the blocks lie along
    rows, so the pieces are the one-piece result cut by rows), written as they come."""
    import onnx
    from onnx import helper, numpy_helper

    initializers = {t.name: t for t in graph.initializer}
    gather = next((n for n in graph.node if n.op_type == "Gather" and len(n.input) == 2 and n.input[1] == "input_ids"
                   and n.input[0] in initializers), None)
    if gather is None:
        return
    table_name = gather.input[0]
    table = initializers[table_name]  # [vocab, hidden], read chunk_rows rows at a time
    if len(table.dims) != 2 or table.data_type != onnx.TensorProto.FLOAT:
        return
    vocab, hidden = table.dims
    num_blocks = -(-hidden // block_size)
    blob = block_size * bits // 8
    scales = np.empty((vocab, num_blocks), dtype=np.float32)  # [vocab, n_blocks]

    def pieces():
        for start in range(0, vocab, chunk_rows):
            rows = reader.array(table, start, start + chunk_rows)  # [chunk_rows, hidden]
            data, scales[start:start + chunk_rows] = quantize_blockwise(rows, bits, block_size)
            yield data  # [rows, n_blocks, blob]

    data_name, scales_name = f"{table_name}_Q{bits}", f"{table_name}_scales"
    written[data_name] = writer.rows(data_name, np.uint8, (vocab, num_blocks, blob), pieces())
    written[scales_name] = writer.array(scales_name, scales)
    graph.initializer.extend([
        numpy_helper.from_array(np.array([vocab, num_blocks, 1], dtype=np.int64), f"{scales_name}_shape"),
        numpy_helper.from_array(np.array([0, 0, num_blocks * block_size], dtype=np.int64), f"{table_name}_rows_shape"),
    ])
    prefix = f"/{table_name}"
    # GatherBlockQuantized reads the 3-D data as rows of one-block chunks: quantize_axis 2, scales [vocab, n_blocks, 1].
    nodes = [
        helper.make_node("Reshape", [scales_name, f"{scales_name}_shape"], [f"{prefix}/scales3"], name=f"{prefix}/ReshapeScales"),
        helper.make_node("GatherBlockQuantized", [data_name, "input_ids", f"{prefix}/scales3"], [f"{prefix}/blocks"],
                         name=f"{prefix}/GatherBlockQuantized", domain=MS, bits=bits, block_size=block_size,
                         gather_axis=0, quantize_axis=2),
    ]
    rows = gather.output[0] if num_blocks * block_size == hidden else f"{prefix}/padded"
    nodes.append(helper.make_node("Reshape", [f"{prefix}/blocks", f"{table_name}_rows_shape"], [rows], name=f"{prefix}/ReshapeRows"))
    if rows != gather.output[0]:
        graph.initializer.extend([numpy_helper.from_array(np.array([value], dtype=np.int64), f"{prefix}/{key}")
                                  for key, value in (("start", 0), ("end", hidden), ("axis", -1))])
        nodes.append(helper.make_node("Slice", [rows, f"{prefix}/start", f"{prefix}/end", f"{prefix}/axis"],
                                      [gather.output[0]], name=f"{prefix}/Slice"))
    _replace(graph, gather, nodes)
    head = helper.make_node("MatMulNBits", ["", data_name, scales_name], [""], domain=MS, K=hidden, N=vocab, bits=bits,
                            block_size=block_size, accuracy_level=accuracy_level)
    _point_heads_at(graph, table_name, head)


def _point_heads_at(graph, table_name: str, head) -> None:
    """Every tied head reading table_name transposed (a FusedMatMul with transB, or a MatMul of its Transpose)
    becomes a copy of `head` (MatMulNBits over the quantized table) with that node's input, output and name."""
    from onnx import helper

    transposed = {n.output[0] for n in graph.node if n.op_type == "Transpose" and list(n.input) == [table_name]
                  and [list(helper.get_attribute_value(a)) for a in n.attribute if a.name == "perm"] in ([], [[1, 0]])}
    for node in list(graph.node):
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        fused = (node.op_type == "FusedMatMul" and node.domain == MS and list(node.input[1:]) == [table_name]
                 and attributes.get("transB") == 1 and not attributes.get("transA") and attributes.get("alpha", 1.0) == 1.0)
        if fused or (node.op_type == "MatMul" and node.input[1] in transposed):
            copy = type(head)()
            copy.CopyFrom(head)
            copy.input[0], copy.output[0], copy.name = node.input[0], node.output[0], node.name or "lm_head"
            _replace(graph, node, [copy])
    used = {name for node in graph.node for name in node.input}
    for node in [n for n in graph.node if n.op_type == "Transpose" and n.output[0] in transposed - used]:
        graph.node.remove(node)


def _quantize_gemms(graph, reader, writer, written: dict, bits: int, block_size: int, accuracy_level: int) -> None:
    """Every Gemm of a constant 2-D weight (alpha and beta 1, A not transposed) as MatMulNBits, then an Add of C.

    quantize_blockwise's blocks are those of ORT's MatMulNBits quantizer (tests/test_quantize.py): the weight's
    rows are its output features, as a Gemm's B is with transB and its transpose is without."""
    import onnx
    from onnx import helper

    initializers = {t.name: t for t in graph.initializer}
    for node in list(graph.node):
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weight = initializers.get(node.input[1]) if node.op_type == "Gemm" else None
        if (weight is None or len(weight.dims) != 2 or weight.data_type != onnx.TensorProto.FLOAT
                or attributes.get("transA", 0) or attributes.get("alpha", 1.0) != 1.0 or attributes.get("beta", 1.0) != 1.0):
            continue
        rows = reader.array(weight)
        rows = rows if attributes.get("transB", 0) else rows.T  # [out, in]
        data, scales = quantize_blockwise(np.ascontiguousarray(rows), bits, block_size)
        name = f"{weight.name}_Q{bits}_{node.name or len(written)}"
        written[name], written[f"{name}_scales"] = writer.array(name, data), writer.array(f"{name}_scales", scales)
        product = node.output[0] if len(node.input) < 3 or not node.input[2] else f"{node.output[0]}/MatMulNBits"
        nodes = [helper.make_node("MatMulNBits", [node.input[0], name, f"{name}_scales"], [product],
                                  name=f"{node.name}/MatMulNBits", domain=MS, K=rows.shape[1], N=rows.shape[0],
                                  bits=bits, block_size=block_size, accuracy_level=accuracy_level)]
        if product != node.output[0]:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}/Add"))
        _replace(graph, node, nodes)


def _replace(graph, old, new: list) -> None:
    """Put the nodes `new` where `old` stood (graph order is topological)."""
    index = list(graph.node).index(old)
    graph.node.remove(old)
    for offset, node in enumerate(new):
        graph.node.insert(index + offset, node)
