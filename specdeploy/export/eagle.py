"""What besides its checkpoint shapes each model's graph (GraphShape): an eagle head (`specdeploy distill
--kind eagle`) read and turned into what the fused graph builder emits, and the draft's vocabulary
subset (draft_vocab.py chooses it).

An eagle head's graph (docs/distill.md states the math), with the builder's operators:

    Gather(target's embedding)(input_ids) [* Gemma's sqrt(hidden)] ; hidden_states
        -> Concat -> MatMul(fc) + bias
        -> [SimplifiedLayerNorm -> MatMul(qkv) -> GroupQueryAttention -> MatMul(o)
            -> SkipSimplifiedLayerNorm -> MatMul(gate), MatMul(up) -> SiLU * up -> MatMul(down)] x L
        -> SkipSimplifiedLayerNorm(target's final norm) -> (residual sum: next_hidden_states)
        -> MatMul(target's LM head rows) [-> softcap]: logits

The head's own KV cache is one shared buffer per layer, as the target's; its rotary table is the
head's (plain Llama rotary at the recorded rope_theta), not the target's.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..errors import SpecdeployError
from . import draft_vocab, fused
from .graph import Graph, save, tensor_spec
from .sources import TorchWeights

EAGLE_WEIGHTS = "model.safetensors"


def draft_kind(folder: Path) -> dict | None:
    """The specdeploy_draft block of a draft folder's config.json (None: a plain checkpoint, or no folder)."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        return None
    try:
        block = json.loads(config.read_text(encoding="utf-8")).get("specdeploy_draft")
    except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):  # the checkpoint's loader names what is wrong
        return None
    return block if isinstance(block, dict) else None


def write_vocab_ids(path: Path, ids: np.ndarray, vocab_size: int) -> None:
    """The bundle's copy of the subset: column i of the draft's logits is token ids[i]."""
    path.write_text(json.dumps({"format": "specdeploy-vocab-ids", "version": 1, "vocab_size": vocab_size,
                                "ids": [int(i) for i in ids]}) + "\n")


def load_eagle_head(folder: Path, block: dict, target_model):
    """The distilled head as distill's PyTorch module (its weights from the folder), checked against the target."""
    import torch
    from safetensors.torch import load_file

    from ..distill.models import EagleConfig, EagleHead

    identity = block.get("target") or {}
    config = target_model.config
    hidden = int(target_model.get_output_embeddings().weight.shape[1])
    if int(block.get("target_hidden_size", -1)) != hidden or int(block.get("target_vocab_size", -1)) != int(
            target_model.get_output_embeddings().weight.shape[0]):
        raise SpecdeployError(f"--draft {folder}: an eagle head for a target of hidden size {block.get('target_hidden_size')} "
                              f"and vocabulary {block.get('target_vocab_size')}; this target has {hidden} and "
                              f"{target_model.get_output_embeddings().weight.shape[0]}")
    if identity.get("model_type") not in (None, config.model_type) or identity.get("num_layers") not in (
            None, config.num_hidden_layers):
        raise SpecdeployError(f"--draft {folder}: the head was distilled for a {identity.get('model_type')} target of "
                              f"{identity.get('num_layers')} layers, not this {config.model_type} of {config.num_hidden_layers}")
    try:
        head = EagleHead(EagleConfig(**block["architecture"]))
        state = load_file(str(folder / EAGLE_WEIGHTS))
        head.load_state_dict(state)
    except (KeyError, TypeError, RuntimeError, OSError) as exc:
        raise SpecdeployError(f"--draft {folder}: cannot read the eagle head ({str(exc).splitlines()[0]})") from None
    return head.eval().requires_grad_(False).to(torch.float32)


def build_eagle(head, target, path: Path, max_context: int, vocab_ids: np.ndarray | None) -> Path:
    """Write the eagle head's fused graph (the module docstring) to path; target: the target's weights source."""
    from ..distill.models import rope

    c = head.c
    g = Graph(path)
    try:
        columns = len(vocab_ids) if vocab_ids is not None else target.model.config.vocab_size
        g.inputs, g.outputs = fused.io_specs(SimpleNamespace(num_key_value_heads=c.num_key_value_heads,
                                                             num_attention_heads=c.num_attention_heads),
                                             range(c.num_layers), columns, head_dim=c.head_dim)
        g.inputs.insert(1, tensor_spec("hidden_states", ["batch_size", "sequence_length", c.hidden_size]))
        g.outputs.insert(1, tensor_spec("next_hidden_states", ["batch_size", "sequence_length", c.hidden_size]))
        _emit_eagle(g, head, target, max_context, vocab_ids, rope)
    finally:
        g.close()
    return save(g, "specdeploy-eagle")


