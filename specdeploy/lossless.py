"""`specdeploy verify --lossless`: speculative decoding gives the target's own output, checked on a bundle.

Greedy: for every prompt, drafter and k in GREEDY_DRAFT_TOKENS, the speculative token ids must equal
target-only decoding's, on a target loaded with exact=True (without it a quantized target's one-token
target-only steps round otherwise: README, "Why it is lossless"), without and with repetition penalty 1.1.

Sampled: rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding") keeps a draft token x with probability min(1, target_probs[x] / draft_probs[x]) and replaces the
first rejected one by a draw from normalize(max(0, target_probs - draft_probs)), so every token is
distributed as the target's. Over `runs` seeded generations, the frequency of each short continuation is
compared (Pearson's chi-square) with its exact probability under the target alone, computed by the oracle
the tests use (specdeploy.testing.exact_continuation_probs): temperature 1 with top-k 3 (3 tokens, k = 2),
then every setting of specdeploy.testing.SAMPLED_SETTINGS (2 tokens, k = 1). Continuations expected fewer
than 5 times are pooled into one cell. A check fails below P_VALUE_LIMIT; a lossless runtime fails one of
the nine about once in a hundred seeds, so a lone failure is worth a run with another --seed.

Nothing on the generation path imports this module (it imports the oracles).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .bench import builtin_prompts
from .bundle import load_manifest
from .errors import SpecdeployError
from .runtime.config import GenerationConfig
from .runtime.loader import load
from .testing import SAMPLED_SETTINGS, exact_continuation_probs

GREEDY_DRAFT_TOKENS = (1, 2, 4, 8)
P_VALUE_LIMIT = 1e-3
TOP_K_CHECK = ("T 1, top-k 3", dict(temperature=1.0, top_k=3), 3, 2)  # name, options, tokens, k
EXTRA_PROMPTS = [  # after the built-in ones: code beginnings of other shapes
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


@dataclass(frozen=True)
class LosslessConfig:
    prompts: tuple[str, ...] = ()  # the greedy check's (empty: the built-in ones and EXTRA_PROMPTS); the sampled checks use the first
    max_new_tokens: int = 64  # per greedy generation
    runs: int = 4000  # seeded generations per sampled check
    seed: int = 0  # the first of each sampled check's seeds

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.runs < 1:
            raise SpecdeployError(f"max_new_tokens and runs must be at least 1 (got {self.max_new_tokens}, {self.runs})")

    def prompt_list(self) -> list[str]:
        return list(self.prompts) or builtin_prompts() + EXTRA_PROMPTS


def chi_square_survival(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square with dof degrees of freedom: the regularized upper incomplete gamma
    function Q(dof / 2, statistic / 2), by the series of P = 1 - Q below dof / 2 + 1 and by Q's continued
    fraction (modified Lentz) above it (Numerical Recipes, 3rd ed., 6.2)."""
    if dof < 1:
        raise ValueError(f"dof must be at least 1 (got {dof})")
    a, x = dof / 2.0, statistic / 2.0
    if x <= 0.0:
        return 1.0
    if math.isinf(x):
        return 0.0
    log_scale = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-16:
            n += 1.0
            term *= x / n
            total += term
        return min(1.0, max(0.0, 1.0 - total * math.exp(log_scale)))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    fraction = d
    for i in range(1, 100_000):
        term = -i * (i - a)
        b += 2.0
        d = term * d + b
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = b + term / c
        c = c if abs(c) > tiny else tiny
        fraction *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return min(1.0, math.exp(log_scale) * fraction)


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """Pearson's test of observed counts against expected ones (rescaled to the same total), cells - 1 degrees of
    freedom; 1.0 for fewer than two cells (nothing to compare), 0.0 for a count where none is expected."""
    if len(observed) < 2:
        return 1.0
    scale = sum(observed) / sum(expected)
    statistic = 0.0
    for seen, mean in zip(observed, expected):
        mean *= scale
        if mean <= 0.0:
            if seen:
                return 0.0
            continue
        statistic += (seen - mean) ** 2 / mean
    return chi_square_survival(statistic, len(observed) - 1)


