"""Gemma 3 through the fused graph: per-layer sliding windows, two rotary tables, q/k norms, (1 + w)
norms, the scaled embedding and a softcapped tied head, against transformers' own model."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from specdeploy.bundle import file_entry
from specdeploy.export import ExportConfig, export_bundle, fused
from specdeploy.export.sources import TorchWeights
from specdeploy.runtime.engine import OrtEngine
from specdeploy.runtime.loader import load

from conftest import BOS, EOS, VOCAB

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def gemma3_config(**overrides):
    import transformers as tf

    options = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                   layer_types=LAYER_TYPES, max_position_embeddings=128, rope_theta=10_000.0, rope_local_base_freq=500.0,
                   rope_scaling={"rope_type": "linear", "factor": 2.0}, final_logit_softcapping=6.0,
                   tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS,
                   initializer_range=0.2)
    return tf.Gemma3TextConfig(**{**options, **overrides})


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tokenizer_dir):
    """A random tiny Gemma 3 and its fp32 bundle. Norm weights are random too (the folded 1 is tested), the
    post-attention and post-feedforward ones large: with a tied head, a random model whose residual stream
    is mostly the token's own embedding predicts that token again and again."""
    import torch
    import transformers as tf

    root = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(4)
    model = tf.Gemma3ForCausalLM(gemma3_config()).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(3.0 if ".post_" in name else 0.0, 0.3)
    model.generation_config = tf.GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS)
    folder = root / "checkpoint"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    out = root / "bundle"
    manifest = export_bundle(ExportConfig(target=str(folder), draft=str(folder), out=str(out), graph="auto",
                                          draft_quantize="none"))
    return model, out, manifest


def reference(model, ids: np.ndarray) -> np.ndarray:
    """transformers' logits [len(ids), vocab] of one no-cache pass."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)[None]).logits[0].float().numpy()


def test_gemma3_takes_the_fused_graph(gemma3):
    model, out, manifest = gemma3
    spec = manifest.target
    assert (spec.graph, spec.kv_cache.shared_buffer, spec.model_type) == ("fused", True, "gemma3_text")
    assert spec.parity.passed and spec.parity.prefill_tokens > WINDOW  # the check reaches past the window
    graph = onnx.load(out / spec.onnx_path, load_external_data=False).graph
    windows = [next(a.i for a in n.attribute if a.name == "local_window_size")
               for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert windows == [WINDOW if kind == "sliding_attention" else -1 for kind in LAYER_TYPES]
    caches = {n.input[7] for n in graph.node if n.op_type == "GroupQueryAttention"}
    assert caches == {"cos_cache", "cos_cache_local"}
    names = {i.name for i in graph.initializer}
    assert "lm_head.weight" not in names and "embed_tokens.weight" in names  # the tied table stored once
    ops = [n.op_type for n in graph.node]
    assert ops.count("FastGelu") == 4 and "Tanh" in ops and ops.count("Reshape") == 4 * 4


def test_gemma3_logits_equal_pytorch_past_the_window(gemma3):
    """Prefill longer than the window, decode steps, a k + 1 verify, a rollback: every logit as transformers'."""
    model, out, manifest = gemma3
    spec = manifest.target
    engine = OrtEngine(out / spec.onnx_path, spec)
    ids = np.random.default_rng(3).integers(2, VOCAB, size=60)
    expected = reference(model, ids)
    cache = engine.new_cache(128)
    got = [engine.run(ids[:20], cache)]  # prefill: 20 > WINDOW
    got += [engine.run(ids[i : i + 1], cache) for i in range(20, 24)]  # decode steps past the window
    got.append(engine.run(ids[24:29], cache))  # verify k + 1 = 5 on a past of 24
    np.testing.assert_allclose(np.concatenate(got), expected[:29], atol=1e-3, rtol=0)
    cache.truncate(26)  # reject three: the sliding layers must not see the rejected keys
    np.testing.assert_allclose(engine.run(ids[26:31], cache), expected[26:31], atol=1e-3, rtol=0)
    np.testing.assert_allclose(engine.run(ids[31:60], cache), expected[31:60], atol=1e-3, rtol=0)
    assert cache.length == 60


def test_gemma3_window_is_the_transformers_window(gemma3):
    """A query sees WINDOW positions, itself included: one position fewer or more changes the logits.
    The graph is rebuilt with the window off by one either way; each then disagrees right where it should."""
    import dataclasses

    model, out, manifest = gemma3
    ids = np.random.default_rng(5).integers(2, VOCAB, size=3 * WINDOW)
    expected = reference(model, ids)
    for window in (WINDOW - 1, WINDOW + 1):
        model.config.sliding_window = window
        try:
            fused.build_fused(TorchWeights(model), out.parent / "shifted.onnx", manifest.max_context)
        finally:
            model.config.sliding_window = WINDOW
        files = tuple(file_entry(out.parent, out.parent / name) for name in ("shifted.onnx", "shifted.onnx.data"))
        shifted = dataclasses.replace(manifest.target, onnx_path="shifted.onnx", files=files)
        engine = OrtEngine(out.parent / "shifted.onnx", shifted)
        diff = np.abs(engine.run(ids, engine.new_cache(64)) - expected).max(-1)  # [positions]
        first = min(window, WINDOW)  # the first query with more than that many positions behind it, itself included
        assert diff[:first].max() < 1e-3 and diff[first] > 1e-2


