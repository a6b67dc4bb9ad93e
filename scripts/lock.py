"""Write requirements.lock: every package `make install` installs, each at one exact version.

    python scripts/lock.py          # `make lock`; after a change to pyproject.toml's requirements

pip resolves what `make install` asks for (torch first, then this package with the extras the Makefile
names) without installing anything (`pip install --dry-run --ignore-installed --report`), against the
indexes pip is configured with, and the lock records the versions it chose. `make install` passes the
lock to pip as a constraints file, so a fresh clone gets the versions `make test` last passed with. The
lock holds what pip chose for this interpreter and platform (CI's: CPython 3.11 on Linux x86_64); another
one may need `make install LOCK=` (pyproject.toml's ranges only). torch is recorded without its local
label (`+cpu`), so the version matches whichever index the Makefile's TORCH_INDEX_URL names.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"


def makefile_value(name: str) -> str:
    """A `NAME := value` or `NAME ?= value` line of the Makefile, so the lock resolves what it installs."""
    match = re.search(rf"^{name}\s*[:?]?=\s*(.+)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.MULTILINE)
    if match is None:
        sys.exit(f"error: the Makefile has no {name}")
    return match.group(1).strip()


def resolve() -> list[tuple[str, str]]:
    """(name, version) of every package pip would install into an empty environment, this one excluded."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                   "--report", str(report), f"torch=={makefile_value('TORCH_VERSION')}",
                   "-e", f".[{makefile_value('EXTRAS')}]"]
        subprocess.run(command, cwd=ROOT, check=True)
        chosen = json.loads(report.read_text(encoding="utf-8"))["install"]
    pins = []
    for item in chosen:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if name != "specdeploy":
            pins.append((name, version.split("+")[0] if name == "torch" else version))
    return sorted(pins, key=lambda pin: pin[0].lower())


def main() -> None:
    pins = resolve()
    header = ("# What `make install` installs, each at one exact version: pip's constraints file.\n"
              "# Written by `make lock` (scripts/lock.py) for CPython "
              f"{platform.python_version_tuple()[0]}.{platform.python_version_tuple()[1]} "
              f"on {platform.system()} {platform.machine()}; do not edit.\n")
    LOCK.write_text(header + "".join(f"{name}=={version}\n" for name, version in pins), encoding="utf-8")
    print(f"{LOCK.name}: {len(pins)} packages")


if __name__ == "__main__":
    main()
