"""`specdeploy distill` with tiny models: the acceptance estimate on cases built to know the answer,
the losses, runs of both kinds, resume = uninterrupted, Ctrl-C, the error lines, and export of a model draft."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from specdeploy.cli import main
from specdeploy.distill import DistillConfig, distill
from specdeploy.distill.data import choose_draft_vocab, read_documents
from specdeploy.distill.evaluate import acceptance_by_position, accepted_counts
from specdeploy.distill.models import build_eagle_head, build_model_draft, chain_mask, load_target
from specdeploy.distill.train import EagleKind, HeldOut, ModelKind, kl_to_target, measure
from specdeploy.errors import SpecdeployError

TINY = dict(seq_len=32, batch_size=2, heldout_tokens=64, generate_tokens=32, eval_every=2, minutes=None, threads=1)


@pytest.fixture(scope="module")
def target(checkpoints):
    return checkpoints("llama")["target"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distill-text")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (folder / "code.py").write_text((stdlib / "textwrap.py").read_text() + (stdlib / "bisect.py").read_text())
    return folder / "code.py"


@pytest.fixture(scope="module")
def loaded(target):
    return load_target(str(target), "cpu")


@pytest.fixture(scope="module")
def batch(loaded, text_file):
    ids = loaded.tokenizer(text_file.read_text())["input_ids"]
    return torch.tensor([ids[:32], ids[100:132]])


def tiny(target, out, text_file, **options) -> DistillConfig:
    return DistillConfig(target=str(target), out=str(out), data=(str(text_file),), **{**TINY, **options})


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def invoke(*args):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


# --- the acceptance estimate and the loss on known cases ------------------------------------------------------------

def test_accepted_counts_exact_cases():
    agree = np.array([[1, 1, 0, 1, 1, 1, 1, 0]], dtype=bool)  # one row: every step reads it
    assert accepted_counts(agree, 4).tolist() == [2, 1, 0, 4, 3]  # rounds start at 0..4; runs capped at k
    assert acceptance_by_position(np.array([2, 1, 0, 4, 3]), 4) == pytest.approx([4 / 5, 3 / 4, 2 / 3, 1 / 2])
    # step s of the round that starts at i is read at [s - 1, i + s - 1]: [1, 0] (step 2 before the start) is never read
    by_step = np.array([[1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 0, 1]], dtype=bool)
    assert accepted_counts(by_step, 3).tolist() == [2, 3]
    assert accepted_counts(agree[:, :3], 4).size == 0


def test_chain_mask_is_causal_at_step_one_and_follows_the_chain_after():
    assert torch.equal(chain_mask(5, 1), torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    step3 = chain_mask(5, 3)  # [5, 15]: step-1 keys, step-2 keys, step-3 keys
    row = step3[4]  # the chain started at index 2: step-1 keys 0..2, its step 2 at 3, its step 3 at 4
    assert row[:5].tolist() == [True, True, True, False, False]
    assert row[5:10].tolist() == [False, False, False, True, False]
    assert row[10:].tolist() == [False, False, False, False, True]


def test_draft_vocab_keeps_specials_then_the_most_frequent():
    counts = np.array([0, 0, 5, 9, 9, 1, 7])
    assert choose_draft_vocab(counts, 5, always=[0, 1]).tolist() == [0, 1, 3, 4, 6]
    assert choose_draft_vocab(counts, 7, always=[0]).tolist() == list(range(7))
    with pytest.raises(SpecdeployError, match="only 7 tokens"):
        choose_draft_vocab(counts, 8, always=[0])
    with pytest.raises(SpecdeployError, match="special tokens"):
        choose_draft_vocab(counts, 2, always=[0, 1])


def test_kl_is_zero_for_the_target_restricted_to_the_draft_vocab_and_positive_otherwise():
    generator = torch.Generator().manual_seed(0)
    target_logprobs = torch.log_softmax(torch.randn(1, 3, 6, generator=generator), -1)
    top_logprobs, top_ids = target_logprobs.topk(6, -1)
    subset = torch.tensor([0, 2, 3, 5])
    full_to_draft = torch.full((6,), -1)
    full_to_draft[subset] = torch.arange(4)
    matched = target_logprobs[..., subset]  # the target renormalized over the subset, as draft logits
    assert float(kl_to_target(matched, top_ids, top_logprobs, full_to_draft)) == pytest.approx(0.0, abs=1e-6)
    uniform = torch.zeros(1, 3, 4)
    expected = (torch.softmax(matched, -1) * (torch.log_softmax(matched, -1) - np.log(0.25))).sum(-1).mean()
    assert float(kl_to_target(uniform, top_ids, top_logprobs, full_to_draft)) == pytest.approx(float(expected), rel=1e-5)


def heldout_of(loaded, batch, features):
    return [HeldOut("text", row[None], loaded.teach(row[None], 1, features)) for row in batch]


def test_a_model_draft_with_all_the_targets_layers_agrees_everywhere(loaded, batch):
    vocab_ids = torch.arange(loaded.vocab_size)
    draft, _ = build_model_draft(loaded, loaded.num_layers, None, vocab_ids, seed=0)
    score = measure(ModelKind(draft), heldout_of(loaded, batch, False), vocab_ids, 4).overall
    assert score.agreement == 1.0 and score.accepted_per_round == 4.0 and score.rounds == 2 * (32 - 4 + 1)
    one_layer, _ = build_model_draft(loaded, 1, None, vocab_ids, seed=0)
    assert measure(ModelKind(one_layer), heldout_of(loaded, batch, False), vocab_ids, 4).overall.agreement < 1.0


def test_an_eagle_head_that_predicts_the_true_next_feature_agrees_everywhere(loaded, batch):
    class Oracle(EagleKind):  # the head's every chain step answers with the target's own next feature
        def logits(self, input_ids, teaching, steps, noise=None):
            self.head.rollout = lambda features, embeds, count: [teaching.features[:, 1:]] * count
            return super().logits(input_ids, teaching, steps, noise)

    vocab_ids = torch.arange(loaded.vocab_size)
    oracle = Oracle(build_eagle_head(loaded, 1, seed=0)[0], loaded, vocab_ids)
    score = measure(oracle, heldout_of(loaded, batch, True), vocab_ids, 4).overall
    assert score.agreement == 1.0 and score.accepted_per_round == 4.0 and score.rounds == 2 * (31 - 4 + 1)
    untrained = measure(EagleKind(build_eagle_head(loaded, 1, seed=0)[0], loaded, vocab_ids),
                        heldout_of(loaded, batch, True), vocab_ids, 4).overall
    assert untrained.agreement < 1.0


@pytest.mark.parametrize("kind", ["model", "eagle"])
def test_loss_falls_on_a_fixed_batch(loaded, batch, kind):
    vocab_ids = torch.tensor(sorted(set(range(0, loaded.vocab_size, 2)) | {1}))  # a trimmed head
    full_to_draft = torch.full((loaded.vocab_size,), -1)
    full_to_draft[vocab_ids] = torch.arange(len(vocab_ids))
    if kind == "model":
        wrapped = ModelKind(build_model_draft(loaded, 1, None, vocab_ids, seed=0)[0])
    else:
        wrapped = EagleKind(build_eagle_head(loaded, 1, seed=0)[0], loaded, vocab_ids)
    teaching = loaded.teach(batch, 16, features=kind == "eagle")
    settings = DistillConfig(target="", out="", kind=kind, unroll=2 if kind == "eagle" else 1)
    params = [p for p in wrapped.module().parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(12):
        loss, _ = wrapped.loss(batch, teaching, full_to_draft, settings, None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses


# --- runs -------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_run(target, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "model"
    events = []
    result = distill(tiny(target, out, text_file, steps=4, layers=1), events.append)
    return out, result, events


def test_a_model_run_writes_a_checkpoint_folder_transformers_loads(model_run, target):
    from transformers import AutoModelForCausalLM

    out, result, events = model_run
    assert result.step == 4 and not result.interrupted
    assert [h["step"] for h in result.history] == [0, 2, 4]
    assert all(np.isfinite(list(h["loss"].values())).all() for h in result.history[1:])
    run = json.loads((out / "distill.json").read_text())
    assert run["step"] == 4 and run["kind"] == "model"
    draft = AutoModelForCausalLM.from_pretrained(out)
    assert draft.config.num_hidden_layers == 1 and draft.config.specdeploy_draft["kind"] == "model"
    assert (out / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    assert not list(out.glob(".*"))  # no temporary file left
    assert {oct((out / name).stat().st_mode & 0o777) for name in run["draft_files"]} == {oct(0o666 & ~current_umask())}


def test_a_model_draft_exports(model_run, target, tmp_path):
    from specdeploy.export import ExportConfig, export_bundle

    manifest = export_bundle(ExportConfig(target=str(target), draft=str(model_run[0]), out=str(tmp_path / "bundle"),
                                          draft_quantize="none"))
    assert manifest.draft.parity.passed and manifest.draft.num_layers == 1


def test_a_file_longer_than_the_context_is_read_without_a_warning(target, text_file, caplog):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    tokenizer.model_max_length = 64  # the file is thousands of tokens: transformers would warn about indexing errors
    hf_logging.enable_propagation()  # its records reach caplog
    try:
        documents, read = read_documents((str(text_file),), tokenizer, max_tokens=10**6, seed=0)
    finally:
        hf_logging.disable_propagation()
    assert read == 1 and len(documents[0].ids) > 64
    assert not [record for record in caplog.records if "sequence length" in record.getMessage()]


def test_an_eagle_run_with_a_draft_vocab_writes_its_contract(target, text_file, tmp_path):
    out = tmp_path / "eagle"
    result = distill(tiny(target, out, text_file, kind="eagle", steps=2, draft_vocab=100, unroll=2))
    assert result.step == 2
    info = json.loads((out / "config.json").read_text())["specdeploy_draft"]
    assert info["kind"] == "eagle" and info["shares_lm_head"] and info["feature_layer"] == 2
    assert info["target_hidden_size"] == 64 and info["draft_vocab"] == "draft_vocab.json"
    vocab = json.loads((out / "draft_vocab.json").read_text())
    assert vocab["size"] == len(vocab["ids"]) == 100 and vocab["ids"] == sorted(vocab["ids"]) and {0, 1} <= set(vocab["ids"])
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert weights["fc.weight"].shape == (64, 128) and "layers.0.self_attn.q_proj.weight" in weights


def test_a_gguf_target_distils_through_its_chat_template(tmp_path, monkeypatch):
    from test_gguf import write_llama_gguf
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    save = PreTrainedTokenizerFast.save_pretrained

    def save_as_with_sentencepiece(self, folder, legacy_format=None, **kwargs):
        """Where sentencepiece is installed, a GGUF-read tokenizer's slow files are its "vocabulary file": the .gguf."""
        if legacy_format is not False:
            Path(folder, "tokenizer.model").write_bytes(Path(self.vocab_file).read_bytes())
        return save(self, folder, legacy_format=legacy_format, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", save_as_with_sentencepiece)
    out = tmp_path / "draft"
    result = distill(DistillConfig(target=str(write_llama_gguf(tmp_path / "tiny.gguf")), out=str(out), layers=1, steps=1,
                                   **{**TINY, "generate_tokens": 16, "seq_len": 16}))
    assert result.step == 1
    heldout = json.loads((out / "heldout.json").read_text())["documents"]
    assert {d["kind"] for d in heldout} == {"chat", "code"}
    chat = next(d for d in heldout if d["kind"] == "chat")
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))  # the GGUF's, saved by transformers
    assert not (out / "tokenizer.model").exists()  # transformers' copy of the whole .gguf, its "vocabulary file"
    assert tokenizer.decode(chat["ids"], skip_special_tokens=False).startswith("<|im_start|>user")
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 1


