"""Constrained decoding (runtime/constraint.py): output held to a JSON schema, a regular expression or a grammar,
exactly the constrained target's, greedy and sampled, speculative or not, alone or batched with free requests."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from scipy import stats as scipy_stats

import specdeploy
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.sampling import SamplingParams, process_logits
from test_serve import chat_bundle  # noqa: F401 (fixture)

PROMPT = "def f(x):"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"}},
          "required": ["name", "size"], "additionalProperties": False}
REGEX = r"(return|yield) [a-z_]{1,12}\(x\)"
LARK = 'start: "x = " NUMBER ("," NUMBER)*\nNUMBER: /[0-9]{1,3}/'
GBNF = 'root ::= "x = " num ("," num)*\nnum ::= [0-9] [0-9]?'


def reference_greedy(generator, prompt_ids: list[int], grammar: str, max_new_tokens: int) -> list[int]:
    """Constrained target-only greedy decoding written out: the target's logits at each position, the tokens
    llguidance disallows there at -inf, the argmax (a fresh matcher, none of the runtime's constraint code)."""
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    compiler = generator.constraint_compiler()
    matcher = llguidance.LLMatcher(compiler.llg_tokenizer(), grammar, log_level=0)
    vocab = generator.target.spec.vocab_size
    bitmask = allocate_token_bitmask(1, vocab)
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        logits = generator.target.logits_after(prompt_ids + tokens, generator.target_cache).astype(np.float64)
        fill_next_token_bitmask(matcher, bitmask, 0)
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        token = int(np.where(allowed, logits, -np.inf).argmax())
        tokens.append(token)
        if token in generator.eos_token_ids:
            break
        assert matcher.consume_token(token)
    return tokens


def grammar_of(**constraint) -> str:
    from specdeploy.runtime.config import GenerationConfig

    return GenerationConfig(**constraint).constraint.grammar()


@pytest.mark.parametrize("drafter", ["model", "hybrid", "prompt-lookup"])
@pytest.mark.parametrize("constraint", [dict(json_schema=SCHEMA), dict(regex=REGEX), dict(grammar=LARK),
                                        dict(grammar=GBNF)], ids=["json_schema", "regex", "lark", "gbnf"])
def test_greedy_constrained_output_is_the_constrained_target_only_output(agreeing_bundle, drafter, constraint):
    generator = specdeploy.load(agreeing_bundle, drafter=drafter)
    prompt_ids = generator.codec.encode(PROMPT)
    expected = reference_greedy(generator, prompt_ids, grammar_of(**constraint), 40)
    baseline = generator.generate(prompt_ids, max_new_tokens=40, speculative=False, **constraint)
    assert baseline.token_ids == expected
    for k in (1, 2, 4):
        out = generator.generate(prompt_ids, max_new_tokens=40, num_draft_tokens=k, **constraint)
        assert out.token_ids == expected, (drafter, k)
        assert out.text == baseline.text


def test_complete_outputs_match_their_constraint(agreeing_bundle):
    """Where the constraint completes within the budget the text is in its language; forced runs (a JSON
    key the schema fixes) are appended without a pass."""
    generator = specdeploy.load(agreeing_bundle)
    out = generator.generate(PROMPT, max_new_tokens=200, json_schema=SCHEMA)
    assert out.stats.finish_reason == "eos", out.text
    value = json.loads(out.text)
    assert set(value) == {"name", "size"} and isinstance(value["size"], int)
    assert out.stats.forced_tokens > 0
    out = generator.generate(PROMPT, max_new_tokens=40, regex=REGEX)
    assert out.stats.finish_reason == "eos" and re.fullmatch(REGEX, out.text), out.text
    for temperature in (0.0, 1.0):  # ignore_eos: the run stops where the constraint is complete
        out = generator.generate(PROMPT, max_new_tokens=60, regex=REGEX, ignore_eos=True, temperature=temperature)
        assert out.stats.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text


@pytest.mark.slow
def test_sampled_constrained_speculative_matches_the_constrained_target_distribution(agreeing_bundle):
    """The first three tokens of 4,000 seeded k = 2 runs against the exact constrained target distribution: the
    target's logits masked at each position, then the sampling setting, position by position."""
    import llguidance

    generator = specdeploy.load(agreeing_bundle, drafter="model")
    prompt_ids = generator.codec.encode(PROMPT)
    regex = r"[a-z]{1,3}[ (][a-z]+"
    params = SamplingParams(temperature=1.0, top_k=3)
    compiler = generator.constraint_compiler()
    grammar = grammar_of(regex=regex)

    def probs(tokens: list[int]) -> np.ndarray:  # [vocab] the constrained target's distribution after tokens
        matcher = llguidance.LLMatcher(compiler.llg_tokenizer(), grammar, log_level=0)
        assert all(matcher.consume_token(t) for t in tokens)
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
        bitmask = allocate_token_bitmask(1, generator.target.spec.vocab_size)
        fill_next_token_bitmask(matcher, bitmask, 0)
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: generator.target.spec.vocab_size]
        logits = generator.target.logits_after(prompt_ids + tokens, generator.target_cache)
        masked = np.where(allowed.astype(bool), logits, -np.inf).astype(np.float32)
        return process_logits(masked[None], params)[0].astype(np.float64)

    exact = {(): 1.0}
    for _ in range(3):
        exact = {seq + (int(t),): p * row[t] for seq, p in exact.items() for row in [probs(list(seq))]
                 for t in np.flatnonzero(row > 0)}
    runs, counts, accepted = 4000, {}, 0
    for seed in range(runs):
        out = generator.generate(prompt_ids, max_new_tokens=3, temperature=1.0, top_k=3, seed=seed, num_draft_tokens=2,
                                 regex=regex)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        accepted += out.stats.accepted
    assert set(counts) <= set(exact)  # nothing outside the constraint
    assert accepted > runs // 4  # the rejection path and the acceptance path both ran
    keys = sorted(exact)
    observed = np.array([counts.get(key, 0) for key in keys])
    expected = np.array([exact[key] for key in keys]) * runs
    assert scipy_stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3


