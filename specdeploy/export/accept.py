"""The accept step of speculative decoding as two small ONNX graphs, written into every bundle.

A host that runs only ONNX Runtime (C++, C#, Java, JavaScript) then needs no sampling code of its
own: it feeds the verify pass's logits to `accept/greedy.onnx` or `accept/sampled.onnx` and reads
back how many draft tokens to keep and which token follows them.

The rule is the runtime's (`specdeploy/runtime/rejection.py`; Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding"), with k draft tokens x_0..x_{k-1}:
  - greedy: accept while x_i == argmax(target_logits_i); the next token is the argmax of the first
    row that disagrees (recovered), or of row k when all agree (bonus);
  - sampled: target_probs = the target's logits processed as `runtime/sampling.py:process_logits`
    processes them (temperature, then top-k, then top-p), then min-p (tokens below min_p times the
    most probable one dropped, as transformers' MinPLogitsWarper); x_i is accepted while
    uniforms[i] * draft_probs[i, x_i] < target_probs[i, x_i]; at the first rejection i the
    recovered token is drawn from normalize(max(0, target_probs_i - draft_probs_i)), when all k are
    accepted the bonus token from target_probs_k, either way by inverse CDF with uniforms[k].
The caller passes the k + 1 uniforms, so a run is reproducible, and the settings as inputs, so one
graph serves every setting (temperature > 0; temperature 0 is the greedy graph). The draft's
probabilities must be its logits processed with the same settings. A repetition penalty needs the
context and stays out of the graph: a host applies it to the logits before feeding them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..bundle import AcceptGraphSpec, AcceptSpec, ModelSpec, TensorSpec, file_entry

FOLDER = "accept"
MIN_OPSET = 13  # ReduceSum with axes as an input, CumSum, GatherElements, ArgMax's select_last_index
PROCESSING = ("temperature", "top_k", "top_p", "min_p")  # the order the sampled graph applies them


class _Builder:
    """Nodes with unique output names, and constants, for one graph of a given opset."""

    def __init__(self, opset: int):
        self.opset, self.nodes, self.initializers, self._count = opset, [], [], 0

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, **attributes):
        """One node; returns its output name (or the list of them when it has several)."""
        from onnx import helper

        names = outputs if isinstance(outputs, list) else [self._name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=self._name(op_type), **attributes))
        return names[0] if len(names) == 1 else names

    def const(self, value, dtype) -> str:
        from onnx import numpy_helper

        name = self._name("const")
        self.initializers.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def reduce(self, op_type: str, x: str, axis: int, keepdims: int) -> str:
        """ReduceSum takes its axes as an input from opset 13, the other reductions from opset 18."""
        if op_type == "ReduceSum" or self.opset >= 18:
            return self.op(op_type, [x, self.const([axis], np.int64)], keepdims=keepdims)
        return self.op(op_type, [x], axes=[axis], keepdims=keepdims)

    def first_true(self, flags: str) -> str:
        """flags [n] bool -> the index of the first true one, as an int64 scalar (n when none is)."""
        padded = self.op("Concat", [flags, self.const([True], np.bool_)], axis=0)  # [n + 1]
        as_int = self.op("Cast", [padded], to=6)  # INT32: ArgMax takes no bool
        return self.op("ArgMax", [as_int], axis=0, keepdims=0, select_last_index=0)

    def model(self, name: str, inputs: list, outputs: list):
        from onnx import helper

        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)],
                                  producer_name="specdeploy")
        proto.ir_version = 8
        return proto


def _common_inputs(b: _Builder, logits_type: int):
    """target_logits [k + 1, vocab] and draft_tokens [k]; returns (value infos, the number of draft tokens as [1])."""
    from onnx import TensorProto, helper

    infos = [helper.make_tensor_value_info("target_logits", logits_type, ["num_positions", "vocab"]),
             helper.make_tensor_value_info("draft_tokens", TensorProto.INT64, ["num_draft_tokens"])]
    return infos, b.op("Shape", ["draft_tokens"])


def _outputs(*extra):
    from onnx import TensorProto, helper

    return [helper.make_tensor_value_info("num_accepted", TensorProto.INT64, []),
            helper.make_tensor_value_info("next_token", TensorProto.INT64, []), *extra]


def greedy_graph(opset: int, logits_type: int):
    """target_logits [k + 1, vocab], draft_tokens [k] -> num_accepted [], next_token [] (int64)."""
    b = _Builder(opset)
    inputs, num_draft = _common_inputs(b, logits_type)
    choices = b.op("ArgMax", ["target_logits"], axis=1, keepdims=0, select_last_index=0)  # [k + 1], first max as NumPy
    zero = b.const([0], np.int64)
    head = b.op("Slice", [choices, zero, num_draft, zero])  # [k]
    mismatch = b.op("Not", [b.op("Equal", [head, "draft_tokens"])])  # [k]
    b.op("Identity", [b.first_true(mismatch)], ["num_accepted"])
    b.op("Gather", [choices, "num_accepted"], ["next_token"], axis=0)
    return b.model("specdeploy-accept-greedy", inputs, _outputs())


def _process(b: _Builder, logits: str) -> str:
    """logits [n, vocab] float32 -> probabilities [n, vocab]: temperature, top-k, top-p, min-p, as process_logits."""
    f32_min_inf = b.const(-np.inf, np.float32)
    vocab = b.op("Gather", [b.op("Shape", [logits]), b.const(1, np.int64)], axis=0)  # []
    # top-k: drop logits below the k-th largest (ties kept, as np.partition's threshold keeps them); off
    # (0 or >= vocab) asks TopK for one value only, so no sort is paid for a setting not in use.
    k_on = b.op("And", [b.op("Greater", ["top_k", b.const(0, np.int64)]), b.op("Less", ["top_k", vocab])])
    k_count = b.op("Unsqueeze", [b.op("Where", [k_on, "top_k", b.const(1, np.int64)]), b.const([0], np.int64)])
    values = b.op("TopK", [logits, k_count], 2, axis=-1, largest=1, sorted=1)[0]  # [n, top_k]
    kth = b.op("Slice", [values, b.const([-1], np.int64), b.const([np.iinfo(np.int64).max], np.int64),
                         b.const([1], np.int64)])  # [n, 1]
    threshold = b.op("Where", [k_on, kth, f32_min_inf])
    kept = b.op("Where", [b.op("Less", [logits, threshold]), f32_min_inf, logits])  # [n, vocab]
    # softmax(logits / temperature) as softmax_row forms it: scale, subtract the max, exp, times 1 / sum.
    scaled = b.op("Mul", [kept, b.op("Reciprocal", ["temperature"])])
    exps = b.op("Exp", [b.op("Sub", [scaled, b.reduce("ReduceMax", scaled, 1, 1)])])
    probs = b.op("Mul", [exps, b.op("Reciprocal", [b.reduce("ReduceSum", exps, 1, 1)])])  # [n, vocab]
    return _min_p(b, _top_p(b, probs, vocab))


def _renormalized(b: _Builder, probs: str, keep: str, on: str) -> str:
    """probs [n, vocab] with only the tokens in keep [n, vocab] (bool) left, renormalized; unchanged when on is false."""
    zero = b.const(0.0, np.float32)
    masked = b.op("Where", [keep, probs, zero])
    renormalized = b.op("Div", [masked, b.reduce("ReduceSum", masked, 1, 1)])
    return b.op("Where", [on, renormalized, probs])


def _top_p(b: _Builder, probs: str, vocab: str) -> str:
    """Keep the smallest most-probable set whose mass reaches top_p: a token stays while the mass ranked before it is below."""
    on = b.op("Less", ["top_p", b.const(1.0, np.float32)])
    count = b.op("Unsqueeze", [b.op("Where", [on, vocab, b.const(1, np.int64)]), b.const([0], np.int64)])
    # Descending, ties by lower index first (the ONNX TopK contract); sampling._nucleus ranks equal weights by
    # logit, then index, which differs only where two logits round to the same probability.
    ranked, order = b.op("TopK", [probs, count], 2, axis=-1, largest=1, sorted=1)  # [n, vocab] each
    # The mass before each token against top_p of the total, summed in float64 as _nucleus sums them: a float32
    # running sum over a 128k vocabulary drifts by 1e-5, enough to move the cut.
    ranked64 = b.op("Cast", [ranked], to=11)
    before = b.op("Sub", [b.op("CumSum", [ranked64, b.const(1, np.int64)]), ranked64])
    limit = b.op("Mul", [b.op("Cast", ["top_p"], to=11), b.reduce("ReduceSum", ranked64, 1, 1)])
    stays = b.op("Cast", [b.op("Less", [before, limit])], to=1)  # [n, vocab] 1.0 / 0.0 in rank order
    scattered = b.op("ScatterElements", [b.op("Mul", [probs, b.const(0.0, np.float32)]), order, stays], axis=1)
    keep = b.op("Cast", [scattered], to=9)  # [n, vocab] bool, in vocabulary order
    return _renormalized(b, probs, keep, on)


def _min_p(b: _Builder, probs: str) -> str:
    """Drop tokens below min_p times the row's most probable token (transformers' MinPLogitsWarper); 0 is off."""
    on = b.op("Greater", ["min_p", b.const(0.0, np.float32)])
    floor = b.op("Mul", [b.reduce("ReduceMax", probs, 1, 1), "min_p"])  # [n, 1]
    keep = b.op("Not", [b.op("Less", [probs, floor])])
    return _renormalized(b, probs, keep, on)


def _draw(b: _Builder, weights: str, uniform: str) -> str:
    """weights [vocab] float32 (not normalized), uniform [] float64 -> the inverse-CDF token, int64 []."""
    cdf = b.op("CumSum", [b.op("Cast", [weights], to=11), b.const(0, np.int64)])  # [vocab] float64
    total = b.op("Gather", [cdf, b.const(-1, np.int64)], axis=0)
    point = b.op("Mul", [uniform, total])
    token = b.reduce("ReduceSum", b.op("Cast", [b.op("LessOrEqual", [cdf, point])], to=7), 0, 0)
    # Rounding can carry the point past the last token with mass: land it on that token, as draw does.
    vocab = b.op("Gather", [b.op("Shape", [weights]), b.const(0, np.int64)], axis=0)
    indices = b.op("Range", [b.const(0, np.int64), vocab, b.const(1, np.int64)])
    with_mass = b.op("Where", [b.op("Greater", [weights, b.const(0.0, np.float32)]), indices,
                               b.const(-1, np.int64)])
    return b.op("Min", [token, b.reduce("ReduceMax", with_mass, 0, 0)])


def sampled_graph(opset: int, logits_type: int):
    """target_logits [k + 1, vocab], draft_tokens [k], draft_probs [k, vocab] float32, uniforms [k + 1] float64,
    temperature [] float32, top_k [] int64, top_p [] float32, min_p [] float32 -> num_accepted [], next_token []
    (int64) and target_probs [k + 1, vocab] float32 (the processed target distributions)."""
    from onnx import TensorProto, helper

    b = _Builder(opset)
    inputs, num_draft = _common_inputs(b, logits_type)
    inputs += [helper.make_tensor_value_info("draft_probs", TensorProto.FLOAT, ["num_draft_tokens", "vocab"]),
               helper.make_tensor_value_info("uniforms", TensorProto.DOUBLE, ["num_positions"]),
               helper.make_tensor_value_info("temperature", TensorProto.FLOAT, []),
               helper.make_tensor_value_info("top_k", TensorProto.INT64, []),
               helper.make_tensor_value_info("top_p", TensorProto.FLOAT, []),
               helper.make_tensor_value_info("min_p", TensorProto.FLOAT, [])]
    target_probs = _process(b, b.op("Cast", ["target_logits"], to=1))
    b.op("Identity", [target_probs], ["target_probs"])
    zero = b.const([0], np.int64)
    columns = b.op("Unsqueeze", ["draft_tokens", b.const([1], np.int64)])  # [k, 1]
    head = b.op("Slice", [target_probs, zero, num_draft, zero])  # [k, vocab]

    def at_draft_tokens(rows: str) -> str:  # [k, vocab] -> [k] float64
        return b.op("Cast", [b.op("Squeeze", [b.op("GatherElements", [rows, columns], axis=1),
                                              b.const([1], np.int64)])], to=11)

    # u_i * draft_p < target_p, in float64 as the NumPy scan compares (a float64 uniform times float32 probabilities).
    tests = b.op("Mul", [b.op("Slice", ["uniforms", zero, num_draft, zero]), at_draft_tokens("draft_probs")])
    rejected = b.op("Not", [b.op("Less", [tests, at_draft_tokens(head)])])  # [k]
    b.op("Identity", [b.first_true(rejected)], ["num_accepted"])

    # The final row: the residual at the first rejection; past the last draft row the draft has zero
    # probability everywhere, so the same formula gives the bonus row, target_probs_k, exactly.
    vocab_1d = b.op("Slice", [b.op("Shape", [target_probs]), b.const([1], np.int64), b.const([2], np.int64)])
    zero_row = b.op("ConstantOfShape", [b.op("Concat", [b.const([1], np.int64), vocab_1d], axis=0)],
                    value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
    draft_rows = b.op("Concat", ["draft_probs", zero_row], axis=0)  # [k + 1, vocab]
    target_row = b.op("Gather", [target_probs, "num_accepted"], axis=0)  # [vocab]
    residual = b.op("Max", [b.op("Sub", [target_row, b.op("Gather", [draft_rows, "num_accepted"], axis=0)]),
                            b.const(0.0, np.float32)])
    # No residual mass only arises from rounding when the two rows are equal; then the target row is exact.
    has_mass = b.op("Greater", [b.reduce("ReduceSum", residual, 0, 0), b.const(0.0, np.float32)])
    weights = b.op("Where", [has_mass, residual, target_row])
    last_uniform = b.op("Gather", ["uniforms", b.op("Squeeze", [num_draft, zero])], axis=0)
    b.op("Identity", [_draw(b, weights, last_uniform)], ["next_token"])
    probs_info = helper.make_tensor_value_info("target_probs", TensorProto.FLOAT, ["num_positions", "vocab"])
    return b.model("specdeploy-accept-sampled", inputs, _outputs(probs_info))


def model_opset(onnx_path: Path) -> int:
    """The default-domain opset a bundle model was exported with (its graph only, not its weights)."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def _spec(root: Path, path: Path, proto) -> AcceptGraphSpec:
    from onnx import helper

    def tensors(values):
        return tuple(TensorSpec(name=v.name, dtype=str(helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)),
                                shape=tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim))
                     for v in values)

    return AcceptGraphSpec(path=path.relative_to(root).as_posix(), inputs=tensors(proto.graph.input),
                           outputs=tensors(proto.graph.output))


def write_accept_graphs(root: Path, target: ModelSpec) -> AcceptSpec:
    """Write accept/greedy.onnx and accept/sampled.onnx for the target's logits into the bundle at root."""
    import onnx
    from onnx import helper

    from ..errors import SpecdeployError

    opset = model_opset(root / target.onnx_path)
    if opset < MIN_OPSET:
        raise SpecdeployError(f"the target was exported with opset {opset}; the accept graphs need {MIN_OPSET} or later")
    logits = next(t for t in target.outputs if t.name == "logits")
    logits_type = helper.np_dtype_to_tensor_dtype(np.dtype(logits.dtype))
    folder = root / FOLDER
    folder.mkdir()
    specs = {}
    for kind, build in (("greedy", greedy_graph), ("sampled", sampled_graph)):
        proto = build(opset, logits_type)
        onnx.checker.check_model(proto, full_check=True)
        path = folder / f"{kind}.onnx"
        onnx.save_model(proto, str(path))
        specs[kind] = _spec(root, path, proto)
    files = tuple(file_entry(root, p) for p in sorted(folder.iterdir()))
    return AcceptSpec(opset=opset, processing=PROCESSING, greedy=specs["greedy"], sampled=specs["sampled"], files=files)
