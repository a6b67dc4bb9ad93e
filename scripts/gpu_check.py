#!/usr/bin/env python3
"""The GPU check: files too large for one call carried to a device machine in parts, then one call that
installs onnxruntime-gpu there and runs the CUDA tests (tests/test_cuda.py) and a measurement.

A device call carries the working tree and the paths it names, 64 MiB in all, and the machine keeps
what a call leaves in /tmp only while it stays warm (30 s after a call). The onnxruntime-gpu wheel
alone is 255 MB, and the tracked demo folder 58 MB. So, here:

    python scripts/gpu_check.py park                     # specdeploy/demo -> .device/parked (the tree: ~3 MB)
    python scripts/gpu_check.py pack onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl \\
        [MORE_FILES ...] --out .device --part-mb 56     # .device/part-NN and .device/parts.json; prints the calls

then on the device machine, back to back while it stays warm, one call per part (each carrying
`.device/parts.json` and its `.device/part-NN`):

    python scripts/gpu_check.py receive .device --store /tmp/specdeploy-gpu

and last (carrying `.device/parts.json` and the demo pair's checkpoints, `.device/parked/target` and
`.device/parked/draft`, 20 MB):

    python scripts/gpu_check.py check --store /tmp/specdeploy-gpu --out $OUT

which joins the parts, checks every file's sha256, installs the wheel into the store (pip --no-deps
--target, ahead of the machine's CPU onnxruntime on PYTHONPATH), runs tests/test_cuda.py and `specdeploy
bench --device cuda` on an fp16 export of the demo pair when its checkpoints travelled, and writes
$OUT/gpu_check.json and $OUT/gpu_check.log. Back here: `python scripts/gpu_check.py unpark`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the device machine runs the tree before anything is installed

from specdeploy.bundle import sha256_file as sha256  # noqa: E402  (imports neither numpy nor onnxruntime)

DEMO, PARKED = ROOT / "specdeploy" / "demo", ROOT / ".device" / "parked"
MANIFEST = "parts.json"


def pack(files: list[Path], out: Path, part_bytes: int) -> dict:
    """The files one after another, cut into parts of part_bytes: out/part-NN and out/parts.json, which
    names each file (its size and sha256, in order) and each part (its sha256)."""
    if part_bytes < 1:
        raise SystemExit("error: --part-mb must be positive")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*"):
        old.unlink()
    listed, parts = [], []
    handle, written = None, 0
    for path in files:
        if not path.is_file():
            raise SystemExit(f"error: {path} is not a file")
        listed.append({"name": path.name, "size": path.stat().st_size, "sha256": sha256(path)})
        with open(path, "rb") as source:
            while block := source.read(min(1 << 20, part_bytes)):
                while block:
                    if handle is None or written == part_bytes:
                        if handle is not None:
                            handle.close()
                        handle, written = open(out / f"part-{len(parts):02d}", "wb"), 0
                        parts.append(f"part-{len(parts):02d}")
                    take = block[: part_bytes - written]
                    handle.write(take)
                    written += len(take)
                    block = block[len(take):]
    if handle is not None:
        handle.close()
    manifest = {"files": listed, "parts": [{"name": name, "sha256": sha256(out / name)} for name in parts]}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def receive(carried: Path, store: Path) -> list[str]:
    """Copy the parts this call carried into the store (kept while the machine stays warm); returns the
    parts the store still lacks."""
    manifest = json.loads((carried / MANIFEST).read_text())
    store.mkdir(parents=True, exist_ok=True)
    shutil.copy2(carried / MANIFEST, store / MANIFEST)
    for part in manifest["parts"]:
        source = carried / part["name"]
        if source.is_file() and sha256(source) == part["sha256"]:
            shutil.copy2(source, store / part["name"])
    return missing_parts(store, manifest)


def missing_parts(store: Path, manifest: dict) -> list[str]:
    return [part["name"] for part in manifest["parts"] if not (store / part["name"]).is_file()
            or sha256(store / part["name"]) != part["sha256"]]


def assemble(store: Path) -> list[Path]:
    """Join the store's parts into the files they were cut from (store/files/NAME), each checked against its
    sha256; refuses while a part is missing."""
    manifest = json.loads((store / MANIFEST).read_text())
    missing = missing_parts(store, manifest)
    if missing:
        raise SystemExit(f"error: the store lacks {', '.join(missing)}: receive them first")
    stream = _Parts(store, [part["name"] for part in manifest["parts"]])
    folder = store / "files"
    folder.mkdir(exist_ok=True)
    paths = []
    for entry in manifest["files"]:
        path = folder / entry["name"]
        with open(path, "wb") as handle:
            left = entry["size"]
            while left:
                block = stream.read(min(left, 1 << 20))
                if not block:
                    raise SystemExit(f"error: the parts end inside {entry['name']}")
                handle.write(block)
                left -= len(block)
        if sha256(path) != entry["sha256"]:
            raise SystemExit(f"error: {entry['name']} does not match its sha256 after joining")
        paths.append(path)
    return paths


class _Parts:
    """The parts read as one stream."""

    def __init__(self, store: Path, names: list[str]):
        self.paths, self.handle = [store / name for name in names], None

    def read(self, size: int) -> bytes:
        while True:
            if self.handle is None:
                if not self.paths:
                    return b""
                self.handle = open(self.paths.pop(0), "rb")
            block = self.handle.read(size)
            if block:
                return block
            self.handle.close()
            self.handle = None


def check(store: Path, out: Path) -> int:
    """Install the carried wheel, run the CUDA tests and a measurement; $OUT/gpu_check.json and .log."""
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "gpu_check.log", "w", encoding="utf-8")
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}
    files = assemble(store)
    site = store / "site"
    wheels = [path for path in files if path.name.endswith(".whl")]
    step(report, log, "install", [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                                  str(site), "--upgrade", *map(str, wheels)])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
           "SPECDEPLOY_GPU_RECORD": str(out / "records.jsonl"),
           "LD_LIBRARY_PATH": os.pathsep.join([*nvidia_library_folders(), os.environ.get("LD_LIBRARY_PATH", "")])}
    step(report, log, "providers", [sys.executable, "-c", "import onnxruntime as o; print(o.__version__, "
                                    "o.get_available_providers())"], env)
    step(report, log, "nvidia-smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"], env)
    step(report, log, "cuda tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                                     str(ROOT / "tests" / "test_cuda.py")], env)
    demo = next((folder for folder in (DEMO, PARKED) if (folder / "target" / "config.json").is_file()), None)
    if demo is not None:  # in the tree, or its checkpoints carried from where `park` put them
        bundle = store / "demo-fp16"
        step(report, log, "export demo fp16", [sys.executable, "-m", "specdeploy", "export", "--target",
                                               str(demo / "target"), "--draft", str(demo / "draft"), "--dtype", "fp16",
                                               "--out", str(bundle), "--force"], env)
        step(report, log, "bench demo fp16 cuda", [sys.executable, "-m", "specdeploy", "bench", str(bundle), "--device",
                                                   "cuda", "--exact", "--json", "-k", "2,4"], env, json_out=True)
    records = out / "records.jsonl"
    report["records"] = [json.loads(line) for line in records.read_text().splitlines()] if records.is_file() else []
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    log.close()
    return 0 if all(entry["returncode"] == 0 for entry in report["steps"].values()) else 1


def nvidia_library_folders() -> list[str]:
    """The lib folders of the machine's pip-installed CUDA libraries (PyTorch's nvidia-* packages), where
    onnxruntime-gpu's CUDA provider finds cuBLAS, cuDNN, cudart and cuRAND."""
    result = subprocess.run([sys.executable, "-c", "import nvidia, os; print('\\n'.join(os.path.join(p, d, 'lib') for p in "
                             "nvidia.__path__ for d in sorted(os.listdir(p)) if os.path.isdir(os.path.join(p, d, 'lib'))))"],
                            capture_output=True, text=True)
    return result.stdout.split() if result.returncode == 0 else []


