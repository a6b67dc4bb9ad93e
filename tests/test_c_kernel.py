"""The sampler's C kernel on its own: tests/c/test_sampling.c checks it against references it computes
itself, built here natively, with the portable loops (FS_PORTABLE: none of GCC's extensions), with
clang, and cross-compiled for aarch64 (Debian's gcc-aarch64-linux-gnu) and run under qemu-aarch64
(Debian's qemu-user). Every build must pass, and print the same digest of the kernel's outputs: the
same bits on every build and CPU."""

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "specdeploy" / "runtime" / "csrc"
SOURCES = [ROOT / "tests" / "c" / "test_sampling.c", CSRC / "sampling.c"]
# setup.py's flags at the optimization CPython builds extensions with (-O3: GCC vectorizes the loops there),
# every warning an error, and no Python include directory: the kernel needs none.
FLAGS = ["-std=c99", "-O3", "-fno-trapping-math", "-ffp-contract=off", "-pthread", "-Wall", "-Wextra", "-Werror",
         f"-I{CSRC}"]
CC = os.environ.get("CC", "cc")
CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
HANG = 600  # seconds: a guard against a hung build or emulator, not a measurement


def build(compiler: str, output: Path, *extra: str) -> Path:
    done = subprocess.run([compiler, *FLAGS, *extra, *map(str, SOURCES), "-lm", "-o", str(output)],
                          capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, done.stderr
    return output


def run(*command) -> str:
    """The driver's digest (stdout); its FAIL lines (stderr) when a check failed."""
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") >= 20, done.stdout  # every section printed its line
    return done.stdout


needs_cc = pytest.mark.skipif(shutil.which(CC) is None, reason=f"no C compiler ({CC})")


@pytest.fixture(scope="module")
def native_digest(tmp_path_factory) -> str:
    if shutil.which(CC) is None:
        pytest.skip(f"no C compiler ({CC})")
    return run(build(CC, tmp_path_factory.mktemp("c") / "test_sampling"))


@needs_cc
def test_the_kernel_passes_its_driver(native_digest):
    assert native_digest.startswith("exp ")


@needs_cc
def test_the_portable_loops_compute_the_same_bits(native_digest, tmp_path):
    """FS_PORTABLE compiles the plain-C fallback of every GCC vector extension and target clone."""
    assert run(build(CC, tmp_path / "portable", "-DFS_PORTABLE")) == native_digest


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is not installed (Debian: apt-get install clang)")
@pytest.mark.parametrize("variant", [(), ("-DFS_PORTABLE",)], ids=["vector-extensions", "portable"])
def test_clang_builds_compute_the_same_bits(native_digest, tmp_path, variant):
    """clang (macOS's compiler) defines __GNUC__ but has GCC's vector extensions only in part."""
    assert run(build("clang", tmp_path / "clang", *variant)) == native_digest


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is not installed (Debian: apt-get install clang)")
def test_the_binding_compiles_with_clang():
    """pip builds the binding with the platform's compiler; where that is clang, it must compile too, or
    installs fall back to NumPy without a word."""
    result = subprocess.run(["clang", "-std=c99", "-fsyntax-only", "-Werror=implicit-function-declaration",
                             "-I", sysconfig.get_paths()["include"], str(ROOT / "specdeploy/runtime/_fastsample.c")],
                            capture_output=True, text=True, timeout=HANG)
    assert result.returncode == 0, result.stderr


def cross_toolchain() -> bool:
    """The cross compiler, its static C library (libc6-dev-arm64-cross, only recommended by gcc-aarch64-linux-gnu)
    and the emulator."""
    if shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None:
        return False
    found = subprocess.run([CROSS_CC, "-print-file-name=libc.a"], capture_output=True, text=True, timeout=HANG)
    return os.path.isabs(found.stdout.strip())


@pytest.mark.skipif(not cross_toolchain(), reason="no aarch64 cross toolchain: apt-get install gcc-aarch64-linux-gnu "
                                                  "libc6-dev-arm64-cross qemu-user")
def test_the_aarch64_build_computes_the_same_bits(native_digest, tmp_path):
    """The Jetson boxes' CPU: the driver cross-compiled (static, so that qemu needs no aarch64 sysroot) passes
    under qemu-aarch64 and prints the native build's digest. Its loops are GCC's vector extensions, which
    become NEON there."""
    assert run(QEMU, build(CROSS_CC, tmp_path / "aarch64", "-static")) == native_digest
