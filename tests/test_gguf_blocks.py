"""A GGUF's quantized blocks kept as they are: each type against gguf's own dequantization, ONNX Runtime's operators
reading them, and tiny quantized GGUF files written here exported end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

from specdeploy.export import blocks  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # K types need rows of 256 values
# Where each type keeps its fp16 fields (d, and m or dmin), and a magnitude for them that gives weights of
# about 0.02-0.1: what the tiny models below need to stay finite.
FP16_FIELDS = {"Q4_0": ((0, 0.01),), "Q4_1": ((0, 0.01), (2, -0.08)), "Q5_0": ((0, 0.005),),
               "Q5_1": ((0, 0.005), (2, -0.08)), "Q8_0": ((0, 0.0008),), "Q4_K": ((0, 0.0003), (2, 0.0003)),
               "Q5_K": ((0, 0.00015), (2, 0.0003)), "Q6_K": ((208, 0.00005),)}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, spread: float = 0.3,
                  magnitude: float = 1.0, file_like: bool = True) -> np.ndarray:
    """Random bytes in a type's layout, [rows, bytes a row] uint8, its fp16 fields set to finite values near the
    type's magnitude times `magnitude` (spread: the standard deviation of their logarithm).

    file_like: a K type's 6-bit scales and mins all of 32..63, so that a min is never more than 2^4 below its
    scale times 8, as in every block of the real files measured (docs/performance.md); else any 6-bit values."""
    kind = blocks.GGUF_BLOCK_TYPES[type_name]
    raw = rng.integers(0, 256, size=(rows, cols // kind.values_per_block, kind.bytes_per_block), dtype=np.uint8)
    if file_like and type_name in ("Q4_K", "Q5_K"):
        raw[:, :, 4:12] |= np.uint8(0xA0)  # bit 5 of the first four scales and mins, bit 7: of the last four
    for at, scale in FP16_FIELDS[type_name]:
        values = (magnitude * scale * np.exp(spread * rng.standard_normal(raw.shape[:2]))).astype(np.float16)
        raw[:, :, at:at + 2] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def gguf_values(raw: np.ndarray, type_name: str, cols: int) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(len(raw), cols)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q6_K"])
def test_a_block_type_is_gguf_dequantization_bit_for_bit(type_name):
    rng = np.random.default_rng(list(blocks.GGUF_BLOCK_TYPES).index(type_name))
    raw = random_blocks(type_name, 48, 512, rng, spread=2.0)
    matrix = blocks.from_gguf(raw, type_name, 512)
    kind = blocks.GGUF_BLOCK_TYPES[type_name]
    assert (matrix.bits, matrix.block_size, matrix.codes.shape) == (kind.bits, kind.block_size,
                                                                   (48, 512 // kind.block_size, kind.block_size * kind.bits // 8))
    expected = gguf_values(raw, type_name, 512)
    assert np.array_equal(blocks.dequantize(matrix).view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K"])
def test_a_4bit_type_with_a_min_rounds_only_its_folded_min(type_name):
    """A 4-bit type's min folds in the default zero point's 8 (blocks.py): bit for bit wherever that sum is exact in
    float32, as in every block of a file whose scales and mins are of one magnitude, and within the min's own
    rounding elsewhere (scales and mins of any size and fp16 fields spread over orders of magnitude here)."""
    for spread, everywhere in ((0.3, True), (2.0, False)):
        rng = np.random.default_rng(7)
        raw = random_blocks(type_name, 64, 512, rng, spread=spread, file_like=everywhere)
        matrix = blocks.from_gguf(raw, type_name, 512)
        ours, expected = blocks.dequantize(matrix), gguf_values(raw, type_name, 512)
        same = ours.view(np.uint32) == expected.view(np.uint32)
        assert same.all() if everywhere else same.mean() > 0.95
        rounding = np.repeat(np.spacing(np.abs(matrix.mins)), matrix.block_size, axis=1) + np.spacing(np.abs(expected))
        assert (np.abs(ours - expected) <= rounding).all()


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gguf_quantized_weights_read_back_exactly(type_name):
    """Real weights quantized by gguf itself (not random bytes): the same values come back."""
    import gguf

    weights = np.random.default_rng(3).standard_normal((32, 256)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[type_name])
    ours = blocks.dequantize(blocks.from_gguf(raw, type_name, 256))
    assert np.array_equal(ours, gguf_values(raw, type_name, 256))


def test_rows_taken_and_stacked_keep_their_values():
    rng = np.random.default_rng(5)
    q = blocks.from_gguf(random_blocks("Q4_K", 8, 256, rng), "Q4_K", 256)
    k = blocks.from_gguf(random_blocks("Q4_K", 4, 256, rng), "Q4_K", 256)
    stacked = blocks.BlockMatrix.stack([q, k])
    assert np.array_equal(blocks.dequantize(stacked), np.concatenate([blocks.dequantize(q), blocks.dequantize(k)]))
    order = np.array([3, 0, 7])
    assert np.array_equal(blocks.dequantize(q.take(order)), blocks.dequantize(q)[order])
    v = blocks.from_gguf(random_blocks("Q6_K", 4, 256, rng), "Q6_K", 256)
    with pytest.raises(ValueError, match="one layout"):
        blocks.BlockMatrix.stack([q, v])


def _operator_graph(tmp_path: Path, matrix: blocks.BlockMatrix) -> Path:
    """A graph of the builder's two readings of one BlockMatrix: x @ W.T (MatMulNBits and the mins' correction)
    and rows of W (GatherBlockQuantized)."""
    from onnx import TensorProto, helper

    from specdeploy.export.graph import Graph, save

    g = Graph(tmp_path / "op.onnx")
    g.inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n", matrix.cols]),
                helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "m"])]
    g.outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                 helper.make_tensor_value_info("rows", TensorProto.FLOAT, None)]
    g.matmul_blocks("x", "w", matrix, "y")
    g.node("Identity", [g.gather("w", matrix, "ids")], ["rows"])
    return save(g)


@pytest.mark.parametrize("type_name", list(blocks.GGUF_BLOCK_TYPES))
def test_onnx_runtime_reads_the_blocks_as_the_reference_does(tmp_path, type_name):
    """MatMulNBits multiplies in int8, quantizing each block of its input by its largest magnitude: inputs whose
    blocks are integers reaching +-127 pass through that exactly, so its products are the reference's up to float32
    summation. GatherBlockQuantized's rows are the reference's rows bit for bit."""
    import onnxruntime as ort

    rng = np.random.default_rng(11)
    matrix = blocks.from_gguf(random_blocks(type_name, 96, 512, rng), type_name, 512)
    session = ort.InferenceSession(str(_operator_graph(tmp_path, matrix)), providers=["CPUExecutionProvider"])
    x = rng.integers(-127, 128, size=(1, 3, 512)).astype(np.float32)
    x.reshape(3, -1, 16)[:, :, 0] = 127  # every block of 16 (so of 32 too) reaches the int8 range's end
    ids = np.array([[95, 0, 42, 42]], dtype=np.int64)
    y, rows = session.run(None, {"x": x, "ids": ids})
    weights = blocks.dequantize(matrix).astype(np.float64)
    expected = x.astype(np.float64) @ weights.T
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert np.array_equal(rows[0], weights[ids[0]].astype(np.float32))


def test_the_header_reader_agrees_with_gguf_reader(tmp_path):
    from gguf import GGUFReader

    from specdeploy.export.gguf_file import GgufFile
    from test_gguf import write_gemma3_gguf

    path = write_quantized_gguf(tmp_path / "q.gguf", "qwen2", {"attn_q": "Q4_K", "ffn_down": "Q6_K"})
    gemma = write_gemma3_gguf(tmp_path / "gemma.gguf")
    for file_path in (path, gemma):
        ours, theirs = GgufFile(file_path), GGUFReader(str(file_path))
        for field in theirs.fields.values():
            if not field.name.startswith("GGUF."):
                assert ours.metadata[field.name] == field.contents(), field.name
        assert list(ours.tensors) == [t.name for t in theirs.tensors]
        for tensor in theirs.tensors:
            info = ours.tensors[tensor.name]
            assert (info.type_name, info.offset, info.nbytes) == (tensor.tensor_type.name, tensor.data_offset,
                                                                 tensor.n_bytes)
            assert np.array_equal(ours.raw_rows(tensor.name, 0, info.rows).reshape(-1),
                                  np.asarray(tensor.data).view(np.uint8).reshape(-1))
        ours.close()


def test_a_broken_header_is_one_error(tmp_path):
    from specdeploy.errors import SpecdeployError
    from specdeploy.export.gguf_file import GgufFile

    path = write_quantized_gguf(tmp_path / "q.gguf", "llama", {})
    data = path.read_bytes()
    for name, content in (("short.gguf", data[:5000]), ("version.gguf", data[:4] + b"\x07\x00\x00\x00" + data[8:]),
                          ("cut.gguf", data[: len(data) - 100])):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(SpecdeployError, match=r"truncated file|GGUF version 7|runs past the end"):
            GgufFile(tmp_path / name)


# --- tiny quantized models, written the way llama.cpp writes them ------------------------------------------------------

ARCH_TYPES = {
    # every type at least once: Q4_K / Q5_K / Q6_K for q / k / v (unlike types: three projections), a tied Q8_0 table
    "llama": {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
              "ffn_up": "Q5_0", "ffn_down": "Q5_1", "token_embd": "Q8_0"},
    # q / k / v of one type (one stacked projection, its biases too), a Q4_K embedding (rows less their mins), a Q6_K head
    "qwen2": {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q6_K", "ffn_gate": "Q4_K",
              "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q4_K", "output": "Q6_K"},
    "gemma3": {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate": "Q5_0",
               "ffn_up": "Q5_0", "ffn_down": "Q6_K", "token_embd": "Q8_0"},
}


def write_quantized_gguf(path: Path, arch: str, types: dict[str, str], seed: int = 0) -> Path:
    """A tiny model of arch as llama.cpp writes one: its matrices (by GGUF name, without `blk.N.`) in the given
    types as random blocks, everything else (norms, biases) float32, a byte-level BPE with ChatML tokens."""
    import gguf
    import torch
    import transformers as tf

    from test_gguf import CHATML, CHATML_TEMPLATE, GEMMA, GEMMA_TEMPLATE, _bpe

    specials = GEMMA if arch == "gemma3" else CHATML
    tokens, merges = _bpe(specials, 320)
    common = dict(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                  tie_word_embeddings="output" not in types)
    config = {"llama": lambda: tf.LlamaConfig(**common),
              "qwen2": lambda: tf.Qwen2Config(**common),
              "gemma3": lambda: tf.Gemma3TextConfig(**common, head_dim=HIDDEN // HEADS, sliding_window=32)}[arch]()
    torch.manual_seed(seed)
    model = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "gemma3": tf.Gemma3ForCausalLM}[arch](config)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(512)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_key_length(HIDDEN // HEADS)
        writer.add_value_length(HIDDEN // HEADS)
        writer.add_sliding_window(32)
    else:
        writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    if arch == "gemma3":  # as test_gguf's Gemma: a SentencePiece vocabulary scored by merge order
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        writer.add_add_space_prefix(False)
        for add, token_id in ((writer.add_bos_token_id, 2), (writer.add_eos_token_id, 1), (writer.add_pad_token_id, 0),
                              (writer.add_unk_token_id, 3)):
            add(token_id)
        writer.add_add_bos_token(True)
        writer.add_chat_template(GEMMA_TEMPLATE)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHATML_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], LAYERS)
    for name, tensor in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        target = names.get_name(base)
        if base == "lm_head" and "output" not in types:
            continue  # tied: the table is the head
        kind = types.get(target.split(".")[-1]) if suffix == "weight" else None
        if kind is None:
            values = tensor.numpy().astype(np.float32)
            if arch == "gemma3" and name.endswith("norm.weight"):
                values = values + 1  # as llama.cpp's converter stores Gemma's norms
            writer.add_tensor(f"{target}.{suffix}", values)
        else:
            rows, cols = tensor.shape
            # A wide table makes confident logits: a random model's near ties would flip under int8 arithmetic.
            magnitude = 25.0 if base in ("model.embed_tokens", "lm_head") else 1.0
            writer.add_tensor(f"{target}.{suffix}", random_blocks(kind, rows, cols, rng, magnitude=magnitude),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", list(ARCH_TYPES))
def test_a_gguf_is_read_as_transformers_reads_it(tmp_path, arch):
    """Every parameter under its state-dict name, as transformers' GGUF loader gives it: a Llama's q and k rows
    unpermuted, Gemma's norms less the 1 llama.cpp stores in them."""
    from specdeploy.export.gguf import config_from_metadata
    from specdeploy.export.gguf_file import GgufFile, transformers_view
    from specdeploy.export.gguf_weights import GgufTensors

    path = write_quantized_gguf(tmp_path / f"{arch}.gguf", arch, ARCH_TYPES[arch])
    file = GgufFile(path)
    tensors = GgufTensors(file, config_from_metadata(transformers_view(file)))
    for name, parameter in transformers_model(path).named_parameters():
        assert np.array_equal(tensors.array(name), parameter.detach().numpy()), name


