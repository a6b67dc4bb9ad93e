"""`specdeploy bench`: target-only against speculative decoding on the same prompts, interleaved.

Besides tokens/s it reports the cost model of Leviathan et al. 2023 ("Fast Inference from
Transformers via Speculative Decoding"): with per-token acceptance alpha, k draft tokens, a draft
step costing c target steps and a verify pass costing v target steps, a round yields
(1 - alpha^(k+1)) / (1 - alpha) tokens for k*c + v target steps of time. alpha is fitted to the
measured tokens per round, so the bound is what the run would reach with no time spent outside
the two models; efficiency is how close it came.
"""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from .errors import SpecdeployError
from .runtime.config import SEED_LIMIT
from .runtime.generate import GenerationStats, Generator


def builtin_prompts() -> list[str]:
    """Ten code prompts written for benchmarking (not from the standard library the demo pairs learn)."""
    return json.loads(resources.files("specdeploy").joinpath("data/code_prompts.json").read_text(encoding="utf-8"))


def read_prompts(path: str | Path) -> list[str]:
    """A UTF-8 file of prompts (see parse_prompts)."""
    return parse_prompts(Path(path).read_text(encoding="utf-8"), f"--prompts {path}")


def parse_prompts(text: str, where: str) -> list[str]:
    """A JSON list of strings, or JSONL with a "prompt" field per line; where names the text in errors."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        data = None
    prompts = data if isinstance(data, list) else None
    if prompts is None:  # JSONL (one line of it is also a JSON object)
        try:
            prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
        except (json.JSONDecodeError, RecursionError, KeyError, TypeError):
            prompts = None
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise SpecdeployError(f"{where}: expected a JSON list of strings or JSONL with a 'prompt' field")
    return prompts


def lengthen_prompts(prompts: list[str], encode, num_tokens: int) -> list[list[int]]:
    """Each prompt's token ids preceded by all the prompts' tokens (repeated) until it is num_tokens long.

    For measuring decode speed at a long context with text the model has seen the like of."""
    ids = [encode(p) for p in prompts]
    longest = max(len(own) for own in ids)
    if longest > num_tokens:  # the report would call it a num_tokens-token prompt
        raise SpecdeployError(f"--prompt-tokens {num_tokens}: a prompt is already {longest} tokens long")
    pool = [token for chunk in ids for token in chunk]
    result = []
    for own in ids:
        need = max(0, num_tokens - len(own))
        result.append((pool * (need // len(pool) + 1))[:need] + own)
    return result


@dataclass(frozen=True)
class BenchConfig:
    prompts: tuple[str | tuple[int, ...], ...]
    max_new_tokens: int = 128
    num_draft_tokens: tuple[int, ...] | None = (4,)  # None: choose k from the cost model ("auto")
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    draft_confidence: float = 0.0
    repeat: int = 1
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # ends a run as EOS does (a chat template's end of turn, with --chat)


@dataclass
class ModeTotals:
    """Sums over every run of one mode."""

    runs: int = 0
    new_tokens: int = 0
    decode_ms: float = 0.0
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    target_ms: float = 0.0
    other_ms: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_calls: int = 0
    target_calls: int = 0
    draft_rounds: int = 0  # rounds that verified at least one draft token
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)  # rounds that drafted position i

    def add(self, stats: GenerationStats) -> None:
        self.runs += 1
        for name in ("new_tokens", "decode_ms", "prefill_ms", "draft_ms", "target_ms", "other_ms", "rounds", "drafted",
                     "accepted", "draft_calls", "target_calls", "draft_rounds"):
            setattr(self, name, getattr(self, name) + getattr(stats, name))
        for name in ("accepted_by_position", "drafted_by_position"):
            totals, counts = getattr(self, name), getattr(stats, name)
            totals += [0] * (len(counts) - len(totals))
            for position, count in enumerate(counts):
                totals[position] += count

    def acceptance_by_position(self) -> list[float | None]:
        """Position i's rate among the rounds that drafted it (None where none did)."""
        return [accepted / drafted if drafted else None
                for accepted, drafted in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / (self.decode_ms / 1000) if self.decode_ms else 0.0

    def to_dict(self) -> dict:
        share = (lambda ms: ms / self.decode_ms if self.decode_ms else 0.0)
        return {**self.__dict__, "tokens_per_s": self.tokens_per_s, "prefill_ms_mean": self.prefill_ms / max(self.runs, 1),
                "time_share": {"draft": share(self.draft_ms), "target": share(self.target_ms), "other": share(self.other_ms)}}


def tokens_per_round(alpha: float, num_draft: int) -> float:
    """Expected tokens per round for i.i.d. acceptance alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    return num_draft + 1.0 if alpha >= 1.0 else (1 - alpha ** (num_draft + 1)) / (1 - alpha)


def fit_alpha(mean_tokens_per_round: float, num_draft: float) -> float:
    """The alpha whose expected tokens per round equals the measured mean (bisection; it is monotone)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if tokens_per_round(middle, num_draft) < mean_tokens_per_round else (low, middle)
    return (low + high) / 2


@dataclass
class KResult:
    num_draft_tokens: int
    speculative: ModeTotals
    identical_outputs: bool | None  # greedy only
    identical_count: int = 0         # greedy: generations whose tokens equal target-only's

    def summary(self, baseline: ModeTotals) -> dict:
        spec = self.speculative
        target_step_ms = baseline.target_ms / max(baseline.target_calls, 1)
        cost_ratio = (spec.draft_ms / max(spec.draft_calls, 1)) / target_step_ms  # c
        verify_cost = (spec.target_ms / max(spec.target_calls, 1)) / target_step_ms  # v
        mean_tokens = spec.new_tokens / spec.rounds if spec.rounds else 0.0  # tokens the run produced, a round
        # alpha from the rounds that drafted, at their mean draft length (a round cut short by the token budget,
        # a confidence stop or a round of the target alone is no rejection)
        drafted_length = spec.drafted / spec.draft_rounds if spec.draft_rounds else 0.0
        alpha = fit_alpha(1 + spec.accepted / spec.draft_rounds, drafted_length) if spec.draft_rounds else 0.0
        # Draft passes per round: k for the model drafter, fewer when prompt lookup proposes for free.
        draft_passes = spec.draft_calls / spec.rounds if spec.rounds else 0.0
        bound = mean_tokens / (draft_passes * cost_ratio + verify_cost)
        speedup = spec.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else 0.0
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "speculative": spec.to_dict(),
            "speedup": speedup,
            "identical_outputs": self.identical_outputs,
            "identical_count": self.identical_count if self.identical_outputs is not None else None,
            "acceptance_rate": spec.accepted / spec.drafted if spec.drafted else 0.0,
            "mean_accepted_tokens": mean_tokens,
            "accepted_by_position": spec.accepted_by_position,
            "acceptance_by_position": spec.acceptance_by_position(),
            "cost_ratio_c": cost_ratio,
            "verify_cost_v": verify_cost,
            "fitted_alpha": alpha,
            "draft_passes_per_round": draft_passes,
            "leviathan_bound": bound,
            "efficiency": speedup / bound if bound else 0.0,
        }


