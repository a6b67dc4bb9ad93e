"""Measurement checks of the benchmarks package (benchmarks/, run as `python -m benchmarks.NAME` from the root).

The client they share with `specdeploy bench --url` is tested in test_load_test.py."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import signal
import sys
import time
import types
from pathlib import Path

import pytest
from test_serve import chat_bundle  # noqa: F401 (fixture)


def benchmark(name: str):
    """benchmarks.NAME, imported as the package's module (the repository root is on pytest's pythonpath)."""
    return importlib.import_module(f"benchmarks.{name}")


def _record(prompt: int = 0, tokens: int = 8) -> dict:
    return {"ok": True, "prompt": prompt, "text": "x" * tokens, "tokens": tokens, "latency_s": 1.0,
            "first_token_s": 0.1, "usage_per_chunk": True, "itl_s": [0.1] * (tokens - 1),
            "chunk_gaps_s": [0.1] * (tokens - 1)}


# ------------------------------------------------------------------------------------------- load_test


def test_load_test_markdown_of_an_interrupted_run_says_so(tmp_path, monkeypatch):
    """SIGTERM after the first cell: the JSON says interrupted, so must the Markdown (it otherwise reads as
    a complete run of --repeat 2, medians and all)."""
    load_test = benchmark("load_test")
    calls = {"n": 0}

    async def fake_run_cell(url, headers, bodies, concurrency):
        calls["n"] += 1
        if calls["n"] > 2:  # warm-up, then one cell, then SIGTERM
            raise SystemExit(143)
        return [_record(body["_prompt"]) for body in bodies], 1.0

    monkeypatch.setattr(load_test, "run_cell", fake_run_cell)
    md, js = tmp_path / "load.md", tmp_path / "load.json"
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            load_test.main(["--url", "http://127.0.0.1:9", "--name", "peer", "--plain", "--concurrency", "1,2",
                            "--modes", "greedy", "--repeat", "2", "--max-tokens", "8", "--markdown-out", str(md),
                            "--json-out", str(js)])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert json.loads(js.read_text())["interrupted"] is True
    assert "interrupted" in md.read_text().lower(), md.read_text()


def test_load_test_markdown_survives_a_sequential_cell_whose_requests_all_failed():
    """A cell of failures is a result to report (failed 4), not a ZeroDivisionError that loses the whole run's
    tables and JSON (main builds the Markdown before it writes either)."""
    load_test = benchmark("load_test")
    args = load_test.parse_args(["--url", "http://127.0.0.1:9", "--max-tokens", "8", "--ignore-eos"])
    failed = [{"ok": False, "prompt": i, "text": "", "status": 503, "error": "busy"} for i in range(4)]
    fine = [_record(i) for i in range(4)]
    cells = [{"kind": "code", "mode": "greedy", "concurrency": 1, "server": "batched (8)", "max_batch": 8, "repeat": 0,
              **load_test.summarize(fine, 1.0, args, None)},
             {"kind": "code", "mode": "greedy", "concurrency": 1, "server": "sequential (1)", "max_batch": 1,
              "repeat": 0, **load_test.summarize(failed, 1.0, args, None)}]
    table = load_test.markdown(cells, {}, args)
    assert "| sequential (1) |" in table
    row = next(line for line in table.splitlines() if "| sequential (1) |" in line).split("|")
    assert [cell.strip() for cell in row[7:12]] == ["", "", "", "", ""]  # TTFT, ITL, tokens/chunk: none measured, not 0


def test_load_test_references_come_from_a_child_loading_the_bundle_as_run_does(tmp_path):
    """The reference texts (what every served output is compared with) and run's tok/s come from a child process
    with specdeploy.load's default session, so no thread pool of it outlives the generations."""
    import specdeploy
    from specdeploy.defaults import DEMO_DIR

    load_test = benchmark("load_test")
    bundle = str(DEMO_DIR / "demo-bundle")
    args = load_test.parse_args([bundle, "--max-tokens", "12", "--ignore-eos"])
    prompts = ["def add(a, b):", "class Stack:"]
    reference = load_test.reference_outputs("code", prompts, "sampled", args, 1)
    generator = specdeploy.load(bundle)
    assert reference["texts"] == {i: generator.generate(p, max_new_tokens=12, ignore_eos=True, seed=i,
                                                        temperature=args.temperature).text for i, p in enumerate(prompts)}
    assert reference["run_tokens_per_s"] > 0
    args = load_test.parse_args([str(tmp_path), "--max-tokens", "12"])
    with pytest.raises(SystemExit) as raised:
        load_test.reference_outputs("code", [], "greedy", args, 0)
    assert str(raised.value.code).startswith("error: ")