def _emit_eagle(g, head, target, max_context: int, vocab_ids, rope) -> None:
    c = head.c
    own = TorchWeights(head)
    lengths = fused.valid_lengths(g)
    cos, sin = rope(max_context, c.head_dim, c.rope_theta, "cpu")
    half = c.head_dim // 2
    rotary = (g.weight("cos_cache", cos[:, :half].numpy()), g.weight("sin_cache", sin[:, :half].numpy()))
    tokens = fused.embedding(g, target, "input_ids")  # the target's own, Gemma's scale included
    joined = g.node("Concat", ["hidden_states", tokens], axis=-1)[0]  # feature first, as fc was trained
    x = fused.linear(g, own, "fc", head.fc, joined)
    norm = fused.ResidualNorm(g, own, c.rms_norm_eps)
    settings = SimpleNamespace(num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                               rms_norm_eps=c.rms_norm_eps)
    for i, layer in enumerate(head.layers):
        attention = layer.self_attn
        attention.scaling = c.head_dim ** -0.5  # scaled_dot_product_attention's default, as trained
        normed = norm(x, f"layers.{i}.input_layernorm")
        context = fused.attention(g, own, f"layers.{i}.self_attn", attention, i, normed, lengths, rotary, settings, -1)
        x = fused.linear(g, own, f"layers.{i}.self_attn.o_proj", attention.o_proj, context)
        normed = norm(x, f"layers.{i}.post_attention_layernorm")
        x = fused.mlp(g, own, f"layers.{i}.mlp", layer.mlp, normed)
    # The target's final norm (Gemma's weight + 1) on the residual stream; its sum is the predicted feature.
    model = target.model
    target_eps = float(getattr(model.config, "rms_norm_eps", c.rms_norm_eps))
    offset = 1.0 if type(model).__name__ == fused.GEMMA3 else 0.0
    weight = g.weight("norm.weight", target.norm("model.norm.weight", offset))
    final, _, _, feature = g.node("SkipSimplifiedLayerNormalization", [x, norm.residual, weight], 4, domain=fused.MS,
                                  epsilon=target_eps)
    g.node("Identity", [feature], ["next_hidden_states"])
    fused.head(g, target, final, vocab_ids)


class EagleReference:
    """PyTorch's logits of the eagle head over a token sequence, for export's parity check.

    `features(ids)`: the target's features f_0..f_{n-1} over ids t_0..t_{n-1} (one no-cache pass).
    The head's input at position i is (f_i, t_{i+1}); its logits there are `logits(features, ids)`,
    [n - 1, columns], through the target's final norm and head rows (softcap as the target's)."""

    def __init__(self, head, target_model, vocab_ids: np.ndarray | None):
        self.head, self.model, self.vocab_ids = head, target_model, vocab_ids

    def features(self, ids: np.ndarray) -> np.ndarray:
        import torch

        captured = {}
        handle = self.model.model.norm.register_forward_pre_hook(lambda module, args: captured.__setitem__("x", args[0]))
        try:
            with torch.no_grad():
                self.model(input_ids=torch.from_numpy(np.asarray(ids, dtype=np.int64))[None], use_cache=False)
        finally:
            handle.remove()
        return captured["x"][0].float().numpy()

    def logits(self, features: np.ndarray, ids: np.ndarray) -> np.ndarray:
        import torch

        from ..distill.models import softcap

        with torch.no_grad():
            embeds = self.model.get_input_embeddings()(torch.from_numpy(np.asarray(ids[1:], dtype=np.int64))[None])
            predicted = self.head.rollout(torch.from_numpy(features[:-1])[None], embeds, 1)[0]
            # Through the modules, not their weights: a streamed reference (gguf_weights) loads each as it runs.
            logits = self.model.get_output_embeddings()(self.model.model.norm(predicted))
            if self.vocab_ids is not None:
                logits = logits[..., torch.from_numpy(self.vocab_ids)]
            logits = softcap(logits, getattr(self.model.config, "final_logit_softcapping", None))
        return logits[0].float().numpy()


