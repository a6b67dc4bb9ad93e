"""The fused graph for the Llama family and Gemma 3: GroupQueryAttention over a KV cache written in place.

optimum's graph returns `present = Concat(past, new)`: every step copies the whole cache (so a step
slows down as the context grows), and its 600 nodes cost more than the arithmetic of a small model. This module emits, from a model's weights, the graph
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

The weights come from a weights source: sources.TorchWeights (a PyTorch model's float32 parameters) or a
GGUF file's own blocks (gguf_weights.GgufWeights). A matrix is either float32 (a MatMul) or a
`blocks.BlockMatrix` (MatMulNBits; GatherBlockQuantized for the embedding, whose tied head reads
the same blocks). The model itself (`weights.model`) gives the structure: the config, the modules
present, the rotary tables; its parameters may be empty (on the meta device).

Which checkpoints qualify is decided by `unsupported_reason`; the rest go through optimum. Either
way the parity check against PyTorch decides whether the bundle is written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .blocks import MS, BlockMatrix
from .graph import Graph, graph_name, save, tensor_spec

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM")
GEMMA3 = "Gemma3ForCausalLM"


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
    rotary = rotary_tables(model, 1)[0].shape[1]
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


def rotary_tables(model, positions: int, module=None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, rotary_dim / 2] exactly as the model's rotary module (default: its
    global one, `model.model.rotary_emb`) computes them."""
    import torch

    ids = torch.arange(positions, dtype=torch.int64)[None]
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = (module or model.model.rotary_emb)(probe, ids)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].float().numpy(), sin[0, :, :half].float().numpy()


def build_fused(weights, path: Path, max_context: int, window: int | None = None, features: bool = False,
                vocab_ids: np.ndarray | None = None) -> Path:
    """Write the fused graph for weights.model (see the module docstring) to path.

    window: each query attends to its last `window` positions, itself included (GroupQueryAttention's
    local_window_size, measured); None: the whole context. Only for drafts, whose numbers never reach the
    output: a draft trained on short windows proposes better, and reads less, with one.
    features: also return `hidden_states` [batch, seq, hidden], the final norm's input (for an eagle draft).
    vocab_ids: the head's rows (a draft's frequent tokens); None: the whole vocabulary."""
    g = Graph(path)
    try:
        _emit(g, weights, max_context, window or -1, features, vocab_ids)
    finally:
        g.close()
    return save(g)


def _emit(g: Graph, weights, max_context: int, window: int, features: bool, vocab_ids: np.ndarray | None) -> None:
    """The nodes and weights of the fused graph (see the module docstring) into g, in graph order."""
    model = weights.model
    config = model.config
    layers = model.model.layers
    gemma = type(model).__name__ == GEMMA3
    g.inputs, g.outputs = io_specs(config, layers, len(vocab_ids) if vocab_ids is not None else config.vocab_size)
    if features:
        g.outputs.insert(1, tensor_spec("hidden_states", ["batch_size", "sequence_length", config.hidden_size]))
    lengths = valid_lengths(g)
    cos, sin = rotary_tables(model, max_context)
    rotary = (g.weight("cos_cache", cos), g.weight("sin_cache", sin))
    if gemma:  # the sliding layers' own table (rope_local_base_freq, unscaled)
        cos, sin = rotary_tables(model, max_context, model.model.rotary_emb_local)
        local_rotary = (g.weight("cos_cache_local", cos), g.weight("sin_cache_local", sin))
    delta = embedding(g, weights, "input_ids")
    # Gemma's RMSNorm multiplies by (1 + weight): the 1 is folded into the stored weight.
    norm = ResidualNorm(g, weights, float(config.rms_norm_eps), offset=1.0 if gemma else 0.0)
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}"
        normed = norm(delta, f"{prefix}.input_layernorm")
        sliding = gemma and config.layer_types[i] == "sliding_attention"
        context = attention(g, weights, f"{prefix}.self_attn", layer.self_attn, i, normed, lengths,
                            local_rotary if sliding else rotary, config,
                            _layer_window(config.sliding_window if sliding else None, window))
        delta = linear(g, weights, f"{prefix}.self_attn.o_proj", layer.self_attn.o_proj, context)
        if gemma:  # normed before it joins the residual stream, then the MLP's own norm
            delta = norm.plain(delta, f"{prefix}.post_attention_layernorm")
            normed = norm(delta, f"{prefix}.pre_feedforward_layernorm")
            delta = norm.plain(mlp(g, weights, f"{prefix}.mlp", layer.mlp, normed, gelu_tanh=True),
                               f"{prefix}.post_feedforward_layernorm")
        else:
            normed = norm(delta, f"{prefix}.post_attention_layernorm")
            delta = mlp(g, weights, f"{prefix}.mlp", layer.mlp, normed)
    final = norm(delta, "model.norm")
    if features:  # the final norm's input, which its fused node returns anyway: what an eagle draft reads
        g.node("Identity", [norm.residual], ["hidden_states"])
    head(g, weights, final, vocab_ids)


