"""A GGUF file's tensors, read in place under the names of the Hugging Face model they belong to.

Export never makes a float32 copy of a GGUF model: each tensor's bytes are read from the file
when asked for (gguf_file.GgufFile), rows at a time, and let go. Three readers sit on that:

- `GgufWeights`, the fused graph's weights source: a matrix of a type blocks.py maps exactly is
  its own quantized blocks (`blocks.BlockMatrix`), anything else float32;
- `streamed_model`, the parity check's PyTorch reference: the transformers model of the file's
  architecture with no weights in memory until a module runs, then only that module's (one decoder
  layer or the head at a time; of the embedding, the rows asked for), dequantized (`dense`);
- `load_model`, the same model with every weight loaded (distill's teacher; optimum's graphs).

llama.cpp's converter changes two things on the way in, which are undone here as transformers'
GGUF loader undoes them: a Llama's q and k rows are permuted (its rotary pairs interleaved) and
Gemma's norm weights carry the 1 that Gemma's RMSNorm adds. A Gemma norm's graph weight is the
file's own value (weight + 1), as llama.cpp reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import SpecdeployError
from .blocks import GGUF_BLOCK_TYPES, BlockMatrix, dequantize, from_gguf
from .gguf_file import GgufFile

# The GGUF architectures whose tensors this module maps onto a transformers model (their fused graphs are
# tested against transformers' own reading of the same files); others go through transformers' loader.
ARCHITECTURES = ("llama", "qwen2", "gemma3")
UNQUANTIZED = ("F32", "F16", "BF16")
ROWS_AT_A_TIME = 4096  # rows converted or dequantized at once: a tensor's temporaries stay a few MB


@dataclass
class TensorUse:
    """What a model's export took from its GGUF: the tensors kept as their own blocks, and those dequantized."""

    kept: dict[str, str] = field(default_factory=dict)  # GGUF tensor -> its type, kept as blocks
    dequantized: dict[str, str] = field(default_factory=dict)  # GGUF tensor -> its type, stored as float32

    def kept_types(self) -> dict[str, int]:
        """GGUF type -> how many tensors of it were kept as blocks."""
        counts: dict[str, int] = {}
        for kind in self.kept.values():
            counts[kind] = counts.get(kind, 0) + 1
        return dict(sorted(counts.items()))


def dense(file: GgufFile, name: str) -> np.ndarray:
    """A tensor as float32 [rows, cols] (or [cols] for a vector), a chunk of rows at a time: blocks.py's reading of
    the types it maps (llama.cpp's values; tests/test_gguf_blocks.py holds it to gguf's), gguf's dequantization
    of the rest."""
    import gguf

    tensor = file.tensors[name]
    kind = gguf.GGMLQuantizationType[tensor.type_name]
    out = np.empty((tensor.rows, tensor.cols), dtype=np.float32)
    for start in range(0, tensor.rows, ROWS_AT_A_TIME):
        stop = min(tensor.rows, start + ROWS_AT_A_TIME)
        raw = file.raw_rows(name, start, stop)
        if tensor.type_name in GGUF_BLOCK_TYPES:
            out[start:stop] = dequantize(from_gguf(raw, tensor.type_name, tensor.cols))
        else:
            out[start:stop] = gguf.quants.dequantize(raw, kind).reshape(stop - start, -1)
    return out if len(tensor.shape) > 1 else out[0]


def dense_rows(file: GgufFile, name: str, rows: np.ndarray) -> np.ndarray:
    """Some rows of a matrix, float32 [len(rows), cols], gguf's dequantization of those rows alone."""
    import gguf

    kind = gguf.GGMLQuantizationType[file.tensors[name].type_name]
    return np.concatenate([gguf.quants.dequantize(file.raw_rows(name, int(row), int(row) + 1), kind).reshape(1, -1)
                           for row in rows]) if len(rows) else np.empty((0, file.tensors[name].cols), np.float32)


def blocks(file: GgufFile, name: str) -> BlockMatrix:
    """A quantized matrix of a type blocks.py maps, as a BlockMatrix of the same values (a chunk of rows at a time)."""
    tensor = file.tensors[name]
    kind = GGUF_BLOCK_TYPES[tensor.type_name]
    rows, cols = tensor.rows, tensor.cols
    n_blocks, blob = cols // kind.block_size, kind.block_size * kind.bits // 8
    codes = np.empty((rows, n_blocks, blob), dtype=np.uint8)
    scales = np.empty((rows, n_blocks), dtype=np.float32)
    mins = None
    for start in range(0, rows, ROWS_AT_A_TIME):
        stop = min(rows, start + ROWS_AT_A_TIME)
        part = from_gguf(file.raw_rows(name, start, stop), tensor.type_name, cols)
        codes[start:stop], scales[start:stop] = part.codes, part.scales
        if part.mins is not None:
            mins = np.empty((rows, n_blocks), dtype=np.float32) if mins is None else mins
            mins[start:stop] = part.mins
    return BlockMatrix(codes, scales, mins, kind.bits, kind.block_size, tensor.type_name)


