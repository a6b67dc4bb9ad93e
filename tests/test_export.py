"""The export stage: every architecture end to end, parity, dtypes, atomic writes, and every bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from specdeploy.bundle import load_manifest
from specdeploy.cli import main
from specdeploy.export import ExportConfig, export_bundle
from specdeploy.runtime.engine import OrtEngine

from conftest import ARCHITECTURES, VOCAB, build_checkpoint, export_pair


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_exports_with_parity(bundles, arch):
    bundle = bundles(arch)
    manifest = load_manifest(bundle, verify=True)
    genai_root_files = {entry.path for entry in manifest.genai.files if "/" not in entry.path}  # genai_config.json
    assert {p.name for p in bundle.iterdir()} == {"specdeploy.json", "target", "draft", "tokenizer", "accept", *genai_root_files}
    # An fp32 export quantizes the draft to int8 (--draft-quantize auto): its check is then greedy agreement.
    assert manifest.target.quantize == "none" and manifest.draft.quantize in ("int8", "none")
    assert manifest.export_options["draft_quantize"] == "auto"
    for spec in (manifest.target, manifest.draft):
        assert spec.parity.passed
        if spec.quantize == "none":
            assert spec.parity.check == "max_abs_diff"
            assert spec.parity.prefill_max_abs_diff < 1e-3 and spec.parity.verify_max_abs_diff < 1e-3
        else:
            assert spec.parity.check == "greedy_agreement" and spec.parity.tolerance == 0.8
        assert spec.vocab_size == VOCAB and spec.dtype == "fp32"
        names = spec.input_names
        assert names[0] == "input_ids" and "attention_mask" in names
        assert f"past_key_values.{spec.num_layers - 1}.value" in names
        assert spec.num_kv_heads == (4 if arch == "gpt2" else 2)
        # The ONNX file loads in a plain ONNX Runtime session, with the I/O the manifest names.
        session = ort.InferenceSession(str(bundle / spec.onnx_path), providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == list(names)
        assert [o.name for o in session.get_outputs()] == [o.name for o in spec.outputs]
    assert manifest.target.num_layers == 2 and manifest.draft.num_layers == 1
    assert manifest.tokenizer.eos_token_ids == (1,) and manifest.tokenizer.bos_token_id == 0


@pytest.mark.parametrize("arch", ["gpt2", "phi3"])
def test_multi_token_with_past_equals_no_cache_logits(bundles, arch):
    """The verify pass (k + 1 tokens on a past) must give the logits of one pass over the whole sequence."""
    bundle = bundles(arch)
    spec = load_manifest(bundle).target
    engine = OrtEngine(bundle / spec.onnx_path, spec)
    ids = np.random.default_rng(0).integers(2, VOCAB, size=14)
    whole = engine.run(ids, engine.new_cache(64))  # [14, vocab], empty past
    cache = engine.new_cache(64)
    engine.run(ids[:6], cache)
    engine.run(ids[6:9], cache)
    stepped = engine.run(ids[9:], cache)  # 5 tokens on a past of 9
    np.testing.assert_allclose(stepped, whole[9:], atol=1e-4)
    cache.truncate(7)  # rollback, then a different continuation
    np.testing.assert_allclose(engine.run(ids[7:], cache), whole[7:], atol=1e-4)


@pytest.mark.parametrize("dtype, quantize", [("fp16", "none"), ("fp32", "int8"), ("fp32", "int4")])
def test_fp16_and_weight_only_quantization(trained_pair, tmp_path, dtype, quantize):
    pair = trained_pair  # random weights are near-flat: rounding flips their argmax, trained ones hold it
    out = tmp_path / "bundle"
    # A tiny model loses more to int4 rounding than the target's threshold allows: --allow-lossy keeps it.
    lossy = quantize == "int4"
    manifest = export_bundle(ExportConfig(target=str(pair["target"]), draft=str(pair["draft"]), out=str(out),
                                          dtype=dtype, quantize=quantize, allow_lossy=lossy))
    target = manifest.target
    assert target.dtype == dtype and target.quantize == quantize
    assert target.parity.check == "greedy_agreement" and target.parity.prefill_tokens + target.parity.verify_tokens >= 256
    agreement = (target.parity.prefill_tokens * target.parity.prefill_greedy_agreement
                 + target.parity.verify_tokens * target.parity.verify_greedy_agreement) / (
                     target.parity.prefill_tokens + target.parity.verify_tokens)
    assert target.parity.passed == (agreement >= 0.95) and (lossy or target.parity.passed)
    assert manifest.export_options["allow_lossy"] is lossy
    assert np.isfinite(target.parity.verify_max_abs_diff)
    import onnx

    graph = onnx.load(out / target.onnx_path, load_external_data=False).graph
    ops = {node.op_type for node in graph.node}
    if quantize != "none":
        assert "MatMulNBits" in ops
    if dtype == "fp16":
        assert target.kv_cache.dtype == "float16"
    import specdeploy

    generator = specdeploy.load(out, exact=True)
    for prompt in ("def f(x):", "import os\n\n\nclass Config:", "x"):
        expected = generator.generate(prompt, max_new_tokens=40, speculative=False).token_ids
        for k in (2, 4):
            assert generator.generate(prompt, max_new_tokens=40, num_draft_tokens=k).token_ids == expected
    # an exact fp16 or quantized target never takes a single-token pass (the one-row kernels differ by
    # ~5e-3 in fp16, ~3e-2 in int8 compute): decoding step by step gives the bits of one verify pass.
    from specdeploy.runtime.engine import OrtEngine

    engine = OrtEngine(out / target.onnx_path, target, exact=True)
    ids = [5, 9, 13, 40, 41, 42, 60, 61]
    stepped, batch = engine.new_cache(64), engine.new_cache(64)
    engine.prefill(ids[:3], stepped)
    engine.prefill(ids[:3], batch)
    rows = np.stack([engine.logits_after(ids[: i + 1], stepped) for i in range(3, 8)])
    np.testing.assert_array_equal(rows, engine.run(ids[3:8], batch))
    assert engine.min_pass_tokens == 2 and generator.drafter.engine.min_pass_tokens == 1


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _copy_with_config(source: Path, folder: Path, **changes) -> str:
    """A copy of a checkpoint folder with config.json entries replaced."""
    shutil.copytree(source, folder)
    _edit_json(folder / "config.json", lambda config: config.update(changes))
    return str(folder)


def _bad(tmp_path, checkpoints, case):
    pair = checkpoints("llama")
    target, draft = str(pair["target"]), str(pair["draft"])
    extra: list[str] = []
    if case == "missing folder":
        target = str(tmp_path / "nope")
    elif case == "not a folder":
        (tmp_path / "file.txt").write_text("x")
        target = str(tmp_path / "file.txt")
    elif case == "config but no weights":
        folder = tmp_path / "noweights"
        folder.mkdir()
        shutil.copy2(pair["target"] / "config.json", folder / "config.json")
        target = str(folder)
    elif case == "config nested too deeply":
        folder = tmp_path / "deep"
        shutil.copytree(pair["draft"], folder)
        (folder / "config.json").write_text("[" * 100000 + "]" * 100000)
        draft = str(folder)
    elif case == "not a causal LM":
        folder = tmp_path / "bert"
        folder.mkdir()
        from transformers import BertConfig, BertModel

        BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                             vocab_size=VOCAB)).save_pretrained(folder)
        target = str(folder)
    elif case == "unsupported architecture":
        target = _copy_with_config(pair["target"], tmp_path / "custom", model_type="totally_new_arch",
                                   architectures=["TotallyNewForCausalLM"])
    elif case == "remote code without the flag":
        target = _copy_with_config(pair["target"], tmp_path / "remote",
                                   auto_map={"AutoModelForCausalLM": "modeling.MyModel"})
    elif case == "mismatched vocabularies":
        folder = tmp_path / "othervocab"
        shutil.copytree(pair["draft"], folder)

        def swap_two_ids(tokenizer):
            vocab = tokenizer["model"]["vocab"]
            a, b = sorted(vocab, key=vocab.get)[10:12]
            vocab[a], vocab[b] = vocab[b], vocab[a]

        _edit_json(folder / "tokenizer.json", swap_two_ids)
        draft = str(folder)
    elif case == "mismatched vocab sizes":
        draft = str(build_checkpoint(tmp_path / "bigvocab", "llama", 1, 32, 3, pair["target"]))
        _edit_json(Path(draft) / "config.json", lambda config: config.update(vocab_size=VOCAB + 16))
    elif case == "hub id not cached":
        target = "some-org/some-model-that-is-not-cached"
    elif case == "unknown dtype":
        extra = ["--dtype", "fp8"]
    elif case == "unknown quantize":
        extra = ["--quantize", "int3"]
    elif case == "max context too long":
        extra = ["--max-context", "100000"]
    return target, draft, extra


BAD_CASES = {
    "missing folder": "no such folder",
    "not a folder": "not a folder",
    "config but no weights": "no weights",
    "config nested too deeply": "config.json is not valid JSON",
    "not a causal LM": "not a causal language model",
    "unsupported architecture": "cannot",
    "remote code without the flag": "--trust-remote-code",
    "mismatched vocabularies": "tokenizers differ",
    "mismatched vocab sizes": "vocab_size",
    "hub id not cached": "not in the local Hugging Face cache",
    "unknown dtype": "--dtype",
    "unknown quantize": "--quantize",
    "max context too long": "max_position_embeddings",
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_is_one_line_and_writes_nothing(checkpoints, tmp_path, case):
    target, draft, extra = _bad(tmp_path, checkpoints, case)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    # In process (click's runner): a real process adds only its imports, and test_cli_errors runs one.
    result = CliRunner().invoke(main, ["export", "--target", target, "--draft", draft, "--out", str(out_parent / "bundle"), *extra])
    assert result.exit_code == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert BAD_CASES[case] in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert list(out_parent.iterdir()) == []


def test_interrupted_export_leaves_nothing(checkpoints, tmp_path):
    pair = checkpoints("phi3")
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "specdeploy", "export", "--target", str(pair["target"]), "--draft", str(pair["draft"]),
         "--out", str(out_parent / "bundle")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        # A shell running us in the background ignores SIGINT, and children inherit that: restore it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 60
    while time.time() < deadline and not any(out_parent.iterdir()):
        time.sleep(0.02)
    assert any(out_parent.iterdir()), "the export never started writing"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "Traceback" not in stderr
    assert list(out_parent.iterdir()) == []


def test_draft_quantize_options_and_fallback(checkpoints, tmp_path, monkeypatch):
    from specdeploy.errors import SpecdeployError
    from specdeploy.export import convert, quantize

    pair = checkpoints("llama")
    with pytest.raises(SpecdeployError, match="unknown --draft-quantize 'int2'"):
        export_pair(pair, tmp_path / "a", draft_quantize="int2")
    with pytest.raises(SpecdeployError, match="use them with --dtype fp32"):
        export_pair(pair, tmp_path / "a", dtype="fp16", draft_quantize="int4")

    def broken_quantizer(path, bits, block_size=32):
        """A quantizer that wrecks the weights: the draft it leaves cannot pass its parity check."""
        import onnx
        from onnx import numpy_helper

        model = onnx.load(path)
        for tensor in model.graph.initializer:
            array = numpy_helper.to_array(tensor)
            if array.ndim == 2 and array.dtype == np.float32:
                tensor.CopyFrom(numpy_helper.from_array(np.random.default_rng(0).normal(size=array.shape).astype(np.float32) * 5, tensor.name))
        convert.save_model(model, path)

    monkeypatch.setattr(quantize, "quantize_weights", broken_quantizer)
    manifest = export_pair(pair, tmp_path / "b")
    assert manifest.draft.quantize == "none" and manifest.draft.parity.check == "max_abs_diff" and manifest.draft.parity.passed
    assert manifest.target.quantize == "none"

    def failing_quantizer(path, bits, block_size=32):
        raise RuntimeError("this quantizer cannot handle the model")

    monkeypatch.setattr(quantize, "quantize_weights", failing_quantizer)
    for arch, out in (("llama", tmp_path / "d"), ("gpt2", tmp_path / "e")):  # fused and optimum drafts
        manifest = export_pair(checkpoints(arch), out)
        assert manifest.draft.quantize == "none" and manifest.draft.parity.passed
        assert load_manifest(out, verify=True).draft.quantize == "none"
    monkeypatch.setattr(quantize, "quantize_weights", broken_quantizer)
    with pytest.raises(SpecdeployError, match="parity check failed for the draft: greedy agreement"):
        export_pair(pair, tmp_path / "c", draft_quantize="int8")
    assert not (tmp_path / "c").exists()
    # A rounded target that no longer gives its fp32 model's tokens is refused, unless asked to keep it.
    with pytest.raises(SpecdeployError, match=r"the target: greedy agreement with fp32 0\.\d+ < 0\.95 over 256 tokens "
                                              r"\(--allow-lossy keeps it anyway\)"):
        export_pair(pair, tmp_path / "c", quantize="int8", draft_quantize="none")
    assert not (tmp_path / "c").exists()
    manifest = export_pair(pair, tmp_path / "c", quantize="int8", draft_quantize="none", allow_lossy=True)
    assert not manifest.target.parity.passed and manifest.export_options["allow_lossy"] is True
    assert load_manifest(tmp_path / "c").target.quantize == "int8"


def test_parity_lets_onnx_runtime_go_before_the_pytorch_model_loads(checkpoints, bundles, monkeypatch):
    """ONNX Runtime's rows go to a scratch file and its session is dropped before PyTorch's model loads:
    the two copies of the weights are never resident together, and the scratch file is gone after."""
    import gc
    import weakref

    from transformers import AutoConfig

    from specdeploy.export import parity
    from specdeploy.export.convert import load_torch_model

    bundle, pair = bundles("llama"), checkpoints("llama")
    spec = load_manifest(bundle).target
    engines, events = [], []

    def load_model():
        gc.collect()
        events.append(("model", [alive() is not None for alive in engines]))
        return load_torch_model(pair["target"], "target", False)

    class CheckedEngine(OrtEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(weakref.ref(self))
            events.append(("engine", None))

    monkeypatch.setattr(parity, "OrtEngine", CheckedEngine)
    onnx_path = bundle / spec.onnx_path
    before = sorted(p.name for p in onnx_path.parent.iterdir())
    config = AutoConfig.from_pretrained(pair["target"])
    report = parity.check_parity(load_model, onnx_path, spec, bundle / "tokenizer" / "tokenizer.json", config)
    assert events == [("engine", None), ("model", [False])] and report.passed
    assert sorted(p.name for p in onnx_path.parent.iterdir()) == before
    assert report.check == "max_abs_diff" and report.prefill_max_abs_diff <= parity.FP32_MAX_ABS_DIFF