def embedding(g: Graph, weights, ids: str) -> str:
    """The token embedding of ids (times Gemma's sqrt(hidden_size), in the table's dtype as transformers rounds it)."""
    model = weights.model
    rows = g.gather("embed_tokens.weight", weights.matrix("model.embed_tokens.weight"), ids)
    if type(model).__name__ == GEMMA3:
        module = model.model.embed_tokens
        scale = module.embed_scale.to(module.weight.dtype).float().numpy()
        rows = g.node("Mul", [rows, g.weight("embed_scale", scale.reshape(1))])[0]
    return rows


def head(g: Graph, weights, final: str, vocab_ids: np.ndarray | None) -> None:
    """logits = the model's LM head over final (and Gemma's softcap), its rows vocab_ids only when given."""
    model = weights.model
    config = model.config
    softcap = getattr(config, "final_logit_softcapping", None) if type(model).__name__ == GEMMA3 else None
    logits = "logits_uncapped" if softcap else "logits"
    tied = weights.tied_head()
    table = weights.matrix("model.embed_tokens.weight" if tied else "lm_head.weight")
    if tied and vocab_ids is None and isinstance(table, BlockMatrix):  # the embedding's blocks, stored once
        g.matmul_blocks(final, "embed_tokens.weight", table, logits, label="lm_head")
    elif tied and vocab_ids is None and "embed_tokens.weight" in {t.name for t in g.initializers}:
        # Tied: read the embedding table transposed instead of storing it twice.
        g.node("FusedMatMul", [final, "embed_tokens.weight"], [logits], domain=MS, transB=1, alpha=1.0)
    else:
        rows = table if vocab_ids is None else (table.take(vocab_ids) if isinstance(table, BlockMatrix)
                                                 else table[vocab_ids])
        g.linear(final, "lm_head", rows, output=logits, label="lm_head")
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


def io_specs(config, layers, columns: int, head_dim: int | None = None) -> tuple[list, list]:
    """The graph's inputs and outputs: the names and shapes of the manifest's KV templates; logits [.., columns].
    head_dim: default, the first layer's attention's."""
    from onnx import TensorProto, helper

    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = head_dim or layers[0].self_attn.head_dim
    inputs = [tensor_spec("input_ids", ["batch_size", "sequence_length"], integer=True),
              tensor_spec("attention_mask", ["batch_size", "total_sequence_length"], integer=True)]
    outputs = [tensor_spec("logits", ["batch_size", "sequence_length", columns])]
    cache_shape = ["batch_size", kv_heads, "past_sequence_length", head_dim]
    present_shape = ["batch_size", kv_heads, "present_sequence_length", head_dim]
    for i in range(len(layers)):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, cache_shape))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, present_shape))
    return inputs, outputs


def valid_lengths(g: Graph) -> tuple[str, str]:
    """GroupQueryAttention's seqlens_k (sum(mask) - 1, per row) and total length (the mask's width), as
    onnxruntime-genai computes them."""
    from onnx import TensorProto

    one = g.weight("one_i64", np.array([1], dtype=np.int64))
    row_sum = g.node("ReduceSum", ["attention_mask", one], keepdims=0)[0]
    seqlens = g.node("Cast", [g.node("Sub", [row_sum, one])[0]], to=TensorProto.INT32)[0]
    width = g.node("Gather", [g.node("Shape", ["attention_mask"])[0], g.weight("axis1_i64", np.array(1, dtype=np.int64))], axis=0)[0]
    return seqlens, g.node("Cast", [width], to=TensorProto.INT32)[0]


class ResidualNorm:
    """RMS norms that carry the residual stream: the first is SimplifiedLayerNormalization, every later
    one SkipSimplifiedLayerNormalization, which adds its input to the running sum before normalizing.
    Each norm is named by its module's state-dict prefix (`model.layers.0.input_layernorm`)."""

    def __init__(self, g: Graph, weights, eps: float, offset: float = 0.0):
        self.g, self.weights, self.eps, self.offset = g, weights, eps, offset
        self.residual: str | None = None

    def _weight(self, prefix: str) -> str:
        name = f"{prefix}.weight"
        return self.g.weight(graph_name(name), self.weights.norm(name, self.offset))

    def __call__(self, x: str, prefix: str) -> str:
        g = self.g
        weight = self._weight(prefix)
        if self.residual is None:
            self.residual = x
            return g.node("SimplifiedLayerNormalization", [x, weight], epsilon=self.eps, axis=-1, stash_type=1)[0]
        out, _, _, self.residual = g.node("SkipSimplifiedLayerNormalization", [x, self.residual, weight], 4, domain=MS,
                                          epsilon=self.eps)
        return out

    def plain(self, x: str, prefix: str) -> str:
        """An RMS norm off the residual stream (Gemma's post-attention and post-feedforward norms)."""
        return self.g.node("SimplifiedLayerNormalization", [x, self._weight(prefix)], epsilon=self.eps, axis=-1,
                           stash_type=1)[0]