def test_serve_peers_keeps_the_rows_of_servers_measured_before_guidellm_failed(tmp_path, monkeypatch, capsys):
    serve_peers = benchmark("serve_peers")
    row = {"streams": 1, "output_tokens_per_s": 50.0, "ttft_p50_ms": 100.0, "ttft_p99_ms": 120.0, "itl_p50_ms": 10.0,
           "itl_p99_ms": 12.0, "output_tokens_mean": 128, "successful": 3, "errored": 0, "incomplete": 0}

    def fake_run(args, url, levels, out):
        if url.endswith(":2"):
            raise serve_peers.GuidellmError("exit status 1: connection refused")
        return [dict(row)]

    monkeypatch.setattr(serve_peers, "run_guidellm", fake_run)
    monkeypatch.setattr(serve_peers, "guidellm_version", lambda executable: "guidellm 0.0")
    out = tmp_path / "peers.json"
    code = serve_peers.main(["--guidellm", "guidellm", "--tokenizer", "tok", "--target", "first=http://h:1",
                             "--target", "second=http://h:2", "--streams", "1", "--json-out", str(out)])
    captured = capsys.readouterr()
    assert code == 1 and "error: guidellm failed against second" in captured.err
    report = json.loads(out.read_text())
    assert [r["server"] for r in report["rows"]] == ["first"] and "second" in report["failed"]
    assert "| first | 1 | 50.0 |" in captured.out


# ------------------------------------------------------------------------------------------ real_models


def test_real_models_time_ours_counts_as_many_tokens_as_the_peers(monkeypatch):
    """The peers decode exactly --tokens tokens whatever EOS does (genai min_length, llama-bench -n,
    llama-speculative --ignore-eos) and the docstring says EOS may not end a run: ours must not stop
    early at EOS either, or it is timed over fewer (and earlier, cheaper) tokens."""
    real_models = benchmark("real_models")

    class FakeGenerator:
        def generate(self, ids, max_new_tokens, ignore_eos=False, **_):
            made = max_new_tokens if ignore_eos else 3  # this model says EOS at its third token
            stats = types.SimpleNamespace(new_tokens=made, tokens_per_s=float(made))  # one second of decode
            return types.SimpleNamespace(stats=stats, token_ids=[1] * made)

    fake = types.ModuleType("specdeploy")
    fake.load = lambda *a, **k: FakeGenerator()
    monkeypatch.setitem(sys.modules, "specdeploy", fake)
    assert real_models.time_ours(Path("bundle"), [1, 2, 3], 128) == 128.0


# ------------------------------------------------------------------------------------------ bench_peers


STEP_S = 0.04  # one forward pass of the fake genai model


def _fake_onnxruntime_genai():
    """onnxruntime-genai's generator as it works: append_tokens runs the prefill and computes the logits of
    the first new token; generate_next_token samples from logits already computed, running the model on
    the previous token first only when there are none (src/generators.cpp, computed_logits_)."""
    og = types.ModuleType("onnxruntime_genai")

    class GeneratorParams:
        def __init__(self, model):
            self.max_length = 0

        def set_search_options(self, max_length, **_):
            self.max_length = max_length

        def set_speculative_options(self, **_):
            pass

    class Generator:
        def __init__(self, model, params):
            self.max_length, self.sequence, self.computed = params.max_length, [], False

        def append_tokens(self, ids):
            self.sequence += list(ids)
            time.sleep(STEP_S)  # the prefill pass
            self.computed = True

        def generate_next_token(self):
            if not self.computed:
                time.sleep(STEP_S)  # the pass on the previous token
            self.computed = False
            self.sequence.append(7)

        def is_done(self):
            return len(self.sequence) >= self.max_length

        def get_sequence(self, index):
            return list(self.sequence)

    og.GeneratorParams, og.Generator = GeneratorParams, Generator
    return og


