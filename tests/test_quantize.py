"""Weight-only quantization: the NumPy blocks against ONNX Runtime's quantizer, the embedding and the
tied head rewritten onto one quantized table, and quantized exports of tied and untied models."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy.export.quantize import dequantize_blockwise, quantize_blockwise


def _ort_blocks(weight: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """What ONNX Runtime's MatMulNBits quantizer stores for the MatMul weight weight.T ([in, out])."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    rows, cols = weight.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cols])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, rows])],
                              [numpy_helper.from_array(np.ascontiguousarray(weight.T), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, bits=bits)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=True, algo_config=config)
    quantizer.process()
    stored = {t.name: numpy_helper.to_array(t) for t in quantizer.model.model.graph.initializer}
    return stored[f"w_Q{bits}"], stored["w_scales"]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("cols, block_size", [(64, 32), (80, 32), (96, 64), (640, 128), (576, 128)])
def test_blocks_equal_onnxruntime_quantizer(bits, cols, block_size):
    rng = np.random.default_rng(cols + bits)
    weight = rng.normal(size=(48, cols)).astype(np.float32)
    weight[3] = 0.0  # an all-zero row: scale 0, codes at the zero point
    weight[5, :block_size] *= 40.0  # one block far larger than the others
    data, scales = quantize_blockwise(weight, bits, block_size)
    ort_data, ort_scales = _ort_blocks(weight, bits, block_size)
    assert data.dtype == np.uint8 and data.shape == ort_data.shape
    np.testing.assert_array_equal(scales, ort_scales.reshape(scales.shape))
    np.testing.assert_array_equal(data, ort_data)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantized_blocks_within_half_a_step(bits):
    rng = np.random.default_rng(bits)
    weight = rng.normal(size=(32, 100)).astype(np.float32)
    data, scales = quantize_blockwise(weight, bits, 32)
    restored = dequantize_blockwise(data, scales, bits, cols=100)
    steps = np.repeat(np.abs(scales), 32, axis=1)[:, :100]
    assert restored.shape == weight.shape
    error = np.abs(restored - weight)
    # Codes run from -2**(bits-1) to 2**(bits-1) - 1 steps: a value opposite in sign to its block's largest
    # may be clipped by up to one step; everything inside the range rounds to within half a step.
    signed = np.repeat(scales, 32, axis=1)[:, :100]
    top = (2 ** (bits - 1) - 1) * np.abs(signed)
    inside = np.where(signed < 0, weight >= -top, weight <= top)
    assert np.all(error[inside] <= steps[inside] / 2 + 1e-6)
    assert np.all(error <= steps + 1e-6)
    # Each block's largest magnitude is represented exactly.
    blocks = np.pad(weight, ((0, 0), (0, 28))).reshape(32, 4, 32)
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    restored_blocks = np.pad(restored, ((0, 0), (0, 28))).reshape(32, 4, 32)
    np.testing.assert_allclose(np.take_along_axis(restored_blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0],
                               largest, rtol=1e-6)


def _tied_graph(table: np.ndarray, path):
    """input_ids -> Gather(table) -> embedded; embedded -> FusedMatMul(table^T) -> logits (a tied head)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    vocab, hidden = table.shape
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["embedded"], axis=0),
             helper.make_node("FusedMatMul", ["embedded", "table"], ["logits"], domain="com.microsoft", transB=1, alpha=1.0)]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"])],
                              [helper.make_tensor_value_info("embedded", TensorProto.FLOAT, [1, "s", hidden]),
                               helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "s", vocab])],
                              [numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    onnx.save_model(model, path)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("hidden", [64, 72])  # 72: the last block is padded, and sliced off after the gather
def test_tied_embedding_and_head_share_one_quantized_table(tmp_path, bits, hidden):
    import onnx
    import onnxruntime as ort

    from specdeploy.export.quantize import quantize_weights

    rng = np.random.default_rng(hidden)
    table = rng.normal(size=(300, hidden)).astype(np.float32)
    path = tmp_path / "model.onnx"
    _tied_graph(table, path)
    quantize_weights(path, bits=bits, block_size=32, accuracy_level=0)

    model = onnx.load(path)
    ops = [n.op_type for n in model.graph.node]
    assert "Gather" not in ops and "FusedMatMul" not in ops
    assert ops.count("GatherBlockQuantized") == 1 and ops.count("MatMulNBits") == 1
    stored = {t.name: t for t in model.graph.initializer}
    assert "table" not in stored  # the fp32 table is gone; one quantized copy serves both
    gather = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    assert head.input[1] == gather.input[0]

    data, scales = quantize_blockwise(table, bits, 32)
    restored = dequantize_blockwise(data, scales, bits, hidden)  # [vocab, hidden]
    ids = np.array([[0, 7, 299, 7, 150]], dtype=np.int64)
    embedded, logits = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})
    np.testing.assert_array_equal(embedded[0], restored[ids[0]])
    np.testing.assert_allclose(logits[0], restored[ids[0]] @ restored.T, rtol=1e-4, atol=1e-3)


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory, tokenizer_dir):
    return _tied_llama(tmp_path_factory.mktemp("tied") / "model", tokenizer_dir)


def _tied_llama(folder, tokenizer_dir):
    import shutil

    import torch
    import transformers as tf

    from conftest import BOS, EOS, VOCAB, train_briefly

    torch.manual_seed(5)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS)
    model = tf.LlamaForCausalLM(config)
    train_briefly(model, tokenizer_dir, steps=80, seed=5)
    model.generation_config = tf.GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy2(tokenizer_dir / name, folder / name)
    return folder


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_tied_export_stores_the_table_once(tmp_path, tied_llama, quantize):
    import onnx

    from conftest import export_pair
    from specdeploy.bundle import load_manifest

    manifest = export_pair({"target": tied_llama, "draft": tied_llama}, tmp_path / "bundle", quantize=quantize, allow_lossy=True)
    target = manifest.target
    model = onnx.load(tmp_path / "bundle" / target.onnx_path, load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("GatherBlockQuantized") == 1 and "FusedMatMul" not in ops
    assert not any(n.op_type == "Gather" and "input_ids" in n.input for n in model.graph.node)
    float_tensors = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2}
    # Every weight matrix, the table included, is quantized: what stays fp32 are block scales and rotary tables.
    assert {name for name in float_tensors if not name.endswith("_scales")} == {"cos_cache", "sin_cache"}
    data_bytes = sum(f.size for f in target.files if f.path.endswith(".data"))
    bits = int(quantize[3:])
    # Each parameter once at bits/8 bytes plus a 4-byte scale per 32, and the fp32 rotary tables; a second
    # copy of the 384 x 64 table would add a fifth to this.
    rotary_bytes = 2 * 4 * target.max_context * target.head_dim // 2
    expected = target.num_parameters * (bits / 8 + 4 / 32) + rotary_bytes
    assert data_bytes <= 1.05 * expected
    assert load_manifest(tmp_path / "bundle", verify=True).target.quantize == quantize


def _matmul_graph(path, rng):
    """x [1, s, 64] -> MatMul [64, 96] -> Add (a small inline bias) -> MatMul [96, 64] -> MatMul [1, 64, 48]
    (leading unit dim: ORT's quantizer reshapes the output back) -> y, with the large weights in model.onnx.data."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from specdeploy.export.convert import save_model

    weights = {"w1": rng.normal(size=(64, 96)), "w2": rng.normal(size=(96, 64)), "w3": rng.normal(size=(1, 64, 48)),
               "b1": rng.normal(size=(96,))}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="first"),
             helper.make_node("Add", ["h1", "b1"], ["h2"], name="bias"),
             helper.make_node("MatMul", ["h2", "w2"], ["h3"], name="second"),
             helper.make_node("MatMul", ["h3", "w3"], ["y"], name="third")]
    graph = helper.make_graph(nodes, "matmuls", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w.astype(np.float32), name) for name, w in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    save_model(model, path)
    return onnx.load(path)  # the whole model, weights included, for the reference


