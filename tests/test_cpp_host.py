"""examples/cpp: `make host` builds specdeploy-host, whose streamed text is `specdeploy run`'s greedy text.

Random-weight models emit byte tokens that are not valid UTF-8, and decoders differ on those (ours
writes U+FFFD, genai's stream drops them): their text is compared when it is valid, and their token
count always. The trained pairs write valid text, compared on every prompt.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ARCHITECTURES
from test_genai_host import PROMPTS, specdeploy_run

from specdeploy.bundle import load_manifest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[hosts]' in the specdeploy clone)")

REPO = Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> Path:
    """`make host` against this interpreter's environment, into a temporary build folder."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed, so the C++ host cannot be built")
    build = tmp_path_factory.mktemp("cpp-build")
    subprocess.run(["make", "-C", str(REPO), "host", f"VENV={sys.prefix}", f"BUILD={build}"], check=True,
                   capture_output=True, text=True)
    return build / "specdeploy-host"


def run_host(host: Path, folder: Path, prompt: str, tmp_path: Path, max_new_tokens: int = MAX_NEW_TOKENS):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_bytes(prompt.encode())
    env = {key: value for key, value in os.environ.items() if key != "LD_LIBRARY_PATH"}  # the rpath finds both libraries
    return subprocess.run([str(host), str(folder), str(prompt_file), str(max_new_tokens)], capture_output=True,
                          env=env)


def new_tokens_reported(stderr: bytes) -> int:
    """The host's statistics line: 'N prompt tokens, M new tokens; ...' -> M."""
    line = next(line for line in stderr.decode().splitlines() if " new tokens" in line)
    return int(line.split(", ")[1].split()[0])


def assert_host_matches_run(host, bundle, folder, flags, tmp_path, always_text: bool):
    for prompt in PROMPTS:
        ours = specdeploy_run(bundle, prompt, *flags)
        result = run_host(host, folder, prompt, tmp_path)
        assert result.returncode == 0, result.stderr.decode()
        assert new_tokens_reported(result.stderr) == len(ours["token_ids"])  # both count a final end-of-sequence
        if always_text or "\ufffd" not in ours["text"]:
            assert result.stdout.decode() == ours["text"], f"prompt {prompt!r}"
        speculating = b"draft tokens accepted" in result.stderr
        assert speculating == (folder == bundle)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_host_greedy_text_equals_specdeploy_run(host, bundles, arch, tmp_path):
    bundle = bundles(arch)
    assert_host_matches_run(host, bundle, bundle, (), tmp_path, always_text=False)
    target_only = bundle / load_manifest(bundle).genai.target_only
    assert_host_matches_run(host, bundle, target_only, ("--no-speculative",), tmp_path, always_text=False)


@pytest.mark.slow
def test_host_writes_the_demo_pairs_text(host, demo_bundle, tmp_path):
    target_only = demo_bundle / load_manifest(demo_bundle).genai.target_only
    assert_host_matches_run(host, demo_bundle, demo_bundle, (), tmp_path, always_text=True)
    assert_host_matches_run(host, demo_bundle, target_only, ("--no-speculative",), tmp_path, always_text=True)


def test_host_bad_input_is_one_error_line(host, bundles, tmp_path):
    bundle = bundles("llama")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f(x):")
    cases = [
        ([], "usage: specdeploy-host BUNDLE PROMPT_FILE MAX_NEW_TOKENS"),
        ([str(tmp_path), str(prompt), "8"], "has no genai_config.json"),
        ([str(bundle), str(tmp_path / "missing.txt"), "8"], "cannot read the prompt file"),
        ([str(bundle), str(prompt), "0"], "MAX_NEW_TOKENS must be a positive integer"),
        ([str(bundle), str(prompt), "8x"], "MAX_NEW_TOKENS must be a positive integer"),
    ]
    for args, message in cases:
        result = subprocess.run([str(host), *args], capture_output=True, text=True)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.startswith("error: ") and message in result.stderr and result.stderr.count("\n") == 1


def test_host_stops_at_the_bundles_max_context(host, bundles, tmp_path):
    """A prompt near max_context with more new tokens than fit: `specdeploy run` (and the Node host) stop at the
    context; the C++ host must too, not refuse to start (max_length = prompt + MAX_NEW_TOKENS > context_length)."""
    from tokenizers import Tokenizer

    bundle = bundles("llama")
    max_context = load_manifest(bundle).max_context
    tokenizer = Tokenizer.from_file(str(bundle / "tokenizer" / "tokenizer.json"))
    prompt, line = "", "def f(x):\n    return x + 1\n"
    while len(tokenizer.encode(prompt).ids) < max_context - 6:
        prompt += line[len(prompt) % len(line)]
    ours = specdeploy_run(bundle, prompt, max_new_tokens=MAX_NEW_TOKENS)
    assert len(ours["token_ids"]) < MAX_NEW_TOKENS  # the context ended it
    result = run_host(host, bundle, prompt, tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    assert new_tokens_reported(result.stderr) == len(ours["token_ids"])


def test_host_runs_a_bundle_without_a_draft_from_its_target_folder(host, draftless_bundle, tmp_path):
    """No speculative config at the root: one error line naming BUNDLE/target, which runs `run`'s text."""
    result = run_host(host, draftless_bundle, PROMPTS[0], tmp_path)
    assert result.returncode == 2 and result.stdout == b"" and result.stderr.decode().count("\n") == 1
    assert "BUNDLE/target runs the target alone" in result.stderr.decode()
    target_only = draftless_bundle / load_manifest(draftless_bundle).genai.target_only
    assert_host_matches_run(host, draftless_bundle, target_only, (), tmp_path, always_text=True)
