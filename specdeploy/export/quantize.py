"""Weight-only int8 / int4 quantization, the embedding and the LM head included.

Every MatMul with a constant weight becomes ONNX Runtime's MatMulNBits (its own quantizer, blocks of
`block_size` along the input dimension, symmetric). The token embedding and the LM head are the
largest tensors of a small model with a large vocabulary (SmolLM2-135M: 49,152 x 576, more bytes
than all its layers at int4), and ONNX Runtime's quantizer leaves both in fp32: the embedding is a
Gather, and a tied head reads the embedding table transposed. So this module quantizes the table
itself, once, in MatMulNBits' layout:

    data    [vocab, n_blocks, block_size * bits / 8] uint8   (two int4 values a byte, low nibble first)
    scales  [vocab, n_blocks] float32

and points both users at that one tensor, as onnxruntime-genai's builder does for tied weights:

    Gather(table, input_ids)        -> GatherBlockQuantized(data, input_ids, scales) [-> Slice the padding]
    FusedMatMul(hidden, table^T)    -> MatMulNBits(hidden, data, scales)      (tied head: stored once)

An untied head is a plain MatMul, which the quantizer takes with the rest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MS = "com.microsoft"
BLOCK_SIZE = 32
# accuracy_level 4: ONNX Runtime multiplies in int8 (activations quantized per block on the fly) with
# its VNNI / AVX-512 kernels; level 0 dequantizes to fp32 first. Measured in docs/performance.md.
ACCURACY_LEVEL = 4


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
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(codes), scales


def dequantize_blockwise(data: np.ndarray, scales: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """The float rows [rows, cols] that quantize_blockwise's data and scales stand for."""
    if bits == 4:
        data = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(*data.shape[:2], -1)
    values = (data.astype(np.float32) - (1 << (bits - 1))) * scales[..., None]
    return values.reshape(data.shape[0], -1)[:, :cols]


def quantize_weights(path: Path, bits: int, block_size: int = BLOCK_SIZE, accuracy_level: int = ACCURACY_LEVEL) -> None:
    """Quantize the model at path in place: embedding and head here, every other MatMul with ORT's quantizer."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    from .convert import save_model

    model = onnx.load(path)
    _quantize_embedding(model.graph, bits, block_size, accuracy_level)
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, bits=bits,
                                          accuracy_level=accuracy_level)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=True,
                                     accuracy_level=accuracy_level, algo_config=config)
    quantizer.process()
    save_model(quantizer.model.model, path)


def _quantize_embedding(graph, bits: int, block_size: int, accuracy_level: int) -> None:
    """The input_ids Gather onto a quantized table, and a tied head (FusedMatMul, transB) onto the same one."""
    from onnx import helper, numpy_helper

    initializers = {t.name: t for t in graph.initializer}
    gather = next((n for n in graph.node if n.op_type == "Gather" and len(n.input) == 2 and n.input[1] == "input_ids"
                   and n.input[0] in initializers), None)
    if gather is None:
        return
    table_name = gather.input[0]
    table = numpy_helper.to_array(initializers[table_name])  # [vocab, hidden]
    if table.ndim != 2 or table.dtype != np.float32:
        return
    vocab, hidden = table.shape
    data, scales = quantize_blockwise(table, bits, block_size)
    num_blocks = data.shape[1]
    data_name, scales_name = f"{table_name}_Q{bits}", f"{table_name}_scales"
    graph.initializer.extend([
        numpy_helper.from_array(data, data_name),
        numpy_helper.from_array(scales, scales_name),
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
    for node in list(graph.node):
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type == "FusedMatMul" and node.domain == MS and list(node.input[1:]) == [table_name]
                and attributes.get("transB") == 1 and not attributes.get("transA") and attributes.get("alpha", 1.0) == 1.0):
            head = helper.make_node("MatMulNBits", [node.input[0], data_name, scales_name], list(node.output),
                                    name=node.name or "lm_head", domain=MS, K=hidden, N=vocab, bits=bits,
                                    block_size=block_size, accuracy_level=accuracy_level)
            _replace(graph, node, [head])
    if not any(table_name in n.input for n in graph.node):
        graph.initializer.remove(initializers[table_name])


def _replace(graph, old, new: list) -> None:
    """Put the nodes `new` where `old` stood (graph order is topological)."""
    index = list(graph.node).index(old)
    graph.node.remove(old)
    for offset, node in enumerate(new):
        graph.node.insert(index + offset, node)