def test_the_streamed_reference_holds_one_layer_at_a_time(tmp_path):
    """The parity check's PyTorch model: transformers' logits, with at most one decoder layer's weights in memory
    during the pass and, of the input embedding, only the rows of the tokens given."""
    import torch

    from specdeploy.export.gguf import config_from_metadata
    from specdeploy.export.gguf_file import GgufFile, transformers_view
    from specdeploy.export.gguf_weights import GgufTensors, streamed_model

    path = write_quantized_gguf(tmp_path / "q.gguf", "qwen2", ARCH_TYPES["qwen2"])
    file = GgufFile(path)
    model = streamed_model(GgufTensors(file, config_from_metadata(transformers_view(file))))
    loaded_layers = []

    def count(module, args):
        loaded_layers.append(sum(1 for layer in model.model.layers if not layer.mlp.up_proj.weight.is_meta))

    for layer in model.model.layers:
        layer.register_forward_pre_hook(count)
    ids = torch.tensor([[5, 9, 5, 200]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        expected = transformers_model(path)(input_ids=ids).logits
    assert loaded_layers == [1] * LAYERS  # as each layer runs, it alone is in memory
    assert all(layer.mlp.up_proj.weight.is_meta for layer in model.model.layers)  # let go once the head ran
    assert torch.equal(logits, expected)


@pytest.fixture(scope="module")
def quantized_bundles(tmp_path_factory):
    """arch -> (GGUF file, its default export): target and draft the same file."""
    from specdeploy.export import ExportConfig, export_bundle

    cache = {}

    def get(arch: str):
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"gguf-{arch}")
            path = write_quantized_gguf(root / f"{arch}.gguf", arch, ARCH_TYPES[arch])
            lines = []
            manifest = export_bundle(ExportConfig(target=str(path), draft=str(path), out=str(root / "bundle")),
                                     report=lambda stage, detail: lines.append(detail))
            cache[arch] = (path, root / "bundle", manifest, lines)
        return cache[arch]

    return get


def _fp32_arithmetic(bundle: Path, spec, folder: Path):
    """A copy of the model's graph whose MatMulNBits multiply in float32 (accuracy_level 0): the weights alone decide."""
    import shutil

    import onnx

    shutil.copytree(bundle / Path(spec.onnx_path).parent, folder)
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.name == "accuracy_level":
                attribute.i = 0
    onnx.save(model, folder / "model.onnx")
    return folder / "model.onnx"


@pytest.mark.parametrize("arch", list(ARCH_TYPES))
def test_a_quantized_gguf_exports_its_own_blocks(quantized_bundles, arch, tmp_path):
    import onnx
    import torch

    import specdeploy
    from specdeploy.runtime.engine import OrtEngine

    path, bundle, manifest, lines = quantized_bundles(arch)
    for spec in (manifest.target, manifest.draft):
        assert spec.quantize == "gguf" and spec.graph == "fused" and spec.parity.passed
        assert spec.gguf.file == path.name and spec.gguf.size == path.stat().st_size and not spec.gguf.dequantized
        assert set(spec.gguf.kept) == set(ARCH_TYPES[arch].values())
    assert any("kept the GGUF's own blocks" in line for line in lines)
    graph = onnx.load(bundle / manifest.target.onnx_path, load_external_data=False).graph
    ops = {node.op_type for node in graph.node}
    assert {"MatMulNBits", "GatherBlockQuantized"} <= ops  # qwen2's Q4_K table: its rows less their gathered mins
    stored = (bundle / (manifest.target.onnx_path + ".data")).stat().st_size
    assert stored < 2.2 * path.stat().st_size  # blocks, not float32 copies (which would be 5-8 times the file)
    # With float32 arithmetic the graph is transformers' model of the same file: the weights are its own.
    engine = OrtEngine(_fp32_arithmetic(bundle, manifest.target, tmp_path / "fp32"), manifest.target)
    ids = np.random.default_rng(2).integers(3, 320, size=40)
    ours = engine.run(ids[:33], engine.new_cache(64))
    with torch.no_grad():
        expected = transformers_model(path)(input_ids=torch.from_numpy(ids[:33])[None]).logits[0].numpy()
    np.testing.assert_allclose(ours, expected, atol=2e-3 * max(1.0, np.abs(expected).max()))
    generator = specdeploy.load(bundle, exact=True)
    prompt = [int(i) for i in ids[:12]]
    alone = generator.generate(prompt, max_new_tokens=20, speculative=False)
    assert generator.generate(prompt, max_new_tokens=20, num_draft_tokens=3).token_ids == alone.token_ids


def test_other_quantizations_of_a_gguf_still_work(tmp_path):
    """--quantize none dequantizes one tensor at a time into an fp32 graph; int8 rounds that; gguf on a folder is
    refused in one line."""
    from specdeploy.errors import SpecdeployError
    from specdeploy.export import ExportConfig, export_bundle

    path = write_quantized_gguf(tmp_path / "q.gguf", "llama", {"attn_q": "Q4_K", "ffn_down": "Q6_K"})
    manifest = export_bundle(ExportConfig(target=str(path), draft=str(path), out=str(tmp_path / "none"),
                                          quantize="none", draft_quantize="int8"))
    assert (manifest.target.quantize, manifest.draft.quantize) == ("none", "int8")
    assert manifest.target.gguf is None and manifest.target.parity.check == "max_abs_diff"
    assert manifest.export_options["quantize"] == "none"
    folder = tmp_path / "folder"
    transformers_model(path).save_pretrained(folder)
    with pytest.raises(SpecdeployError, match=r"--quantize gguf keeps a \.gguf file's own blocks; the target"):
        export_bundle(ExportConfig(target=str(folder), draft=str(path), out=str(tmp_path / "x"), quantize="gguf"))
    assert not (tmp_path / "x").exists()


def test_a_float_gguf_exports_as_fp32(tmp_path):
    """Nothing quantized to keep: the default export of an F32 file is an fp32 bundle, named so."""
    from specdeploy.export import ExportConfig, export_bundle

    path = write_quantized_gguf(tmp_path / "f.gguf", "qwen2", {})
    manifest = export_bundle(ExportConfig(target=str(path), draft=str(path), out=str(tmp_path / "b")))
    assert manifest.target.quantize == "none" and manifest.target.parity.check == "max_abs_diff"
    assert manifest.target.gguf.kept == {} and manifest.draft.quantize == "none"
    assert json.loads((tmp_path / "b" / "specdeploy.json").read_text())["target"]["gguf"]["file"] == "f.gguf"
