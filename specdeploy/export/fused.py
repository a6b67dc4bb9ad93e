"""The fused graph for the Llama family and Gemma 3: GroupQueryAttention over a KV cache written in place.

optimum's graph returns `present = Concat(past, new)`: every step copies the whole cache (so a step
slows down as the context grows), and its 600 nodes cost more than the arithmetic of a small model. This module emits, from the same PyTorch weights, the graph
onnxruntime-genai's model builder emits for these models, with ONNX Runtime's contrib operators:

    Gather -> [SimplifiedLayerNorm -> MatMul(qkv) -> GroupQueryAttention -> MatMul(o)
               -> SkipSimplifiedLayerNorm -> MatMul(gate), MatMul(up) -> SiLU * up -> MatMul(down)] x L
           -> SkipSimplifiedLayerNorm -> MatMul(lm_head)

GroupQueryAttention applies the rotary embedding itself (cos/sin tables taken from the model's own
rotary module, so rope scaling comes along) and, when a present output is bound to the buffer of
its past input, writes the new keys and values into that buffer: the cache is one preallocated
[1, kv_heads, max_context, head_dim] tensor per layer, and rollback is a length change. The valid
length comes from `attention_mask` (ones over past + new), as in onnxruntime-genai.

Gemma 3 (Gemma3ForCausalLM), as onnxruntime-genai's builder emits it for the CPU:

    Gather -> Mul(sqrt(hidden)) -> [SimplifiedLayerNorm -> MatMul(q), MatMul(k), MatMul(v)
               -> Reshape -> SimplifiedLayerNorm(q_norm, k_norm, per head) -> Reshape -> GroupQueryAttention
               -> MatMul(o) -> SimplifiedLayerNorm(post_attention) -> SkipSimplifiedLayerNorm(pre_feedforward)
               -> MatMul(gate), MatMul(up) -> FastGelu * up -> MatMul(down)
               -> SimplifiedLayerNorm(post_feedforward)] x L
           -> SkipSimplifiedLayerNorm -> FusedMatMul(embedding table, transposed) [-> softcap]

Gemma's norms multiply by (1 + weight): the 1 is folded into each stored weight. GroupQueryAttention
takes q, k and v apart (the q/k norms sit before its rotary), query_pre_attn_scalar ** -0.5 as its
scale, and the sliding layers (config.layer_types) their window as local_window_size and their own
rotary table (rope_local_base_freq); the global layers keep rope_theta and rope_scaling. Every layer's
cache is full length; a sliding layer only reads its window of it. The tied head reads the embedding
table (stored once); final_logit_softcapping, when set, is softcap * tanh(logits / softcap).

Which checkpoints qualify is decided by `unsupported_reason`; the rest go through optimum. Either
way the parity check against PyTorch decides whether the bundle is written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .convert import weights_path
from .weights import DataWriter

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM")
GEMMA3 = "Gemma3ForCausalLM"
MS = "com.microsoft"
OPSET = 17


def unsupported_reason(model, max_context: int) -> str | None:
    """Why this model cannot take the fused graph (None when it can)."""
    config = model.config
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not in the fused family ({', '.join(ARCHITECTURES)})"
    if not type(model).__module__.startswith("transformers."):
        return f"{name} comes from the checkpoint's own code, not transformers'"
    try:
        return _unsupported_layout(model, config, name, max_context)
    except AttributeError as exc:  # a layout the builder does not know
        return f"unexpected module layout ({exc})"


def _unsupported_layout(model, config, name: str, max_context: int) -> str | None:
    if name == GEMMA3:
        problem = _unsupported_gemma3(config)
        if problem is not None:
            return problem
    elif getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act}"
    mlp = model.model.layers[0].mlp
    if getattr(getattr(mlp, "gate_up_proj", None), "bias", None) is not None:
        return "a biased packed gate/up projection"
    window = getattr(config, "sliding_window", None)
    if name == "Qwen2ForCausalLM" and not getattr(config, "use_sliding_window", False):
        window = None
    if name != GEMMA3 and window is not None and window < max_context:  # Gemma 3: per layer, see _layer_window
        return f"sliding window {window} < max context {max_context}"
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        # dynamic and longrope change their tables with the sequence length
        return f"rope scaling '{rope_type}'"
    attention = model.model.layers[0].self_attn
    head_dim = attention.head_dim
    if head_dim % 16:
        return f"head_dim {head_dim} (GroupQueryAttention's rotary kernel needs a multiple of 16)"
    rotary = _rotary_tables(model, 1)[0].shape[1]
    if rotary % 8:
        return f"rotary dimension {2 * rotary}"
    return None


def _unsupported_gemma3(config) -> str | None:
    """What transformers' Gemma 3 does that the fused graph does not (None: nothing)."""
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if activation != "gelu_pytorch_tanh":
        return f"activation {activation}"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    kinds = set(config.layer_types) - {"sliding_attention", "full_attention"}
    if kinds:
        return f"layer types {', '.join(sorted(kinds))}"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        # transformers' Gemma 3 attention reads the setting but never applies it; the graph follows
        # the reference rather than guess which of the two a checkpoint was trained with.
        return "attn_logit_softcapping, which transformers' Gemma 3 does not apply"
    return None


