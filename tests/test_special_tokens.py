"""Special tokens checked at export: repaired where the checkpoint settles them, refused where it does not.

The Llama pair of conftest states BOS <s> (0), EOS </s> (1) and pad </s> (1) in every file; each test
copies it and makes the files disagree one way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specdeploy.errors import SpecdeployError


def _edit(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _copy(source: Path, folder: Path, **files) -> Path:
    """A copy of a checkpoint with {file stem: {key: value | None (removed)}} applied."""
    shutil.copytree(source, folder)
    for stem, changes in files.items():
        _edit(folder / f"{stem}.json", **changes)
    return folder


def _check(folder: Path, tmp_path: Path):
    from specdeploy.export import checkpoint as ckpt
    from specdeploy.export.special_tokens import check_special_tokens

    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    checkpoint = ckpt.load_checkpoint(str(folder), "target", work_dir=work)
    lines = []
    checked = check_special_tokens(checkpoint, ckpt.load_tokenizer_json(checkpoint, work), work,
                                   lambda stage, detail: lines.append(detail))
    assert len(lines) == len(checked.repairs)  # every repair is reported, once, in brief (the manifest keeps it whole)
    for brief, whole in zip(lines, checked.repairs):
        assert whole.startswith(brief.split(", over ")[0]) and len(brief) <= len(whole) + 60
    return checked


def test_agreeing_checkpoint_is_unchanged(checkpoints, tmp_path):
    folder = checkpoints("llama")["target"]
    checked = _check(folder, tmp_path)
    assert checked.repairs == () and checked.tokenizer_dir == folder
    assert (checked.checkpoint.bos_token_id, checked.checkpoint.eos_token_ids, checked.checkpoint.pad_token_id) == (0, (1,), 1)


def test_tokenizer_repaired_when_config_and_generation_config_agree(checkpoints, tmp_path):
    folder = _copy(checkpoints("llama")["target"], tmp_path / "ckpt",
                   tokenizer_config={"eos_token": "<s>", "pad_token": "<s>"}, special_tokens_map={"eos_token": "<s>"})
    checked = _check(folder, tmp_path)
    assert checked.checkpoint.eos_token_ids == (1,) and checked.checkpoint.pad_token_id == 1
    assert any(line.startswith("target: eos '</s>' (1) from config.json and generation_config.json, was "
                               "tokenizer_config.json eos_token '<s>' (0), special_tokens_map.json eos_token '<s>' (0)")
               for line in checked.repairs)
    assert any(line.startswith("target: pad '</s>' (1)") for line in checked.repairs)
    repaired = checked.tokenizer_dir
    assert repaired != folder
    assert json.loads((repaired / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    assert json.loads((repaired / "special_tokens_map.json").read_text())["eos_token"] == "</s>"
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<s>"  # the checkpoint untouched


@pytest.mark.parametrize("case, files, message", [
    ("config and generation_config disagree on eos", {"generation_config": {"eos_token_id": 0}},
     r"eos: config.json eos_token_id \[1\], generation_config.json eos_token_id \[0\]"),
    ("one file against the tokenizer", {"generation_config": {"bos_token_id": None}, "config": {"bos_token_id": 1}},
     r"bos: tokenizer_config.json bos_token '<s>' \(0\), special_tokens_map.json bos_token '<s>' \(0\), "
     r"config.json bos_token_id '</s>' \(1\)"),
    ("pad three ways", {"generation_config": {"pad_token_id": 0}},
     r"pad: tokenizer_config.json pad_token '</s>' \(1\), .*config.json pad_token_id '</s>' \(1\), "
     r"generation_config.json pad_token_id '<s>' \(0\)"),
    ("add_bos_token unlike the post-processor", {"tokenizer_config": {"add_bos_token": True}},
     r"add_bos_token: tokenizer_config.json add_bos_token True, tokenizer.json post-processor prepends BOS False"),
    ("eos against config alone", {"generation_config": {"eos_token_id": None}, "tokenizer_config": {"eos_token": "<s>"}},
     r"eos: tokenizer_config.json eos_token '<s>' \(0\), config.json eos_token_id \[1\]"),
])
def test_unsettled_disagreement_is_refused(checkpoints, tmp_path, case, files, message):
    folder = _copy(checkpoints("llama")["target"], tmp_path / "ckpt", **files)
    with pytest.raises(SpecdeployError, match="the special tokens disagree: " + message) as caught:
        _check(folder, tmp_path)
    assert "\n" not in str(caught.value) and "nothing in the checkpoint says which is right" in str(caught.value)


def test_head_larger_than_tokenizer_is_padding(tokenizer_dir, tmp_path):
    import transformers as tf

    from conftest import BOS, EOS, VOCAB, build_checkpoint, model_config  # noqa: F401

    folder = build_checkpoint(tmp_path / "ckpt", "llama", 1, 32, seed=3, tokenizer_dir=tokenizer_dir)
    config = model_config("llama", 1, 32)
    config.vocab_size = VOCAB + 16  # head rows past the tokenizer, as Gemma 3 pads 262,143 tokens to 262,144
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    checked = _check(folder, tmp_path)
    assert checked.repairs == () and checked.checkpoint.config.vocab_size == VOCAB + 16


def test_tokenizer_larger_than_head_is_refused(checkpoints, tmp_path):
    folder = _copy(checkpoints("llama")["target"], tmp_path / "ckpt", config={"vocab_size": 300})
    with pytest.raises(SpecdeployError, match=r"the tokenizer has ids up to 383 \(384 tokens\) but the model's head "
                                              r"has 300 rows"):
        _check(folder, tmp_path)


def test_end_of_turn_token_joins_the_stop_set_and_the_bundle(checkpoints, tmp_path):
    import specdeploy
    from specdeploy.bundle import load_manifest
    from specdeploy.export import ExportConfig, export_bundle

    pair = checkpoints("llama")
    # the template closes each turn with <s>, a special token outside the stop set [</s>]
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<s>\n{% endfor %}"
    roles = {role: _copy(pair[role], tmp_path / role, tokenizer_config={"chat_template": template, "eos_token": "<s>"})
             for role in ("target", "draft")}
    lines = []
    export_bundle(ExportConfig(target=str(roles["target"]), draft=str(roles["draft"]), out=str(tmp_path / "bundle")),
                  report=lambda stage, detail: lines.append(detail))
    manifest = load_manifest(tmp_path / "bundle", verify=True)
    assert manifest.target.eos_token_ids == (1, 0) == manifest.draft.eos_token_ids == manifest.tokenizer.eos_token_ids
    repairs = manifest.export_options["special_token_repairs"]["target"]
    assert repairs[0].startswith("target: eos '</s>' (1) from config.json and generation_config.json")
    assert repairs[1] == ("target: eos_token_ids + '<s>' (0): the chat template ends an assistant turn with it, "
                          "and the stop set was [1]")
    assert all(any(repair.startswith(line.split(", over ")[0]) for line in lines) for repair in repairs)  # each reported
    bundled = json.loads((tmp_path / "bundle" / "tokenizer" / "tokenizer_config.json").read_text())
    assert bundled["eos_token"] == "</s>" and bundled["chat_template"] == template
    generator = specdeploy.load(tmp_path / "bundle")
    for prompt in ([5, 9, 13], [40, 41], [200]):
        tokens = generator.generate(prompt, max_new_tokens=16, speculative=False).token_ids
        assert not {0, 1} & set(tokens[:-1])  # either stop token ends generation


def test_a_decoder_that_drops_the_first_space_is_written_without_that_step(checkpoints, tmp_path):
    """Llama 2's, Mistral's and Phi-3's decoders strip the space a text starts with; the runtime decodes only a
    reply's ids, so a reply starting with a spaced word lost its space ('isParis' after the prompt)."""
    from tokenizers import Tokenizer

    source = checkpoints("llama")["target"]
    folder = _copy(source, tmp_path / "ckpt")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["decoder"] = {"type": "Sequence", "decoders": [data["decoder"], {"type": "Strip", "content": " ", "start": 1,
                                                                         "stop": 0}]}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    spaced = next(i for t, i in Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab().items()
                  if t.startswith("Ġ") and t[1:].isascii() and t[1:].isalpha())  # 'Ġ' itself is a letter
    assert not Tokenizer.from_file(str(folder / "tokenizer.json")).decode([spaced]).startswith(" ")
    checked = _check(folder, tmp_path)
    assert any("drops the space" in line for line in checked.repairs)
    assert Tokenizer.from_file(str(checked.tokenizer_dir / "tokenizer.json")).decode([spaced]).startswith(" ")
    assert checked.checkpoint.eos_token_ids == (1,)  # nothing else changed


def test_metaspace_decoders_keep_their_first_space_and_others_are_left_alone():
    from specdeploy.export.leading_space import unstripped

    metaspace = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    assert unstripped(metaspace)["prepend_scheme"] == "never" and metaspace["prepend_scheme"] == "first"
    assert unstripped({"type": "Metaspace", "replacement": "▁", "add_prefix_space": True})["add_prefix_space"] is False
    assert unstripped({"type": "Sequence", "decoders": [{"type": "ByteFallback"}, metaspace]})["decoders"][1][
        "prepend_scheme"] == "never"
    both_ends = {"type": "Sequence", "decoders": [{"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 1}]}
    assert unstripped(both_ends)["decoders"] == [{"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 0, "stop": 1}]
    assert unstripped({"type": "Sequence", "decoders": [{"type": "Strip", "content": " ", "start": 1, "stop": 0}]}) == {
        "type": "Sequence", "decoders": []}
    for plain in ({"type": "ByteLevel"}, {"type": "Metaspace", "prepend_scheme": "never"}, None,
                  {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "Strip", "content": " ", "start": 0,
                                                                          "stop": 1}]}):
        assert unstripped(plain) is None