VOCAB_IDS_FILE = "vocab_ids.json"


@dataclass(frozen=True)
class GraphShape:
    """What besides its checkpoint decides one model's graph in a bundle."""

    features: bool = False  # the target: also return hidden_states, which an eagle draft reads
    vocab_ids: np.ndarray | None = None  # the draft: its head's rows (a vocabulary subset)
    vocab_source: dict | None = None  # where the counts that chose vocab_ids came from (draft_vocab.VocabSubset)
    eagle: dict | None = None  # the draft: an eagle folder's specdeploy_draft block (its head is built from it)
    folder: Path | None = None  # the draft's folder

    def check(self, graph: str, model, max_context: int) -> None:
        """An eagle draft's features and a draft vocabulary subset are fused-graph outputs."""
        if graph == "fused":
            return
        why = fused.unsupported_reason(model, max_context) or "--graph optimum was asked for"
        if self.features:
            raise SpecdeployError(f"an eagle draft reads the target's features, which only its fused graph returns, "
                                  f"and the target cannot take it: {why}")
        if self.vocab_ids is not None:
            raise SpecdeployError(f"a draft vocabulary subset needs the fused graph for the draft, which cannot take it: "
                                  f"{why} (--draft-vocab 0 keeps the whole vocabulary)")

    def head(self, target_model):
        return load_eagle_head(self.folder, self.eagle, target_model)

    def num_parameters(self, model) -> int:
        """The model's parameters; an eagle draft's own (its fc and layers: the head rows are the target's)."""
        source = self.head(model) if self.eagle is not None else model
        return sum(p.numel() for p in source.parameters())

    def build(self, weights, path: Path, max_context: int, window: int | None) -> Path:
        """The fused graph (from the target's weights, for an eagle draft), and the vocabulary file beside it."""
        model = weights.model
        if self.vocab_ids is not None:
            write_vocab_ids(path.parent / VOCAB_IDS_FILE, self.vocab_ids, int(model.get_output_embeddings().weight.shape[0]))
        if self.eagle is not None:
            return build_eagle(self.head(model), weights, path, max_context, self.vocab_ids)
        return fused.build_fused(weights, path, max_context, window, self.features, self.vocab_ids)

    def describe(self, spec, root: Path, vocab_size: int):
        """spec with the draft's kind, eagle contract and vocabulary subset."""
        from ..bundle import EagleSpec

        changes: dict = {}
        if self.vocab_ids is not None:
            ids_path = (Path(spec.onnx_path).parent / VOCAB_IDS_FILE).as_posix()
            changes.update(vocab_ids=ids_path, vocab_subset=len(self.vocab_ids), vocab_size=vocab_size,
                           vocab_source=dict(self.vocab_source or {}))
        if self.eagle is not None:
            run = _read_json(self.folder / "distill.json")
            trained = {key: run[key] for key in ("step", "elapsed_s", "options") if key in run}
            if run.get("history"):
                trained["last_evaluation"] = run["history"][-1]
            changes.update(kind="eagle", architecture="EagleHead", source=str(self.folder), vocab_size=vocab_size,
                           eagle=EagleSpec(feature_size=int(self.eagle["target_hidden_size"]),
                                           trained=json.loads(json.dumps(trained, default=str))))
        return dataclasses.replace(spec, **changes)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def graph_shapes(draft_path: Path | None, requested_vocab: int | None, vocab_size: int,
                 sample: draft_vocab.TextSample | None = None) -> dict:
    """Each role's GraphShape: an eagle folder's head, the draft vocabulary (draft_vocab.choose_vocab: from
    the draft folder's draft_vocab.json, or --draft-vocab N counted over `sample`), the target's feature
    output when the draft reads it."""
    folder = draft_path if draft_path is not None and draft_path.is_dir() else None
    block = draft_kind(folder) if folder is not None else None
    eagle = block if block is not None and block.get("kind") == "eagle" else None
    vocab = draft_vocab.choose_vocab(folder, requested_vocab, vocab_size, eagle=eagle is not None, sample=sample)
    return {"target": GraphShape(features=eagle is not None),
            "draft": GraphShape(vocab_ids=None if vocab is None else vocab.ids,
                                vocab_source=None if vocab is None else vocab.source, eagle=eagle, folder=folder)}
