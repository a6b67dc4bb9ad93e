#!/usr/bin/env python3
"""A GGUF of a real architecture at a larger model's dimensions, random Q4_K_M weights, written one tensor at a time:
what export does with a file of that size, where no such model is on PyPI.

    python scripts/synthetic_gguf.py OUT.gguf --vocab-from QWEN2.5-CODER-1.5B.gguf [--shape qwen2.5-7b]

The file is Qwen 2's layout at Qwen2.5-7B's dimensions (28 layers, hidden 3584, 28 heads over 4 KV heads,
MLP 18944, untied head) in llama.cpp's Q4_K_M mix: Q4_K everywhere but the head, and attn_v and ffn_down
of the layers llama.cpp gives more bits (the first and last eighth, every third between), which are
Q6_K. Its vocabulary and chat template are the --vocab-from file's (a Qwen 2.5 GGUF), the embedding and
head have as many rows. The blocks are random with scales of real magnitude (each weight about
1/sqrt(its input width)), so activations stay finite through every layer; what the model says means
nothing. Peak memory of writing: one tensor.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SHAPES = {"qwen2.5-7b": dict(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, context=32768,
                             rope_theta=1_000_000.0)}
VALUES = {"Q4_K": (256, 144), "Q6_K": (256, 210)}  # values and bytes a super-block


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers of a Q4_K_M whose attn_v and ffn_down are Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K type, [rows, bytes a row] uint8, each weight of about 1/sqrt(cols)."""
    values, size = VALUES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    target = 1.0 / np.sqrt(cols)
    if kind == "Q4_K":  # d sc q - dmin m: scales and mins of 32..63, dmin so that a block centres near 0
        raw[:, :, 4:12] |= np.uint8(0xA0)
        d = np.float16(target / 220)
        raw[:, :, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        raw[:, :, 2:4] = np.frombuffer(np.float16(7.5 * float(d)).tobytes(), np.uint8)
    else:  # Q6_K: d sc (q - 32), int8 scales
        raw[:, :, 208:210] = np.frombuffer(np.float16(target / (64 * 18)).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def main() -> int:
    import gguf

    from specdeploy.export.gguf_file import GgufFile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab-from", type=Path, required=True, help="a Qwen 2.5 GGUF whose vocabulary to copy")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="qwen2.5-7b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    source = GgufFile(args.vocab_from)
    meta = source.metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(args.out), "qwen2")
    writer.add_name(f"synthetic {args.shape} (random weights)")
    writer.add_context_length(shape["context"])
    writer.add_block_count(shape["layers"])
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(list(meta["tokenizer.ggml.token_type"]))
    writer.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    for key, add in (("tokenizer.ggml.eos_token_id", writer.add_eos_token_id),
                     ("tokenizer.ggml.padding_token_id", writer.add_pad_token_id),
                     ("tokenizer.ggml.bos_token_id", writer.add_bos_token_id),
                     ("tokenizer.ggml.add_bos_token", writer.add_add_bos_token),
                     ("tokenizer.chat_template", writer.add_chat_template)):
        if key in meta:
            add(meta[key])
    hidden, inter, layers = shape["hidden"], shape["intermediate"], shape["layers"]
    kv = hidden // shape["heads"] * shape["kv_heads"]
    plan = [("token_embd.weight", "Q4_K", vocab, hidden), ("output_norm.weight", "F32", 1, hidden),
            ("output.weight", "Q6_K", vocab, hidden)]
    for i in range(layers):
        v_kind = "Q6_K" if more_bits(i, layers) else "Q4_K"
        plan += [(f"blk.{i}.attn_norm.weight", "F32", 1, hidden), (f"blk.{i}.ffn_norm.weight", "F32", 1, hidden),
                 (f"blk.{i}.attn_q.weight", "Q4_K", hidden, hidden), (f"blk.{i}.attn_q.bias", "F32", 1, hidden),
                 (f"blk.{i}.attn_k.weight", "Q4_K", kv, hidden), (f"blk.{i}.attn_k.bias", "F32", 1, kv),
                 (f"blk.{i}.attn_v.weight", v_kind, kv, hidden), (f"blk.{i}.attn_v.bias", "F32", 1, kv),
                 (f"blk.{i}.attn_output.weight", "Q4_K", hidden, hidden),
                 (f"blk.{i}.ffn_gate.weight", "Q4_K", inter, hidden), (f"blk.{i}.ffn_up.weight", "Q4_K", inter, hidden),
                 (f"blk.{i}.ffn_down.weight", v_kind, hidden, inter)]
    for name, kind, rows, cols in plan:  # the table of contents first, then each tensor's bytes as it is made
        if kind == "F32":
            writer.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            nbytes = rows * cols // VALUES[kind][0] * VALUES[kind][1]
            writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    for name, kind, rows, cols in plan:
        if kind == "F32":
            values = np.ones(cols, np.float32) if name.endswith("norm.weight") else 0.02 * rng.standard_normal(cols)
            writer.write_tensor_data(values.astype(np.float32))
        else:
            writer.write_tensor_data(blocks(kind, rows, cols, rng))
    writer.close()
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB, {len(plan)} tensors, vocabulary {vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
