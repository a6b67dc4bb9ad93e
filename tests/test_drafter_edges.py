"""Drafter edges: the policy's cost accounting, the vocabulary subset file, and what load's docs say of lookup_ngram."""

import json
from pathlib import Path

import pytest

import specdeploy
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.drafters import read_vocab_ids

DEMO = Path(specdeploy.__file__).parent / "demo" / "demo-bundle"


@pytest.mark.parametrize("plain_first", [True, False])
def test_a_rounds_engine_time_counts_the_draft_whatever_row_comes_first(plain_first):
    """A batch with a target-only row (speculative=False) beside a drafting row: the engine seconds a round
    starts from (its plan's RoundStart) count the draft's passes as engine time, not as time outside the
    engines (the policy's outside_ms would pay for them twice), whichever row runs first."""
    generator = specdeploy.load(DEMO, drafter="model", max_batch=2, warm_up=False)
    scheduler = generator.scheduler
    plain = generator.new_sequence("def f(x):", max_new_tokens=8, speculative=False, streaming=False)
    drafting = generator.new_sequence("import os\n", max_new_tokens=8, streaming=False)
    for sequence in (plain, drafting) if plain_first else (drafting, plain):
        scheduler.submit(sequence)
    while not (plain.prefilled and drafting.prefilled):
        scheduler.step()
    assert plain.drafter is None and drafting.drafter is not None
    draft = drafting.drafter.engine
    draft.seconds += 5.0  # as if its passes had taken 5 s
    plan = scheduler.schedule()  # the next round, both rows decoding
    assert [work.sequence for work in plan.decode] == ([plain, drafting] if plain_first else [drafting, plain])
    assert plan.round_start.engine_seconds == pytest.approx(generator.target.seconds + draft.seconds)


@pytest.mark.parametrize("ids", [[0.5, 1.5, 2.5], [0, 1, 2.9]])
def test_a_vocabulary_subset_of_fractional_ids_is_refused(tmp_path, ids):
    """Column i of a subset draft's logits is token ids[i]: an id that is no integer names no token
    (NumPy would truncate 1.5 to 1 and map the column to another token)."""
    path = tmp_path / "vocab_ids.json"
    path.write_text(json.dumps({"ids": ids}))
    with pytest.raises(SpecdeployError, match="vocab_ids.json"):
        read_vocab_ids(path, 384, len(ids))


def test_a_vocabulary_subset_with_an_id_out_of_any_range_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "vocab_ids.json"
    path.write_text('{"ids": [1e999, 2, 3]}')  # JSON's 1e999 is float infinity
    with pytest.raises(SpecdeployError, match="vocab_ids.json"):
        read_vocab_ids(path, 384, 3)
    path.write_text('{"ids": [%d, 2, 3]}' % 2**70)
    with pytest.raises(SpecdeployError, match="vocab_ids.json"):
        read_vocab_ids(path, 384, 3)


def test_load_documents_lookup_ngram_as_the_shortest_match():
    """lookup_ngram is the lookup's min_ngram (loader.py): its matches run from MAX_NGRAM down to it."""
    generator = specdeploy.load(DEMO, drafter="prompt-lookup", lookup_ngram=1, warm_up=False)
    lookup = generator.drafter
    assert (lookup.min_ngram, lookup.max_ngram) == (1, 3)
    assert "the longest match" not in " ".join(specdeploy.load.__doc__.split())
