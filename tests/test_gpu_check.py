"""scripts/gpu_check.py's carrying of large files in parts: what runs on the device machine, checked here."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script(name: str):
    """scripts/NAME.py imported from its file: a script, run as `python scripts/NAME.py`, is no package's module."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def files(tmp_path):
    """Two files of awkward sizes, as a wheel and a model would be."""
    first, second = tmp_path / "in" / "a.whl", tmp_path / "in" / "b.gguf"
    first.parent.mkdir()
    first.write_bytes(bytes(range(256)) * 41 + b"end")  # 10,499 bytes
    second.write_bytes(b"\x07" * 5000)
    return [first, second]


def test_parts_carried_one_call_at_a_time_join_into_the_same_files(files, tmp_path):
    gpu = script("gpu_check")
    manifest = gpu.pack(files, tmp_path / "parts", 4096)
    assert [part["name"] for part in manifest["parts"]] == ["part-00", "part-01", "part-02", "part-03"]  # 15,499 bytes
    assert [entry["name"] for entry in manifest["files"]] == ["a.whl", "b.gguf"]
    store = tmp_path / "store"
    for index, part in enumerate(manifest["parts"]):  # each device call carries the manifest and one part
        carried = tmp_path / f"call-{index}"
        carried.mkdir()
        (carried / "parts.json").write_bytes((tmp_path / "parts" / "parts.json").read_bytes())
        (carried / part["name"]).write_bytes((tmp_path / "parts" / part["name"]).read_bytes())
        missing = gpu.receive(carried, store)
        assert missing == [p["name"] for p in manifest["parts"][index + 1:]]
    joined = gpu.assemble(store)
    assert [path.read_bytes() for path in joined] == [path.read_bytes() for path in files]


def test_a_missing_or_damaged_part_is_refused(files, tmp_path):
    gpu = script("gpu_check")
    gpu.pack(files, tmp_path / "parts", 4096)
    store = tmp_path / "store"
    gpu.receive(tmp_path / "parts", store)
    (store / "part-02").unlink()
    with pytest.raises(SystemExit, match="lacks part-02"):
        gpu.assemble(store)
    damaged = tmp_path / "parts" / "part-02"
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    assert gpu.receive(tmp_path / "parts", store) == ["part-02"]  # a part that fails its sha256 is not kept


def test_the_command_line_prints_one_device_call_per_part_and_the_check(files, tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "pack", *map(str, files), "--out",
                             str(tmp_path / "parts"), "--part-mb", "0.005"], capture_output=True, text=True, check=True)
    calls = result.stdout.splitlines()
    parts = json.loads((tmp_path / "parts" / "parts.json").read_text())["parts"]
    assert len(calls) == len(parts) + 1 and all("receive" in call for call in calls[:-1]) and "check" in calls[-1]
    bad = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "receive"], capture_output=True, text=True)
    assert bad.returncode == 2 and "receive needs the carried folder" in bad.stderr


def test_check_refuses_a_store_without_its_parts(tmp_path):
    gpu = script("gpu_check")
    store = tmp_path / "store"
    store.mkdir()
    (store / "parts.json").write_text(json.dumps({"files": [], "parts": [{"name": "part-00", "sha256": "0" * 64}]}))
    with pytest.raises(SystemExit, match="lacks part-00"):
        gpu.check(store, tmp_path / "out")
    assert Path(tmp_path / "out" / "gpu_check.log").is_file()
