"""The target (the teacher) and the two kinds of draft it distils into.

- `Target`: a frozen Hugging Face causal LM; one pass gives its top-k log-probabilities and, for an
  eagle head, its last hidden state before the final norm (the "feature" of EAGLE).
- `ModelDraft` (--kind model): a small causal LM of the target's own architecture with fewer
  layers, initialised from the target's weights where the shapes allow; its head covers the
  draft vocabulary (all ids, or the N most frequent).
- `EagleHead` (--kind eagle): EAGLE-1 (Li et al., 2024, "EAGLE: Speculative Sampling Requires
  Rethinking Feature Uncertainty"): fc([feature_t, embed(token_t+1)]) -> decoder layer(s) ->
  predicted feature_t+1, read out by the target's own final norm and LM head (frozen, shared).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SpecdeployError

FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


class Target:
    """The frozen teacher; `teach` is its one pass."""

    def __init__(self, model, tokenizer, source: str, folder: Path | None, gguf_file: str | None):
        self.model, self.tokenizer, self.source = model, tokenizer, source
        self.folder, self.gguf_file = folder, gguf_file  # folder: the HF folder (None for a .gguf)
        self.config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.hidden_size = int(model.get_output_embeddings().weight.shape[1])
        self.num_layers = int(self.config.num_hidden_layers)
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        # The decoder stack: base_model, or `model` where base_model_prefix names another (Gemma 3's
        # "language_model", for its multimodal sibling) and base_model is the whole model.
        bases = [model.base_model, getattr(model, "model", None)]
        self.final_norm = next((getattr(base, name) for base in bases if base is not None for name in FINAL_NORM_NAMES
                                if isinstance(getattr(base, name, None), nn.Module)), None)
        self._captured: dict[str, torch.Tensor] = {}
        if self.final_norm is not None:
            self.final_norm.register_forward_pre_hook(lambda module, args: self._captured.__setitem__("x", args[0]))

    @property
    def head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        return self.model.get_output_embeddings().weight

    @property
    def embed(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def identity(self) -> dict:
        return {"source": self.source, "model_type": self.config.model_type, "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "num_layers": self.num_layers}

    @torch.no_grad()
    def teach(self, input_ids: torch.Tensor, top_k: int, features: bool) -> "Teaching":  # input_ids [batch, seq]
        logits = self.model(input_ids=input_ids, use_cache=False).logits.float()  # [batch, seq, vocab]
        top_logprobs, top_ids = torch.log_softmax(logits, dim=-1).topk(min(top_k, self.vocab_size), dim=-1)
        del logits
        captured = self._captured.pop("x", None)
        return Teaching(top_ids=top_ids, top_logprobs=top_logprobs, argmax=top_ids[..., 0],
                        features=captured.float() if features else None)


@dataclass(frozen=True)
class Teaching:
    top_ids: torch.Tensor        # [batch, seq, top_k] the target's most likely next tokens, best first
    top_logprobs: torch.Tensor   # [batch, seq, top_k] their log-probabilities over the whole vocabulary
    argmax: torch.Tensor         # [batch, seq] the target's greedy choice
    features: torch.Tensor | None  # [batch, seq, hidden] last hidden state before the final norm (eagle only)


def check_target(source: str) -> tuple[Path, dict]:
    """(the folder, transformers' gguf_file argument or nothing) of a --target, checked before anything is read."""
    path = Path(source).expanduser()
    if not path.exists():
        raise SpecdeployError(f"--target {source}: no such file or folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecdeployError(f"--target {source}: no config.json (not a Hugging Face checkpoint folder)")
        if not any(path.glob("*.safetensors")):
            raise SpecdeployError(f"--target {source}: no *.safetensors weights (pickle weights are not loaded)")
        folder, kwargs = path.resolve(), {}
    elif path.suffix.lower() == ".gguf":
        folder, kwargs = path.resolve().parent, {"gguf_file": path.name}
    else:
        raise SpecdeployError(f"--target {source}: not a folder, nor a .gguf file")
    return folder, kwargs


def load_target(source: str, device: str) -> Target:
    """A Hugging Face folder (safetensors weights) or a .gguf file: its tokenizer and config from one reading of its
    header, its weights dequantized one tensor at a time (export/gguf_weights.py; transformers' GGUF loader for an
    architecture that module does not read)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = Path(source).expanduser()
    folder, kwargs = check_target(source)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the GGUF loader's progress and notes are not ours to print
    try:
        if kwargs:
            tokenizer, model = _load_gguf(path.resolve())
        else:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    except SpecdeployError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for an unloadable checkpoint
        raise SpecdeployError(f"--target {source}: cannot load it as a causal LM: {_first_line(exc)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if not getattr(tokenizer, "is_fast", False):
        raise SpecdeployError(f"--target {source}: its tokenizer has no fast (tokenizer.json) form")
    model.to(device).eval().requires_grad_(False)
    return Target(model, tokenizer, str(path.resolve()), None if kwargs else folder, kwargs.get("gguf_file"))


def _load_gguf(path: Path):
    """A .gguf target's tokenizer and model (float32)."""
    from transformers import AutoModelForCausalLM

    from ..export import gguf, gguf_weights
    from ..export.gguf_file import transformers_view

    file = gguf.open_gguf(path, "target")
    view = transformers_view(file)
    config = gguf.config_from_metadata(view)
    tokenizer = gguf.tokenizer_from_metadata(view, config)
    if file.architecture in gguf_weights.ARCHITECTURES:
        return tokenizer, gguf_weights.load_model(gguf_weights.GgufTensors(file, config))
    file.close()
    return tokenizer, AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True,
                                                           dtype=torch.float32)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if not cap else torch.tanh(logits / cap) * cap


# --- the model kind -------------------------------------------------------------------------------------------------

def draft_config(target: Target, layers: int, hidden_size: int | None):
    """The target's config with fewer layers (and, if asked, narrower); a separate LM head."""
    if layers > target.num_layers:
        raise SpecdeployError(f"--layers {layers}: the target has only {target.num_layers} layers")
    if hidden_size is not None and hidden_size > target.hidden_size:
        raise SpecdeployError(f"--hidden-size {hidden_size}: a draft wider than the target "
                              f"(hidden size {target.hidden_size}) would cost more than it saves")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    # No dropout: its draws come from no state a checkpoint holds, so a resumed run would end with other weights.
    for name, value in config.to_dict().items():
        if isinstance(value, float) and name.endswith(("dropout", "pdrop", "dropout_prob")):
            setattr(config, name, 0.0)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    config.tie_word_embeddings = False
    if hidden_size is not None and hidden_size != target.hidden_size:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or target.hidden_size // heads
        if hidden_size % head_dim:
            raise SpecdeployError(f"--hidden-size {hidden_size}: must be a multiple of the target's head size {head_dim}")
        new_heads = hidden_size // head_dim
        config.hidden_size, config.num_attention_heads = hidden_size, new_heads
        if hasattr(config, "num_key_value_heads"):
            kv = min(getattr(config, "num_key_value_heads", None) or heads, new_heads)
            config.num_key_value_heads = max(d for d in range(1, kv + 1) if new_heads % d == 0)
        if getattr(config, "intermediate_size", None):
            config.intermediate_size = max(64, round(config.intermediate_size * hidden_size / target.hidden_size / 64) * 64)
        if getattr(config, "head_dim", None):
            config.head_dim = head_dim
    return config


class ModelDraft(nn.Module):
    """A Hugging Face causal LM whose head is a separate [draft_vocab, hidden] matrix (rows = `vocab_ids`)."""

    def __init__(self, lm, head: torch.Tensor, vocab_ids: torch.Tensor, softcap_value: float | None):
        super().__init__()
        self.lm = lm
        self.lm.get_output_embeddings().requires_grad_(False)  # rebuilt from `head` when saved; unused in training
        self.head = nn.Parameter(head)             # [draft_vocab, hidden]
        self.register_buffer("vocab_ids", vocab_ids)  # [draft_vocab] the target id of each head row
        self.softcap_value = softcap_value

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [batch, seq] -> [batch, seq, draft_vocab]
        hidden = self.lm.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        return softcap(F.linear(hidden, self.head), self.softcap_value)

    def to_hf(self, target: Target):
        """The LM with a full [vocab, hidden] head: the trained rows at their ids, elsewhere the target's rows (a
        draft of the target's width) or the draft's own initial ones (a narrower draft)."""
        with torch.no_grad():
            full = target.head_weight.detach().clone() if self.head.shape[1] == target.hidden_size else \
                self.lm.get_output_embeddings().weight.detach().clone()
            full[self.vocab_ids] = self.head.detach()
            self.lm.get_output_embeddings().weight.copy_(full)
        return self.lm


def build_model_draft(target: Target, layers: int, hidden_size: int | None, vocab_ids: torch.Tensor,
                      seed: int) -> tuple[ModelDraft, list[str]]:
    """The draft and a note of what was copied from the target."""
    from transformers import AutoModelForCausalLM

    config = draft_config(target, layers, hidden_size)
    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = target.model.state_dict()
    own = lm.state_dict()
    head_name = next(name for name, p in lm.named_parameters() if p is lm.get_output_embeddings().weight)
    copied = {name: source[name] for name, tensor in own.items()
              if name != head_name and name in source and source[name].shape == tensor.shape}
    lm.load_state_dict(copied, strict=False)
    embed = lm.get_input_embeddings().weight
    same_width = embed.shape[1] == target.hidden_size
    if same_width:
        embed.requires_grad_(False)  # the target's embedding, kept: the draft reads the same token space
        head = target.head_weight.detach()[vocab_ids.to(target.head_weight.device)].clone().cpu()
    else:
        head = torch.randn(len(vocab_ids), embed.shape[1]) * getattr(config, "initializer_range", 0.02)
    layer_names = sorted({int(part) for name in copied for part in name.split(".")[2:3] if part.isdigit()})
    note = [f"{len(copied)} of {len(own) - 1} tensors from the target"]
    if layer_names:
        note.append(f"layers {layer_names[0]}-{layer_names[-1]}" if len(layer_names) > 1 else f"layer {layer_names[0]}")
    if same_width:
        note.append("embedding (frozen) and head rows")
    return ModelDraft(lm, head, vocab_ids.cpu(), target.softcap), note


# --- the eagle kind -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    num_layers: int = 1

    @classmethod
    def for_target(cls, target: Target, layers: int) -> "EagleConfig":
        c = target.config
        heads = c.num_attention_heads
        return cls(hidden_size=target.hidden_size,
                   intermediate_size=getattr(c, "intermediate_size", None) or 4 * target.hidden_size,
                   num_attention_heads=heads, num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or target.hidden_size // heads,
                   rope_theta=float(getattr(c, "rope_theta", None) or 10000.0),
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_eps", None) or 1e-6),
                   num_layers=layers)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(length: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary tables for positions 0..length-1: cos, sin [length, head_dim] (halves rotated)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x, cos, sin):  # x [batch, heads, seq, head_dim]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class EagleAttention(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, past: list, mask):
        """x [batch, seq, hidden]; past: (key, value) [batch, kv_heads, seq, head_dim] of earlier chain steps;
        mask [seq, seq * (len(past) + 1)] True where a query may attend."""
        batch, seq, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(batch, seq, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys = torch.cat([kv[0] for kv in past] + [k], dim=2)
        values = torch.cat([kv[1] for kv in past] + [v], dim=2)
        groups = c.num_attention_heads // c.num_key_value_heads
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1)), (k, v)


