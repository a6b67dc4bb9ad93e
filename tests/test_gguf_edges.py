"""GGUF files as llama.cpp reads them: files that hold no whole model, and the tokenizer metadata llama.cpp
derives (its add_bos default, its end-of-generation tokens found by their text)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from specdeploy.errors import SpecdeployError

pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_gguf import HEADS, HIDDEN, KV_HEADS, LAYERS, _write_tensors, write_llama_gguf, write_llama_header  # noqa: E402


def _copy_metadata(reader, writer, skip=()) -> None:
    import gguf

    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in skip:
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), field.types[0])


def _tensor(t) -> np.ndarray:
    return np.array(t.data).reshape(list(reversed(t.shape.tolist()))).astype(np.float32)


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _work(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return work


def test_vocab_only_gguf_is_refused(tmp_path):
    """A vocab-only GGUF (llama.cpp's --vocab-only, all metadata and no tensors) has no weights: transformers fills
    every one with random numbers, and the export used to write that random model as the bundle (exit 0)."""
    import gguf

    from specdeploy.export import checkpoint as ckpt

    reader = gguf.GGUFReader(str(write_llama_gguf(tmp_path / "full.gguf")))
    path = tmp_path / "vocab-only.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    _copy_metadata(reader, writer)
    _finish(writer)
    with pytest.raises(SpecdeployError, match="vocab-only.gguf"):
        ckpt.load_checkpoint(str(path), "target", work_dir=_work(tmp_path))


def test_split_gguf_is_read_whole_or_refused(tmp_path):
    """The first file of a split GGUF (-00001-of-00002.gguf) holds only some of the tensors; llama.cpp loads every
    part. Converting the first part alone leaves the rest of the model random: it must be refused (or all parts read)."""
    import gguf
    from safetensors.numpy import load_file

    from specdeploy.export import checkpoint as ckpt

    full = write_llama_gguf(tmp_path / "full.gguf")
    reader = gguf.GGUFReader(str(full))
    tensors = list(reader.tensors)
    half = len(tensors) // 2
    for index, part in enumerate((tensors[:half], tensors[half:])):
        writer = gguf.GGUFWriter(str(tmp_path / f"tiny-0000{index + 1}-of-00002.gguf"), "llama")
        if index == 0:
            _copy_metadata(reader, writer)
        writer.add_uint16("split.no", index)
        writer.add_uint16("split.count", 2)
        writer.add_int32("split.tensors.count", len(tensors))
        for t in part:
            writer.add_tensor(t.name, _tensor(t))
        _finish(writer)
    whole = ckpt.load_checkpoint(str(full), "target", work_dir=_work(tmp_path))
    try:
        split = ckpt.load_checkpoint(str(tmp_path / "tiny-00001-of-00002.gguf"), "target", work_dir=_work(tmp_path))
    except SpecdeployError:
        return  # refused: fine
    want, got = load_file(str(whole.path / "model.safetensors")), load_file(str(split.path / "model.safetensors"))
    differ = sorted(name for name in want if name not in got or not np.array_equal(want[name], got[name]))
    assert not differ, f"the first part of a split GGUF was converted with other (random) weights: {differ[:3]}"


class _ModelLoaded(BaseException):
    """Raised past gguf.py's `except Exception`: loading a model was attempted at all."""


def test_lora_adapter_gguf_is_refused_before_any_model_is_built(tmp_path, monkeypatch):
    """A LoRA adapter GGUF (general.type 'adapter', as convert_lora_to_gguf writes it) is no model. Its metadata
    names no sizes, so transformers builds its default Llama config (7B parameters, 27 GB in fp32): on this
    machine the export was killed for memory instead of refusing the file."""
    import gguf
    import transformers

    from specdeploy.export import checkpoint as ckpt

    path = tmp_path / "adapter.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 16.0)
    for layer in range(LAYERS):
        writer.add_tensor(f"blk.{layer}.attn_q.weight.lora_a", np.zeros((4, HIDDEN), np.float32))
        writer.add_tensor(f"blk.{layer}.attn_q.weight.lora_b", np.zeros((HIDDEN, 4), np.float32))
    _finish(writer)

    def refuse_to_load(*args, **kwargs):
        raise _ModelLoaded()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse_to_load)
    try:
        with pytest.raises(SpecdeployError, match="adapter"):
            ckpt.load_checkpoint(str(path), "target", work_dir=_work(tmp_path))
    except _ModelLoaded:
        pytest.fail("a LoRA adapter GGUF was loaded as a model (transformers builds a default 7B Llama for it)")