def _rotary_tables(model, positions: int, module=None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, rotary_dim / 2] exactly as the model's rotary module (default: its
    global one, `model.model.rotary_emb`) computes them."""
    import torch

    ids = torch.arange(positions, dtype=torch.int64)[None]
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = (module or model.model.rotary_emb)(probe, ids)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].float().numpy(), sin[0, :, :half].float().numpy()


def _np(tensor) -> np.ndarray:
    return tensor.detach().float().numpy()


class _Graph:
    """Nodes, and initializers written straight into the external data file as they come.

    A weight never sits in the protobuf: each is copied once (transposed to [in, out]) and
    written (weights.DataWriter), so exporting takes about one model's worth of memory beyond
    PyTorch's copy rather than three."""

    def __init__(self, data_path: Path):
        from onnx import helper

        self.helper = helper
        self.nodes: list = []
        self.initializers: list = []
        self._count = 0
        self._data = DataWriter(data_path)

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(self._data.array(name, array))
        return name

    def close(self) -> None:
        self._data.close()

    def node(self, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs) -> list[str]:
        self._count += 1
        if isinstance(outputs, int):
            outputs = [f"/{op.lower()}_{self._count}/out{i}" for i in range(outputs)]
        self.nodes.append(self.helper.make_node(op, inputs, outputs, name=f"{op}_{self._count}", domain=domain, **attrs))
        return outputs

    def linear(self, x: str, name: str, module) -> str:
        """x @ W.T (+ b): MatMul with the weight stored [in, out]."""
        out = self.node("MatMul", [x, self.weight(f"{name}.weight", _np(module.weight).T)])[0]
        if getattr(module, "bias", None) is not None:
            out = self.node("Add", [out, self.weight(f"{name}.bias", _np(module.bias))])[0]
        return out


def build_fused(model, path: Path, max_context: int, window: int | None = None, features: bool = False,
                vocab_ids: np.ndarray | None = None) -> Path:
    """Write the fused fp32 graph for model (see the module docstring) to path.

    window: each query attends to its last `window` positions, itself included (GroupQueryAttention's
    local_window_size, measured); None: the whole context. Only for drafts, whose numbers never reach the
    output: a draft trained on short windows proposes better, and reads less, with one.
    features: also return `hidden_states` [batch, seq, hidden], the final norm's input (for an eagle draft).
    vocab_ids: the head's rows (a draft's frequent tokens); None: the whole vocabulary."""
    g = _Graph(weights_path(path))
    try:
        _emit(g, model, max_context, window or -1, features, vocab_ids)
    finally:
        g.close()
    return _save(g, path)


def _save(g: _Graph, path: Path) -> Path:
    import onnx
    from onnx import helper

    graph = helper.make_graph(g.nodes, "specdeploy-fused", g.inputs, g.outputs, g.initializers)
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)], producer_name="specdeploy"
    )
    proto.ir_version = 8
    onnx.save_model(proto, path)  # the graph only: its initializers already point into path + ".data"
    return path