class EagleMLP(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleLayer(nn.Module):
    """A Llama decoder layer (pre-norm attention and SwiGLU MLP), parameter names as Llama's."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = EagleAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = EagleMLP(c)

    def forward(self, x, cos, sin, past, mask):
        attended, kv = self.self_attn(self.input_layernorm(x), cos, sin, past, mask)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), kv


def chain_mask(length: int, step: int, device=None) -> torch.Tensor:
    """Which keys the step-`step` query at index i sees: [length, step * length], True = attend.

    Index i of step 1 holds the head's input (feature_i, token_i+1), a draft chain that starts there
    runs along the diagonal: its step s sits at index i + s - 1. So the step-`step` query at index i
    belongs to the chain started at i - step + 1; it sees the step-1 keys up to that start (the
    accepted prefix, fed the target's features) and its own chain's keys of steps 2..step. With
    step 1 this is the causal mask. (EAGLE-3's "training-time test" mask.)"""
    query = torch.arange(length, device=device)[:, None]
    key = torch.arange(length, device=device)[None, :]
    blocks = [key <= query - step + 1] + [key == query - step + b for b in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


class EagleHead(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.c = c
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
        self.layers = nn.ModuleList(EagleLayer(c) for _ in range(c.num_layers))

    def rollout(self, features: torch.Tensor, token_embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """features [batch, seq, hidden] (the target's, at i), token_embeds [batch, seq, hidden] (token i+1)
        -> the predicted features at i+1 for chain steps 1..steps, each [batch, seq, hidden].

        Step s >= 2 feeds index i the head's own step s-1 prediction at i-1; its rows i < s-1 start
        before the sequence and are not meaningful."""
        seq = features.shape[1]
        cos, sin = rope(seq, self.c.head_dim, self.c.rope_theta, features.device)
        caches: list[list] = [[] for _ in self.layers]
        inputs, predictions = features, []
        for step in range(1, steps + 1):
            mask = chain_mask(seq, step, features.device)
            x = self.fc(torch.cat([inputs, token_embeds], dim=-1))
            for layer, cache in zip(self.layers, caches):
                x, kv = layer(x, cos, sin, cache, mask)
                cache.append(kv)
            predictions.append(x)
            inputs = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        return predictions


def build_eagle_head(target: Target, layers: int, seed: int) -> tuple[EagleHead, list[str]]:
    """A head for the target; its layers start as the target's last layer where that is a plain Llama layer."""
    if target.final_norm is None:
        raise SpecdeployError(f"--kind eagle: cannot find the final norm of {target.config.model_type} "
                              "(the head reads the hidden state before it)")
    config = EagleConfig.for_target(target, layers)
    torch.manual_seed(seed)
    head = EagleHead(config)
    with torch.no_grad():
        head.fc.weight.normal_(0.0, 0.02)
        head.fc.weight[:, : config.hidden_size] += torch.eye(config.hidden_size)  # start from "feature_t+1 = feature_t"
        head.fc.bias.zero_()
    note = ["fc starts as the identity on the feature"]
    marker = f"layers.{target.num_layers - 1}."
    source = {name.split(marker, 1)[1]: tensor for name, tensor in target.model.state_dict().items() if marker in name}
    own = head.layers[0].state_dict()
    if set(source) == set(own) and all(source[n].shape == own[n].shape for n in own):
        for layer in head.layers:
            layer.load_state_dict(source)
        note.append(f"layer from the target's last layer ({target.num_layers - 1})")
    else:
        note.append("layer randomly initialised (the target's layers are not plain Llama layers)")
    return head, note


def parameter_count(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def describe_count(count: int) -> str:
    return f"{count / 1e6:.2f}M" if count >= 1e5 else f"{count / 1e3:.1f}k"
