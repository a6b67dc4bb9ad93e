#!/usr/bin/env python3
"""A distilled model-kind draft as a GGUF for llama.cpp's speculative decoding (the peer comparison).

llama.cpp's converter (convert_hf_to_gguf.py) writes the draft's weights; llama.cpp then refuses a
draft whose vocabulary metadata differs from the target's, and the converter reads some tokenizers
differently from the GGUF the target came in (SmolLM2's tokenizer.json becomes an SPM vocabulary,
the target's GGUF has gpt2/smollm). So this copies every tokenizer.* field of the target's GGUF
over the converted draft's, keeping its own weights and hyperparameters.

    PYTHONPATH=LLAMA_CPP/gguf-py python scripts/draft_to_gguf.py --draft DRAFT_DIR --target TARGET.gguf \\
        --converter LLAMA_CPP/convert_hf_to_gguf.py --out DRAFT.gguf [--outtype q8_0]

The converter needs its own requirements (sentencepiece among them); run this with a Python that has them.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, required=True, help="a `specdeploy distill --kind model` folder")
    parser.add_argument("--target", type=Path, required=True, help="the target's GGUF (its tokenizer is copied)")
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--outtype", default="q8_0")
    args = parser.parse_args()
    import gguf

    with tempfile.TemporaryDirectory() as work:
        folder = Path(work) / "draft"
        folder.mkdir()
        for name in HF_FILES:  # the checkpoint alone: no training state, no specdeploy files
            if (args.draft / name).is_file():
                shutil.copy2(args.draft / name, folder / name)
        converted = Path(work) / "converted.gguf"
        subprocess.run([sys.executable, str(args.converter), str(folder), "--outfile", str(converted),
                        "--outtype", args.outtype], check=True, capture_output=True)
        draft, target = gguf.GGUFReader(converted), gguf.GGUFReader(args.target)
        writer = gguf.GGUFWriter(args.out, arch=draft.fields[gguf.Keys.General.ARCHITECTURE].contents())
        fields = [f for f in draft.fields.values() if not f.name.startswith("tokenizer.")]
        fields += [f for f in target.fields.values() if f.name.startswith("tokenizer.")]
        for field in fields:
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
        for tensor in draft.tensors:
            writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in draft.tensors:
            writer.write_tensor_data(tensor.data, tensor_endianess=draft.endianess)
        writer.close()
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
