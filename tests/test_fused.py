"""The fused graph (GroupQueryAttention over an in-place KV buffer) against PyTorch and against optimum's graph."""

import stat

import numpy as np
import onnx
import pytest

from specdeploy.bundle import load_manifest
from specdeploy.errors import SpecdeployError
from specdeploy.export import ExportConfig, export_bundle
from specdeploy.runtime.engine import OrtEngine
from specdeploy.runtime.loader import load

from conftest import VOCAB, export_pair


def test_fused_and_optimum_layouts_are_chosen_and_recorded(bundles):
    manifest = load_manifest(bundles("llama"))
    target, draft = manifest.target, manifest.draft
    # The target (head_dim 16) takes the fused graph; the draft (head_dim 8) is too small for its rotary kernel.
    assert (target.graph, target.kv_cache.shared_buffer) == ("fused", True)
    assert (draft.graph, draft.kv_cache.shared_buffer) == ("optimum", False)
    assert "position_ids" not in target.input_names and "position_ids" in draft.input_names
    ops = {n.op_type for n in onnx.load(bundles("llama") / target.onnx_path, load_external_data=False).graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops and "Concat" not in ops
    gpt2 = load_manifest(bundles("gpt2"))
    assert gpt2.target.graph == gpt2.draft.graph == "optimum"
    # Weights live beside the graph, readable by others (a bundle is deployed, not private).
    for spec in (target, draft):
        data = bundles("llama") / (spec.onnx_path + ".data")
        assert data.is_file() and data.stat().st_mode & stat.S_IROTH
        assert spec.onnx_path + ".data" in {f.path for f in spec.files}


def test_fused_graph_equals_optimum_graph(checkpoints, bundles, tmp_path):
    """The same checkpoint through both graphs: the same logits, prefill, verify and after a rollback."""
    pair = checkpoints("qwen2")  # q/k/v biases
    out = tmp_path / "optimum"
    export_pair(pair, out, graph="optimum")
    concat = load_manifest(out).target
    fused = load_manifest(bundles("qwen2")).target
    assert not concat.kv_cache.shared_buffer and fused.kv_cache.shared_buffer
    engines = [OrtEngine(out / concat.onnx_path, concat), OrtEngine(bundles("qwen2") / fused.onnx_path, fused)]
    caches = [e.new_cache(64) for e in engines]
    ids = np.random.default_rng(3).integers(2, VOCAB, size=30)
    steps = [ids[:17], ids[17:22], ids[22:23]]
    for piece in steps:
        a, b = (e.run(piece, c) for e, c in zip(engines, caches))
        np.testing.assert_allclose(a, b, atol=1e-4)
    for cache in caches:
        cache.truncate(19)  # reject the last positions; the fused cache only lowers its length
    a, b = (e.run(ids[19:25], c) for e, c in zip(engines, caches))
    np.testing.assert_allclose(a, b, atol=1e-4)
    assert caches[1].length == caches[0].length == 25


def test_tied_embeddings_share_one_table(tokenizer_dir, tmp_path):
    """A tied lm_head reads the embedding table transposed (FusedMatMul) instead of storing it twice; the
    rotary tables come from the model's own module, scaling included; q/k/v/o and MLP biases."""
    import transformers as tf

    from conftest import BOS, EOS

    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                            tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0},
                            attention_bias=True, mlp_bias=True, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS,
                            initializer_range=0.2)
    folder = tmp_path / "tied"
    import torch

    torch.manual_seed(5)
    model = tf.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    out = tmp_path / "bundle"
    manifest = export_bundle(ExportConfig(target=str(folder), draft=str(folder), out=str(out), graph="fused",
                                          draft_quantize="none"))
    spec = manifest.target
    assert spec.graph == "fused" and spec.parity.passed and spec.parity.verify_max_abs_diff < 1e-3
    graph = onnx.load(out / spec.onnx_path, load_external_data=False).graph
    assert "lm_head.weight" not in {i.name for i in graph.initializer}
    assert any(n.op_type == "FusedMatMul" for n in graph.node)
    generator = load(out, drafter="model")
    prompt = "def bisect(a, x):"
    expected = generator.generate(prompt, max_new_tokens=20, speculative=False).token_ids
    assert generator.generate(prompt, max_new_tokens=20, num_draft_tokens=3).token_ids == expected


def test_graph_option_errors(checkpoints, tmp_path):
    gpt2 = checkpoints("gpt2")
    with pytest.raises(SpecdeployError, match="--graph fused cannot export the target: GPT2LMHeadModel"):
        export_pair(gpt2, tmp_path / "a", graph="fused")
    llama = checkpoints("llama")
    with pytest.raises(SpecdeployError, match="--graph fused cannot export the draft: head_dim 8"):
        export_pair(llama, tmp_path / "b", graph="fused")
    with pytest.raises(SpecdeployError, match="unknown --graph 'static'"):
        export_pair(llama, tmp_path / "c", graph="static")
    assert not any(tmp_path.iterdir())