def sampled_continuations(generator, prompt_ids: list[int], options: dict, length: int, num_draft_tokens: int, runs: int,
                          first_seed: int = 0) -> dict:
    """`runs` seeded speculative generations of `length` tokens at one sampling setting against the exact
    target distribution of their continuations: the cells (each expected at least 5 times, the rest pooled),
    the chi-square p-value, and the draft tokens kept."""
    params = GenerationConfig(**options).sampling
    exact = exact_continuation_probs(generator, prompt_ids, params, length, min_probability=5 / runs)
    counts = dict.fromkeys(exact, 0)
    accepted = drafted = 0
    for seed in range(first_seed, first_seed + runs):
        out = generator.generate(prompt_ids, max_new_tokens=length, seed=seed, num_draft_tokens=num_draft_tokens,
                                 **options)
        key = tuple(out.token_ids)
        if key in counts:
            counts[key] += 1
        accepted += out.stats.accepted
        drafted += out.stats.drafted
    keys = sorted(exact, key=exact.get, reverse=True)
    observed = [counts[key] for key in keys] + [runs - sum(counts.values())]
    expected = [exact[key] * runs for key in keys] + [runs * (1.0 - sum(exact.values()))]
    if expected[-1] < 1e-9:  # a support enumerated whole: a pooled count is an outcome the target cannot give
        expected[-1] = 0.0
    p_value = chi_square_p_value(observed, expected)
    return {"runs": runs, "cells": len(observed), "chi_square_p": p_value, "accepted": accepted, "drafted": drafted,
            "acceptance_rate": accepted / drafted if drafted else None}


def greedy_equivalence(bundle: str, prompts: list[str], max_new_tokens: int, drafters: tuple[str, ...],
                       repetition_penalty: float = 1.0, progress=None) -> dict:
    """Speculative token ids against target-only's for every prompt, drafter and k, on an exact target."""
    mismatches, checked = [], 0
    options = dict(max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty)
    for drafter in drafters:
        generator = load(bundle, drafter=drafter, exact=True)
        for index, prompt in enumerate(prompts):
            if progress:
                progress(f"greedy, repetition penalty {repetition_penalty}, drafter {drafter}: prompt {index + 1}/{len(prompts)}")
            baseline = generator.generate(prompt, speculative=False, **options).token_ids
            for k in GREEDY_DRAFT_TOKENS:
                checked += 1
                if generator.generate(prompt, num_draft_tokens=k, **options).token_ids != baseline:
                    mismatches.append({"drafter": drafter, "k": k, "prompt": prompt})
    return {"prompts": len(prompts), "drafters": list(drafters), "repetition_penalty": repetition_penalty,
            "comparisons": checked, "mismatches": mismatches}


def check_lossless(bundle: str, config: LosslessConfig, progress=None) -> dict:
    """Every check of the module's docstring on one bundle; the report, with "passed"."""
    prompts = config.prompt_list()
    drafters = ("model", "hybrid") if load_manifest(bundle).draft is not None else ("prompt-lookup",)
    report = {"bundle": bundle, "greedy": [greedy_equivalence(bundle, prompts, config.max_new_tokens, drafters, penalty, progress)
                                           for penalty in (1.0, 1.1)]}
    generator = load(bundle, drafter=drafters[0])
    prompt_ids = generator.codec.encode(prompts[0])
    checks = [TOP_K_CHECK] + [(name, options, 2, 1) for name, options in SAMPLED_SETTINGS.items()]
    report["sampled"] = {}
    for name, options, length, k in checks:
        if progress:
            progress(f"sampled, {name}: {config.runs} runs")
        report["sampled"][name] = {"tokens": length, "num_draft_tokens": k, **sampled_continuations(
            generator, prompt_ids, options, length, k, config.runs, config.seed)}
    report["passed"] = (not any(g["mismatches"] for g in report["greedy"])
                        and all(s["chi_square_p"] >= P_VALUE_LIMIT for s in report["sampled"].values()))
    return report


def lossless_lines(report: dict) -> list[str]:
    """The report in lines of text, one per check, then the verdict."""
    lines = []
    for greedy in report["greedy"]:
        lines.append(f"greedy, repetition penalty {greedy['repetition_penalty']}: {greedy['comparisons']} speculative runs "
                     f"({greedy['prompts']} prompts, drafter {' and '.join(greedy['drafters'])}, k "
                     f"{', '.join(map(str, GREEDY_DRAFT_TOKENS))}) against target-only: {len(greedy['mismatches'])} differ")
        lines += [f"  differs: drafter {m['drafter']}, k {m['k']}, prompt {m['prompt']!r}" for m in greedy["mismatches"][:5]]
    for name, check in report["sampled"].items():
        acceptance = "no draft token" if check["acceptance_rate"] is None else f"acceptance {check['acceptance_rate']:.2f}"
        flag = "" if check["chi_square_p"] >= P_VALUE_LIMIT else f"  (below {P_VALUE_LIMIT})"
        lines.append(f"sampled, {name}: {check['runs']} runs of {check['tokens']} tokens at k = {check['num_draft_tokens']}, "
                     f"{check['cells']} cells, chi-square p = {check['chi_square_p']:.3g}{flag}, {acceptance}")
    lines.append("ok: lossless: every greedy output equals target-only's, every sampled distribution the target's"
                 if report["passed"] else "not lossless: see the checks above")
    return lines
