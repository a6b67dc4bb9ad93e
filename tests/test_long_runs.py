"""Long runs: resident memory stays flat while thousands of tokens are generated inside the
context, and reaching the context limit ends generation as `length`, with a note, never an error."""

import os
from pathlib import Path

import pytest

import specdeploy

from conftest import LONG_CONTEXT

STATM = Path("/proc/self/statm")


def resident_mib() -> float:
    return int(STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _growth_per_1000(generator, max_new_tokens: int, **options) -> tuple[float, list[float], object]:
    """RSS growth (MiB per 1,000 tokens) over the last three quarters of one streamed run, after a warm-up.

    The warm-up is the same run: a shared-buffer KV cache is mapped lazily, so the first run to a
    length also brings in the pages of every position it reaches (bounded by the cache's size,
    and not what this measures)."""
    generator.generate("def f(x):", max_new_tokens=max_new_tokens, **options)
    samples = []
    pieces = generator.stream("def f(x):", max_new_tokens=max_new_tokens, **options)
    for count, _ in enumerate(pieces, 1):
        if count % 100 == 0:  # pieces: about one per token
            samples.append(resident_mib())
    stats = pieces.output.stats
    steady = samples[len(samples) // 4 :]
    return (steady[-1] - steady[0]) / (stats.new_tokens * 3 / 4) * 1000, samples, stats


@pytest.mark.skipif(not STATM.exists(), reason="resident memory is read from /proc")
def test_resident_memory_is_flat_up_to_the_context_limit(long_bundle):
    generator = specdeploy.load(long_bundle)
    assert not generator.eos_token_ids  # this pair has no EOS: every run goes to its budget
    growth, samples, stats = _growth_per_1000(generator, LONG_CONTEXT * 2, speculative=False, temperature=0.8, seed=3)
    assert stats.finish_reason == "length" and "max context of 4608" in stats.note
    assert stats.prompt_tokens + stats.new_tokens == LONG_CONTEXT and stats.new_tokens > 4000  # to the limit, no error
    assert growth < 1.0, f"RSS grew {growth:.2f} MiB per 1,000 tokens ({samples})"


@pytest.mark.skipif(not STATM.exists(), reason="resident memory is read from /proc")
def test_resident_memory_is_flat_with_a_concatenating_draft(long_bundle):
    """The draft here is optimum's graph: a new past length every pass (ONNX Runtime's per-shape
    memory patterns grew with every token before they were turned off for such graphs). Fewer
    tokens than the context allows: its passes copy the cache, so time grows with the square."""
    generator = specdeploy.load(long_bundle, drafter="model")
    assert not generator.drafter.cache.shared_buffer
    growth, samples, stats = _growth_per_1000(generator, 1500, temperature=0.8, seed=3)
    assert stats.new_tokens == 1500 and stats.drafted > 0
    assert growth < 1.0, f"RSS grew {growth:.2f} MiB per 1,000 tokens ({samples})"


def test_the_context_limit_is_a_length_finish_on_every_path(long_bundle):
    generator = specdeploy.load(long_bundle)
    prompt = [2 + i % 300 for i in range(LONG_CONTEXT - 6)]  # 6 positions left
    for options in ({"speculative": True}, {"speculative": False}, {"temperature": 1.0, "num_draft_tokens": 8}):
        output = generator.generate(prompt, max_new_tokens=50, **options)
        assert len(output.token_ids) == 6 and output.stats.finish_reason == "length"
        assert output.stats.note.startswith("stopped at the bundle's max context of 4608 tokens")
    output = generator.generate(prompt, max_new_tokens=6)
    assert output.stats.finish_reason == "length" and output.stats.note == ""  # max_new_tokens, not the context