def _emit(g: _Graph, model, max_context: int, window: int, features: bool, vocab_ids: np.ndarray | None) -> None:
    """The nodes and weights of the fused graph (see the module docstring) into g, in graph order."""
    config = model.config
    layers = model.model.layers
    gemma = type(model).__name__ == GEMMA3
    g.inputs, g.outputs = _io_specs(config, layers, len(vocab_ids) if vocab_ids is not None else config.vocab_size)
    if features:
        g.outputs.insert(1, _tensor("hidden_states", ["batch_size", "sequence_length", config.hidden_size]))
    lengths = _valid_lengths(g)
    cos, sin = _rotary_tables(model, max_context)
    rotary = (g.weight("cos_cache", cos), g.weight("sin_cache", sin))
    if gemma:  # the sliding layers' own table (rope_local_base_freq, unscaled)
        cos, sin = _rotary_tables(model, max_context, model.model.rotary_emb_local)
        local_rotary = (g.weight("cos_cache_local", cos), g.weight("sin_cache_local", sin))
    embed = model.model.embed_tokens.weight
    delta = g.node("Gather", [g.weight("embed_tokens.weight", _np(embed)), "input_ids"], axis=0)[0]
    if gemma:  # embeddings times sqrt(hidden_size), in the table's dtype as transformers rounds it
        scale = model.model.embed_tokens.embed_scale.to(embed.dtype)
        delta = g.node("Mul", [delta, g.weight("embed_scale", _np(scale).reshape(1))])[0]
    # Gemma's RMSNorm multiplies by (1 + weight): the 1 is folded into the stored weight.
    norm = _ResidualNorm(g, float(config.rms_norm_eps), offset=1.0 if gemma else 0.0)
    for i, layer in enumerate(layers):
        normed = norm(delta, layer.input_layernorm, f"layers.{i}.input_layernorm")
        sliding = gemma and config.layer_types[i] == "sliding_attention"
        context = _attention(g, i, layer.self_attn, normed, lengths, local_rotary if sliding else rotary, config,
                             _layer_window(config.sliding_window if sliding else None, window))
        delta = g.linear(context, f"layers.{i}.o_proj", layer.self_attn.o_proj)
        if gemma:  # normed before it joins the residual stream, then the MLP's own norm
            delta = norm.plain(delta, layer.post_attention_layernorm, f"layers.{i}.post_attention_layernorm")
            normed = norm(delta, layer.pre_feedforward_layernorm, f"layers.{i}.pre_feedforward_layernorm")
            delta = norm.plain(_mlp(g, i, layer.mlp, normed, gelu_tanh=True), layer.post_feedforward_layernorm,
                               f"layers.{i}.post_feedforward_layernorm")
        else:
            normed = norm(delta, layer.post_attention_layernorm, f"layers.{i}.post_attention_layernorm")
            delta = _mlp(g, i, layer.mlp, normed)
    final = norm(delta, model.model.norm, "norm")
    if features:  # the final norm's input, which its fused node returns anyway: what an eagle draft reads
        g.node("Identity", [norm.residual], ["hidden_states"])
    _head(g, model, final, vocab_ids)


def _head(g: _Graph, model, final: str, vocab_ids: np.ndarray | None) -> None:
    """logits = the model's LM head over final (and Gemma's softcap), its rows vocab_ids only when given."""
    config = model.config
    embed = model.model.embed_tokens.weight
    head = model.lm_head
    softcap = getattr(config, "final_logit_softcapping", None) if type(model).__name__ == GEMMA3 else None
    logits = "logits_uncapped" if softcap else "logits"
    tied = head.weight.data_ptr() == embed.data_ptr()
    if tied and vocab_ids is None and "embed_tokens.weight" in {t.name for t in g.initializers}:
        # Tied: read the embedding table transposed instead of storing it twice.
        g.node("FusedMatMul", [final, "embed_tokens.weight"], [logits], domain=MS, transB=1, alpha=1.0)
    else:
        rows = _np(head.weight) if vocab_ids is None else _np(head.weight)[vocab_ids]
        g.nodes.append(g.helper.make_node("MatMul", [final, g.weight("lm_head.weight", rows.T)], [logits], name="lm_head"))
    if softcap:  # softcap * tanh(logits / softcap)
        cap = g.weight("final_logit_softcapping", np.array([softcap], dtype=np.float32))
        g.node("Mul", [g.node("Tanh", [g.node("Div", [logits, cap])[0]])[0], cap], ["logits"])


