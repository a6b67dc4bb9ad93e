#!/usr/bin/env python3
"""What a verify pass costs next to a one-token step, in the state each decoding mode runs in.

The cost model's bound takes the target's time per token in target-only decoding against its time
per round in speculative decoding. The two differ by the pass (k + 1 tokens against one) and by
the state the machine is in when it runs: in speculative decoding every target pass follows draft
passes and a verify pass. To tell the two apart, each generate call here times every target pass,
and every third pass it also runs one extra probe pass of the other shape at the same position (a
(k + 1)-token pass during target-only decoding, a 1-token pass during speculative decoding), then
takes it back (the cache is truncated to where it was, and the logits the loop reads are copied
first, so the tokens are unchanged). Per row, medians of:

    target-only state: the 1-token step, and the (k + 1)-token probe
    speculative state: the (k + 1)-token verify pass, and the 1-token probe

    .venv/bin/python scripts/pass_cost.py BUNDLE [--settings greedy,t0.8] [--drafter hybrid] [--repeat 2]

--between WORK,... asks what the state is made of. Greedy only: the speculative rounds propose the
target's own greedy continuation (every token is accepted, every verify pass has k + 1 tokens), and
each proposal first does WORK instead of drafting: `none`; `draft` (the bundle's draft model runs
the proposal's passes, its tokens unused); `readN` (a sum over N MB of other memory); `sleepN` (N
ms); `ort` (k runs of a one-node ONNX model). One row per WORK:

    .venv/bin/python scripts/pass_cost.py BUNDLE --between none,draft,read4,sleep1,ort

Timing wraps ONNX Runtime's run call only; the probes are not part of any generation's figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import parse_setting  # noqa: E402

PROBE_EVERY = 3  # passes between probes


class OracleDrafter:
    """Proposes the target's own greedy continuation of the prompt, after doing some other work."""

    engine = None  # no draft model of its own: the stats count only the target's passes

    def __init__(self, work):
        self.work = work  # called with the context before each proposal
        self.prompt_length = 0
        self.continuation: list[int] = []

    def prefill(self, context: list[int]) -> None:
        pass

    def reset(self) -> None:
        pass

    def propose(self, context, num_tokens, sampler, rng, min_confidence=0.0):
        self.work(context, num_tokens)
        done = len(context) - self.prompt_length
        return list(self.continuation[done : done + num_tokens]), None