def _rotary_rows(rows: int, heads: int) -> np.ndarray:
    """The order that undoes llama.cpp's permutation of a Llama's q or k rows: hf_rows = gguf_rows[order].

    The converter writes w.reshape(heads, 2, rows / heads / 2, ...).swapaxes(1, 2): each head's two rotary
    halves interleaved, as llama.cpp's rotary kernel pairs them."""
    permuted = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)
    return np.argsort(permuted)


class GgufTensors:
    """The file's tensors under a transformers model's state-dict names, with llama.cpp's changes undone."""

    def __init__(self, file: GgufFile, config):
        import gguf

        if file.architecture not in ARCHITECTURES:
            raise SpecdeployError(f"{file.path}: the GGUF architecture '{file.architecture}' is not one whose blocks "
                                  f"export reads in place ({', '.join(ARCHITECTURES)})")
        self.file, self.config = file, config
        self._names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[file.architecture.upper()],
                                               int(config.num_hidden_layers))

    def gguf_name(self, name: str) -> str:
        """The GGUF tensor of a state-dict name (`model.layers.0.self_attn.q_proj.weight` -> `blk.0.attn_q.weight`);
        a tied head's is the embedding's."""
        base, suffix = name.rsplit(".", 1)
        mapped = self._names.get_name(base)
        if mapped is None:
            raise SpecdeployError(f"{self.file.path}: no GGUF tensor for {name}")
        if f"{mapped}.{suffix}" not in self.file.tensors and base == "lm_head":
            mapped = self._names.get_name("model.embed_tokens")
        if f"{mapped}.{suffix}" not in self.file.tensors:
            raise SpecdeployError(f"{self.file.path}: the tensor {mapped}.{suffix} ({name}) is missing")
        return f"{mapped}.{suffix}"

    def tied_head(self) -> bool:
        return self._names.get_name("lm_head") + ".weight" not in self.file.tensors

    def row_order(self, name: str) -> np.ndarray | None:
        """The rows to take to undo llama.cpp's q / k permutation (None: the rows are as transformers has them)."""
        if self.file.architecture != "llama" or not name.endswith((".q_proj.weight", ".q_proj.bias",
                                                                   ".k_proj.weight", ".k_proj.bias")):
            return None
        heads = int(self.config.num_attention_heads)
        if ".k_proj." in name:
            heads = int(getattr(self.config, "num_key_value_heads", None) or heads)
        tensor = self.file.tensors[self.gguf_name(name)]
        return _rotary_rows(tensor.rows if len(tensor.shape) > 1 else tensor.cols, heads)

    def norm_shift(self, name: str) -> float:
        """What llama.cpp added to this tensor (Gemma's norm weights carry their 1)."""
        return 1.0 if self.file.architecture == "gemma3" and name.endswith("norm.weight") else 0.0

    def array(self, name: str) -> np.ndarray:
        """A parameter as transformers holds it, float32."""
        values = dense(self.file, self.gguf_name(name))
        order = self.row_order(name)
        if order is not None:
            values = values[order]
        shift = self.norm_shift(name)
        return values - np.float32(shift) if shift else values


class GgufWeights:
    """fused.py's weights source for a GGUF file: blocks where keep_blocks and the type maps exactly, else float32.

    model: the transformers model of the file's architecture, for its structure (its parameters on the
    meta device). `use` records what was kept and what was dequantized."""

    def __init__(self, tensors: GgufTensors, model, keep_blocks: bool):
        self.tensors, self.model, self.keep_blocks = tensors, model, keep_blocks
        self.use = TensorUse()

    def array(self, name: str) -> np.ndarray:
        return self.tensors.array(name)

    def matrix(self, name: str) -> np.ndarray | BlockMatrix:
        source = self.tensors.gguf_name(name)
        kind = self.tensors.file.tensors[source].type_name
        if not self.keep_blocks or kind not in GGUF_BLOCK_TYPES:
            if self.keep_blocks and kind not in UNQUANTIZED:
                self.use.dequantized[source] = kind
            return self.tensors.array(name)
        matrix = blocks(self.tensors.file, source)
        order = self.tensors.row_order(name)
        self.use.kept[source] = kind
        return matrix if order is None else matrix.take(order)

    def norm(self, name: str, offset: float) -> np.ndarray:
        """weight + offset; a Gemma norm's (offset 1) is the file's own value."""
        shift = self.tensors.norm_shift(name)
        if shift and offset == shift:
            return dense(self.tensors.file, self.tensors.gguf_name(name))
        return self.tensors.array(name) + np.float32(offset)

    def tied_head(self) -> bool:
        return self.tensors.tied_head()


