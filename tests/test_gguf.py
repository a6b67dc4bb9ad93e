"""GGUF checkpoints in: tiny .gguf files written here with gguf's GGUFWriter, exported, compared with transformers."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from specdeploy.errors import SpecdeployError

pytest.importorskip("gguf")

CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]  # ids 0..5
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                  "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 2, 4, 2


def _bpe(specials: list[str], vocab_size: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE trained on a slice of the standard library: its tokens (by id) and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [(stdlib / name).read_text() for name in ("textwrap.py", "bisect.py")]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    data = json.loads(tokenizer.to_str())
    tokens = [""] * len(data["model"]["vocab"])
    for token, index in data["model"]["vocab"].items():
        tokens[index] = token
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    return tokens, merges


def _write_tensors(writer, model, arch) -> None:
    import gguf

    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.numpy().astype(np.float32))


def write_llama_header(writer, vocab_size: int) -> None:
    """A tiny Llama's hyperparameters and a gpt2 (byte-level BPE) tokenizer of vocab_size tokens."""
    _write_shape(writer)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(vocab_size)
    writer.add_tokenizer_model("gpt2")


def _write_shape(writer) -> None:
    """The hyperparameters both tiny layouts share."""
    writer.add_context_length(256)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(2 * HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)


def write_llama_gguf(path: Path, *, add_bos: bool = False, eos: int = 2, seed: int = 0, eot: int | None = None,
                     eom: int | None = None) -> Path:
    """A Llama layout as llama.cpp writes SmolLM2: a GPT-2 BPE, ChatML, no BOS prepended, EOS <|im_end|>."""
    import gguf
    import torch
    import transformers as tf

    tokens, merges = _bpe(CHATML, 320)
    config = tf.LlamaConfig(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                            max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    write_llama_header(writer, len(tokens))
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in CHATML else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos)
    if eot is not None:
        writer.add_eot_token_id(eot)
    if eom is not None:
        writer.add_eom_token_id(eom)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML_TEMPLATE)
    _write_tensors(writer, model, gguf.MODEL_ARCH.LLAMA)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gemma3_gguf(path: Path, vocab: tuple[list[str], list[float], list[int]] | None = None) -> Path:
    """A Gemma 3 layout: <eos> is the GGUF's EOS, and the template ends a turn with <end_of_turn>. Its vocabulary:
    `vocab` (tokens, scores, types), else a byte-level BPE's tokens scored by merge order."""
    import gguf
    import torch
    import transformers as tf

    tokens, merges = _bpe(GEMMA, 300) if vocab is None else (vocab[0], None)
    head_dim = 16
    config = tf.Gemma3TextConfig(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                 head_dim=head_dim, max_position_embeddings=256, sliding_window=32)
    torch.manual_seed(3)
    model = tf.Gemma3ForCausalLM(config)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny-gemma3")
    _write_shape(writer)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(32)
    writer.add_tokenizer_model("llama")  # Gemma's tokenizers are SentencePiece: transformers builds a Unigram
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))] if vocab is None else vocab[1])
    writer.add_token_types([gguf.TokenType.CONTROL if t in GEMMA else gguf.TokenType.NORMAL for t in tokens]
                           if vocab is None else vocab[2])
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_add_space_prefix(False)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_chat_template(GEMMA_TEMPLATE)
    _write_tensors(writer, model, gguf.MODEL_ARCH.GEMMA3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q0.gguf")


@pytest.fixture(scope="module")
def llama_bundle(tmp_path_factory, llama_gguf):
    from specdeploy.export import ExportConfig, export_bundle

    out = tmp_path_factory.mktemp("gguf-bundle") / "bundle"
    lines = []
    manifest = export_bundle(ExportConfig(target=str(llama_gguf), draft=str(llama_gguf), out=str(out),
                                          draft_quantize="none"), report=lambda stage, detail: lines.append(detail))
    return out, manifest, lines


def test_gguf_export_greedy_equals_transformers(llama_gguf, llama_bundle):
    import torch
    from transformers import AutoModelForCausalLM

    import specdeploy

    out, manifest, _ = llama_bundle
    assert manifest.target.source == str(llama_gguf) == manifest.draft.source
    assert manifest.target.parity.passed and manifest.draft.parity.passed
    model = AutoModelForCausalLM.from_pretrained(llama_gguf.parent, gguf_file=llama_gguf.name, dtype=torch.float32)
    generator = specdeploy.load(out)
    for seed in range(3):
        prompt = [int(i) for i in np.random.default_rng(seed).integers(3, 320, size=10)]
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=2,
                                pad_token_id=0)[0, len(prompt):].tolist()
        plain = generator.generate(prompt, max_new_tokens=24, speculative=False)
        speculative = generator.generate(prompt, max_new_tokens=24, num_draft_tokens=3)
        assert plain.token_ids == speculative.token_ids
        assert hf[: len(plain.token_ids)] == plain.token_ids
        assert len(plain.token_ids) == 24 or hf[len(plain.token_ids)] == 2  # stopped where transformers stopped