@pytest.mark.parametrize("bits", [4, 8])
def test_matmuls_quantized_one_at_a_time_equal_the_whole_graph_quantizer(tmp_path, bits):
    """quantize_weights hands ORT's quantizer one MatMul at a time; the nodes and tensors equal one pass over the graph."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    from specdeploy.export.quantize import quantize_weights

    path = tmp_path / "model.onnx"
    whole = _matmul_graph(path, np.random.default_rng(bits))
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, bits=bits, accuracy_level=4)
    reference = MatMulNBitsQuantizer(whole, bits=bits, block_size=32, is_symmetric=True, accuracy_level=4,
                                     algo_config=config)
    reference.process()
    expected = reference.model.model
    quantize_weights(path, bits=bits, block_size=32, accuracy_level=4)

    ours = onnx.load(path)
    assert [n.SerializeToString() for n in ours.graph.node] == [n.SerializeToString() for n in expected.graph.node]
    assert "Reshape" in [n.op_type for n in ours.graph.node]  # the 3-D weight's output reshape came along
    got = {t.name: numpy_helper.to_array(t) for t in ours.graph.initializer}
    want = {t.name: numpy_helper.to_array(t) for t in expected.graph.initializer}
    assert got.keys() == want.keys() and not {"w1", "w2", "w3"} & got.keys()
    for name, array in want.items():
        assert got[name].dtype == array.dtype
        np.testing.assert_array_equal(got[name], array)
    x = {"x": np.random.default_rng(0).normal(size=(1, 5, 64)).astype(np.float32)}
    ours_out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, x)[0]
    expected_out = ort.InferenceSession(expected.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]
    np.testing.assert_array_equal(ours_out, expected_out)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("chunk_rows", [1, 64, 299, 1000])  # one row, uneven pieces, all but one row, one piece
def test_embedding_quantized_in_row_chunks_equals_one_piece(tmp_path, bits, chunk_rows):
    import onnx
    from onnx import numpy_helper

    from specdeploy.export.convert import externalize
    from specdeploy.export.quantize import quantize_weights

    table = np.random.default_rng(chunk_rows).normal(size=(300, 72)).astype(np.float32)
    table[7] = 0.0
    path = tmp_path / "model.onnx"
    _tied_graph(table, path)
    externalize(path)
    quantize_weights(path, bits=bits, block_size=32, accuracy_level=0, chunk_rows=chunk_rows)
    stored = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    data, scales = quantize_blockwise(table, bits, 32)
    np.testing.assert_array_equal(stored[f"table_Q{bits}"], data)
    np.testing.assert_array_equal(stored["table_scales"], scales)


def test_quantization_never_loads_every_weight(tmp_path, monkeypatch):
    """The graph is read without its weights: loading the external data (the whole model in memory) is an error."""
    import onnx.external_data_helper

    from specdeploy.export.quantize import quantize_weights

    path = tmp_path / "model.onnx"
    _matmul_graph(path, np.random.default_rng(1))

    def refuse(*args, **kwargs):
        raise AssertionError("quantization loaded the whole model")

    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_model", refuse)
    monkeypatch.setattr(onnx, "load_external_data_for_model", refuse)
    quantize_weights(path, bits=8, block_size=32)
    ops = {n.op_type for n in onnx.load(path, load_external_data=False).graph.node}
    assert "MatMulNBits" in ops and "MatMul" not in ops