def linear(g: Graph, weights, prefix: str, module, x: str) -> str:
    """The Linear `module` (state-dict prefix `prefix`) over x, its bias included."""
    bias = weights.array(f"{prefix}.bias") if getattr(module, "bias", None) is not None else None
    return g.linear(x, graph_name(prefix), weights.matrix(f"{prefix}.weight"), bias)


def _stacked(parts: list) -> np.ndarray | BlockMatrix | None:
    """q, k and v's weights as one matrix (rows one after another), or None where their storage differs."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts, axis=0)
    if all(isinstance(p, BlockMatrix) for p in parts) and len({p.layout() for p in parts}) == 1:
        return BlockMatrix.stack(parts)
    return None


def attention(g: Graph, weights, prefix: str, attn, i: int, normed: str, lengths: tuple[str, str],
              rotary: tuple[str, str], config, window: int) -> str:
    """One qkv projection (+ bias), then GroupQueryAttention on layer i's KV buffers; its output before o_proj.

    window: GroupQueryAttention's local_window_size (see _layer_window). With q/k norms (Gemma 3) q, k
    and v are three projections, q and k normed over each head before GroupQueryAttention rotates them;
    so are q, k and v whose weights are stored unlike (a GGUF's Q4_K q and k beside a Q6_K v)."""
    if hasattr(attn, "q_norm"):
        q, k, v = (linear(g, weights, f"{prefix}.{proj}", getattr(attn, proj), normed)
                   for proj in ("q_proj", "k_proj", "v_proj"))
        eps = float(config.rms_norm_eps)
        qkv = [_head_norm(g, weights, q, f"{prefix}.q_norm", attn.head_dim, attn.q_proj.out_features, eps),
               _head_norm(g, weights, k, f"{prefix}.k_norm", attn.head_dim, attn.k_proj.out_features, eps), v]
    elif hasattr(attn, "qkv_proj"):
        qkv = linear(g, weights, f"{prefix}.qkv_proj", attn.qkv_proj, normed)
    else:
        projections = [f"{prefix}.{proj}" for proj in ("q_proj", "k_proj", "v_proj")]
        matrices = [weights.matrix(f"{p}.weight") for p in projections]
        biases = [weights.array(f"{p}.bias") if attn.q_proj.bias is not None else None for p in projections]
        stacked = _stacked(matrices)
        if stacked is None:
            qkv = [g.linear(normed, graph_name(p), m, b) for p, m, b in zip(projections, matrices, biases)]
        else:
            bias = None if biases[0] is None else np.concatenate(biases)
            qkv = g.linear(normed, graph_name(f"{prefix}.qkv_proj"), stacked, bias)
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


def _head_norm(g: Graph, weights, x: str, prefix: str, head_dim: int, width: int, eps: float) -> str:
    """Gemma's RMS norm (weight + 1) over each head of x [batch, seq, width = heads * head_dim], as
    onnxruntime-genai emits it: Reshape [batch, seq * heads, head_dim] -> SimplifiedLayerNormalization
    -> Reshape back."""
    name = graph_name(prefix)
    split = g.node("Reshape", [x, g.weight(f"{name}.split_shape", np.array([0, -1, head_dim], dtype=np.int64))])[0]
    weight = g.weight(f"{name}.weight", weights.norm(f"{prefix}.weight", 1.0))
    normed = g.node("SimplifiedLayerNormalization", [split, weight], epsilon=eps, axis=-1, stash_type=1)[0]
    return g.node("Reshape", [normed, g.weight(f"{name}.join_shape", np.array([0, -1, width], dtype=np.int64))])[0]


def mlp(g: Graph, weights, prefix: str, module, normed: str, gelu_tanh: bool = False) -> str:
    """down(SiLU(gate(x)) * up(x)) (Phi-3 stores gate and up as one matrix); gelu_tanh (Gemma 3's
    gelu_pytorch_tanh) in place of SiLU."""
    name = graph_name(prefix)
    if hasattr(module, "gate_up_proj"):
        weight = weights.matrix(f"{prefix}.gate_up_proj.weight")
        half = weight.rows // 2 if isinstance(weight, BlockMatrix) else weight.shape[0] // 2
        gate_rows, up_rows = np.arange(half), np.arange(half, 2 * half)
        parts = ((weight.take(gate_rows), weight.take(up_rows)) if isinstance(weight, BlockMatrix)
                 else (weight[:half], weight[half:]))
        gate = g.linear(normed, f"{name}.gate_proj", parts[0])
        up = g.linear(normed, f"{name}.up_proj", parts[1])
    else:
        gate = linear(g, weights, f"{prefix}.gate_proj", module.gate_proj, normed)
        up = linear(g, weights, f"{prefix}.up_proj", module.up_proj, normed)
    if gelu_tanh:
        act = g.node("FastGelu", [gate], domain=MS)[0]  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
    else:
        act = g.node("Mul", [gate, g.node("Sigmoid", [gate])[0]])[0]  # SiLU; ONNX Runtime fuses this into QuickGelu
    return linear(g, weights, f"{prefix}.down_proj", module.down_proj, g.node("Mul", [act, up])[0])
