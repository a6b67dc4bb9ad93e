"""The one thing pyproject.toml cannot say without an experimental table: the sampler's C kernel.

The extension is optional: without a C compiler the install still succeeds and the runtime computes
the same in NumPy, slower (see specdeploy/runtime/sampling.py). It is the portable kernel
(specdeploy/runtime/csrc/sampling.c, no Python.h; tests/c drives it alone) and its CPython binding
(specdeploy/runtime/_fastsample.c). -fno-trapping-math lets GCC turn the kernel's selects into vector
blends; -ffp-contract=off keeps every build (AVX-512, AVX2, baseline, aarch64) to the same bits. MSVC
takes neither (nor needs them).
"""

import sys

from setuptools import Extension, setup

FLAGS = [] if sys.platform == "win32" else ["-std=c99", "-fno-trapping-math", "-ffp-contract=off"]

setup(
    ext_modules=[
        Extension("specdeploy.runtime._fastsample",
                  ["specdeploy/runtime/_fastsample.c", "specdeploy/runtime/csrc/sampling.c"],
                  depends=["specdeploy/runtime/csrc/sampling.h"], extra_compile_args=FLAGS, optional=True),
    ]
)