def choose_num_draft(alpha: float, cost_ratio: float, verify_cost_per_token: float, limit: int = 16) -> int:
    """The k that maximizes tokens per unit time under the cost model (verify cost grows ~linearly in k)."""
    def speed(k: int) -> float:
        return tokens_per_round(alpha, k) / (k * cost_ratio + 1.0 + verify_cost_per_token * k)

    return max(range(1, limit + 1), key=speed)


def peak_memory_mb() -> float:
    """This process's peak resident memory in MiB.

    /proc/self/status VmHWM where there is one: Linux carries ru_maxrss across exec, so a bench
    started by a big parent (benchmarks/bench_peers.py holds PyTorch models) reported the parent's
    546 MB as its own."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform != "darwin" else peak / 2**20  # KiB on Linux, bytes on macOS


def model_memory(spec, max_context: int) -> dict:
    """One model's resident floor in bytes: its weights as the bundle stores them (the sizes of its ONNX
    files: packed int8/int4 blocks and their scales, fp16 or fp32 tensors) and its KV cache at
    max_context in the cache's dtype. The graph's own structure is a few KB of those files."""
    kv_itemsize = np.dtype(spec.kv_cache.dtype).itemsize
    return {"weights_bytes": sum(entry.size for entry in spec.files),
            "kv_cache_bytes": 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * max_context * kv_itemsize,
            "dtype": spec.dtype if spec.quantize == "none" else spec.quantize}


def memory_budget(manifest) -> dict:
    """Per model (target, and draft where the bundle has one): the bytes model_memory counts; total_mb is
    all of them together, in MiB."""
    models = {spec.role: model_memory(spec, manifest.max_context) for spec in manifest.models}
    total = sum(model["weights_bytes"] + model["kv_cache_bytes"] for model in models.values())
    return {**models, "total_mb": total / 2**20}


def _auto_num_draft(generator: Generator, config: BenchConfig, options: dict, spec_options: dict, progress) -> int:
    """k for "auto": the cost model's best, from a pilot of k = 4 on the first three prompts."""
    pilot = KResult(4, ModeTotals(), None)
    pilot_base = ModeTotals()
    for prompt in config.prompts[:3]:
        pilot_base.add(generator.generate(prompt, speculative=False, seed=config.seed, **options).stats)
        pilot.speculative.add(generator.generate(prompt, num_draft_tokens=4, seed=config.seed, **spec_options).stats)
    figures = pilot.summary(pilot_base)
    k = choose_num_draft(figures["fitted_alpha"], figures["cost_ratio_c"], (figures["verify_cost_v"] - 1) / 4)
    progress(f"auto: alpha {figures['fitted_alpha']:.2f}, c {figures['cost_ratio_c']:.3f}, "
             f"v(4) {figures['verify_cost_v']:.2f} -> k = {k}")
    return k


