"""Weight-only quantization settings on one checkpoint: greedy agreement with fp32 PyTorch and decode speed.

    python -m benchmarks.quant_sweep HF_FOLDER WORK 8:32:4 4:32:4 4:32:0 4:64:4 4:128:4 4:16:4

Each setting is BITS:BLOCK_SIZE:ACCURACY_LEVEL, applied by specdeploy's own quantizer
(specdeploy/export/quantize.py: MatMulNBits for every MatMul, the embedding and a tied head on one
quantized table) to the fused fp32 graph. Agreement is teacher-forced over export's parity text
(the argmax at each of 261 positions against PyTorch fp32, as export's check takes it). Decode is
64 one-token steps after a 64-token prefill, 2 threads; the settings run in interleaved rounds.
The graphs go to WORK/quant-sweep/ (replaced each run; nothing else in WORK is touched).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from specdeploy.export import checkpoint as ckpt
from specdeploy.export import convert, fused, parity, quantize
from specdeploy.export.sources import TorchWeights
from specdeploy.export.build import model_spec
from specdeploy.export.config import ExportConfig
from specdeploy.runtime import OrtEngine, SessionConfig

MAX_CONTEXT = 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("work", type=Path)
    parser.add_argument("settings", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    convert.quiet_export_logs()
    checkpoint = ckpt.load_checkpoint(str(args.checkpoint), "target")
    model = convert.load_torch_model(args.checkpoint, "target", False)
    work = args.work / "quant-sweep"  # this script's own folder, replaced each run; the rest of WORK is left alone
    shutil.rmtree(work, ignore_errors=True)
    (work / "fp32").mkdir(parents=True)
    fused.build_fused(TorchWeights(model), work / "fp32" / "model.onnx", MAX_CONTEXT)
    ids = parity.parity_tokens(args.checkpoint / "tokenizer.json", model.config.vocab_size, 261)
    with torch.no_grad():
        reference = model(input_ids=torch.from_numpy(ids)[None]).logits[0].numpy()  # [261, vocab]
    runs = {}
    for setting in ["32:0:0", *args.settings]:
        bits, block, level = (int(v) for v in setting.split(":"))
        name = "fp32" if bits == 32 else f"int{bits}, block {block}, accuracy_level {level}"
        folder = work / setting.replace(":", "-")
        shutil.copytree(work / "fp32", folder)
        if bits != 32:
            quantize.quantize_weights(folder / "model.onnx", bits, block, level)
        spec = model_spec("target", checkpoint, folder / "model.onnx", work,
                           ExportConfig(str(args.checkpoint), str(args.checkpoint), str(work / "unused")),
                           MAX_CONTEXT, 1, "fused", "none" if bits == 32 else f"int{bits}")
        engine = OrtEngine(folder / "model.onnx", spec, SessionConfig(device="cpu", intra_op_threads=2, allow_spinning=True))
        logits = engine.run(ids, engine.new_cache(300))  # [261, vocab]
        agreement = float(np.mean(logits.argmax(-1) == reference.argmax(-1)))
        size = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
        runs[name] = (engine, agreement, size, [])
    for _ in range(args.rounds):
        for name, (engine, _, _, rates) in runs.items():
            cache = engine.new_cache(300)
            engine.run(ids[:64], cache)
            token, start = 100, time.perf_counter()
            for _ in range(64):
                token = int(engine.run([token], cache)[-1].argmax())
            rates.append(64 / (time.perf_counter() - start))
    print("| setting | greedy agreement with fp32 | weights MB | decode tok/s (median) | runs |\n|---|---|---|---|---|")
    for name, (_, agreement, size, rates) in runs.items():
        print(f"| {name} | {agreement:.3f} | {size:.0f} | {statistics.median(rates):.1f} | "
              f"{', '.join(f'{r:.0f}' for r in rates)} |")


if __name__ == "__main__":
    main()