def test_a_resumed_run_continues_exactly_as_an_uninterrupted_one(target, text_file, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    options = dict(kind="eagle", unroll=2, eval_every=10)
    distill(tiny(target, straight, text_file, steps=4, **options))
    distill(tiny(target, split, text_file, steps=2, **options))
    assert json.loads((split / "distill.json").read_text())["step"] == 2
    result = distill(tiny(target, split, text_file, steps=4, resume=True, **options))
    assert result.step == 4
    a, b = (torch.load(folder / "checkpoint.pt", weights_only=True) for folder in (straight, split))
    assert a["step"] == b["step"] == 4
    assert all(torch.equal(a["draft"][name], b["draft"][name]) for name in a["draft"])
    assert torch.equal(a["noise_rng"], b["noise_rng"])


def test_ctrl_c_keeps_a_complete_checkpoint(target, text_file, tmp_path):
    out = tmp_path / "interrupted"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "specdeploy", "distill", "--target", str(target), "--out", str(out), "--data", str(text_file),
         "--seq-len", "32", "--batch-size", "2", "--heldout-tokens", "64", "--generate-tokens", "32", "--layers", "1",
         "--checkpoint-steps", "1", "--eval-every", "1000", "--threads", "1"],  # fingerprint as TINY's
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.startswith("checkpoint step"):
            process.send_signal(signal.SIGINT)
            break
    rest = process.communicate(timeout=120)[1]
    assert process.returncode == 130, "".join(lines) + rest
    last = rest.strip().splitlines()[-1]
    assert last.startswith("error: interrupted at step") and "Traceback" not in rest
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    run = json.loads((out / "distill.json").read_text())
    assert run["step"] == state["step"] >= 1 and run["saved_because"] == "interrupt"
    assert f"step {state['step']};" in last
    assert not list(out.glob(".*"))
    result = distill(tiny(target, out, text_file, layers=1, steps=state["step"] + 1, resume=True))
    assert result.step == state["step"] + 1


