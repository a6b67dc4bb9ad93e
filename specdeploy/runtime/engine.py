"""Engines: one exported model behind `forward(token_ids, cache) -> logits`.

`OrtEngine` runs a bundle model in an ONNX Runtime session on the CPU, CUDA or TensorRT execution
provider. `CachedModel` pairs an engine with its KV cache and the tokens that cache holds, so that
callers only say which context they want logits for and the cache follows (rollback included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..bundle import ModelSpec, check_graph_io
from ..errors import SpecdeployError
from .kv_cache import KVCache, SharedKVCache, _ortvalue

DEVICES = ("cpu", "cuda", "tensorrt")
PREFILL_CHUNK = 64  # tokens per prefill pass (see CachedModel.prefill)
BOUND_IDS = 64  # passes up to this many tokens bind their ids from a fixed buffer (see OrtEngine)
# Scratch-logits passes up to this many tokens write one fixed buffer (see OrtEngine.forward): every
# decode pass, and each prefill chunk (no fresh 2 MB array to fault in per chunk: a 1,920-token prefill
# of the benchmark pair 780 -> 725 ms).
SCRATCH_ROWS = PREFILL_CHUNK


@dataclass(frozen=True)
class SessionConfig:
    device: str = "cpu"  # cpu | cuda | tensorrt
    intra_op_threads: int = 0  # 0: ONNX Runtime picks (one per physical core)
    # Two sessions that spin-wait fight over the same cores when draft and target alternate.
    allow_spinning: bool = False
    graph_optimization: str = "all"  # disable | basic | extended | all
    # One process-wide ONNX Runtime thread pool for all sessions (sized by the first one), spinning:
    # draft and target alternate, and two per-session pools only wake and park threads against each
    # other. Measured on 2 cores: target step 3.2 ms instead of 4.5 ms, speculative greedy 1.35x
    # faster. Process-wide: once it exists, ONNX Runtime refuses sessions with their own pools, so
    # it is off for engines built directly and on for `specdeploy.load` (see there).
    shared_threads: bool = False
    trt_cache_dir: str | None = None  # TensorRT engines are built once and cached here
    # ONNX Runtime's CPU arena keeps freed activation memory for reuse; without it the fused graphs
    # ran at the same speed (1,241 vs 1,234 tok/s speculative on codepair) with a lower peak.
    memory_arena: bool = False


def trt_profiles(spec: ModelSpec, max_context: int, max_new: int = 33) -> dict[str, str]:
    """Explicit TensorRT optimization profiles (min/opt/max shapes) for every dynamic input.

    Format from the ONNX Runtime TensorRT EP docs: "name:1x4x0x64,name2:...". Inputs run 1..max_new
    tokens per pass (k + 1 <= 33) or a prefill chunk, on a past of 0..max_context - 1 positions.
    TensorRT needs min <= opt <= max on every axis: opt is the typical shape, clamped into range
    (a short context puts the usual 512-position opt above max)."""
    longest_pass = min(max(max_new, PREFILL_CHUNK), max_context)
    ranges = {"tokens": (1, 5, longest_pass), "mask": (1, 512, max_context), "past": (0, 512, max_context - 1)}
    ranges = {axis: (low, min(max(opt, low), high), high) for axis, (low, opt, high) in ranges.items()}
    shapes = {"min": [], "opt": [], "max": []}
    for tensor in spec.inputs:
        if tensor.name in ("input_ids", "position_ids"):
            dims = {key: (1, n) for key, n in zip(shapes, ranges["tokens"])}
        elif tensor.name == "attention_mask":
            dims = {key: (1, n) for key, n in zip(shapes, ranges["mask"])}
        else:  # past keys and values [1, kv_heads, past, head_dim]; a shared buffer is always max_context long
            heads, head_dim = tensor.shape[1], tensor.shape[3]
            lengths = (max_context,) * 3 if spec.kv_cache.shared_buffer else ranges["past"]
            dims = {key: (1, heads, past, head_dim) for key, past in zip(shapes, lengths)}
        for key, value in dims.items():
            shapes[key].append(f"{tensor.name}:{'x'.join(str(d) for d in value)}")
    return {f"trt_profile_{key}_shapes": ",".join(items) for key, items in shapes.items()}


def trt_options(config: SessionConfig, spec: ModelSpec | None) -> dict:
    """The TensorRT execution provider's options: fp16 kernels only for an fp16 bundle (an fp32 one
    would otherwise run at fp16 precision without saying so), the engine cache, the profiles."""
    options = {"trt_fp16_enable": spec is not None and spec.dtype == "fp16",
               "trt_engine_cache_enable": config.trt_cache_dir is not None}
    if config.trt_cache_dir:
        options["trt_engine_cache_path"] = config.trt_cache_dir
    if spec is not None:
        options.update(trt_profiles(spec, spec.max_context))
    return options


def providers_for(config: SessionConfig, spec: ModelSpec | None = None) -> list:
    import onnxruntime as ort

    if config.device not in DEVICES:
        raise SpecdeployError(f"unknown device '{config.device}' (choose from {', '.join(DEVICES)})")
    available = set(ort.get_available_providers())
    if config.device == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in available:
        raise SpecdeployError(
            f"device '{config.device}' needs onnxruntime-gpu (pip install 'specdeploy[gpu]'); this onnxruntime has "
            + ", ".join(sorted(available))
        )
    if config.device == "cuda":
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if "TensorrtExecutionProvider" not in available:
        raise SpecdeployError("device 'tensorrt' needs an onnxruntime-gpu build with the TensorRT execution provider")
    return [("TensorrtExecutionProvider", trt_options(config, spec)), "CUDAExecutionProvider", "CPUExecutionProvider"]


_GLOBAL_POOL: list[int] = []  # the size the process-wide pool was created with; ONNX Runtime allows it once


def global_pool_active() -> bool:
    """Whether this process already runs ONNX Runtime on the shared pool (new sessions must then join it)."""
    return bool(_GLOBAL_POOL)


def _use_global_pool(threads: int) -> None:
    import onnxruntime.capi._pybind_state as ort_c

    if not _GLOBAL_POOL:
        ort_c.set_global_thread_pool_sizes(threads, 1)
        _GLOBAL_POOL.append(threads)


def session_options(config: SessionConfig, spec: ModelSpec | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if config.shared_threads:
        _use_global_pool(config.intra_op_threads)
        options.use_per_session_threads = False
    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    options.graph_optimization_level = levels[config.graph_optimization]
    if not config.shared_threads:
        options.intra_op_num_threads = config.intra_op_threads
        options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.enable_cpu_mem_arena = config.memory_arena
    # ONNX Runtime keeps one memory pattern per distinct set of input shapes, for as long as the
    # session lives. A concatenating KV cache (a new past length every pass), or a GPU pass's mask
    # as wide as the context, makes a new set nearly every pass: the patterns then grow without
    # bound (resident memory then grows with every token). Only a CPU shared-buffer graph, whose shapes
    # are the buffers' plus 1..PREFILL_CHUNK ids, keeps them.
    options.enable_mem_pattern = spec is not None and spec.kv_cache.shared_buffer and config.device == "cpu"

    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.allow_spinning else "0")
    options.log_severity_level = 4  # fatal only: a failed run is reported as one line, by the caller
    return options


class OrtEngine:
    """One bundle model in an ONNX Runtime session; batch 1, positions implied by the cache length."""

    def __init__(self, model_path: Path, spec: ModelSpec, config: SessionConfig = SessionConfig()):
        import onnxruntime as ort

        self.spec = spec
        providers = providers_for(config, spec)  # validates the device first
        if config.device != "cpu" and spec.graph == "fused" and spec.dtype == "fp32":
            # ONNX Runtime's CUDA GroupQueryAttention runs fp16/bf16 only: an fp32 fused graph would
            # send every attention node, and the KV buffers with it, back to the CPU each pass.
            raise SpecdeployError(
                f"the {spec.role} is an fp32 fused graph, which ONNX Runtime's GPU kernels do not run: "
                "export with --dtype fp16 (or --graph optimum) for --device cuda/tensorrt"
            )
        try:
            self.session = ort.InferenceSession(str(model_path), session_options(config, spec), providers=providers)
        except SpecdeployError:
            raise
        except Exception as exc:
            raise SpecdeployError(f"ONNX Runtime cannot load {model_path}: {str(exc).splitlines()[0]}") from None
        check_graph_io(spec, self.session.get_inputs(), self.session.get_outputs())
        names = set(spec.input_names)
        self._has_mask = "attention_mask" in names
        self._has_positions = "position_ids" in names
        kv = spec.kv_cache
        self._past_names = [name for i in range(spec.num_layers) for name in (kv.past_key % i, kv.past_value % i)]
        self._output_names = ["logits"] + [n for i in range(spec.num_layers) for n in (kv.present_key % i, kv.present_value % i)]
        self.cache_dtype = np.dtype(kv.dtype)
        self.shared_buffer = kv.shared_buffer
        self._bound = None  # the shared-buffer cache whose buffers the binding holds
        self._logits_dtype = np.dtype(next(t.dtype for t in spec.outputs if t.name == "logits"))
        self._float32_logits = self._logits_dtype == np.float32
        self.seconds = 0.0  # time spent inside session.run, for the stats
        self.calls = 0
        from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

        self._binding = self.session.io_binding()._iobinding
        self._run = self.session._sess.run_with_iobinding
        # The KV cache stays on the device of the execution provider; only the logits come to NumPy.
        self._device = "cpu" if config.device == "cpu" else "cuda"
        self._cpu = OrtDevice.make("cpu", 0)._get_c_device()
        self._cache_device = OrtDevice.make(self._device, 0)._get_c_device()
        self._ones = np.ones((1, 0), dtype=np.int64)
        self._positions = np.zeros((1, 0), dtype=np.int64)
        # Shared-buffer graphs: OrtValues over fixed buffers for the token ids (one per pass length)
        # and the mask (one per valid length), made once. Binding one costs ~0.3 us against ~2.5 us
        # for binding a NumPy array, on passes whose Python side is the "other" time of a round.
        self._ids = np.zeros((1, BOUND_IDS), dtype=np.int64)
        self._first_id = self._ids[0, :1]  # [1]: a one-token pass's id (a 1-D index is the cheapest write)
        self._ids_values = [_ortvalue(self._ids[:, :n], "cpu") if n else None for n in range(BOUND_IDS + 1)]
        self._mask_values: list = []
        self._scratch = None  # see forward(scratch=True); made on first use
        self._bound_ids = self._bound_logits = None  # the OrtValues the binding holds now, if ours
        self._stepping = None  # the cache whose one-token scratch pass was the last one (see step)

    def new_cache(self, capacity: int) -> KVCache:
        spec = self.spec
        if capacity > spec.max_context:
            raise SpecdeployError(f"a cache of {capacity} positions exceeds the {spec.role}'s max context {spec.max_context}")
        kind = SharedKVCache if self.shared_buffer else KVCache
        return kind(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.cache_dtype, capacity, self._device)

    def forward(self, token_ids, cache: KVCache, scratch: bool = False) -> np.ndarray:
        """Run token_ids ([n], a list or an array) after the cache's valid positions; returns logits [n, vocab] (float32).

        IO binding keeps every tensor where ONNX Runtime put it: the presents come back as OrtValues
        whose memory the cache reads in place (no copy into new NumPy arrays), and they are bound
        as the next step's past as they are.

        scratch: the logits of a short pass (up to SCRATCH_ROWS tokens, on a shared-buffer graph) land
        in one buffer the engine owns and its next scratch pass overwrites: no array, OrtValue or
        binding to make per pass (~7 us of a ~20 us draft step's Python). For callers that read the
        logits before the next pass, as the generate loop does; everyone else gets a fresh array.
        """
        past_length = cache.length
        count = len(token_ids)
        total = past_length + count
        if total > cache.capacity:
            raise SpecdeployError(f"context of {total} tokens exceeds the bundle's max context {cache.capacity}")
        if self._ones.shape[1] < total:
            self._ones = np.ones((1, cache.capacity), dtype=np.int64)  # [1, capacity]: slices stay contiguous
            self._positions = np.arange(cache.capacity, dtype=np.int64)[None]
            self._mask_values = [None] * (cache.capacity + 1)  # views of the old array go with it
        if cache.shared_buffer:
            return self._forward_shared(token_ids, count, total, cache, scratch and count <= SCRATCH_ROWS)
        # The C-level binding skips the Python wrappers' per-call bookkeeping: draft steps are
        # short enough (~0.6 ms) for that to show. Bound NumPy arrays must outlive the run.
        binding = self._binding
        token_ids = np.ascontiguousarray(token_ids, dtype=np.int64).reshape(1, count)
        binding.bind_input("input_ids", token_ids)
        if self._has_mask:
            binding.bind_input("attention_mask", self._ones[:, :total])
        if self._has_positions:
            binding.bind_input("position_ids", self._positions[:, past_length:total])
        for name, tensor in zip(self._past_names, cache.past()):
            binding.bind_ortvalue_input(name, tensor)
        binding.bind_output("logits", self._cpu)
        for name in self._output_names[1:]:
            binding.bind_output(name, self._cache_device)
        self._bound_ids = self._bound_logits = self._stepping = None
        start = time.perf_counter()
        self._run(binding, None)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        outputs = binding.get_outputs()  # C OrtValues, owned by us from here on
        cache.update([outputs[i] for i in range(1, len(outputs))])
        logits = outputs[0].numpy()[0]  # [n, vocab]; a view on the CPU
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)

    def _forward_shared(self, token_ids, count: int, total: int, cache: SharedKVCache, scratch: bool) -> np.ndarray:
        """The fused graphs: each present is bound to its past's buffer and written in place.

        The cache buffers stay bound from one pass to the next, and so does the cache's mask on the
        CPU (written in place; see SharedKVCache); the token ids and the logits are bound when a
        pass's length differs from the last one's, each from an OrtValue made once. Every line here
        runs cold after a pass has streamed the weights through the caches, so it does as little as
        it can."""
        binding = self._binding
        self._stepping = None  # until this pass has run (a failed one may leave other ids or logits bound)
        if count <= BOUND_IDS:
            if count == 1:
                self._first_id[0] = token_ids[0]
            else:
                self._ids[0, :count] = token_ids
            ids = self._ids_values[count]
            if ids is not self._bound_ids:  # a binding stays until rebound: runs of equal length skip it
                binding.bind_ortvalue_input("input_ids", ids)
                self._bound_ids = ids
        else:  # the binding does not keep the array alive: the engine does, until the next pass
            self._long_ids = np.ascontiguousarray(token_ids, dtype=np.int64).reshape(1, count)
            binding.bind_input("input_ids", self._long_ids)
            self._bound_ids = None
        if cache is not self._bound:
            for name, tensor in zip(self._past_names, cache.tensors):
                binding.bind_ortvalue_input(name, tensor)
            for name, tensor in zip(self._output_names[1:], cache.tensors):
                binding.bind_ortvalue_output(name, tensor)
            if cache.mask_value is not None:
                binding.bind_ortvalue_input("attention_mask", cache.mask_value)
            self._bound = cache
        if cache.mask_value is not None:  # on the CPU: the cache's full-width mask, written in place
            cache.mask_to(total)
        else:  # a GPU: one mask per valid length, as wide as the context (the layout the GPU kernels were written for)
            mask = self._mask_values[total]
            if mask is None:
                mask = self._mask_values[total] = _ortvalue(self._ones[:, :total], "cpu")
            binding.bind_ortvalue_input("attention_mask", mask)
        if scratch:
            if self._scratch is None:
                self._make_scratch()
            output = self._scratch_values[count]
            if output is not self._bound_logits:
                binding.bind_ortvalue_output("logits", output)
                self._bound_logits = output
            logits = self._scratch_rows[count]
        else:
            # A fresh array: the caller may keep it. The engine holds it, since the binding points
            # into its memory, until the next pass rebinds the output.
            self._logits = fresh = np.empty((1, count, self.spec.vocab_size), dtype=self._logits_dtype)
            binding.bind_ortvalue_output("logits", _ortvalue(fresh, "cpu"))
            self._bound_logits = None
            logits = fresh[0]
        start = time.perf_counter()
        self._run(binding, None)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        cache.length += count
        # A one-token scratch pass on the CPU leaves the binding as step() needs it: only the token and
        # the cache's own mask change.
        self._stepping = cache if scratch and count == 1 and self._float32_logits and cache.mask is not None else None
        return logits if self._float32_logits else logits.astype(np.float32)

    def step(self, token: int, cache: SharedKVCache) -> np.ndarray:
        """forward([token], cache, scratch=True)[0]: the draft's inner loop, in as few statements as it can
        take (each runs cold after the previous pass, ~2 us of a ~20 us gap between draft passes).

        Once a one-token scratch pass has bound its ids and logits (self._stepping), the next ones on
        the CPU only write the token into the bound ids buffer and one more 1 into the cache's mask:
        nothing is bound. Anything else goes to forward."""
        total = cache.length + 1
        if cache is not self._stepping or total > cache.capacity:
            return self.forward((token,), cache, scratch=True)[0]
        self._first_id[0] = token
        cache.mask_to(total)
        binding = self._binding
        start = time.perf_counter()
        self._run(binding, None)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        cache.length = total
        return self._scratch_first

    def _make_scratch(self) -> None:
        """One [1, SCRATCH_ROWS, vocab] buffer; a pass of n tokens writes its first n rows (contiguous)."""
        self._scratch = np.empty((1, SCRATCH_ROWS, self.spec.vocab_size), dtype=self._logits_dtype)
        self._scratch_values = [None] + [_ortvalue(self._scratch[:, :n], "cpu") for n in range(1, SCRATCH_ROWS + 1)]
        self._scratch_rows = [None] + [self._scratch[0, :n] for n in range(1, SCRATCH_ROWS + 1)]
        self._scratch_first = self._scratch[0, 0]  # [vocab]: a one-token pass's logits


class CachedModel:
    """An engine, its KV cache, and the tokens the cache holds (so rollback is automatic)."""

    def __init__(self, engine: OrtEngine, capacity: int, min_pass_tokens: int | None = None,
                 scratch_logits: bool = False):
        self.engine = engine
        self.cache = engine.new_cache(capacity)
        self.tokens: list[int] = []  # the tokens whose keys and values the cache holds
        # The context list the last sync followed, and how many leading positions self.tokens shares
        # with it: the generate loop only appends to its context, so the next sync compares only
        # what came after (a prefix copy and compare of the whole context, per model per round,
        # otherwise). A context list changed in place, rather than appended to, must be passed as a
        # new list; self.tokens shortened by hand lowers the mark at the next extend.
        self._synced: list[int] | None = None
        self._agreed = 0
        # True: extend's logits are only valid until the next pass (OrtEngine.forward's scratch).
        self.scratch_logits = scratch_logits
        # ONNX Runtime's kernels take a separate path for a single row. In fp32 its logits differ
        # from a multi-token pass by 6e-6 to 6e-5; in fp16 by ~5e-3, and the int8-compute
        # MatMulNBits kernels (quantized models) fall back to fp32 for one row and differ by ~3e-2:
        # enough to flip greedy near-ties between target-only decoding (one token per pass) and
        # verification (k + 1). Passes of two or more tokens agree bit for bit whatever their
        # length, so an fp16 or quantized model never runs a single-token pass: the previous token
        # is run again beside it (its keys and values are rewritten with the same bits). Costs
        # ~15% per target-only step of an int8 target; fp32 keeps single-token passes (6% faster).
        # The rule needs a free rollback: with optimum's concatenating graphs, stepping back one
        # position copies the whole cache (and on a GPU round-trips it through the host) every
        # step, so those keep single-token passes and only near-ties may differ.
        # A draft's numbers never reach the output, so drafts keep single-token passes.
        if min_pass_tokens is None:
            spec = engine.spec
            rounded = spec.quantize != "none" or spec.dtype != "fp32"
            min_pass_tokens = 2 if rounded and engine.shared_buffer and spec.role == "target" else 1
        self.min_pass_tokens = min_pass_tokens
        # Whether step() may take the engine's one-token path (both settings are fixed from here on).
        self._steps = min_pass_tokens == 1 and scratch_logits and self.cache.shared_buffer

    def reset(self) -> None:
        self.cache.reset()
        self.tokens = []
        self._agreed = 0

    def uncached(self, context: list[int]) -> list[int]:
        """Truncate the cache to its longest prefix shared with context, keeping at least one token to run."""
        return self._sync(context, len(context) - 1)

    def prefill(self, context: list[int]) -> None:
        """Make the cache hold exactly context (reusing whatever prefix it already holds).

        Long contexts go in chunks of PREFILL_CHUNK tokens: the graphs compute logits at every
        position, and a 1,920-token prompt in one pass held 63 MB of target logits (and as much
        for the draft) that nobody reads."""
        rest = self._sync(context, len(context))
        for start in range(0, len(rest), PREFILL_CHUNK):
            self.extend(rest[start : start + PREFILL_CHUNK])

    def _sync(self, context: list[int], max_shared: int) -> list[int]:
        limit = min(len(self.tokens), max_shared)
        start = min(self._agreed, limit) if context is self._synced else 0  # tokens[:start] == context[:start]
        shared = limit
        if self.tokens[start:limit] != context[start:limit]:
            shared = next(i for i in range(start, limit) if self.tokens[i] != context[i])
        if shared < len(self.tokens):
            del self.tokens[shared:]
            self.cache.truncate(shared)
        self._synced, self._agreed = context, shared
        return context[shared:]

    def extend(self, token_ids: list[int]) -> np.ndarray:
        """Append tokens to the cache; returns their logits [n, vocab]."""
        if len(self.tokens) < self._agreed:  # shortened by hand since the last sync (see _sync)
            self._agreed = len(self.tokens)
        try:
            if len(token_ids) >= self.min_pass_tokens or not token_ids:  # every draft step: one call to the engine
                logits = self.engine.forward(token_ids, self.cache, self.scratch_logits)
            else:
                logits = self._short_pass(token_ids)
            self.tokens.extend(token_ids)
            return logits
        except BaseException:
            self._recover()
            raise

    def step(self, token: int) -> np.ndarray:
        """extend([token])[-1]: one token in, the next token's logits [vocab] out (the draft's inner loop)."""
        if not self._steps:
            return self.extend([token])[-1]
        if len(self.tokens) < self._agreed:  # shortened by hand since the last sync (see _sync)
            self._agreed = len(self.tokens)
        try:
            logits = self.engine.step(token, self.cache)
            self.tokens.append(token)
        except BaseException:
            self._recover()
            raise
        return logits

    def _recover(self) -> None:
        """After an error or Ctrl-C mid-pass: bring the token list and the cache back in step (to the
        shorter of the two), so the next call resyncs instead of writing one slot off."""
        valid = min(len(self.tokens), self.cache.length)
        del self.tokens[valid:]
        self.cache.truncate(valid)
        self._agreed = min(self._agreed, valid)

    def _short_pass(self, token_ids: list[int]) -> np.ndarray:
        """Fewer tokens than min_pass_tokens (one): run them beside others (see __init__)."""
        if self.tokens:  # run the previous token again in front
            self.cache.truncate(len(self.tokens) - 1)
            return self.engine.forward([self.tokens[-1], *token_ids], self.cache, self.scratch_logits)[1:]
        # nothing before it: a padding copy behind it, dropped again (causal: it changes nothing before)
        logits = self.engine.forward(list(token_ids) * 2, self.cache, self.scratch_logits)[: len(token_ids)]
        self.cache.truncate(len(token_ids))
        return logits

    def logits_after(self, context: list[int]) -> np.ndarray:
        """Logits [vocab] of the token that follows context (a long catch-up goes in prefill chunks)."""
        rest = self.uncached(context)
        if len(rest) == 1:  # the draft after a rejection: one token, the short path
            return self.step(rest[0])
        while len(rest) > PREFILL_CHUNK:
            self.extend(rest[:PREFILL_CHUNK])
            rest = rest[PREFILL_CHUNK:]
        return self.extend(rest)[-1]