def _layer_window(sliding_window: int | None, draft_window: int) -> int:
    """GroupQueryAttention's local_window_size for a layer whose queries attend to their last
    `sliding_window` positions, itself included (transformers' sliding_window; None: all), within
    the draft's window if it has one (-1: none). GroupQueryAttention's local_window_size means the
    same, W positions itself included, whether they come in one pass or over steps (measured:
    tests/test_fused_gemma.py)."""
    limits = [w for w in (sliding_window, draft_window if draft_window > 0 else None) if w is not None]
    return min(limits) if limits else -1


def _tensor(name: str, shape: list, integer: bool = False):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.INT64 if integer else TensorProto.FLOAT, shape)


def _io_specs(config, layers, columns: int) -> tuple[list, list]:
    """The graph's inputs and outputs: the names and shapes of the manifest's KV templates; logits [.., columns]."""
    from onnx import TensorProto, helper

    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = layers[0].self_attn.head_dim
    inputs = [_tensor("input_ids", ["batch_size", "sequence_length"], integer=True),
              _tensor("attention_mask", ["batch_size", "total_sequence_length"], integer=True)]
    outputs = [_tensor("logits", ["batch_size", "sequence_length", columns])]
    cache_shape = ["batch_size", kv_heads, "past_sequence_length", head_dim]
    present_shape = ["batch_size", kv_heads, "present_sequence_length", head_dim]
    for i in range(len(layers)):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, cache_shape))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, present_shape))
    return inputs, outputs


def _valid_lengths(g: _Graph) -> tuple[str, str]:
    """GroupQueryAttention's seqlens_k (sum(mask) - 1, per row) and total length (the mask's width), as
    onnxruntime-genai computes them."""
    from onnx import TensorProto

    one = g.weight("one_i64", np.array([1], dtype=np.int64))
    row_sum = g.node("ReduceSum", ["attention_mask", one], keepdims=0)[0]
    seqlens = g.node("Cast", [g.node("Sub", [row_sum, one])[0]], to=TensorProto.INT32)[0]
    width = g.node("Gather", [g.node("Shape", ["attention_mask"])[0], g.weight("axis1_i64", np.array(1, dtype=np.int64))], axis=0)[0]
    return seqlens, g.node("Cast", [width], to=TensorProto.INT32)[0]


class _ResidualNorm:
    """RMS norms that carry the residual stream: the first is SimplifiedLayerNormalization, every later
    one SkipSimplifiedLayerNormalization, which adds its input to the running sum before normalizing."""

    def __init__(self, g: _Graph, eps: float, offset: float = 0.0):
        self.g, self.eps, self.offset = g, eps, offset
        self.residual: str | None = None

    def _weight(self, module, name: str) -> str:
        return self.g.weight(f"{name}.weight", _np(module.weight) + np.float32(self.offset))

    def __call__(self, x: str, module, name: str) -> str:
        g = self.g
        weight = self._weight(module, name)
        if self.residual is None:
            self.residual = x
            return g.node("SimplifiedLayerNormalization", [x, weight], epsilon=self.eps, axis=-1, stash_type=1)[0]
        out, _, _, self.residual = g.node("SkipSimplifiedLayerNormalization", [x, self.residual, weight], 4, domain=MS,
                                          epsilon=self.eps)
        return out

    def plain(self, x: str, module, name: str) -> str:
        """An RMS norm off the residual stream (Gemma's post-attention and post-feedforward norms)."""
        return self.g.node("SimplifiedLayerNormalization", [x, self._weight(module, name)], epsilon=self.eps, axis=-1,
                           stash_type=1)[0]