# --- bad input --------------------------------------------------------------------------------------------------------

def assert_one_error(code, stderr, message):
    """One error line, last; before it at most the run's progress lines (an error found once the target was read)."""
    lines = stderr.strip().splitlines()
    assert code == 2 and lines[-1].startswith("error: "), stderr
    assert all(line.startswith("distill: ") for line in lines[:-1]), stderr
    assert message in lines[-1], lines[-1]
    return lines


def test_bad_input_is_one_error_line_and_writes_nothing(target, text_file, tmp_path, model_run):
    base = ["distill", "--target", str(target), "--data", str(text_file), "--seq-len", "32", "--steps", "1",
            "--generate-tokens", "0"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "blob.bin").write_bytes(b"\0\1\2")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "llama", "vocab_size": "many"}')
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"not weights")
    new = str(tmp_path / "new")
    cases = [
        (["distill", "--target", str(tmp_path / "missing"), "--out", new], "no such file or folder"),
        (["distill", "--target", str(tmp_path / "broken"), "--out", new], "cannot load it as a causal LM"),
        (base + ["--out", new, "--data", str(tmp_path / "empty")], "an empty folder"),
        (["distill", "--target", str(target), "--out", new, "--data", str(tmp_path / "binary")], "no text in it"),
        (base + ["--out", new, "--layers", "3"], "the target has only 2 layers"),
        (base + ["--out", new, "--kind", "eagle", "--layers", "3"], "the target has only 2 layers"),
        (base + ["--out", new, "--hidden-size", "128"], "a draft wider than the target"),
        (base + ["--out", new, "--draft-vocab", "1000"], "has only 384 tokens"),
        (base + ["--out", new, "--draft-vocab", "2"], "special tokens"),
        (base + ["--out", new, "--draft-vocab", "0"], "must be at least 1"),
        (base + ["--out", new, "--resume"], "no distill checkpoint"),
        (base + ["--out", str(tmp_path / "other")], "not empty and not a distill folder"),
        (base + ["--out", str(model_run[0])], "pass --resume to continue it"),
        (base + ["--out", str(model_run[0]), "--resume", "--layers", "2", "--batch-size", "2",
                 "--heldout-tokens", "64", "--generate-tokens", "32"], "was made with --layers 1, this run has --layers 2"),
        (base + ["--out", new, "--kind", "medusa"], "--kind"),
    ]
    if not torch.cuda.is_available():
        cases.append((base + ["--out", new, "--device", "cuda"], "no CUDA device"))
    for args, message in cases:
        lines = assert_one_error(*invoke(*args)[::2], message)
        if message in ("no such file or folder", "must be at least 1", "--kind", "no distill checkpoint"):
            assert len(lines) == 1, lines  # found before anything was read: the error alone
    assert not Path(new).exists()
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["notes.txt"]