def test_gguf_special_tokens_come_from_its_metadata(llama_bundle):
    from tokenizers import Tokenizer

    out, manifest, lines = llama_bundle
    for spec in (manifest.target, manifest.draft, manifest.tokenizer):
        # <|im_end|>, then <|endoftext|>: llama.cpp ends at both
        assert spec.bos_token_id == 1 and spec.eos_token_ids == (2, 0) and spec.pad_token_id == 0
    # transformers' conversion says BOS = EOS = <|im_start|> and prepends it; the GGUF says neither
    tokenizer = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    assert tokenizer.encode("def f", add_special_tokens=True).ids == tokenizer.encode("def f", add_special_tokens=False).ids
    config = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False and config["eos_token"] == "<|im_end|>" and config["bos_token"] == "<|im_start|>"
    repairs = manifest.export_options["special_token_repairs"]["target"]
    assert any(line.startswith("target: eos '<|im_end|>' (2) from GGUF tokenizer.ggml.eos_token_id")
               and "'<|im_start|>' (1)" in line for line in repairs)
    assert any("add_bos_token False from GGUF tokenizer.ggml.add_bos_token" in line for line in repairs)
    assert all(any(repair.startswith(line.split(", over ")[0]) for line in lines) for repair in repairs)  # each was reported
    assert "<|im_end|>" in (out / "tokenizer" / "chat_template.jinja").read_text()


def test_gguf_that_prepends_bos_keeps_it(tmp_path):
    from specdeploy.export import checkpoint as ckpt
    from specdeploy.export.special_tokens import check_special_tokens
    from tokenizers import Tokenizer

    path = write_llama_gguf(tmp_path / "bos.gguf", add_bos=True, seed=1)
    work = tmp_path / "work"
    work.mkdir()
    checkpoint = ckpt.load_checkpoint(str(path), "target", work_dir=work)
    checked = check_special_tokens(checkpoint, ckpt.load_tokenizer_json(checkpoint, work), work, lambda *a: None)
    assert checked.checkpoint.bos_token_id == 1 and checked.checkpoint.eos_token_ids == (2, 0)
    tokenizer = Tokenizer.from_file(str(checked.tokenizer_dir / "tokenizer.json"))
    assert tokenizer.encode("x", add_special_tokens=True).ids[0] == 1
    assert not any("add_bos_token" in line for line in checked.repairs)


def test_gguf_end_of_turn_and_message_tokens_stop_as_eos_does(tmp_path):
    """Llama 3 style metadata: tokenizer.ggml.eot_token_id and eom_token_id end generation beside the EOS,
    as llama.cpp ends it."""
    from specdeploy.export import checkpoint as ckpt

    path = write_llama_gguf(tmp_path / "eot.gguf", eos=0, eot=2, eom=1, seed=3)
    work = tmp_path / "work"
    work.mkdir()
    checkpoint = ckpt.load_checkpoint(str(path), "target", work_dir=work)
    assert checkpoint.eos_token_ids == (0, 2, 1)
    assert json.loads((checkpoint.path / "config.json").read_text())["eos_token_id"] == 0