def _attention(g: _Graph, i: int, attn, normed: str, lengths: tuple[str, str], rotary: tuple[str, str], config,
               window: int) -> str:
    """One fused qkv MatMul (+ bias), then GroupQueryAttention on layer i's KV buffers; its output before o_proj.

    window: GroupQueryAttention's local_window_size (see _layer_window). With q/k norms (Gemma 3) q, k
    and v are three MatMuls, q and k normed over each head before GroupQueryAttention rotates them."""
    if hasattr(attn, "q_norm"):
        q, k, v = (g.linear(normed, f"layers.{i}.{name}", getattr(attn, name)) for name in ("q_proj", "k_proj", "v_proj"))
        eps = float(config.rms_norm_eps)
        qkv = [_head_norm(g, q, attn.q_norm, f"layers.{i}.q_norm", attn.head_dim, attn.q_proj.out_features, eps),
               _head_norm(g, k, attn.k_norm, f"layers.{i}.k_norm", attn.head_dim, attn.k_proj.out_features, eps), v]
    elif hasattr(attn, "qkv_proj"):
        qkv = g.linear(normed, f"layers.{i}.qkv_proj", attn.qkv_proj)
    else:
        weight = np.concatenate([_np(p.weight).T for p in (attn.q_proj, attn.k_proj, attn.v_proj)], axis=1)
        qkv = g.node("MatMul", [normed, g.weight(f"layers.{i}.qkv_proj.weight", weight)])[0]
        if attn.q_proj.bias is not None:
            bias = np.concatenate([_np(p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
            qkv = g.node("Add", [qkv, g.weight(f"layers.{i}.qkv_proj.bias", bias)])[0]
    if isinstance(qkv, str):  # packed: GroupQueryAttention splits it
        qkv = [qkv, "", ""]
    heads = config.num_attention_heads
    return g.node(
        "GroupQueryAttention",
        [*qkv, f"past_key_values.{i}.key", f"past_key_values.{i}.value", *lengths, *rotary],
        [f"/layers.{i}/attn/out", f"present.{i}.key", f"present.{i}.value"],
        domain=MS, num_heads=heads, kv_num_heads=getattr(config, "num_key_value_heads", None) or heads,
        scale=float(attn.scaling), do_rotary=1, rotary_interleaved=0, local_window_size=window,
    )[0]


def _head_norm(g: _Graph, x: str, module, name: str, head_dim: int, width: int, eps: float) -> str:
    """Gemma's RMS norm (weight + 1) over each head of x [batch, seq, width = heads * head_dim], as
    onnxruntime-genai emits it: Reshape [batch, seq * heads, head_dim] -> SimplifiedLayerNormalization
    -> Reshape back."""
    split = g.node("Reshape", [x, g.weight(f"{name}.split_shape", np.array([0, -1, head_dim], dtype=np.int64))])[0]
    weight = g.weight(f"{name}.weight", _np(module.weight) + np.float32(1.0))
    normed = g.node("SimplifiedLayerNormalization", [split, weight], epsilon=eps, axis=-1, stash_type=1)[0]
    return g.node("Reshape", [normed, g.weight(f"{name}.join_shape", np.array([0, -1, width], dtype=np.int64))])[0]


def _mlp(g: _Graph, i: int, mlp, normed: str, gelu_tanh: bool = False) -> str:
    """down(SiLU(gate(x)) * up(x)) of layer i (Phi-3 stores gate and up as one matrix); gelu_tanh
    (Gemma 3's gelu_pytorch_tanh) in place of SiLU."""
    if hasattr(mlp, "gate_up_proj"):
        weight = _np(mlp.gate_up_proj.weight)
        half = weight.shape[0] // 2
        gate = g.node("MatMul", [normed, g.weight(f"layers.{i}.gate_proj.weight", weight[:half].T)])[0]
        up = g.node("MatMul", [normed, g.weight(f"layers.{i}.up_proj.weight", weight[half:].T)])[0]
    else:
        gate = g.linear(normed, f"layers.{i}.gate_proj", mlp.gate_proj)
        up = g.linear(normed, f"layers.{i}.up_proj", mlp.up_proj)
    if gelu_tanh:
        act = g.node("FastGelu", [gate], domain=MS)[0]  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
    else:
        act = g.node("Mul", [gate, g.node("Sigmoid", [gate])[0]])[0]  # SiLU; ONNX Runtime fuses this into QuickGelu
    return g.linear(g.node("Mul", [act, up])[0], f"layers.{i}.down_proj", mlp.down_proj)