def test_gguf_without_add_bos_key_prepends_what_llama_cpp_prepends(tmp_path):
    """With no tokenizer.ggml.add_bos_token key, llama.cpp prepends BOS by the tokenizer's kind: not for a 'gpt2'
    BPE (SmolLM2's kind). The bundle took transformers' conversion instead, which prepends <|im_start|>."""
    import gguf

    from specdeploy.export import checkpoint as ckpt
    from specdeploy.export.special_tokens import check_special_tokens
    from tokenizers import Tokenizer

    reader = gguf.GGUFReader(str(write_llama_gguf(tmp_path / "full.gguf")))
    path = tmp_path / "no-add-bos.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    _copy_metadata(reader, writer, skip=("tokenizer.ggml.add_bos_token",))
    for t in reader.tensors:
        writer.add_tensor(t.name, _tensor(t))
    _finish(writer)
    work = _work(tmp_path)
    checkpoint = ckpt.load_checkpoint(str(path), "target", work_dir=work)
    checked = check_special_tokens(checkpoint, ckpt.load_tokenizer_json(checkpoint, work), work, lambda *a: None)
    tokenizer = Tokenizer.from_file(str(checked.tokenizer_dir / "tokenizer.json"))
    # llama.cpp (llama_tokenize, add_special=True) on this file: [290, 72, 311], no start token
    assert tokenizer.encode("def f", add_special_tokens=True).ids == tokenizer.encode("def f", add_special_tokens=False).ids


LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"]  # ids 0..3


def _write_llama3_style_gguf(path: Path) -> Path:
    """Llama 3.1 as convert_hf_to_gguf writes it: EOS <|end_of_text|>, and no eot/eom keys (llama.cpp finds
    <|eot_id|> and <|eom_id|> by their text and ends generation at both)."""
    import gguf
    import torch
    import transformers as tf
    from tokenizers import pre_tokenizers

    tokens = LLAMA3 + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "en"]
    config = tf.LlamaConfig(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                            max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(7)
    model = tf.LlamaForCausalLM(config)
    writer = gguf.GGUFWriter(str(path), "llama")
    write_llama_header(writer, len(tokens))
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in LLAMA3 else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(["Ġ t", "e n"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    _write_tensors(writer, model, gguf.MODEL_ARCH.LLAMA)
    _finish(writer)
    return path


def test_gguf_end_of_turn_and_message_tokens_without_their_keys_stop(tmp_path):
    """README: a GGUF's end-of-turn and end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>) join the stop set.
    llama.cpp's converter writes no eot/eom key for Llama 3: llama.cpp finds both by their text (its EOG set for
    this file is [1, 2, 3]); the export read only the keys and stopped at <|end_of_text|> alone."""
    from specdeploy.export import checkpoint as ckpt
    from specdeploy.export.special_tokens import check_special_tokens

    path = _write_llama3_style_gguf(tmp_path / "llama3.gguf")
    work = _work(tmp_path)
    checkpoint = ckpt.load_checkpoint(str(path), "target", work_dir=work)
    checked = check_special_tokens(checkpoint, ckpt.load_tokenizer_json(checkpoint, work), work, lambda *a: None)
    assert checked.checkpoint.eos_token_ids[0] == 1
    assert {2, 3} <= set(checked.checkpoint.eos_token_ids)


def test_gguf_export_progress_names_the_gguf_file(tmp_path):
    """The 'load' progress line names what is being exported; for a GGUF it showed the work folder's hash
    ('target: gguf-94c4c908a3fd') instead of the file."""
    from specdeploy.export import ExportConfig, export_bundle

    path = write_llama_gguf(tmp_path / "tiny-named.gguf", seed=4)
    lines = []
    export_bundle(ExportConfig(target=str(path), draft=str(path), out=str(tmp_path / "bundle"), draft_quantize="none"),
                  report=lambda stage, detail: lines.append(f"{stage} {detail}"))
    repairs = ("from GGUF", "decoder drops the space")  # the special-token check's lines, not progress
    loads = [line for line in lines if line.startswith("load target: ") and not any(r in line for r in repairs)]
    assert loads and all("tiny-named.gguf" in line and "gguf-" not in line.split("tiny-named")[0] for line in loads), loads
