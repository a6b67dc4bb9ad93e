"""`specdeploy distill`: resuming after a cut first checkpoint, resume = uninterrupted for a target with dropout,
--data folders under node_modules, what a failed run leaves behind, and the options that cannot make a window."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from specdeploy.cli import main
from specdeploy.distill import DistillConfig, distill
from specdeploy.distill.data import expand_paths
from test_distill import target, text_file  # noqa: F401 (fixtures)

TINY = dict(seq_len=32, batch_size=2, heldout_tokens=64, generate_tokens=32, eval_every=1000, minutes=None, threads=1)


def tiny(target, out, text_file, **options) -> DistillConfig:
    return DistillConfig(target=str(target), out=str(out), data=(str(text_file),), **{**TINY, **options})


def invoke(*args):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stderr


def one_error(code, stderr) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


def test_a_write_cut_during_the_first_checkpoint_leaves_a_resumable_run(target, text_file, tmp_path, monkeypatch):
    """docs/distill.md: a write cut between checkpoint.pt and distill.json leaves checkpoint.pt one step ahead, and
    --resume takes it. On the first checkpoint distill.json still says step null: --resume must take it too."""
    from specdeploy.distill import checkpoint as ckpt

    out = tmp_path / "run"
    real = ckpt.write_model_draft

    def cut(*args, **kwargs):  # a kill or a second Ctrl-C right after checkpoint.pt was renamed into place
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "write_model_draft", cut)
    with pytest.raises(KeyboardInterrupt):
        distill(tiny(target, out, text_file, layers=1, steps=3, checkpoint_steps=1))
    assert (out / "checkpoint.pt").is_file()
    monkeypatch.setattr(ckpt, "write_model_draft", real)
    result = distill(tiny(target, out, text_file, layers=1, steps=3, checkpoint_steps=1, resume=True))
    assert result.step == 3


def test_a_resumed_model_draft_of_a_target_with_dropout_continues_exactly(checkpoints, text_file, tmp_path):
    """GPT-2's config has dropout 0.1: the draft copies it, trains with it, and the global RNG that draws it is not
    in the checkpoint, so a resumed run ends with other weights than an uninterrupted one."""
    gpt2 = checkpoints("gpt2")["target"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    distill(tiny(gpt2, straight, text_file, layers=1, steps=4))
    distill(tiny(gpt2, split, text_file, layers=1, steps=2))
    distill(tiny(gpt2, split, text_file, layers=1, steps=4, resume=True))
    a, b = (torch.load(folder / "checkpoint.pt", weights_only=True) for folder in (straight, split))
    assert a["step"] == b["step"] == 4
    assert all(torch.equal(a["draft"][name], b["draft"][name]) for name in a["draft"])


def test_a_data_folder_inside_a_node_modules_folder_is_read(tmp_path, text_file):
    """Only folders under the --data folder are skipped; a folder the user names is read wherever it lies."""
    folder = tmp_path / "node_modules" / "left-pad"
    folder.mkdir(parents=True)
    (folder / "index.js").write_text(text_file.read_text())
    assert expand_paths((str(folder),)) == [folder / "index.js"]


def test_too_little_text_leaves_no_folder_the_run_made(target, tmp_path):
    """--out a/b/new with a and b new: the run made all three, and on bad input it leaves none of them."""
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "a.txt").write_text("a")
    code, stderr = invoke("distill", "--target", str(target), "--out", str(tmp_path / "a" / "b" / "new"),
                          "--data", str(tmp_path / "tiny"), "--seq-len", "32", "--generate-tokens", "0",
                          "--heldout-tokens", "64", "--steps", "1", "--threads", "1")
    assert "fewer than one --seq-len 32 window" in one_error(code, stderr)
    assert not (tmp_path / "a").exists(), sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "a").rglob("*"))


@pytest.mark.parametrize("seq_len, unroll", [(1, 1), (2, 2)])
def test_an_eagle_seq_len_with_no_position_for_each_chain_step_is_refused(target, text_file, tmp_path, seq_len, unroll):
    """An eagle window of S tokens has S - 1 head inputs and chain step s trains on S - s of them: --seq-len 1 ended
    in PyTorch's RuntimeError, --seq-len 2 --unroll 2 trained with a NaN feature loss."""
    out = tmp_path / "eagle"
    code, stderr = invoke("distill", "--target", str(target), "--out", str(out), "--data", str(text_file),
                          "--kind", "eagle", "--seq-len", str(seq_len), "--unroll", str(unroll), "--batch-size", "1",
                          "--generate-tokens", "0", "--heldout-tokens", "16", "--steps", "1", "--threads", "1")
    line = one_error(code, stderr)
    assert "--seq-len" in line and "RuntimeError" not in line, line
    assert not out.exists()


def test_max_text_tokens_zero_with_data_names_the_option(target, text_file, tmp_path):
    """--max-text-tokens 0 reads no token of --data; the error blamed the file ("every file is empty, binary or not
    UTF-8") although it is a readable UTF-8 text file."""
    code, stderr = invoke("distill", "--target", str(target), "--out", str(tmp_path / "new"), "--data", str(text_file),
                          "--max-text-tokens", "0", "--generate-tokens", "0", "--steps", "1")
    line = one_error(code, stderr)
    assert "--max-text-tokens" in line, line


def test_an_eagle_head_for_a_target_without_a_fused_graph_is_refused_before_training(checkpoints, text_file, tmp_path):
    """Export builds an eagle head from the target's fused graph only (GPT-2 has none): distill used to train
    the head whole and export refused it afterwards. It is refused before any data is made."""
    gpt2 = checkpoints("gpt2")["target"]
    out = tmp_path / "eagle"
    code, stderr = invoke("distill", "--target", str(gpt2), "--out", str(out), "--data", str(text_file),
                          "--kind", "eagle", "--generate-tokens", "0", "--heldout-tokens", "16", "--steps", "1",
                          "--threads", "1")
    assert "fused graph" in one_error(code, stderr)
    assert not out.exists()


def test_minutes_bound_the_whole_run_generations_included(target, text_file, tmp_path):
    """--minutes spent before the target generates anything: each generation stops where its share of the run
    ends and says how much it made, training takes no step, and the run still ends with an evaluated draft."""
    notes = []
    result = distill(tiny(target, tmp_path / "run", text_file, layers=1, minutes=1e-6),
                     report=lambda event: notes.append(getattr(event, "text", None)))
    assert result.step == 0 and result.evaluation is not None and (tmp_path / "run" / "checkpoint.pt").is_file()
    assert notes[0].startswith("starting: --minutes 1e-06 bounds the whole run")
    cut = [note for note in notes if note and "all that fit in the" in note]
    assert [note.split(":")[0] for note in cut] == ["training text", "held-out text (greedy)"], notes
