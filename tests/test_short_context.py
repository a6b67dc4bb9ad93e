"""The edges of the context: a bundle whose context export accepts must load and generate up to its end."""

import pytest

from specdeploy.runtime.loader import load

from conftest import export_pair


@pytest.fixture(scope="module")
def short_bundles(tmp_path_factory, checkpoints):
    """max_context -> a bundle of the tiny Llama pair exported with that (tiny) context."""
    pair = checkpoints("llama")
    root = tmp_path_factory.mktemp("short-context")
    return {n: (export_pair(pair, root / f"ctx{n}", max_context=n), root / f"ctx{n}")[1] for n in (2, 6)}


def test_a_two_token_context_bundle_loads_and_generates(short_bundles):
    """export accepts --max-context 2 (its floor), and the manifest too; the load's warm-up must then not
    refuse the bundle with a 2-token prompt of its own (a one-token prompt has room for one new token)."""
    generator = load(short_bundles[2])  # warm_up=True, as every CLI command loads
    output = generator.generate([5], max_new_tokens=4)
    assert len(output.token_ids) == 1 and output.stats.finish_reason == "length"


def test_a_short_context_bundle_loads_with_several_slots(short_bundles):
    """max_batch > 1 calibrates the speculation policy at load: on a 6-token context its timed passes must fit
    (or be skipped), not fail the load with 'a calibration prompt ... leaves no room'."""
    generator = load(short_bundles[6], max_batch=2)
    alone = load(short_bundles[6], warm_up=False)
    prompts = [[5], [6, 7]]
    expected = [alone.generate(p, max_new_tokens=9, speculative=False).token_ids for p in prompts]
    outputs = generator.generate_many(prompts, max_new_tokens=9)
    assert [o.token_ids for o in outputs] == expected
    assert [len(o.token_ids) for o in outputs] == [5, 4]