def step(report: dict, log, name: str, command: list[str], env: dict | None = None, json_out: bool = False) -> None:
    """Run one step, its output into the log, its exit code and time (and its last JSON line) into the report."""
    start = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
        code, stdout, stderr = result.returncode, result.stdout, result.stderr
    except OSError as exc:  # the program is missing
        code, stdout, stderr = 127, "", str(exc)
    entry = {"returncode": code, "seconds": round(time.perf_counter() - start, 1), "tail": (stdout + stderr)[-2000:]}
    if json_out and code == 0 and stdout.strip():
        entry["json"] = json.loads(stdout.strip().splitlines()[-1])
    report["steps"][name] = entry
    log.write(f"== {name}: exit {code}, {entry['seconds']} s\n$ {' '.join(command)}\n{stdout}{stderr}\n")
    log.flush()


def park() -> None:
    """Move the tracked demo folder out of the tree that travels (.device is git-ignored); unpark undoes it."""
    if PARKED.exists():
        raise SystemExit(f"error: {PARKED} exists already: unpark first")
    PARKED.parent.mkdir(parents=True, exist_ok=True)
    DEMO.rename(PARKED)
    print(f"parked {DEMO} in {PARKED}")


def unpark() -> None:
    if not PARKED.exists():
        raise SystemExit(f"error: nothing parked at {PARKED}")
    if DEMO.exists():
        raise SystemExit(f"error: {DEMO} exists: move it aside before unparking")
    PARKED.rename(DEMO)
    print(f"restored {DEMO}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("pack", "receive", "check", "park", "unpark"))
    parser.add_argument("paths", nargs="*", type=Path, help="pack: the files; receive: the carried folder")
    parser.add_argument("--out", type=Path, default=None, help="pack: the parts' folder; check: $OUT")
    parser.add_argument("--part-mb", type=float, default=56.0, help="pack: the size of a part, MiB")
    parser.add_argument("--store", type=Path, default=Path("/tmp/specdeploy-gpu"))
    args = parser.parse_args()
    if args.command == "pack":
        if not args.paths or args.out is None:
            parser.error("pack needs the files and --out")
        manifest = pack(args.paths, args.out, int(args.part_mb * (1 << 20)))
        for part in manifest["parts"]:
            print(f"device call: carry {args.out}/{MANIFEST} {args.out}/{part['name']}; "
                  f"python scripts/gpu_check.py receive {args.out} --store {args.store}")
        print(f"device call: carry {args.out}/{MANIFEST} .device/parked/target .device/parked/draft; "
              f"python scripts/gpu_check.py check --store {args.store} --out $OUT")
    elif args.command == "receive":
        if len(args.paths) != 1:
            parser.error("receive needs the carried folder")
        missing = receive(args.paths[0], args.store)
        print(f"the store lacks {', '.join(missing)}" if missing else "every part is in the store")
    elif args.command == "check":
        if args.out is None:
            parser.error("check needs --out")
        return check(args.store, args.out)
    else:
        {"park": park, "unpark": unpark}[args.command]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