def between_work(name: str, gen):
    """The work `--between NAME` does before each oracle proposal."""
    if name == "none":
        return lambda context, count: None
    if name == "draft":
        engine = gen.drafter.engine
        cache = engine.new_cache(gen.max_context)

        def draft(context, count):  # a model proposal's passes: the catch-up, then count - 1 steps
            engine.logits_after(context, cache)
            for step in range(count - 1):
                engine.run([context[-1]], cache)
        return draft
    if name.startswith("read"):
        memory = np.ones(int(name[4:]) << 18, dtype=np.float32)  # N MB
        return lambda context, count: memory.sum()
    if name.startswith("sleep"):
        seconds = float(name[5:]) / 1000
        return lambda context, count: time.sleep(seconds)
    if name == "ort":
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        from specdeploy.runtime.session import SessionConfig, global_pool_active, session_options

        weight = numpy_helper.from_array(np.ones((256, 256), dtype=np.float32), "w")
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "one_node",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])], [weight])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
        options = session_options(SessionConfig(shared_threads=global_pool_active()))
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feed = {"x": np.ones((1, 256), dtype=np.float32)}

        def run_other(context, count):
            for _ in range(count):
                session.run(None, feed)
        return run_other
    raise SystemExit(f"error: unknown --between work '{name}' (none, draft, readN, sleepN, ort)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--settings", default="greedy,t0.8")
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--drafter", default="hybrid", help="hybrid | model | prompt-lookup")
    ap.add_argument("--between", help="WORK,...: oracle proposals after WORK (see above); greedy only")
    args = ap.parse_args()
    import specdeploy
    from specdeploy.bench import builtin_prompts

    gen = specdeploy.load(args.bundle, drafter="model" if args.between else args.drafter)
    target, cache, k = gen.target, gen.target_cache, args.num_draft_tokens
    durations: list[float] = []  # the passes of the current target.run call
    samples: dict[tuple, list[float]] = defaultdict(list)
    now = {"row": "", "speculative": False, "passes": 0}

    session_run = target._run

    def timed(binding, options):
        start = time.perf_counter()
        session_run(binding, options)
        durations.append(time.perf_counter() - start)

    target._run = timed
    loop_run = target.run

    def probe(token_ids: list[int], key: tuple) -> None:
        length = cache.length
        target._stepping = None  # the probe must not leave the one-token binding state behind it
        durations.clear()
        loop_run(token_ids, cache)
        samples[key].append(durations[-1])
        cache.truncate(length)

    def run(token_ids, on_cache):
        durations.clear()
        logits = loop_run(token_ids, on_cache)
        if on_cache is not cache or len(durations) != 1:  # another cache, or a chunked prefill
            return logits
        row, count = now["row"], len(token_ids)
        now["passes"] += 1
        probe_now = now["passes"] % PROBE_EVERY == 0
        if now["speculative"] and count == k + 1:
            samples[(row, "verify")].append(durations[-1])
            if probe_now:
                logits = logits.copy()
                probe([int(token_ids[-1])], (row, "spec probe 1"))
        elif not now["speculative"] and count == 1:
            samples[(row, "step")].append(durations[-1])
            if probe_now:
                logits = logits.copy()
                probe([int(token_ids[-1])] * (k + 1), (row, "target-only probe"))
        return logits

    target.run = run
    prompts = builtin_prompts()
    gen.generate(prompts[0], max_new_tokens=16)  # warm-up
    if args.between:
        rows = args.between.split(",")
        oracles = {name: OracleDrafter(between_work(name, gen)) for name in rows}
        model_drafter = gen.drafter
        for repeat in range(args.repeat):
            for index, prompt in enumerate(prompts):
                for name in (rows if (index + repeat) % 2 == 0 else rows[::-1]):
                    now["row"], now["speculative"], gen.drafter = name, False, model_drafter
                    own = gen.generate(prompt, speculative=False, max_new_tokens=args.max_new_tokens)
                    oracle = oracles[name]
                    oracle.prompt_length, oracle.continuation = len(gen.codec.encode(prompt)), own.token_ids
                    now["speculative"], gen.drafter = True, oracle
                    gen.generate(prompt, max_new_tokens=args.max_new_tokens, num_draft_tokens=k)
        gen.drafter = model_drafter
    else:
        settings = [parse_setting(name) for name in args.settings.split(",")]
        rows = [setting.name for setting in settings]
        for repeat in range(args.repeat):
            for setting in settings:
                fields = {key: value for key, value in asdict(setting).items() if key != "name"}
                now["row"] = setting.name
                for index, prompt in enumerate(prompts):
                    for speculative in (False, True):
                        now["speculative"] = speculative
                        gen.generate(prompt, speculative=speculative, max_new_tokens=args.max_new_tokens,
                                     num_draft_tokens=k, seed=repeat * len(prompts) + index, **fields)

    print(f"| {'between' if args.between else 'setting'} | target-only: step | its {k + 1}-token probe | ratio "
          "| speculative: verify | its 1-token probe | ratio | speculative 1-token / target-only step "
          "| verify / target-only step |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for row in rows:
        m = {key[1]: 1000 * statistics.median(values) for key, values in samples.items() if key[0] == row}
        step, probe_k, verify, probe_1 = m["step"], m["target-only probe"], m["verify"], m["spec probe 1"]
        print(f"| {row} | {step:.2f} ms | {probe_k:.2f} ms | {probe_k / step:.2f} | {verify:.2f} ms | {probe_1:.2f} ms "
              f"| {verify / probe_1:.2f} | {probe_1 / step:.2f} | {verify / step:.2f} |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
