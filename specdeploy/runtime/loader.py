"""`load(bundle)`: a manifest, an ONNX Runtime session per model and a tokenizer become a Generator."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..bundle import load_manifest
from ..manifest_rules import check_kv_memory
from ..errors import SpecdeployError
from .chat import load_chat_template
from .drafters import MAX_NGRAM, ModelDrafter, PromptLookupDrafter, read_vocab_ids
from .hybrid import HybridDrafter
from .eagle import EagleDrafter
from .engine import OrtEngine
from .session import SessionConfig
from .generate import Generator
from .text import TextCodec

DRAFTERS = ("model", "prompt-lookup", "hybrid")
# The shortest n-gram prompt lookup drafts from: alone, and beside a draft model (whose first token must agree
# with the lookup's), where 2-gram matches kept fewer tokens a round than 3-gram ones on the Qwen2.5-Coder pair.
LOOKUP_NGRAM, HYBRID_NGRAM = 2, 3


def _session_config(bundle: Path, device: str, session: SessionConfig | None, weights_in_memory: bool = False) -> SessionConfig:
    """The sessions' settings: `session`'s, on `device` where it names none other; TensorRT engines cached
    in the bundle unless it names another folder."""
    if session is not None and device != "cpu" and session.device not in ("cpu", device):
        raise SpecdeployError(f"device '{device}' and the SessionConfig's device '{session.device}' differ: give one")
    config = session or SessionConfig(shared_threads=os.environ.get("SPECDEPLOY_SHARED_THREADS", "1") != "0")
    if device != "cpu":
        config = dataclasses.replace(config, device=device)
    if weights_in_memory:
        config = dataclasses.replace(config, weights_in_memory=True)
    if config.device == "tensorrt" and config.trt_cache_dir is None:
        config = dataclasses.replace(config, trt_cache_dir=str(bundle / "trt_cache"))
    return config


def load(bundle: str | Path, device: str = "cpu", drafter: str = "hybrid", verify: bool = False,
         session: SessionConfig | None = None, lookup_ngram: int | None = None, warm_up: bool = True,
         max_batch: int = 1, policy: str = "auto", exact: bool = False, weights_in_memory: bool = False) -> Generator:
    """Load a bundle for generation on `device` (cpu | cuda | tensorrt).

    drafter: "hybrid" (default: the draft model, its proposal continued by prompt lookup where an n-gram
    of `lookup_ngram` tokens recurs, of 3 when sampling, and the model's first token is the lookup's; a copy
    under way proposed by the lookup alone: HybridDrafter), "model" (the draft model every round) or
    "prompt-lookup" (no model; "hybrid" on a bundle without a draft model, which refuses "model"). lookup_ngram
    (1 to MAX_NGRAM) is the shortest n-gram the lookup drafts from (None: 2 alone, 3 beside a draft model,
    where shorter matches measured to keep fewer tokens). All three change speed, never the distribution.

    Every file the manifest lists is checked for its place and size; verify=True also re-hashes each
    one against its sha256 (a same-size corrupted weights file is caught only then).

    ONNX Runtime runs on one process-wide thread pool (fastest when draft and target alternate), unless
    SPECDEPLOY_SHARED_THREADS=0 or SessionConfig(shared_threads=False) gives each session its own.

    max_batch: sequences that decode together (generate_many, a server's requests). The policy ("auto":
    speculate where the measured costs say it pays, "always", "never") picks each round's draft length
    up to the request's k: for several rows, and a lone row of an exact, fp16 or quantized target (a sampled
    one on a target that is not exact).

    exact=False (the default): each target pass runs the fastest kernels for its shape; output is an
    exact sample of the target's distribution as the pass that checks each token computes it, greedy
    text may differ from target-only's where two tokens tie within rounding, and where draft lengths
    follow measured costs (a sampled row of a quantized or fp16 target) a seed's sample may change from
    run to run. exact=True (a fused
    graph): greedy text the same with and without speculation at any k, drafter and batch, and a seed
    gives one sample whatever the batch.

    warm_up=True (the default) runs each kind of pass once before returning (Generator.warm_up): the
    first request runs as fast as later ones. weights_in_memory: see SessionConfig (`serve` sets it)."""
    bundle = Path(bundle)
    _check_arguments(drafter, lookup_ngram, max_batch, verify=verify, warm_up=warm_up, exact=exact)
    manifest = load_manifest(bundle, verify=verify)
    check_kv_memory(manifest, slots=max_batch)  # every slot's caches are mapped at load
    config = _session_config(bundle, device, session, weights_in_memory)

    def engine(spec, features: str | None = None) -> OrtEngine:
        # The generate loop reads each pass's logits before the next pass: they may share one buffer.
        return OrtEngine(bundle / spec.onnx_path, spec, config, scratch_logits=True, exact=exact, features=features)

    drafter = drafter_for(manifest, drafter, bundle)
    eagle = manifest.draft.eagle if drafter != "prompt-lookup" else None
    target = engine(manifest.target, eagle.target_feature if eagle is not None else None)
    chosen = _make_drafter(drafter, manifest, bundle, engine, lookup_ngram)
    tokenizer_dir = bundle / manifest.tokenizer.path
    codec = TextCodec(tokenizer_dir, manifest.tokenizer)
    generator = Generator(target, chosen, codec, manifest.max_context, manifest.target.eos_token_ids, manifest,
                          chat_template=load_chat_template(tokenizer_dir), max_batch=max_batch, policy=policy)
    if warm_up:
        generator.warm_up()
    return generator


def _make_drafter(drafter: str, manifest, bundle: Path, engine, lookup_ngram: int | None):
    """The drafter named (drafter_for's answer), its model on engine(spec[, feature output])."""
    if drafter == "prompt-lookup":
        return PromptLookupDrafter(manifest.target.vocab_size, min_ngram=lookup_ngram or LOOKUP_NGRAM)
    lookup = PromptLookupDrafter(manifest.target.vocab_size, min_ngram=lookup_ngram or HYBRID_NGRAM)
    spec, eagle = manifest.draft, manifest.draft.eagle
    ids = read_vocab_ids(bundle / spec.vocab_ids, spec.vocab_size, spec.vocab_subset) if spec.vocab_ids else None
    if eagle is not None:
        draft = EagleDrafter(engine(spec, eagle.feature_output), manifest.max_context, vocab_ids=ids)
    else:
        draft = ModelDrafter(engine(spec), manifest.max_context, vocab_ids=ids)
    return draft if drafter == "model" else HybridDrafter(draft, lookup)


def drafter_for(manifest, drafter: str, bundle: Path | str) -> str:
    """The drafter that runs for the one asked: a bundle without a draft model drafts by prompt lookup ("hybrid"
    falls back to it, which is what hybrid does wherever the draft model is not used); "model" is refused there."""
    if manifest.draft is not None:
        return drafter
    if drafter == "model":
        raise SpecdeployError(f"the bundle {bundle} has no draft model, so drafter 'model' cannot run: use 'hybrid' or "
                              "'prompt-lookup' (both draft by prompt lookup here), or export it again with --draft")
    return "prompt-lookup"


def _check_arguments(drafter: str, lookup_ngram: int | None, max_batch: int, **flags: bool) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise SpecdeployError(f"{name} must be True or False (got {value!r})")
    if drafter not in DRAFTERS:
        raise SpecdeployError(f"unknown drafter '{drafter}' (choose from {', '.join(DRAFTERS)})")
    ngram = LOOKUP_NGRAM if lookup_ngram is None else lookup_ngram
    for name, value in (("lookup_ngram", ngram), ("max_batch", max_batch)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecdeployError(f"{name} must be an integer (got {value!r})")
    if lookup_ngram is not None and not 1 <= lookup_ngram <= MAX_NGRAM:
        raise SpecdeployError(f"lookup_ngram must be in 1..{MAX_NGRAM} (got {lookup_ngram})")
