"""The oracles in specdeploy.testing: exact where they can be checked by hand, and never imported by the product."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from specdeploy.runtime.sampling import SamplingParams, process_logits
from specdeploy.testing import exact_continuation_probs


def test_the_product_never_imports_the_oracles(agreeing_bundle):
    script = textwrap.dedent(f"""
        import sys
        import specdeploy
        from specdeploy import bench, cli
        specdeploy.load({str(agreeing_bundle)!r}).generate("def f(x):", max_new_tokens=4)
        assert "specdeploy.testing" not in sys.modules, "the product imported specdeploy.testing"
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.7, top_p=0.8)])
def test_exact_continuation_probs_are_the_chain_rule_of_the_target(agreeing_bundle, params):
    """Every 2-token continuation's probability is p(a | prompt) * p(b | prompt, a), from the target's own
    logits, and over a truncated distribution they sum to 1."""
    import specdeploy

    generator = specdeploy.load(agreeing_bundle)
    prompt = generator.codec.encode("def f(x):")
    exact = exact_continuation_probs(generator, prompt, params, 2)
    assert abs(sum(exact.values()) - 1.0) < 1e-5  # float32 rows

    def probs(context):  # [vocab], from a fresh cache every time
        generator.reset()
        return process_logits(generator.target.logits_after(context, generator.target_cache)[None], params)[0]

    first = probs(prompt)
    assert {sequence[0] for sequence in exact} == set(np.flatnonzero(first).tolist())
    for (a, b), probability in exact.items():
        assert probability == pytest.approx(float(first[a]) * float(probs(prompt + [a])[b]), rel=1e-4)  # passes of other lengths: last bits