def test_constrained_and_free_requests_share_passes_as_they_run_alone(agreeing_bundle):
    """Four requests in one batch, two constrained, two free: each gives what it gives alone."""
    requests = [dict(regex=REGEX), {}, dict(json_schema=SCHEMA), dict(temperature=0.8, seed=5)]
    prompts = [PROMPT, "import os\n", "class A:", PROMPT]
    alone = specdeploy.load(agreeing_bundle, exact=True)
    expected = [alone.generate(p, max_new_tokens=30, **r).token_ids for p, r in zip(prompts, requests)]
    batched = specdeploy.load(agreeing_bundle, exact=True, max_batch=4)
    sequences = [batched.new_sequence(p, streaming=False, max_new_tokens=30, **r) for p, r in zip(prompts, requests)]
    for sequence in sequences:
        batched.scheduler.submit(sequence)
    while not all(sequence.finished for sequence in sequences):
        batched.scheduler.step()
    assert [sequence.output().token_ids for sequence in sequences] == expected


@pytest.mark.parametrize("constraint, message", [
    (dict(regex="a", json_schema={"type": "string"}), "one constraint at a time"),
    (dict(regex="(unclosed"), "regex"),
    (dict(json_schema="{not json"), "json_schema is not JSON"),
    (dict(json_schema=[1, 2]), "json_schema must be"),
    (dict(grammar="start: undefined_rule"), "grammar"),
    (dict(regex=""), "regex must be a non-empty string"),
])
def test_a_bad_constraint_is_one_error(agreeing_bundle, constraint, message):
    generator = specdeploy.load(agreeing_bundle)
    with pytest.raises(SpecdeployError, match=re.escape(message)) as error:
        generator.generate(PROMPT, max_new_tokens=4, **constraint)
    assert "\n" not in str(error.value)