def test_resume_refuses_an_unreadable_checkpoint(model_run, target, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(model_run[0], out)
    (out / "checkpoint.pt").write_bytes(b"truncated")
    code, _, stderr = invoke("distill", "--target", str(target), "--out", str(out), "--resume")
    assert_one_error(code, stderr, "is not a complete checkpoint")


def test_an_interrupted_checkpoint_write_leaves_a_resumable_run(target, text_file, tmp_path, monkeypatch):
    """A second Ctrl-C (or a kill) while checkpoint n is being written must leave checkpoint n - 1 (or n) whole and
    resumable; checkpoint.pt is replaced before distill.json, so the two disagree and --resume refuses the folder."""
    from specdeploy.distill import checkpoint as ckpt

    out = tmp_path / "run"
    real, calls = ckpt.write_model_draft, []

    def interrupted_on_the_second_save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_model_draft", interrupted_on_the_second_save)
    with pytest.raises(KeyboardInterrupt):
        distill(tiny(target, out, text_file, layers=1, steps=3, checkpoint_steps=1, eval_every=1000))
    monkeypatch.setattr(ckpt, "write_model_draft", real)
    result = distill(tiny(target, out, text_file, layers=1, steps=3, checkpoint_steps=1, eval_every=1000, resume=True))
    assert result.step == 3


def test_a_draft_folder_inside_the_data_folder_is_not_training_text(target, text_file, tmp_path):
    """`--data DIR --out DIR/draft`: the first run reads DIR before the draft exists; a resumed run then reads the
    draft's own JSON files as text, so its draft vocabulary differs and --resume refuses an unchanged run."""
    import shutil

    data = tmp_path / "corpus"
    data.mkdir()
    shutil.copy(text_file, data / "code.py")
    out = data / "draft"
    distill(tiny(target, out, data, layers=1, steps=1, draft_vocab=100, generate_tokens=0))
    result = distill(tiny(target, out, data, layers=1, steps=2, draft_vocab=100, generate_tokens=0, resume=True))
    assert result.step == 2


def assert_one_error_after_progress(code, stderr, message):
    """Progress lines may come first (the run got as far as making data); the error is still one line."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
    assert message in errors[0], errors[0]


def test_too_little_text_is_one_error_line_and_writes_nothing(target, tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "a.txt").write_text("a")
    out = tmp_path / "new"
    code, _, stderr = invoke("distill", "--target", str(target), "--out", str(out), "--data", str(tmp_path / "tiny"),
                             "--seq-len", "32", "--generate-tokens", "0", "--heldout-tokens", "64", "--steps", "1")
    assert_one_error_after_progress(code, stderr, "fewer than one --seq-len 32 window")
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_a_seq_len_past_the_targets_positions_is_refused_before_anything_is_written(checkpoints, text_file, tmp_path):
    """GPT-2's n_positions is 256 here: --seq-len 300 is bad input, found only mid-run as an IndexError."""
    out = tmp_path / "new"
    code, _, stderr = invoke("distill", "--target", str(checkpoints("gpt2")["target"]), "--out", str(out), "--data",
                             str(text_file), "--seq-len", "300", "--batch-size", "1", "--generate-tokens", "0",
                             "--heldout-tokens", "64", "--steps", "1", "--layers", "1", "--threads", "1")
    assert_one_error_after_progress(code, stderr, "--seq-len 300")
    assert not out.exists()
