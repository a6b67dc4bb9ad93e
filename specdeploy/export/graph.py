"""An ONNX graph written as it is built: nodes in order, initializers streamed into the external data file.

The builder of the fused graphs (fused.py, eagle.py) and the one place a `blocks.BlockMatrix` becomes
operators: MatMulNBits for x @ W.T, GatherBlockQuantized for rows of an embedding table, and for a
matrix with mins the sums of each block of its inputs times them, subtracted (blocks.py states the
math). A weight never sits in the protobuf: each is written once and the graph holds a pointer to
its bytes (weights.DataWriter), so building takes about one weight's memory beyond its source's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .blocks import MS, BlockMatrix
from .convert import weights_path
from .weights import DataWriter

OPSET = 17
# MatMulNBits' accuracy_level for blocks read from a GGUF: 4 multiplies in int8 (activations quantized per
# block on the fly, as llama.cpp quantizes them for its own dot products) with the VNNI / AVX-512 kernels.
ACCURACY_LEVEL = 4


def graph_name(name: str) -> str:
    """An initializer's name in the graph: the state-dict name without the decoder's `model.` and a layer's
    `self_attn.` and `mlp.` (`model.layers.0.self_attn.o_proj` -> `layers.0.o_proj`)."""
    return name.removeprefix("model.").replace(".self_attn.", ".").replace(".mlp.", ".")


def tensor_spec(name: str, shape: list, integer: bool = False):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.INT64 if integer else TensorProto.FLOAT, shape)


class Graph:
    """Nodes, and initializers written straight into the external data file as they come (a float32 matrix
    transposed to [in, out]; a BlockMatrix as its codes, scales and mins). `inputs` and `outputs`: the graph's.

    path: where `save` writes the graph; its weights go beside it (path + '.data'), cleared first."""

    def __init__(self, path: Path):
        from onnx import helper

        self.path = Path(path)
        self.helper = helper
        self.nodes: list = []
        self.initializers: list = []
        self.inputs: list = []
        self.outputs: list = []
        self._count = 0
        self._data = DataWriter(weights_path(self.path))
        self._block_sums: dict[tuple[str, int], str] = {}
        self._stored_blocks: set[str] = set()
        self._constants: set[str] = set()

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(self._data.array(name, array))
        return name

    def constant(self, name: str, array: np.ndarray) -> str:
        """A small constant (a shape, an axis) that several nodes may read: stored once under its name."""
        if name not in self._constants:
            self._constants.add(self.weight(name, array))
        return name

    def close(self) -> None:
        self._data.close()

    def node(self, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", label: str | None = None,
             **attrs) -> list[str]:
        """One node (named label, else after its op and place); outputs: names, or how many to name here."""
        self._count += 1
        if isinstance(outputs, int):
            outputs = [f"/{op.lower()}_{self._count}/out{i}" for i in range(outputs)]
        self.nodes.append(self.helper.make_node(op, inputs, outputs, name=label or f"{op}_{self._count}", domain=domain,
                                                **attrs))
        return outputs

    def blocks(self, name: str, matrix: BlockMatrix) -> dict[str, str]:
        """A BlockMatrix's initializers (stored once per name): codes, scales [rows, n_blocks] and mins."""
        stored = {"codes": f"{name}_Q{matrix.bits}", "scales": f"{name}_scales"}
        if matrix.mins is not None:
            stored["mins"] = f"{name}_mins"
        if stored["codes"] not in self._stored_blocks:
            for key, array in (("codes", matrix.codes), ("scales", matrix.scales), ("mins", matrix.mins)):
                if key in stored:
                    self.weight(stored[key], array)
            self._stored_blocks.add(stored["codes"])
        return stored

    def block_sums(self, x: str, block_size: int, cols: int) -> str:
        """x [..., cols] summed over each block of block_size inputs: [..., cols / block_size] (once per x)."""
        key = (x, block_size)
        if key not in self._block_sums:
            shape = self.constant(f"block_shape_{cols // block_size}x{block_size}",
                                  np.array([0, 0, cols // block_size, block_size], dtype=np.int64))
            axis = self.constant("last_axis_i64", np.array([-1], dtype=np.int64))
            grouped = self.node("Reshape", [x, shape])[0]
            self._block_sums[key] = self.node("ReduceSum", [grouped, axis], keepdims=0)[0]
        return self._block_sums[key]

    def matmul_blocks(self, x: str, name: str, matrix: BlockMatrix, output: str | None = None,
                      label: str | None = None) -> str:
        """x @ matrix.T: MatMulNBits over the codes, less the blocks' input sums times the mins when there are mins."""
        stored = self.blocks(name, matrix)
        product = [output] if output and matrix.mins is None else 1
        out = self.node("MatMulNBits", [x, stored["codes"], stored["scales"]], product, domain=MS, label=label,
                        K=matrix.cols, N=matrix.rows, bits=matrix.bits, block_size=matrix.block_size,
                        accuracy_level=ACCURACY_LEVEL)[0]
        if matrix.mins is None:
            return out
        sums = self.block_sums(x, matrix.block_size, matrix.cols)
        correction = self.node("FusedMatMul", [sums, stored["mins"]], domain=MS, transB=1, alpha=1.0)[0]
        return self.node("Sub", [out, correction], [output] if output else 1)[0]

    def linear(self, x: str, name: str, weight, bias: np.ndarray | None = None, output: str | None = None,
               label: str | None = None) -> str:
        """x @ W.T (+ b): a MatMul with a float32 weight stored [in, out], or MatMulNBits over a BlockMatrix (the
        product's node named label, if given)."""
        last = output if bias is None else None
        if isinstance(weight, BlockMatrix):
            out = self.matmul_blocks(x, name, weight, last, label)
        else:
            out = self.node("MatMul", [x, self.weight(f"{name}.weight", np.ascontiguousarray(weight.T))],
                            [last] if last else 1, label=label)[0]
        if bias is not None:
            out = self.node("Add", [out, self.weight(f"{name}.bias", bias)], [output] if output else 1)[0]
        return out

    def gather(self, table: str, weight, ids: str) -> str:
        """Rows of an embedding table [vocab, hidden]: Gather, or GatherBlockQuantized over a BlockMatrix (less the
        gathered mins of each block)."""
        if not isinstance(weight, BlockMatrix):
            return self.node("Gather", [self.weight(table, weight), ids], axis=0)[0]
        stored = self.blocks(table, weight)
        shape3 = self.weight(f"{table}_scales_shape", np.array([weight.rows, weight.num_blocks, 1], dtype=np.int64))
        scales3 = self.node("Reshape", [stored["scales"], shape3])[0]
        # The 3-D codes read as rows of one-block chunks: quantize_axis 2, scales [vocab, n_blocks, 1].
        rows = self.node("GatherBlockQuantized", [stored["codes"], ids, scales3], domain=MS, bits=weight.bits,
                         block_size=weight.block_size, gather_axis=0, quantize_axis=2)[0]  # [.., n_blocks, block]
        if weight.mins is not None:
            axis = self.constant("last_axis_i64", np.array([-1], dtype=np.int64))
            mins = self.node("Unsqueeze", [self.node("Gather", [stored["mins"], ids], axis=0)[0], axis])[0]
            rows = self.node("Sub", [rows, mins])[0]
        flat = self.weight(f"{table}_rows_shape", np.array([0, 0, weight.cols], dtype=np.int64))
        return self.node("Reshape", [rows, flat])[0]


def save(g: Graph, name: str = "specdeploy-fused") -> Path:
    """The graph in g.path (its data file closed); its initializers already point into path + '.data'."""
    import onnx
    from onnx import helper

    g.close()
    graph = helper.make_graph(g.nodes, name, g.inputs, g.outputs, g.initializers)
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)], producer_name="specdeploy"
    )
    proto.ir_version = 8
    onnx.save_model(proto, g.path)
    return g.path