def test_run_and_chat_take_a_constraint_from_their_flags(agreeing_bundle, chat_bundle, tmp_path):
    from click.testing import CliRunner

    from specdeploy.cli import main

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    grammar_file = tmp_path / "list.gbnf"
    grammar_file.write_text(GBNF)
    runner = CliRunner()
    result = runner.invoke(main, ["run", str(agreeing_bundle), "--prompt", PROMPT, "--json-schema", str(schema_file),
                                  "--max-new-tokens", "200", "--no-stream"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)) == {"name", "size"} and "forced by the constraint" in result.stderr
    result = runner.invoke(main, ["run", str(agreeing_bundle), "--prompt", PROMPT, "--grammar", str(grammar_file)])
    assert result.exit_code == 0 and re.fullmatch(r"x = [0-9]{1,2}(,[0-9]{1,2})*", result.stdout), result.output
    result = runner.invoke(main, ["chat", str(chat_bundle), "--regex", REGEX], input="hello\n")
    assert result.exit_code == 0 and re.search(REGEX, result.stdout), result.output
    for args, message in ((["--regex", "("], "error: regex: "), (["--regex", "a", "--json-schema", str(schema_file)],
                          "error: one constraint at a time"), (["--grammar", str(tmp_path / "none")], "--grammar")):
        result = runner.invoke(main, ["run", str(agreeing_bundle), "--prompt", PROMPT, *args])
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.exit_code == 2 and len(errors) == 1 and message in errors[0], result.output


@pytest.mark.parametrize("bundle_name", ["eagle_bundle", "subset_bundle"])
def test_drafts_that_read_target_features_or_cover_a_vocabulary_subset(request, bundle_name):
    """An eagle head needs the target's features at every position, so no token is forced past it; a draft
    over a vocabulary subset stops proposing where the constraint allows none of its tokens (sampled rows
    would have no distribution). Greedy: the constrained target-only output; sampled: valid and complete."""
    generator = specdeploy.load(request.getfixturevalue(bundle_name), drafter="model")
    prompt_ids = generator.codec.encode(PROMPT)
    expected = reference_greedy(generator, prompt_ids, grammar_of(json_schema=SCHEMA), 120)
    for k in (2, 4):
        assert generator.generate(prompt_ids, max_new_tokens=120, json_schema=SCHEMA, num_draft_tokens=k).token_ids \
            == expected
    for seed in range(3):
        out = generator.generate(prompt_ids, max_new_tokens=200, json_schema=SCHEMA, temperature=1.0, seed=seed)
        assert out.stats.finish_reason == "eos" and set(json.loads(out.text)) == {"name", "size"}, out.text


def test_a_constraint_ended_by_an_end_of_turn_the_request_does_not_stop_at_stops_there(chat_bundle):
    """The matcher may end at the chat template's end of turn; a prompt request stops only at the bundle's EOS
    ids. Where they differ, the generation stops once the constraint has taken its end token, not at
    max_new_tokens."""
    generator = specdeploy.load(chat_bundle)
    assert generator.end_of_turn_ids
    generator.eos_token_ids = frozenset()  # this bundle's end of turn is its EOS: make them differ
    for seed in range(3):
        out = generator.generate(PROMPT, max_new_tokens=60, regex=REGEX, temperature=1.0, seed=seed)
        assert out.stats.finish_reason == "stop" and out.stats.new_tokens < 60, out.token_ids
        assert re.fullmatch(REGEX, generator.codec.decode(out.token_ids[:-1])), out.text


def test_a_constraint_compiled_once_gives_each_sequence_a_matcher_of_its_own(agreeing_bundle):
    """The compiler keeps a compiled constraint and hands out copies: two sequences of one schema advance apart."""
    from specdeploy.runtime.constraint import ConstraintSpec

    compiler = specdeploy.load(agreeing_bundle).constraint_compiler()
    spec = ConstraintSpec("regex", REGEX)
    first, second = compiler.constraint(spec), compiler.constraint(spec)
    assert first.matcher is not second.matcher
    start = second.disallowed(()).copy()
    token = int(np.flatnonzero(~start)[0])
    first.commit([token])
    assert np.array_equal(second.disallowed(()), start) and not np.array_equal(first.disallowed(()), start)