def test_bench_peers_genai_decode_rate_does_not_count_the_prefills_token():
    """ours: N new tokens over the N decode passes that made them; HF: the first chunk's tokens left out
    with its time. genai's first token comes out of append_tokens (timed as prefill), so counting it as a
    decode token gives N tokens over N - 1 passes: 4 tokens over 3 passes reads 33% fast here."""
    bench_peers = benchmark("bench_peers")
    peer = object.__new__(bench_peers.GenaiPeer)
    peer.og, peer.args = _fake_onnxruntime_genai(), argparse.Namespace(num_draft_tokens=4)
    run = peer.run(None, "target_only", [1, 2, 3], bench_peers.Setting("greedy"), 0, 4)
    assert run["new_tokens"] == 4
    rate, per_pass = run["decode_tokens"] / run["decode_s"], 1 / STEP_S
    assert rate < 1.1 * per_pass, (rate, per_pass)


# ------------------------------------------------------------------------------------------- load_test


def test_load_test_a_server_that_fails_to_start_says_why(monkeypatch, capsys):
    """start_server's `error: the server exited ...` (a bad bundle, a bad --max-batch) must reach the user, not
    turn into "interrupted: writing the cells so far" and an empty table."""
    load_test = benchmark("load_test")

    def failing_start(*_args, **_kwargs):
        raise SystemExit("error: the server exited (2) before listening")

    monkeypatch.setattr(load_test, "start_server", failing_start)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exc:
            load_test.main(["bundle", "--no-reference", "--max-tokens", "8"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    said = capsys.readouterr().err + str(exc.value.code)
    assert "error: the server exited (2) before listening" in said, said


@pytest.mark.parametrize("argv", [
    ["/nonexistent-bundle", "--max-tokens", "8"],  # SpecdeployError traceback from the reference's load
    ["--url", "http://127.0.0.1:9", "--kinds", "text"],  # KeyError
    ["--url", "http://127.0.0.1:9", "--modes", "greedy,sample"],  # a typo runs as a sampled mode named "sample"
    ["--url", "http://127.0.0.1:9", "--concurrency", "two"],  # ValueError
    ["--url", "http://127.0.0.1:9", "--concurrency", "0"],  # cells of 0 requests, reported as fine
    ["--url", "http://127.0.0.1:9", "--num-prompts", "0"],  # ZeroDivisionError
])
def test_load_test_bad_arguments_are_one_error_line(argv, capsys):
    load_test = benchmark("load_test")
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exc:
            load_test.main(argv + ["--max-tokens", "8", "--repeat", "1"] if "--max-tokens" not in argv else argv)
    finally:
        signal.signal(signal.SIGTERM, previous)
    said = capsys.readouterr().err + str(exc.value.code)
    assert exc.value.code == 2 or str(exc.value.code).startswith("error:"), said
    assert "Traceback" not in said and "interrupted" not in said, said


# ------------------------------------------------------------------------------------------ batch_bench


def test_batch_bench_every_timed_run_prefills_its_prompts(monkeypatch):
    """The docstring's figures include the prefill; a generator keeps its slots' prompts cached, so from the second
    round (or setting) on, the batched generators (one slot per prompt) skip every prefill while the sequential one
    (one slot, the prompts in turn) prefills each again: the batched / sequential ratio is inflated."""
    batch_bench = benchmark("batch_bench")
    import specdeploy
    from specdeploy.defaults import SHIPPED_BUNDLE

    prefills: list[tuple[str, float]] = []

    def load(*args, **kwargs):
        generator = specdeploy.load(*args, **kwargs)
        generate, generate_many = generator.generate, generator.generate_many

        def one(*a, **k):
            out = generate(*a, **k)
            prefills.append(("sequential", out.stats.prefill_ms))
            return out

        def many(*a, **k):
            outs = generate_many(*a, **k)
            prefills.extend(("batched", o.stats.prefill_ms) for o in outs)
            return outs

        generator.generate, generator.generate_many = one, many
        return generator

    monkeypatch.setattr(batch_bench, "specdeploy", types.SimpleNamespace(load=load))
    monkeypatch.setattr(sys, "argv", ["batch_bench.py", str(SHIPPED_BUNDLE), "--batch", "2", "--tokens", "4",
                                      "--rounds", "2"])
    batch_bench.main()
    cached = [(kind, ms) for kind, ms in prefills if ms < 1.0]  # an uncached prefill of a code prompt: tens of ms
    assert not cached, (cached, prefills)


# ------------------------------------------------------------------------------------------ bench_hosts


def test_bench_hosts_genai_decode_rate_does_not_count_the_prefills_token(monkeypatch):
    """As in bench_peers: genai's first token comes out of append_tokens (the prefill, outside the timer), so
    counting it over the generate_next_token loop gives N tokens over N - 1 passes."""
    bench_hosts = benchmark("bench_hosts")
    og = _fake_onnxruntime_genai()

    class Config:
        def __init__(self, folder):
            pass

        def overlay(self, text):
            pass

    og.Config, og.Model = Config, lambda config: object()
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", og)
    result = bench_hosts.genai(Path("target"), [[1, 2, 3]], 4, None)
    assert result["new_tokens"] == 4
    assert result["tokens_per_s"] < 1.1 / STEP_S, (result["tokens_per_s"], 1 / STEP_S)


# ------------------------------------------------------------------------------------------ real_models


def test_real_models_time_ours_runs_on_two_threads_as_every_peer(monkeypatch):
    """The docstring and the table say 2 threads for every system (genai's config set to 2, llama-bench -t 2);
    ours loads with ONNX Runtime's default (one thread per physical core: 1 on the docs' VMs, 16 on a bigger
    host), so the ratios compare different thread counts."""
    real_models = benchmark("real_models")
    seen = {}

    class FakeGenerator:
        def generate(self, ids, max_new_tokens, **_):
            stats = types.SimpleNamespace(new_tokens=max_new_tokens, tokens_per_s=1.0)
            return types.SimpleNamespace(stats=stats, token_ids=[1] * max_new_tokens)

    def load(*args, **kwargs):
        seen.update(kwargs)
        return FakeGenerator()

    fake = types.ModuleType("specdeploy")
    fake.load = load
    monkeypatch.setitem(sys.modules, "specdeploy", fake)
    real_models.time_ours(Path("bundle"), [1, 2, 3], 8)
    assert getattr(seen.get("session"), "intra_op_threads", None) == 2, seen


# ------------------------------------------------------------------------------------------ quant_sweep


def test_quant_sweep_keeps_what_the_work_folder_already_holds(tmp_path, monkeypatch):
    """docs/performance.md runs `real_models.py prepare --work WORK` and `quant_sweep.py HF_FOLDER WORK ...` with the
    same WORK; quant_sweep removed the whole folder (wheels, GGUF files, bundles) before writing its settings."""
    quant_sweep = benchmark("quant_sweep")
    work = tmp_path / "work"
    (work / "bundles").mkdir(parents=True)
    (work / "bundles" / "keep.txt").write_text("an export of an hour")

    def stop(*_args, **_kwargs):
        raise RuntimeError("stop before any conversion")

    monkeypatch.setattr(quant_sweep.ckpt, "load_checkpoint", lambda *a, **k: None)
    monkeypatch.setattr(quant_sweep.convert, "load_torch_model", lambda *a, **k: None)
    monkeypatch.setattr(quant_sweep.fused, "build_fused", stop)
    monkeypatch.setattr(sys, "argv", ["quant_sweep.py", str(tmp_path / "hf"), str(work), "8:32:4"])
    with pytest.raises((RuntimeError, SystemExit)):
        quant_sweep.main()
    assert (work / "bundles" / "keep.txt").read_text() == "an export of an hour"


def test_load_test_drives_a_real_server_and_compares_its_outputs(tmp_path, capsys):
    """The whole path on the demo bundle: a server of ours started, answers read by the package's clients, each
    greedy output compared with the runtime's own (whole answers, --no-stream: test_load_test.py)."""
    from specdeploy.defaults import DEMO_DIR

    load_test = benchmark("load_test")
    out = tmp_path / "load.json"
    previous = signal.getsignal(signal.SIGTERM)  # main installs its own
    try:
        load_test.main([str(DEMO_DIR / "demo-bundle"), "--max-batch", "2", "--concurrency", "2", "--modes", "greedy",
                        "--max-tokens", "8", "--ignore-eos", "--requests-per-stream", "1", "--min-requests", "2",
                        "--num-prompts", "2", "--json-out", str(out)])
    finally:
        signal.signal(signal.SIGTERM, previous)
    report = json.loads(out.read_text())
    (cell,) = report["cells"]
    assert (cell["requests"], cell["failed"], cell["compared"], cell["altered"]) == (2, 0, 2, 0), cell
    assert cell["generated_tokens"] == 16 and cell["latency_p50_s"] > 0 and report["stream"] is True
    assert cell["usage_per_chunk"] and cell["ttft_p50_s"] > 0 and cell["tokens_per_chunk"] > 0
    assert "| code | greedy | 2 | batched (2) |" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- constrained


def test_constrained_counts_every_cell_and_times_the_mask(chat_bundle, monkeypatch):
    """One round on the tiny chat bundle, two tasks: each of the four cells ran both, the constrained outputs
    are checked against their schema (the free ones are not JSON), forced tokens are counted where the schema
    fixes its keys, and the mask's cost is a share of a measured target-only step."""
    constrained = benchmark("constrained")
    monkeypatch.setattr(constrained, "TASKS", constrained.TASKS[:2])
    report = constrained.in_process(str(chat_bundle), 1, 200, "hybrid")
    cells = report["cells"]
    assert sorted(cells) == ["speculative constrained", "speculative free", "target-only constrained",
                             "target-only free"]
    assert all(cell["outputs"] == 2 and cell["tokens"] > 0 for cell in cells.values())
    assert cells["target-only constrained"]["valid"] == cells["speculative constrained"]["valid"] == 2
    assert cells["target-only constrained"]["forced"] > 0
    assert report["mask_us_per_token"] > 0 and 0 < report["mask_share_of_step"]


def test_pair_times_every_system_on_every_prompt_and_compares_greedy_text(chat_bundle, tmp_path, capsys):
    """Three rounds on the tiny chat bundle: each of our systems ran every prompt of each kind, each prompt's
    run of median rate summed per system, setting and kind, the ratios against our target alone, and greedy
    text compared."""
    pair = benchmark("pair")
    out = tmp_path / "pair.json"
    assert pair.main(["--bundle", f"tiny={chat_bundle}", "--prompts", "6", "--tokens", "6", "--settings",
                      "greedy,sampled", "--systems", "target,model,hybrid", "--rounds", "3",
                      "--json-out", str(out)]) == 0
    summary = json.loads(out.read_text())
    systems = ["specdeploy tiny target alone", "specdeploy tiny model", "specdeploy tiny hybrid"]
    assert sorted(summary["rates"]) == sorted(f"{system} | {setting} | {kind}" for system in systems
                                              for setting in ("greedy", "sampled") for kind in ("code", "chat"))
    assert all(rate > 0 for rate in summary["rates"].values())
    greedy = summary["greedy_same"]  # [equal, runs]: runs counted per drafter
    assert sorted(greedy) == ["tiny hybrid", "tiny model"] and all(runs == 6 for _, runs in greedy.values())
    printed = capsys.readouterr().out
    assert "| specdeploy tiny target alone |" in printed and "1.00 |" in printed
    runs = {}  # (system, setting, kind) -> prompt -> the rates of its three runs, as printed
    for system, setting, prompt, rate in re.findall(r"  (specdeploy tiny [a-z ]+) (greedy|sampled) prompt (\d): "
                                                    r"([\d.]+) tok/s", printed):
        kind = "code" if int(prompt) < 4 else "chat"
        runs.setdefault((system, setting, kind), {}).setdefault(prompt, []).append(float(rate))
    assert len(runs) == 12 and all(len(rates) == 3 for prompts in runs.values() for rates in prompts.values())
    for (system, setting, kind), prompts in runs.items():  # 6 tokens a run: 6 a prompt over its median's time
        median_time = sum(6 / sorted(rates)[1] for rates in prompts.values())
        assert summary["rates"][f"{system} | {setting} | {kind}"] == pytest.approx(6 * len(prompts) / median_time,
                                                                                  rel=2e-3)
    with pytest.raises(SystemExit, match="--systems"):
        pair.main(["--bundle", str(chat_bundle), "--systems", "model"])
