"""Lossless on a real pair: greedy speculative == target-only on 20 prompts, and sampled == the target's distribution.

    python scripts/check_lossless.py BUNDLE [--runs 4000]

(1) Greedy, without and with repetition penalty 1.1: for every prompt, drafter (model, hybrid) and
k in {1, 2, 4, 8}, the speculative token ids must equal target-only's, with load(exact=True) (without
it a quantized target's one-token target-only steps round otherwise: docs/performance.md, "Exactness"). (2) Sampled (temperature 1,
top-k 3): over `runs` seeded generations of 3 tokens with k = 2, the frequencies of every 3-token
continuation are compared (chi-square) with the exact target probabilities, computed from the
target alone. (3) Every sampling setting of docs/performance.md's table (temperature 0.8 with
top-k 50, top-p 0.95, both, min-p 0.05, top-p 0.95 and repetition penalty 1.1): the first two
tokens of `runs` generations with k = 1 against the exact joint target distribution, cells
expected fewer than 5 times pooled. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
from scipy import stats

import specdeploy
from specdeploy.bench import builtin_prompts
from specdeploy.testing import SAMPLED_SETTINGS, exact_continuation_probs
from specdeploy.runtime.sampling import SamplingParams

EXTRA_PROMPTS = [
    "def read_lines(path):\n",
    "import re\n\nPATTERN = re.compile(",
    "class Point:\n    def __init__(self, x, y):\n",
    "def binary_search(items, target):\n    low, high = 0, len(items) - 1\n",
    "for index, value in enumerate(values):\n",
    "try:\n    import numpy as np\nexcept ImportError:\n",
    "def __repr__(self):\n        return ",
    "with open(filename, encoding='utf-8') as handle:\n",
    "if __name__ == '__main__':\n",
    "def test_parse_empty_string(self):\n",
]


SETTINGS = SAMPLED_SETTINGS


def greedy_equivalence(bundle: str, prompts: list[str], max_new_tokens: int, repetition_penalty: float = 1.0) -> dict:
    mismatches = []
    checked = 0
    options = dict(max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty)
    for drafter in ("model", "hybrid"):
        generator = specdeploy.load(bundle, drafter=drafter, exact=True)
        for prompt in prompts:
            baseline = generator.generate(prompt, speculative=False, **options).token_ids
            for k in (1, 2, 4, 8):
                checked += 1
                if generator.generate(prompt, num_draft_tokens=k, **options).token_ids != baseline:
                    mismatches.append({"drafter": drafter, "k": k, "prompt": prompt})
    return {"prompts": len(prompts), "repetition_penalty": repetition_penalty, "comparisons": checked,
            "mismatches": mismatches}


def sampled_distribution(bundle: str, runs: int) -> dict:
    generator = specdeploy.load(bundle, drafter="model")
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = generator.codec.encode(builtin_prompts()[0])

    exact = exact_continuation_probs(generator, prompt, params, 3)
    counts = dict.fromkeys(exact, 0)
    accepted = drafted = 0
    for seed in range(runs):
        out = generator.generate(prompt, max_new_tokens=3, temperature=1.0, top_k=3, seed=seed, num_draft_tokens=2)
        counts[tuple(out.token_ids)] += 1
        accepted += out.stats.accepted
        drafted += out.stats.drafted
    keys = sorted(exact)
    observed = np.array([counts[key] for key in keys])
    expected = np.array([exact[key] for key in keys]) * runs
    p_value = stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue
    total_variation = 0.5 * np.abs(observed / runs - expected / expected.sum()).sum()
    return {"runs": runs, "outcomes": len(keys), "chi_square_p": float(p_value), "total_variation": float(total_variation),
            "acceptance_rate": accepted / drafted if drafted else 0.0}


def setting_distribution(bundle: str, runs: int, options: dict) -> dict:
    """The first two tokens of runs seeded k = 1 generations at one sampling setting against the exact joint
    target distribution (cells expected fewer than 5 times pooled into one)."""
    generator = specdeploy.load(bundle, drafter="model")
    params = specdeploy.GenerationConfig(**options).sampling
    # A prompt with many likely continuations and a draft that agrees on about half: both the
    # acceptance and the rejection paths run often.
    prompt = generator.codec.encode(EXTRA_PROMPTS[1])

    exact = exact_continuation_probs(generator, prompt, params, 2, min_probability=5 / runs)  # pairs a run can see
    counts = dict.fromkeys(exact, 0)
    accepted = 0
    for seed in range(runs):
        out = generator.generate(prompt, max_new_tokens=2, seed=seed, num_draft_tokens=1, **options)
        key = tuple(out.token_ids)
        if key in counts:
            counts[key] += 1
        accepted += out.stats.accepted
    keys = sorted(exact)
    observed = [counts[key] for key in keys]
    expected = [exact[key] * runs for key in keys]
    rest = runs * (1.0 - sum(exact.values()))
    if rest > 1e-9:  # a support enumerated whole leaves no pooled cell
        observed.append(runs - sum(counts.values()))
        expected.append(rest)
    p_value = stats.chisquare(observed, np.array(expected) * sum(observed) / sum(expected)).pvalue
    return {"runs": runs, "cells": len(observed), "chi_square_p": float(p_value), "acceptance_rate": accepted / runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--runs", type=int, default=4000)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    prompts = list(itertools.islice(builtin_prompts() + EXTRA_PROMPTS, 20))
    greedy = greedy_equivalence(args.bundle, prompts, args.max_new_tokens)
    penalized = greedy_equivalence(args.bundle, prompts, args.max_new_tokens, repetition_penalty=1.1)
    sampled = sampled_distribution(args.bundle, args.runs)
    settings = {name: setting_distribution(args.bundle, args.runs, options) for name, options in SETTINGS.items()}
    print(json.dumps({"greedy": greedy, "greedy_repetition_penalty": penalized, "sampled": sampled,
                      "settings": settings}))


if __name__ == "__main__":
    main()
