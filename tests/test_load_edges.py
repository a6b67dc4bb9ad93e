"""The Python API at its edges, on the shipped demo bundle (no export, no torch): a max_batch whose KV caches
cannot fit, a per-session pool after the shared one, bad SessionConfig fields, calibrate's arguments, and
load's flags."""

import os
import subprocess
import sys
import textwrap

import pytest

import specdeploy
from specdeploy.defaults import SHIPPED_BUNDLE
from specdeploy.errors import SpecdeployError
from specdeploy.runtime import SessionConfig


def test_a_max_batch_whose_kv_caches_cannot_fit_is_refused_by_name():
    """The KV-memory check (manifest._check_kv_memory) counts one slot; max_batch slots were mapped
    unchecked and the map failed with a bare OSError ([Errno 12] Cannot allocate memory)."""
    with pytest.raises(SpecdeployError, match="max_batch"):
        specdeploy.load(SHIPPED_BUNDLE, max_batch=10**9, warm_up=False)


def test_a_per_session_pool_after_the_shared_pool_is_one_clear_refusal():
    """Once a load has started ONNX Runtime's shared pool, ONNX Runtime opens no session with a pool of its
    own: a load with shared_threads=False says so, naming the way out, instead of blaming the model file."""
    script = textwrap.dedent(f"""
        import specdeploy
        from specdeploy.errors import SpecdeployError
        from specdeploy.runtime import SessionConfig
        first = specdeploy.load({str(SHIPPED_BUNDLE)!r}, warm_up=False)
        try:
            specdeploy.load({str(SHIPPED_BUNDLE)!r}, warm_up=False, session=SessionConfig(shared_threads=False))
        except SpecdeployError as exc:
            print(exc)
        print(len(first.generate("def fib(n):", max_new_tokens=4).token_ids))
    """)
    env = {k: v for k, v in os.environ.items() if k != "SPECDEPLOY_SHARED_THREADS"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    message, generated = result.stdout.strip().splitlines()[-2:]
    assert "shared thread pool" in message and "SPECDEPLOY_SHARED_THREADS=0" in message and "model.onnx" not in message
    assert generated == "4"  # the first generator goes on


@pytest.mark.parametrize("options, name", [(dict(graph_optimization="bogus"), "graph_optimization"),
                                           (dict(intra_op_threads="2"), "intra_op_threads"),
                                           (dict(memory_arena="no"), "memory_arena")])
def test_a_bad_session_config_is_refused_naming_the_setting(options, name):
    """SessionConfig is never checked: a bad field surfaced as 'ONNX Runtime cannot load
    .../target/model.onnx: 'bogus'' (or pybind's 'incompatible function arguments'), blaming the model file."""
    with pytest.raises(SpecdeployError, match=name):
        specdeploy.load(SHIPPED_BUNDLE, warm_up=False, session=SessionConfig(**options))


@pytest.mark.parametrize("arguments", [([5, 9, 13, 40], "4"), ([5, 9, 13, 40], 0), ([5, 10**6], 4)],
                         ids=["k-string", "k-zero", "id-outside-vocab"])
def test_calibrate_refuses_bad_arguments_with_specdeploy_error(arguments):
    """Generator.calibrate took its arguments unchecked: ONNX Runtime's RuntimeError (an id outside the
    vocabulary), TypeError (k a string). It takes a prompt as generate does (text, or ids, checked)."""
    generator = specdeploy.load(SHIPPED_BUNDLE, warm_up=False, max_batch=2)
    with pytest.raises(SpecdeployError):
        generator.calibrate(*arguments)
    generator.reset()
    assert len(generator.generate("def fib(n):", max_new_tokens=4).token_ids) == 4


@pytest.mark.parametrize("flag", ["verify", "warm_up"])
def test_load_flags_must_be_true_or_false(flag):
    with pytest.raises(SpecdeployError, match=flag):
        specdeploy.load(SHIPPED_BUNDLE, **{flag: "no"})


@pytest.mark.parametrize("prompt", ["def fib(n):", []], ids=["text", "empty"])
def test_calibrate_takes_a_prompt_as_generate_does(prompt):
    generator = specdeploy.load(SHIPPED_BUNDLE, warm_up=False, max_batch=2)
    generator.calibrate(prompt, 2)
    generator.reset()
    assert len(generator.generate("def fib(n):", max_new_tokens=4).token_ids) == 4


def test_calibrate_refuses_while_a_stream_is_open_and_the_stream_goes_on_as_alone():
    """calibrate times passes in every slot's caches: with a stream open it overwrote that stream's KV cache, and
    the stream's greedy tokens went wrong. It is refused until the stream ends."""
    generator = specdeploy.load(SHIPPED_BUNDLE, warm_up=False, max_batch=2)
    prompt = "def fibonacci(n):\n"
    alone = generator.generate(prompt, max_new_tokens=40, temperature=0).token_ids
    stream = generator.stream(prompt, max_new_tokens=40, temperature=0)
    pieces = iter(stream)
    next(pieces)
    with pytest.raises(SpecdeployError, match="finish or close"):
        generator.calibrate("class Stack:\n", 3)
    list(pieces)
    assert stream.output.token_ids == alone
    generator.calibrate("class Stack:\n", 3)  # once nothing generates
    assert generator.generate(prompt, max_new_tokens=40, temperature=0).token_ids == alone