def test_gemma3_greedy_equals_transformers_generate(gemma3):
    import torch

    model, out, manifest = gemma3
    prompt = [int(i) for i in np.random.default_rng(6).integers(2, VOCAB, size=12)]
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
    generator = load(out, drafter="model")
    plain = generator.generate(prompt, max_new_tokens=30, speculative=False)
    speculative = generator.generate(prompt, max_new_tokens=30, num_draft_tokens=3)
    assert len(hf) > 2 * WINDOW  # the prompt and the output reach past the window
    assert plain.token_ids == hf == speculative.token_ids
    assert speculative.stats.accepted > 0


def test_gemma3_unsupported_settings(tmp_path):
    import transformers as tf

    assert fused.unsupported_reason(tf.Gemma3ForCausalLM(gemma3_config()), 4096) is None  # window < context is fine
    softcapped = tf.Gemma3ForCausalLM(gemma3_config(attn_logit_softcapping=50.0))
    assert "attn_logit_softcapping" in fused.unsupported_reason(softcapped, 128)
    gelu = tf.Gemma3ForCausalLM(gemma3_config(hidden_activation="gelu"))
    assert "activation gelu" in fused.unsupported_reason(gelu, 128)
    dynamic = tf.Gemma3ForCausalLM(gemma3_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert "rope scaling 'dynamic'" in fused.unsupported_reason(dynamic, 128)


def test_gemma3_under_onnxruntime_genai(gemma3):
    """genai 0.18 runs the bundle (speculative and target-only) with the runtime's greedy tokens. Its config
    has no sliding_window block: the graph masks the sliding layers over full-context caches itself."""
    model, out, manifest = gemma3
    assert manifest.genai.unsupported is None
    config = json.loads((out / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert config["model"]["type"] == "gemma3_text" and "sliding_window" not in decoder
    assert decoder["head_size"] == 16 and decoder["num_key_value_heads"] == 2
    assert config["search"]["past_present_share_buffer"] is True
    og = pytest.importorskip("onnxruntime_genai")
    generator = load(out, drafter="model")
    prompt = [int(i) for i in np.random.default_rng(7).integers(2, VOCAB, size=12)]
    ours = generator.generate(prompt, max_new_tokens=30, speculative=False).token_ids
    ours = ours[:-1] if ours[-1] == EOS else ours  # genai leaves the end-of-sequence token out
    assert len(ours) > 2 * WINDOW
    for folder in (out, out / manifest.genai.target_only):
        genai_model = og.Model(str(folder))
        params = og.GeneratorParams(genai_model)
        params.set_search_options(max_length=len(prompt) + 30, do_sample=False)
        genai = og.Generator(genai_model, params)
        genai.append_tokens(prompt)
        while not genai.is_done():
            genai.generate_next_token()
        assert [int(t) for t in genai.get_sequence(0)][len(prompt):] == ours, folder


def test_an_eagle_head_for_gemma3_round_trips(gemma3, tmp_path):
    """distill --kind eagle on a Gemma 3 target (its decoder stack is `model`, its embedding scaled, its final
    norm offset by 1, its head tied and softcapped), export, and greedy output equal to the target alone."""
    import sysconfig

    import specdeploy
    from specdeploy.distill import DistillConfig, distill

    model, out, manifest = gemma3
    checkpoint = Path(manifest.target.source)
    text = tmp_path / "code.py"
    text.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text())
    head = tmp_path / "eagle"
    distill(DistillConfig(target=str(checkpoint), out=str(head), kind="eagle", data=(str(text),), steps=20,
                          draft_vocab=192, seq_len=32, batch_size=2, heldout_tokens=64, generate_tokens=0, eval_every=20,
                          minutes=None, threads=1))
    bundle = tmp_path / "bundle"
    exported = export_bundle(ExportConfig(target=str(checkpoint), draft=str(head), out=str(bundle), draft_quantize="none"))
    assert exported.draft.kind == "eagle" and exported.draft.parity.passed
    assert exported.draft.parity.check == "max_abs_diff"
    generator = specdeploy.load(bundle, drafter="model")
    for prompt in ("def f(x):", "import os\n"):
        ids = generator.codec.encode(prompt)
        alone = generator.generate(ids, max_new_tokens=24, speculative=False)
        spec = generator.generate(ids, max_new_tokens=24, num_draft_tokens=3)
        assert spec.token_ids == alone.token_ids and spec.stats.drafted > 0


def test_gemma3_verify_rows_share_one_pass_bit_for_bit(gemma3):
    """Its sliding-window and global attention nodes split by rows as any (runtime/packed.py)."""
    from test_packed import check_packed_pass

    check_packed_pass(gemma3[1], {0: [5, 6, 7], 2: [9 + i % 40 for i in range(20)], 3: [8, 8]})