def skeleton(config):
    """The transformers model for config, its parameters on the meta device (no memory), its buffers (rotary
    tables, Gemma's embedding scale) real."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # under init_empty_weights the model's own tying leaves two head parameters
    return model.eval().requires_grad_(False)


def _units(model) -> list[tuple[str, object]]:
    """The modules that hold the model's parameters, each loaded whole: every decoder layer, and each other
    module with parameters of its own (the embedding, the final norm, the head), by state-dict prefix."""
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    layer_ids = {id(layer) for layer in layers}
    units, inside = [], set()
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if id(module) in layer_ids:
            units.append((name, module))
            inside.add(name)
        elif any(True for _ in module.parameters(recurse=False)):
            units.append((name, module))
    return units


class _Loader:
    """Puts a unit's parameters in place from the file (dequantized) and takes them away again."""

    def __init__(self, tensors: GgufTensors):
        self.tensors = tensors
        self.loaded = None

    def load_rows(self, prefix: str, unit, ids) -> None:
        """The input embedding with only the rows ids asks for read (the rest left unwritten, never resident)."""
        import torch

        if self.loaded is not None:
            self.release(self.loaded)
        name = f"{prefix}.weight"
        wanted = np.unique(ids.detach().cpu().numpy().reshape(-1))
        table = torch.empty(tuple(unit.weight.shape), dtype=torch.float32)
        table[torch.from_numpy(wanted)] = torch.from_numpy(dense_rows(self.tensors.file, self.tensors.gguf_name(name),
                                                                      wanted))
        unit.register_parameter("weight", torch.nn.Parameter(table, requires_grad=False))
        self.loaded = unit

    def load(self, prefix: str, unit) -> None:
        import torch

        if self.loaded is unit:
            return
        if self.loaded is not None:
            self.release(self.loaded)
        for name, module in unit.named_modules():
            for leaf, parameter in list(module.named_parameters(recurse=False)):
                full = ".".join(part for part in (prefix, name, leaf) if part)
                values = torch.from_numpy(self.tensors.array(full))
                if tuple(values.shape) != tuple(parameter.shape):
                    raise SpecdeployError(f"{self.tensors.file.path}: {full} is {tuple(values.shape)} in the GGUF, "
                                          f"{tuple(parameter.shape)} in the model its metadata describes")
                module.register_parameter(leaf, torch.nn.Parameter(values, requires_grad=False))
        self.loaded = unit

    @staticmethod
    def release(unit) -> None:
        import torch

        for module in unit.modules():
            for leaf, parameter in list(module.named_parameters(recurse=False)):
                module.register_parameter(leaf, torch.nn.Parameter(torch.empty(parameter.shape, device="meta"),
                                                                   requires_grad=False))


def streamed_model(tensors: GgufTensors):
    """The transformers model of the file, whose weights are read as each module runs and let go when the next one
    does: one decoder layer (or the head) in memory at a time, and of the input embedding only the rows of the
    tokens it is given. The module that ran last keeps its weights, so a caller may apply the head to many rows
    without reading it again."""
    model = skeleton(tensors.config)
    loader = _Loader(tensors)
    embedding = model.get_input_embeddings()
    for prefix, unit in _units(model):
        if unit is embedding:  # a lookup: only the rows of the tokens it is given
            unit.register_forward_pre_hook(lambda module, args, prefix=prefix: loader.load_rows(prefix, module, args[0]))
        else:
            unit.register_forward_pre_hook(lambda module, args, prefix=prefix: loader.load(prefix, module))
    return model


def load_model(tensors: GgufTensors):
    """The transformers model of the file with every weight loaded (float32), one tensor read at a time."""
    model = skeleton(tensors.config)
    tied = tensors.tied_head()
    head = model.get_output_embeddings()
    for prefix, unit in _units(model):
        if not (tied and unit is head):  # a tied head is the embedding table itself, tied below
            _Loader(tensors).load(prefix, unit)
    if tied and head is not None:
        head.weight = model.get_input_embeddings().weight
    return model