def run_bench(generator: Generator, config: BenchConfig, progress=None) -> dict:
    """Interleaved target-only / speculative runs over every prompt, after a warm-up; returns a JSON-ready dict."""
    progress = progress or (lambda message: None)
    options = dict(max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_k=config.top_k,
                   top_p=config.top_p, min_p=config.min_p, repetition_penalty=config.repetition_penalty,
                   stop_token_ids=config.stop_token_ids)
    spec_options = dict(options, draft_confidence=config.draft_confidence)
    greedy = config.temperature == 0.0
    first = config.prompts[0]
    generator.generate(first, speculative=False, **options)  # warm-up: sessions, allocator arenas, caches
    generator.generate(first, num_draft_tokens=4, **spec_options)

    ks = config.num_draft_tokens or (_auto_num_draft(generator, config, options, spec_options, progress),)

    baseline = ModeTotals()
    results = {k: KResult(k, ModeTotals(), True if greedy else None) for k in ks}
    for repeat in range(config.repeat):
        for index, prompt in enumerate(config.prompts):
            seed = (config.seed + repeat * len(config.prompts) + index) % SEED_LIMIT  # as chat's turns wrap
            generator.reset()  # no run reuses the previous run's prefix
            reference = generator.generate(prompt, speculative=False, seed=seed, **options)
            baseline.add(reference.stats)
            for k in ks:
                generator.reset()
                out = generator.generate(prompt, num_draft_tokens=k, seed=seed, **spec_options)
                results[k].speculative.add(out.stats)
                if greedy and out.token_ids != reference.token_ids:
                    results[k].identical_outputs = False
                elif greedy:
                    results[k].identical_count += 1
            progress(f"prompt {index + 1}/{len(config.prompts)}, repeat {repeat + 1}/{config.repeat}")

    by_k = [results[k].summary(baseline) for k in ks]
    best = max(by_k, key=lambda r: r["speedup"])
    return {
        "prompts": len(config.prompts),
        "max_new_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "top_k": config.top_k,
        "top_p": config.top_p,
        "min_p": config.min_p,
        "repetition_penalty": config.repetition_penalty,
        "repeat": config.repeat,
        "target_only": baseline.to_dict(),
        "speculative": best["speculative"],
        "num_draft_tokens": best["num_draft_tokens"],
        "speedup": best["speedup"],
        "identical_outputs": best["identical_outputs"],
        "identical_count": best["identical_count"],
        "acceptance_rate": best["acceptance_rate"],
        "mean_accepted_tokens": best["mean_accepted_tokens"],
        "by_num_draft_tokens": by_k,
        "peak_rss_mb": peak_memory_mb(),
        "memory_budget": memory_budget(generator.manifest),
    }


def context_sweep(reports: list[dict]) -> dict:
    """run_bench reports of the same prompts lengthened to several prompt_tokens, in one run -> the first
    report, with every length's report (by_prompt_tokens) and its decode speed against the first's.

    Decode speed at a long context is a ratio, and ratios are only worth something measured in one run:
    this machine's speed drifts by ~10% between runs."""
    first = reports[0]
    rows = []
    for report in reports:
        target, speculative = report["target_only"]["tokens_per_s"], report["speculative"]["tokens_per_s"]
        rows.append({
            "prompt_tokens": report["prompt_tokens"],
            "target_only_tokens_per_s": target,
            "target_only_ms_per_token": 1000.0 / target if target else None,
            "speculative_tokens_per_s": speculative,
            "acceptance_rate": report["acceptance_rate"],
            "mean_accepted_tokens": report["mean_accepted_tokens"],
            "target_only_vs_first": target / first["target_only"]["tokens_per_s"],
            "speculative_vs_first": speculative / first["speculative"]["tokens_per_s"],
            "peak_rss_mb": report["peak_rss_mb"],
        })
    return dict(first, by_prompt_tokens=reports, context_sweep=rows)

