"""logprobs: each new token's log-probability is the target's own, whichever pass produced it."""

import numpy as np
import pytest

import specdeploy
from specdeploy.errors import SpecdeployError


def reference(generator, prompt_ids, tokens):
    """Target-only log-softmax of every new token, one fresh pass per position."""
    rows = []
    for i in range(len(tokens)):
        generator.target_cache.reset()
        logits = generator.target.logits_after(prompt_ids + tokens[:i], generator.target_cache).astype(np.float64)
        shifted = logits - logits.max()
        rows.append(shifted - np.log(np.exp(shifted).sum()))
    generator.reset()
    return rows


@pytest.mark.parametrize("settings", [dict(), dict(temperature=0.8, top_p=0.95, seed=3)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("max_batch", [1, 2])
def test_logprobs_are_the_targets(agreeing_bundle, settings, speculative, max_batch):
    generator = specdeploy.load(agreeing_bundle, max_batch=max_batch, policy="always")
    prompts = ["def f(x):", "import os\n"]
    outputs = generator.generate_many(prompts, max_new_tokens=16, logprobs=3, speculative=speculative, **settings)
    for prompt, output in zip(prompts, outputs):
        assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
        rows = reference(generator, generator.codec.encode(prompt), output.token_ids)
        for entry, row, token in zip(output.logprobs, rows, output.token_ids):
            assert entry.token_id == token
            assert abs(entry.logprob - row[token]) < 1e-4
            best = np.argsort(-row, kind="stable")[:3]
            assert [t for t, _ in entry.top] == best.tolist()
            assert np.allclose([lp for _, lp in entry.top], row[best], atol=1e-4)
        if not settings:  # greedy: the chosen token is the most likely one
            assert all(entry.top[0][0] == entry.token_id for entry in output.logprobs)


def test_logprobs_off_and_bad(agreeing_bundle):
    generator = specdeploy.load(agreeing_bundle)
    assert generator.generate("x", max_new_tokens=4).logprobs is None
    assert all(entry.top == () for entry in generator.generate("x", max_new_tokens=4, logprobs=0).logprobs)
    for bad in (-1, 21, 1.5):
        with pytest.raises(SpecdeployError, match="logprobs"):
            generator.generate("x", max_new_tokens=4, logprobs=bad)


def test_top_alternatives_break_ties_to_the_lower_id():
    """The `top` most likely tokens, ties to the lower id, also where ties straddle the cut (an fp16 target's
    logits tie often)."""
    import numpy as np

    from specdeploy.runtime.sequence import token_logprobs

    row = np.array([1.0, 1.0, 0.0, 2.0, 2.0, 0.0, 0.0, 0.0, 2.0, 0.0, 1.0, 2.0, 2.0, 0.0, 0.0, 1.0, 2.0, 1.0, 0.0],
                   dtype=np.float32)
    got = [token for token, _ in token_logprobs(row[None], [0], 13)[0].top]
    assert got == sorted(range(len(row)), key=lambda i: (-row[i], i))[:13]