def test_gemma3_gguf_converts_with_its_metadata(tmp_path):
    from specdeploy.export import checkpoint as ckpt
    from specdeploy.export.special_tokens import check_special_tokens
    from tokenizers import Tokenizer

    path = write_gemma3_gguf(tmp_path / "gemma.gguf")
    work = tmp_path / "work"
    work.mkdir()
    checkpoint = ckpt.load_checkpoint(str(path), "target", work_dir=work)
    assert checkpoint.config.model_type == "gemma3_text" and checkpoint.source == str(path)
    config = json.loads((checkpoint.path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)
    lines = []
    checked = check_special_tokens(checkpoint, ckpt.load_tokenizer_json(checkpoint, work), work,
                                   lambda stage, detail: lines.append(detail))
    assert checked.checkpoint.bos_token_id == 2 and checked.checkpoint.pad_token_id == 0
    assert checked.checkpoint.eos_token_ids == (1, 5)  # <eos>, then <end_of_turn>: the GGUF's own, as llama.cpp reads it
    assert not any("'<end_of_turn>'" in line for line in lines)  # so no repair adds it
    assert list(checked.repairs) == lines
    tokenizer = Tokenizer.from_file(str(checked.tokenizer_dir / "tokenizer.json"))
    assert tokenizer.encode("x", add_special_tokens=True).ids[0] == 2


def test_one_gguf_as_target_and_draft_is_read_and_converted_once(tmp_path, monkeypatch):
    """Each read of a GGUF parses every token of its vocabulary: the draft reuses the target's folder and metadata."""
    from gguf import GGUFReader, TokenType

    from specdeploy.export import checkpoint as ckpt
    from specdeploy.export import gguf

    reads = []
    monkeypatch.setattr(gguf, "read_tokens", lambda path, role, read=gguf.read_tokens: reads.append(role) or read(path, role))
    path = write_gemma3_gguf(tmp_path / "gemma.gguf")
    work = tmp_path / "work"
    work.mkdir()
    target = ckpt.load_checkpoint(str(path), "target", work_dir=work)
    draft = ckpt.load_checkpoint(str(path), "draft", work_dir=work)
    assert reads == ["target"]
    assert draft.path == target.path and draft.gguf_tokens == target.gguf_tokens
    # The control tokens come from that one read: every CONTROL-typed token of the file, in its order.
    reader = GGUFReader(str(path))
    types = reader.get_field("tokenizer.ggml.token_type").contents()
    control = [t for t, kind in zip(reader.get_field("tokenizer.ggml.tokens").contents(), types)
               if kind == TokenType.CONTROL]
    assert list(target.gguf_tokens.control_tokens) == control and "<end_of_turn>" in control
    # The config is the loaded model's: it names the model class (the manifest's architecture).
    assert json.loads((target.path / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]


def test_bad_gguf_is_one_error_line(tmp_path, checkpoints):
    from specdeploy.export import checkpoint as ckpt

    work = tmp_path / "work"
    work.mkdir()
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(SpecdeployError, match=r"fake.gguf: not a GGUF file"):
        ckpt.load_checkpoint(str(fake), "target", work_dir=work)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(SpecdeployError, match=r"truncated.gguf: cannot read the GGUF file"):
        ckpt.load_checkpoint(str(truncated), "target", work_dir=work)
    import gguf

    other = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(other), "rwkv6")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SpecdeployError, match=r"does not read the architecture 'rwkv6'"):
        ckpt.load_checkpoint(str(other), "target", work_dir=work)


def test_cli_export_from_gguf_reports_errors_in_one_line(tmp_path, checkpoints):
    import subprocess
    import sys

    fake = tmp_path / "model.gguf"
    fake.write_text("hello")
    result = subprocess.run([sys.executable, "-m", "specdeploy", "export", "--target", str(fake), "--draft",
                             str(checkpoints("llama")["draft"]), "--out", str(tmp_path / "b")],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: --target {fake}: not a GGUF file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]  # no partial bundle left behind


def write_qwen3moe_gguf(path: Path):
    """A Qwen3-MoE layout as llama.cpp writes it: architecture 'qwen3moe', the experts stacked per layer."""
    import gguf
    import torch
    import transformers as tf

    tokens, merges = _bpe(CHATML, 320)
    # transformers' GGUF loader leaves moe_intermediate_size at its default (768)
    config = tf.Qwen3MoeConfig(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                               moe_intermediate_size=768, num_experts=4, num_experts_per_tok=2,
                               num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                               head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = tf.Qwen3MoeForCausalLM(config)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name("tiny-qwen3moe")
    _write_shape(writer)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(768)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in CHATML else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, LAYERS)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, tensor in model.state_dict().items():
        if ".mlp.experts." in name:  # model.layers.{i}.mlp.experts.{e}.{proj}.weight
            layer, _, _, index, proj, _ = name.split(".")[2:]
            experts.setdefault((layer, proj), {})[int(index)] = tensor.numpy()
            continue
        base, suffix = name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.numpy().astype(np.float32))
    for (layer, proj), by_index in experts.items():
        stacked = np.stack([by_index[i] for i in sorted(by_index)]).astype(np.float32)
        writer.add_tensor(f"{names.get_name(f'model.layers.{layer}.mlp.experts.{proj}')}.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_qwen3_moe_gguf_is_read_as_transformers_reads_it(tmp_path):
    """llama.cpp names Qwen3-MoE 'qwen3moe'; transformers' GGUF loader reads it (as qwen3_moe), and optimum
    exports qwen3_moe: the architecture check must not refuse it."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdeploy.export import checkpoint as ckpt

    path = write_qwen3moe_gguf(tmp_path / "moe.gguf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    assert model.config.model_type == "qwen3_moe"  # transformers reads the file
    work = tmp_path / "work"
    work.mkdir()
    checkpoint = ckpt.load_checkpoint(str(path), "target", work_dir=work)
    assert checkpoint.config.model_type == "qwen3_moe" and checkpoint.eos_token_ids == (2, 0)


def test_gguf_conversion_prints_no_progress_bar(tmp_path, capfd):
    """gguf_to_folder turns transformers' dequantization bar off (it would cut through the CLI's progress lines);
    transformers draws that bar with tqdm.auto directly, which its disable_progress_bar does not reach."""
    from specdeploy.export import gguf

    path = write_llama_gguf(tmp_path / "bar.gguf", seed=2)
    work = tmp_path / "work"
    work.mkdir()
    capfd.readouterr()
    gguf.gguf_to_folder(path, "target", work)
    assert "de-quantizing" not in capfd.readouterr().err
