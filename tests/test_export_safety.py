"""Export safety: --force replaces only a bundle, replacement is atomic, leftovers are recovered,
concurrent exports to one path run one after the other, and untrusted checkpoints are refused."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from specdeploy import swap
from specdeploy.bundle import MANIFEST_NAME, load_manifest
from specdeploy.cli import main
from specdeploy.errors import SpecdeployError
from specdeploy.export import checkpoint as ckpt

from conftest import export_pair


def cli(*args):
    """The command in process (click's runner): exit_code and stderr, as a real process gives them."""
    return CliRunner().invoke(main, list(args))


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_force_refuses_what_is_not_a_bundle(checkpoints, tmp_path):
    pair = checkpoints("llama")
    source = tmp_path / "src"
    source.mkdir()
    (source / "main.py").write_text("print('my code')\n")
    base = ["export", "--target", str(pair["target"]), "--draft", str(pair["draft"]), "--force"]
    result = cli(*base, "--out", str(source))
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: --out") and "not a specdeploy bundle" in result.stderr
    assert _tree(source) == {"main.py": b"print('my code')\n"}
    (source / MANIFEST_NAME).write_text('{"format_version": 1, "hello": "not a manifest"}')
    with pytest.raises(SpecdeployError, match="does not hold a specdeploy bundle"):
        export_pair(pair, source, force=True)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(SpecdeployError, match="is not a folder"):
        export_pair(pair, tmp_path / "file.txt", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "src"]  # no lock, no partial folder


def test_force_replaces_a_bundle_in_one_exchange(checkpoints, bundles, tmp_path, monkeypatch):
    """Until the swap, out is the old, whole bundle; the swap exchanges the two folders in one step (out is
    never renamed aside, so there is no instant without a bundle there)."""
    pair = checkpoints("llama")
    out = tmp_path / "bundle"
    shutil.copytree(bundles("gpt2"), out)
    seen, renamed = [], []
    real_replace, real_rename = swap.replace, os.rename

    def watched(built, destination):  # at the instant of the swap, out must still be the old, whole bundle
        seen.append(load_manifest(destination).target.model_type)
        return real_replace(built, destination)

    def rename(source, destination, **options):
        renamed.append(Path(source))
        return real_rename(source, destination, **options)

    monkeypatch.setattr(swap, "replace", watched)
    monkeypatch.setattr(os, "rename", rename)
    export_pair(pair, out, force=True)
    assert seen == ["gpt2"] and load_manifest(out, verify=True).target.model_type == "llama"
    assert out not in renamed  # no two renames: out was exchanged, never moved aside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]
    monkeypatch.undo()
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder holds nothing to lose: --force may fill it
    export_pair(pair, empty, force=True)
    assert load_manifest(empty).target.model_type == "llama"


class LibcWithoutRenameat2:
    """A C library that lacks renameat2 (another OS, an old glibc): ctypes.CDLL(None) finds no such function."""

    def __init__(self, *args, **options):
        pass


def test_replace_without_exchange_keeps_a_bundle_in_place(bundles, tmp_path, monkeypatch):
    """Where renameat2 is missing: two renames, and a crash between them is undone by the next load."""
    out, built = tmp_path / "bundle", tmp_path / "built"
    shutil.copytree(bundles("gpt2"), out)
    shutil.copytree(bundles("llama"), built)
    real_rename = os.rename

    def crash_on_second(source, destination):
        if Path(source) == built:
            raise KeyboardInterrupt  # the process dies between the two renames
        return real_rename(source, destination)

    monkeypatch.setattr(swap.ctypes, "CDLL", LibcWithoutRenameat2)
    monkeypatch.setattr(swap.os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        swap.replace(built, out)
    monkeypatch.setattr(swap.os, "rename", real_rename)
    assert not out.exists() and len([p for p in tmp_path.iterdir() if ".old-" in p.name]) == 1
    assert load_manifest(out).target.model_type == "gpt2"  # the load put the old bundle back
    assert not [p for p in tmp_path.iterdir() if ".old-" in p.name]


def test_next_export_cleans_leftovers(checkpoints, tmp_path):
    pair = checkpoints("llama")
    out = tmp_path / "bundle"
    (tmp_path / ".bundle.partial-abc123" / "bundle").mkdir(parents=True)  # a killed export's work folder
    (tmp_path / ".bundle.old-20260101").mkdir()  # a replacement interrupted after its first rename
    (tmp_path / ".other.partial-1").mkdir()  # another bundle's: not ours to touch
    stages = []
    export_pair(pair, out)
    from specdeploy.export import ExportConfig, export_bundle

    export_bundle(ExportConfig(target=str(pair["target"]), draft=str(pair["draft"]), out=str(out), force=True),
                  lambda stage, detail: stages.append(stage))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial-1", "bundle"]
    assert "clean" not in stages  # the first export already cleaned them


def test_concurrent_exports_to_one_path_run_one_after_the_other(checkpoints, tmp_path):
    """Two first uses of one bundle path: one exports, the other waits on the lock and reuses the result."""
    pair = checkpoints("llama")
    out = tmp_path / "bundle"
    script = ("import sys; from specdeploy.export import ExportConfig, export_bundle; "
              "export_bundle(ExportConfig(target=sys.argv[1], draft=sys.argv[2], out=sys.argv[3], force=True, "
              "reuse_existing=True), lambda stage, detail: print(stage, flush=True))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    processes = [subprocess.Popen([sys.executable, "-c", script, str(pair["target"]), str(pair["draft"]), str(out)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], [r[1][-2000:] for r in results]
    stages = [stdout.split() for stdout, _ in results]
    assert sum("write" in s for s in stages) == 1  # exactly one of them exported
    load_manifest(out, verify=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_a_held_lock_makes_a_timed_wait_fail_with_one_line(tmp_path):
    out = tmp_path / "bundle"
    held, release = threading.Event(), threading.Event()

    def hold():
        with swap.bundle_lock(out):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(10)
    start = time.monotonic()
    with pytest.raises(SpecdeployError, match="another export to .* holds"):
        with swap.bundle_lock(out, timeout=0.3):
            pass
    assert 0.25 < time.monotonic() - start < 5
    release.set()
    thread.join()
    assert list(tmp_path.iterdir()) == []  # the lock file goes with its last holder


def test_pickle_weights_need_allow_pickle(checkpoints, tmp_path):
    pair = checkpoints("llama")
    folder = tmp_path / "pickled"
    shutil.copytree(pair["target"], folder)
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    both = ckpt.load_checkpoint(str(folder), "target")  # safetensors beside it: those are what gets loaded
    assert both.path == folder.resolve()
    (folder / "model.safetensors").unlink()
    with pytest.raises(SpecdeployError, match="pickle files .*--allow-pickle"):
        ckpt.load_checkpoint(str(folder), "target")
    assert ckpt.load_checkpoint(str(folder), "target", allow_pickle=True).path == folder.resolve()
    result = cli("export", "--target", str(folder), "--draft", str(pair["draft"]), "--out", str(tmp_path / "b"))
    assert result.exit_code == 2 and "--allow-pickle" in result.stderr and "Traceback" not in result.stderr


def test_remote_code_and_missing_tokenizer_are_refused_in_one_line(checkpoints, tmp_path):
    pair = checkpoints("llama")
    remote = tmp_path / "remote"
    shutil.copytree(pair["target"], remote)
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "modeling.M"}}))
    with pytest.raises(SpecdeployError, match="--trust-remote-code"):
        ckpt.load_checkpoint(str(remote), "target")
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(pair["draft"], bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink()
    result = cli("export", "--target", str(pair["target"]), "--draft", str(bare), "--out", str(tmp_path / "b"))
    assert result.exit_code == 2 and "Traceback" not in result.stderr and "NoneType" not in result.stderr
    assert "error: --draft" in result.stderr and "no tokenizer" in result.stderr
    assert not (tmp_path / "b").exists()