def test_sliding_window_and_rope_scaling_fall_back(tokenizer_dir, tmp_path):
    """What the fused graph cannot express exactly goes through optimum instead (auto), with the reason."""
    import transformers as tf

    from specdeploy.export import fused

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    windowed = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=32, **base))
    assert "sliding window 32" in fused.unsupported_reason(windowed, 256)
    assert fused.unsupported_reason(tf.MistralForCausalLM(tf.MistralConfig(sliding_window=4096, **base)), 256) is None
    dynamic = tf.LlamaForCausalLM(tf.LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, **base))
    assert "rope scaling 'dynamic'" in fused.unsupported_reason(dynamic, 256)
    linear = tf.LlamaForCausalLM(tf.LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}, **base))
    assert fused.unsupported_reason(linear, 256) is None


def test_checkpoint_code_and_short_contexts(checkpoints, tmp_path):
    """A class from the checkpoint's own code goes through optimum; a context shorter than the parity
    check still exports (the check shrinks to fit)."""
    import transformers as tf

    from specdeploy.export import fused

    class LlamaForCausalLM(tf.LlamaForCausalLM):  # as remote code would define it
        pass

    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2)
    assert "checkpoint's own code" in fused.unsupported_reason(LlamaForCausalLM(config), 256)
    manifest = export_pair(checkpoints("llama"), tmp_path / "short", max_context=16)
    assert manifest.target.graph == "fused" and manifest.target.parity.passed
    assert manifest.target.parity.prefill_tokens + manifest.target.parity.verify_tokens <= 16


def test_draft_window_keeps_output_exact(checkpoints, tmp_path):
    """A windowed draft proposes from the last N tokens only; the target still decides every token."""
    from conftest import build_checkpoint

    pair = checkpoints("llama")
    draft = build_checkpoint(tmp_path / "draft", "llama", 0, 0, seed=7, tokenizer_dir=pair["target"],
                             noisy_copy_of=pair["target"], noise=0.1)  # head_dim 16: fused
    out = tmp_path / "windowed"
    manifest = export_pair({"target": pair["target"], "draft": draft}, out, draft_window=64, draft_quantize="none")
    assert manifest.draft.attention_window == 64 and manifest.target.attention_window is None
    assert manifest.draft.parity.passed and manifest.draft.parity.verify_max_abs_diff < 1e-3  # window > check
    import torch
    from transformers import AutoModelForCausalLM

    ids = np.random.default_rng(8).integers(2, VOCAB, size=150)
    engine = OrtEngine(out / manifest.draft.onnx_path, manifest.draft)
    windowed = engine.run(ids, engine.new_cache(256))
    with torch.no_grad():
        full = AutoModelForCausalLM.from_pretrained(draft).eval()(torch.from_numpy(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(windowed[:64], full[:64], atol=1e-4)  # inside the window: the model itself
    assert np.abs(windowed[64:] - full[64:]).max() > 1e-3  # a query sees its last 64 positions, itself included
    cache = engine.new_cache(256)  # the same window whether positions come in one pass, chunks or one by one
    engine.run(ids[:90], cache)
    stepped = np.stack([engine.run(ids[i : i + 1], cache)[0] for i in range(90, 100)])
    np.testing.assert_allclose(np.concatenate([stepped, engine.run(ids[100:], cache)]), windowed[90:], atol=1e-4)
    generator = load(out, drafter="model")
    prompt = list(range(5, 205))  # 200 tokens: far past the window
    expected = generator.generate(prompt, max_new_tokens=40, speculative=False).token_ids
    out_ids = generator.generate(prompt, max_new_tokens=40, num_draft_tokens=4)
    assert out_ids.token_ids == expected and out_ids.stats.accepted > 0
    with pytest.raises(SpecdeployError, match="--draft-window must be at least 64"):
        export_pair(pair, tmp_path / "a", draft_window=16)
    with pytest.raises(SpecdeployError, match="--draft-window needs the fused graph for the draft.*head_dim 8"):
        export_pair(pair, tmp_path / "b", draft_window=128)


def test_partial_rotary_phi3(tokenizer_dir, tmp_path):
    """Phi-3 with rotary on half of each head (GroupQueryAttention rotates the first rotary_dim dims)."""
    import torch
    import transformers as tf

    from conftest import BOS, EOS

    config = tf.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                           original_max_position_embeddings=128, partial_rotary_factor=0.5, tie_word_embeddings=False,
                           bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS, initializer_range=0.2)
    from specdeploy.export import fused

    folder = tmp_path / "phi3"
    torch.manual_seed(9)
    model = tf.Phi3ForCausalLM(config)
    assert fused.rotary_tables(model, 4)[0].shape == (4, 8)  # rotary on 16 of 32 dims
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    manifest = export_pair({"target": folder, "draft": folder}, tmp_path / "bundle", graph="fused", draft_quantize="none")
    assert manifest.target.graph == "fused" and manifest.target.parity.verify_max_abs_diff < 1e-3
