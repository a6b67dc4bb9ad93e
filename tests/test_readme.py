"""The README's quickstart, run as a newcomer runs it: its fenced commands, in order, in a plain shell.

The shell starts without the environment on its PATH and with a fresh home, so nothing of the user's
is touched. `make demo` runs whole except the install step (the environment running this test is the one
it would make) and the fetch of SmolLM2 (a download; a tiny GGUF of the same layout stands in for it, so
the export, the question and the bench run as they would): it writes the default bundle in the fresh home,
and every later command runs it. `make test` is the suite running this test, so it is only checked to
exist (`make -n`). A command of a kind this file does not know fails the test, so the README cannot drift
past it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_gguf import write_llama_gguf

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
ACTIVATE = ". .venv/bin/activate"
CHAT_INPUT = "Why is the sky blue?\n"


def quickstart_commands(readme: str) -> list[str]:
    """The command lines of the fenced blocks in the README's Quickstart section, comments removed."""
    section = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", section, re.S | re.M):
        for line in block.splitlines():
            command = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
            if command:
                commands.append(command)
    return commands


def test_the_quickstart_is_a_sequence_this_test_can_run():
    commands = quickstart_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert commands[0] == "make demo" and ACTIVATE in commands
    before_activation = commands[: commands.index(ACTIVATE)]
    for command in commands:
        known = command in ("make demo", "make test", ACTIVATE) or command.startswith("specdeploy ")
        assert known, f"README quickstart: this test does not know how to run {command!r}"
        if command.startswith("specdeploy "):
            assert command not in before_activation, f"{command!r} comes before {ACTIVATE!r} puts specdeploy on the PATH"


def shell_env(home: Path) -> dict:
    """A new shell's: no virtualenv active, the environment's bin off the PATH, a fresh home, no outer make."""
    bin_dir = str(VENV / "bin")
    env = {key: value for key, value in os.environ.items()
           if key not in ("VIRTUAL_ENV", "SPECDEPLOY_HOME", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != Path(bin_dir))
    env["HOME"] = str(home)
    return env


def shell(command: str, env: dict, activated: bool, input: str | None = None) -> subprocess.CompletedProcess:
    script = f"set -e\n{ACTIVATE}\n{command}" if activated else f"set -e\n{command}"
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, input=input,
                          timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(Path(sys.prefix).resolve() != VENV.resolve(),
                    reason="the quickstart's .venv is not the environment running the tests")
def test_the_quickstart_runs_as_written(tmp_path):
    env = shell_env(tmp_path / "home")
    (tmp_path / "home").mkdir()
    demo_bundle = tmp_path / "home" / ".cache" / "specdeploy" / "demo-bundle"
    gguf = write_llama_gguf(tmp_path / "SmolLM2-stand-in.gguf")
    activated = False
    for command in quickstart_commands((ROOT / "README.md").read_text(encoding="utf-8")):
        if command == ACTIVATE:
            result = shell("command -v specdeploy", env, activated=True)
            assert result.returncode == 0 and Path(result.stdout.strip()) == VENV / "bin" / "specdeploy", result.stderr
            before = shell("command -v specdeploy", env, activated=False)  # not the environment's before
            assert before.returncode != 0 or Path(before.stdout.strip()) != VENV / "bin" / "specdeploy"
            activated = True
        elif command == "make test":  # the suite running this test: it exists and runs pytest
            result = shell("make -n test -o .venv/.installed", env, activated)
            assert result.returncode == 0 and "pytest tests" in result.stdout, result.stderr
        elif command == "make demo":
            # everything but the install and the download
            result = shell(f"make demo -o .venv/.installed DEMO_GGUF={gguf}", env, activated)
            assert result.returncode == 0, result.stderr
            assert (demo_bundle / "specdeploy.json").is_file() and "wrote the default bundle" in result.stderr
            assert "speedup" in result.stdout and ". .venv/bin/activate" in result.stderr  # the bench's table
            # the question reached the model through its chat template: the same reply as a run of it
            expected = shell(f"{VENV}/bin/specdeploy run --chat 'Explain in three sentences why the sky is blue.' "
                             "--max-new-tokens 128", env, activated=False)
            assert expected.returncode == 0, expected.stderr
            assert expected.stdout in result.stdout
            again = shell(f"make demo -o .venv/.installed DEMO_GGUF={gguf}", env, activated)  # keeps the bundle
            assert again.returncode == 0 and "running the default bundle already in" in again.stderr, again.stderr
        elif command.startswith("specdeploy chat"):
            result = shell(command, env, activated, input=CHAT_INPUT)
            assert result.returncode == 0, result.stderr
            assert result.stdout.strip() and "exporting" not in result.stderr
        else:
            result = shell(command, env, activated)
            assert result.returncode == 0, result.stderr
            assert "exporting" not in result.stderr
