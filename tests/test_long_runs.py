"""Long runs: what one generation keeps stays flat while thousands of tokens are generated inside the
context, and reaching the context limit ends generation as `length`, with a note, never an error.

Memory is counted, not sampled: tracemalloc traces every Python object and NumPy buffer the runtime
allocates, the same on every run whatever else the machine does. The process's resident memory (what
ONNX Runtime's own allocations add) is a measurement, recorded in docs/performance.md, not a test."""

import tracemalloc

import specdeploy

from conftest import LONG_CONTEXT

# What a generation keeps per token, by design: its context and new-token lists and the ints in them
# (~45 bytes), and, streamed, the token's text. A row of logits kept per pass is 1.5 KB at this pair's
# 384-token vocabulary, several times the bound.
KEPT_PER_TOKEN = 160  # bytes


def _kept_per_token(generator, max_new_tokens: int, **options) -> tuple[float, object]:
    """Bytes of Python and NumPy memory still allocated per token streamed, between a quarter of the way
    and the end of one run (after a warm-up run of the same length, so that every buffer a pass can
    need exists already), leaving out the KV caches' own arrays: they hold the context by design, and
    a concatenating cache keeps a truncated copy or not depending on the last round's acceptance."""
    generator.generate("def f(x):", max_new_tokens=max_new_tokens, **options)
    pieces = generator.stream("def f(x):", max_new_tokens=max_new_tokens, **options)
    quarter = max_new_tokens // 4
    outside_caches = [tracemalloc.Filter(False, "*/specdeploy/runtime/kv_cache.py")]
    tracemalloc.start()
    try:
        for count, _ in enumerate(pieces, 1):  # pieces: about one per token
            if count == quarter:
                start = tracemalloc.take_snapshot().filter_traces(outside_caches)
        end = tracemalloc.take_snapshot().filter_traces(outside_caches)
    finally:
        tracemalloc.stop()
    kept = sum(stat.size_diff for stat in end.compare_to(start, "filename"))
    stats = pieces.output.stats
    return kept / (stats.new_tokens - quarter), stats


def test_memory_kept_is_flat_up_to_the_context_limit(long_bundle):
    generator = specdeploy.load(long_bundle)
    assert not generator.eos_token_ids  # this pair has no EOS: every run goes to its budget
    per_token, stats = _kept_per_token(generator, LONG_CONTEXT * 2, speculative=False, temperature=0.8, seed=3)
    assert stats.finish_reason == "length" and "max context of 4608" in stats.note
    assert stats.prompt_tokens + stats.new_tokens == LONG_CONTEXT and stats.new_tokens > 4000  # to the limit, no error
    assert per_token < KEPT_PER_TOKEN, f"{per_token:.0f} bytes kept per token"


def test_memory_kept_is_flat_with_a_concatenating_draft(long_bundle):
    """The draft here is optimum's graph: a new past length every pass. ONNX Runtime's per-shape memory
    patterns grew with every token until they were turned off for such graphs: the session must keep
    them off (the target's fused graph, one shape of buffers, keeps them on). Fewer tokens than the
    context allows: its passes copy the cache, so time grows with the square."""
    generator = specdeploy.load(long_bundle, drafter="model")
    assert not generator.drafter.cache.shared_buffer
    assert not generator.drafter.engine.session.get_session_options().enable_mem_pattern
    assert generator.target.session.get_session_options().enable_mem_pattern
    per_token, stats = _kept_per_token(generator, 1500, temperature=0.8, seed=3)
    assert stats.new_tokens == 1500 and stats.drafted > 0
    assert per_token < KEPT_PER_TOKEN, f"{per_token:.0f} bytes kept per token"


def test_the_context_limit_is_a_length_finish_on_every_path(long_bundle):
    generator = specdeploy.load(long_bundle)
    prompt = [2 + i % 300 for i in range(LONG_CONTEXT - 6)]  # 6 positions left
    for options in ({"speculative": True}, {"speculative": False}, {"temperature": 1.0, "num_draft_tokens": 8}):
        output = generator.generate(prompt, max_new_tokens=50, **options)
        assert len(output.token_ids) == 6 and output.stats.finish_reason == "length"
        assert output.stats.note.startswith("stopped at the bundle's max context of 4608 tokens")
    output = generator.generate(prompt, max_new_tokens=6)
    assert output.stats.finish_reason == "length" and output.stats.note == ""  # max_new_tokens, not the context
