"""Engines: one exported model behind one pass, `run(token_ids, cache) -> logits`.

`OrtEngine` runs a bundle model in an ONNX Runtime session on the CPU, CUDA or TensorRT execution
provider. Three passes reach its sessions: `run` (one cache; `prefill` / `logits_after` run what
a cache lacks of a context), `run_batch` (a token after each of several caches) and `run_packed`
(tokens after several caches, packed.py), called by the runner (runner.py) and the drafters. The
cache (kv_cache.py) holds the tokens it has seen and rolls back by `truncate(n)`. An engine serves
any number of caches one after another (a server's requests): everything it keeps between passes
is either fixed at load or rebound when the cache changes.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..bundle import ModelSpec
from ..errors import SpecdeployError
from .kv_cache import KVCache, KVSlots, SharedKVCache, ort_value
from .packed import PackedPass
from .session import PREFILL_CHUNK, SessionConfig, check_exact, model_weights, open_session

BOUND_IDS = 64  # passes up to this many tokens bind their ids from a fixed buffer (see OrtEngine)
# Scratch-logits passes up to this many tokens write one fixed buffer (see OrtEngine.run): every
# decode pass, and each prefill chunk (no fresh array of logits to fault in per chunk).
SCRATCH_ROWS = PREFILL_CHUNK


class OrtEngine:
    """One bundle model in an ONNX Runtime session; batch 1, positions implied by the cache length.

    scratch_logits: the logits of a short pass (up to SCRATCH_ROWS tokens, on a shared-buffer graph)
    land in one buffer that the next pass overwrites: no array, OrtValue or binding to make per
    pass. For callers that read the logits before the next pass, as the generate loop does.

    exact: ONNX Runtime's kernels take a separate path for a single row, whose logits differ from a
    multi-token pass's (in the last bits in fp32, far more in fp16 and in int8-compute MatMulNBits,
    which falls back to fp32 for one row): enough to flip greedy near-ties between target-only
    decoding and verification. Passes of two or more tokens agree bit for bit whatever their length,
    so an exact target never runs a single-token pass (min_pass_tokens 2): the previous token runs
    again beside it (its keys and values rewritten with the same bits). That costs target-only speed
    (docs/performance.md), so it is an option. It needs a free rollback, a cache
    written in place: with optimum's concatenating graphs, stepping back one position copies the
    whole cache every step, so an exact engine refuses them. Drafts run single tokens regardless.
    """

    def __init__(self, model_path: Path, spec: ModelSpec, config: SessionConfig = SessionConfig(),
                 scratch_logits: bool = False, exact: bool = False, features: str | None = None):
        """features: an output of [batch, seq, F] rows (a target's `hidden_states` for an eagle draft, an
        eagle draft's `next_hidden_states`) that each pass writes into its cache's feature buffer, row p
        for position p (shared-buffer graphs only). An eagle draft's feature input is `run`'s `features`."""
        self.spec = spec
        self.model_path, self.config = model_path, config
        self.weights = model_weights(model_path) if config.weights_in_memory else None  # alive as long as the sessions
        self.session = open_session(model_path, spec, config, self.weights)
        self.columns = spec.vocab_subset or spec.vocab_size  # the logits' width (a draft may cover a subset)
        self.features = features
        self.feature_size = 0
        if features is not None:
            tensor = next((t for t in spec.outputs if t.name == features), None)
            if tensor is None or not spec.kv_cache.shared_buffer or not isinstance(tensor.shape[-1], int):
                raise SpecdeployError(f"the {spec.role} graph has no fixed-width output '{features}' on a shared-buffer cache")
            self.feature_size = tensor.shape[-1]
        self._feature_input = spec.eagle.feature_input if spec.eagle is not None else None
        names = set(spec.input_names)
        self._has_mask = "attention_mask" in names
        self._has_positions = "position_ids" in names
        kv = spec.kv_cache
        self._past_names = [name for i in range(spec.num_layers) for name in (kv.past_key % i, kv.past_value % i)]
        self._present_names = [name for i in range(spec.num_layers) for name in (kv.present_key % i, kv.present_value % i)]
        self.cache_dtype = np.dtype(kv.dtype)
        self.shared_buffer = kv.shared_buffer
        self.logits_dtype = np.dtype(next(t.dtype for t in spec.outputs if t.name == "logits"))  # the graph's (packed.py reads it)
        self.float32_logits = self.logits_dtype == np.float32
        self.scratch_logits = scratch_logits
        if exact:
            check_exact(spec)
        self.exact = exact and spec.role == "target"  # a draft's numbers never reach the output
        self.min_pass_tokens = 2 if self.exact else 1  # see the class docstring
        self.seconds = 0.0  # time spent inside session.run, for the stats
        self.calls = 0
        self._binding = self.session.io_binding()  # bound NumPy arrays must outlive the run
        self._run = self.session.run_with_iobinding
        # The KV cache stays on the device of the execution provider; only the logits come to NumPy.
        self._device = "cpu" if config.device == "cpu" else "cuda"
        self._mask_ones = np.ones((1, 0), dtype=np.int64)  # [1, capacity]: masks of concat graphs and GPUs
        self._positions = np.zeros((1, 0), dtype=np.int64)  # [1, capacity]: 0, 1, 2, ...
        self._mask_values: list = []  # [total]: an OrtValue over _mask_ones[:, :total], made on first use
        # Shared-buffer graphs: OrtValues over fixed buffers for the token ids (one per pass length)
        # and the logits (scratch_logits), made once: binding one is far cheaper than binding a
        # NumPy array, on passes whose Python side is the "other" time of a round.
        self._ids = np.zeros((1, BOUND_IDS), dtype=np.int64)  # [1, BOUND_IDS]
        self._first_id = self._ids[0, :1]  # [1]: a one-token pass's id (a 1-D index is the cheapest write)
        self._ids_values = [ort_value(self._ids[:, :n], "cpu") if n else None for n in range(BOUND_IDS + 1)]
        self._scratch = None  # [1, SCRATCH_ROWS, vocab], with OrtValues and views per pass length; see _make_scratch
        # What the binding holds now: the cache whose buffers it binds, the ids and logits OrtValues
        # (if ours), and the cache whose one-token scratch pass was the last pass (see _step).
        self._bound_cache = self._bound_ids = self._bound_logits = self._stepping = None
        self._batch_logits: dict = {}  # rows -> ([rows, 1, vocab] logits, its OrtValue); see run_batch
        self._batch_ids_values: dict = {}
        self._batch_ids = np.zeros((0, 1), dtype=np.int64)  # [rows, 1]

    def new_cache(self, capacity: int) -> KVCache | SharedKVCache:
        spec = self.spec
        if capacity > spec.max_context:
            raise SpecdeployError(f"a cache of {capacity} positions exceeds the {spec.role}'s max context {spec.max_context}")
        if not self.shared_buffer:
            return KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.cache_dtype, capacity, self._device)
        return SharedKVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.cache_dtype, capacity, self._device,
                             feature_size=self.feature_size)

    def new_slots(self, slots: int, capacity: int) -> KVSlots | None:
        """The caches of `slots` sequences in one buffer per layer, for run_batch (None where this engine
        cannot batch: optimum's graphs, or a GPU; run_batch then runs one pass per sequence)."""
        spec = self.spec
        if capacity > spec.max_context:
            raise SpecdeployError(f"a cache of {capacity} positions exceeds the {spec.role}'s max context {spec.max_context}")
        if not self.shared_buffer or self._device != "cpu":
            return None
        pool = KVSlots(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.cache_dtype, capacity, slots,
                       feature_size=self.feature_size)
        if spec.role == "target" and slots > 1:  # verify passes (and an exact target's steps) share one run
            try:
                pool.packed_pass = PackedPass(self, pool, self.model_path, self.config)
            except SpecdeployError:  # a graph packed.py cannot split: each row runs its own passes, as exactly
                pool.packed_pass = None
        return pool

    def run_packed(self, token_lists: list[list[int]], caches: list, wanted: list[int] | None = None) -> list[np.ndarray]:
        """Each cache runs its tokens after its valid positions, as run(tokens, cache) would; returns each
        one's logits at its last `wanted` positions (None: all of them), [wanted, vocab], valid until the
        next pass.

        Caches that are rows of one KVSlots with a packed graph (packed.py) run in one pass, each row bit
        for bit as its own pass: lists of two or more tokens, or of any length on an engine whose single
        tokens never run alone (min_pass_tokens > 1: its packed graphs have a spare attention row). Anything
        else runs one pass per cache."""
        wanted = [len(tokens) for tokens in token_lists] if wanted is None else wanted
        pool = getattr(caches[0], "pool", None)
        packed = getattr(pool, "packed_pass", None)
        single = any(len(tokens) == 1 for tokens in token_lists)
        if (packed is not None and len(caches) > 1 and all(cache.pool is pool for cache in caches)
                and len({cache.slot_index for cache in caches}) == len(caches) and (packed.spare or not single)):
            slots = packed.slots(token_lists, caches)
            if slots is not None:
                self._stepping = None
                return packed.run(token_lists, caches, slots, wanted)
        return [np.array(self.run(tokens, cache)[len(tokens) - want :]) for tokens, cache, want in zip(token_lists, caches, wanted)]

    def run_batch(self, token_ids: list[int], caches: list, features: list[np.ndarray] | None = None) -> np.ndarray:
        """One token after each of several caches ([n] tokens, n caches); returns their logits [n, vocab].
        features: an eagle draft's input row [1, F] for each.

        Caches that are rows of one KVSlots run in one pass over its first rows (every row up to the
        highest one given): a row that is not given writes its pending slot (the position at its
        length, past its valid ones) and keeps its length. A pass of n rows computes each row as a
        one-token pass of that row alone would, bit for bit; so an engine whose single tokens run
        beside another (min_pass_tokens > 1: an exact target, see the class docstring)
        runs one pass per cache instead, as does anything else. The rows are valid until the next pass."""
        pool = getattr(caches[0], "pool", None)
        rows = 1 + max(cache.slot_index for cache in caches) if pool is not None else 0
        batched = (len(caches) > 1 and pool is not None and self.min_pass_tokens == 1
                   and all(cache.pool is pool for cache in caches)
                   and len({cache.slot_index for cache in caches}) == len(caches)
                   and all(cache.length < cache.capacity for cache in pool.caches[:rows]))
        rows_in = features if features is not None else [None] * len(caches)
        if len(caches) == 1:  # the pass alone, its logits as they are (a view the next pass may overwrite)
            return self.run([token_ids[0]], caches[0], rows_in[0])[-1:]
        if not batched:  # each row copied out as it comes: the next pass may overwrite a scratch row
            out = np.empty((len(caches), self.columns), dtype=np.float32)  # [n, vocab]
            for row, (token, cache, feature) in enumerate(zip(token_ids, caches, rows_in)):
                out[row] = self.run([token], cache, feature)[-1]
            return out
        if (features is None) != (self._feature_input is None):
            raise SpecdeployError(f"the {self.spec.role} graph {'needs' if features is None else 'takes no'} feature rows")
        ids, logits, logits_value = self._batch_buffers(rows)
        ids[:] = 0
        for token, cache in zip(token_ids, caches):
            ids[cache.slot_index, 0] = token
        pool.mask_next(rows, True)
        self._bind_batch(pool, rows, logits_value, caches, features)
        try:
            self._timed_run()
        finally:
            pool.mask_next(rows, False)  # each row's mask back to its valid length
        if self.features is not None:  # each given row's feature to its position
            pool.place_features([cache.slot_index for cache in caches], [cache.length for cache in caches])
        for token, cache in zip(token_ids, caches):
            cache.length += 1
            cache.tokens.append(int(token))
            cache.mask_to(cache.length)
        rows_out = logits[[cache.slot_index for cache in caches], 0]  # [n, vocab]
        return rows_out if self.float32_logits else rows_out.astype(np.float32)

    def _bind_batch(self, pool, rows: int, logits_value, caches: list, features: list | None) -> None:
        """Bind the first `rows` slots of pool for one batched pass (run_batch), and the feature rows."""
        buffers, mask = pool.prefix(rows)
        binding = self._binding
        for name, tensor in zip(self._past_names, buffers):
            binding.bind_ortvalue_input(name, tensor)
        for name, tensor in zip(self._present_names, buffers):
            binding.bind_ortvalue_output(name, tensor)
        binding.bind_ortvalue_input("attention_mask", mask)
        binding.bind_ortvalue_input("input_ids", self._batch_ids_values[rows])
        binding.bind_ortvalue_output("logits", logits_value)
        if self.features is not None:
            binding.bind_ortvalue_output(self.features, pool.feature_rows(rows))
        if features is not None:  # [rows, 1, F]: each given row's input at its slot, zeros elsewhere
            self._features_in = np.zeros((rows, 1, features[0].shape[-1]), dtype=np.float32)
            for cache, feature in zip(caches, features):
                self._features_in[cache.slot_index, 0] = feature[-1]
            binding.bind_cpu_input(self._feature_input, self._features_in)
        self._bound_cache = self._bound_ids = self._bound_logits = self._stepping = None

    def _batch_buffers(self, rows: int):
        """The ids [rows, 1] and logits [rows, 1, vocab] of a batched pass, with their OrtValues (made once per size)."""
        if rows not in self._batch_logits:
            if self._batch_ids.shape[0] < rows:
                self._batch_ids = np.zeros((max(rows, 2 * self._batch_ids.shape[0]), 1), dtype=np.int64)
                self._batch_ids_values = {}
                self._batch_logits = {}
            logits = np.empty((rows, 1, self.columns), dtype=self.logits_dtype)
            self._batch_logits[rows] = (logits, ort_value(logits, "cpu"))
        if rows not in self._batch_ids_values:
            self._batch_ids_values[rows] = ort_value(self._batch_ids[:rows], "cpu")
        logits, value = self._batch_logits[rows]
        return self._batch_ids[:rows, 0:1], logits, value

    def run(self, token_ids, cache: KVCache | SharedKVCache, features: np.ndarray | None = None) -> np.ndarray:
        """Run token_ids ([n], a list or an array) after the cache's tokens; returns their logits [n, vocab]
        (float32), and the cache holds them too: the pass of one cache.
        features [n, F]: an eagle draft's feature input, one row per token."""
        if (features is None) != (self._feature_input is None):
            raise SpecdeployError(f"the {self.spec.role} graph {'needs' if features is None else 'takes no'} feature rows")
        if features is not None:
            # float32 rows, kept by the engine until the next pass (the binding does not hold them)
            self._features_in = np.ascontiguousarray(features, dtype=np.float32).reshape(1, len(token_ids), -1)
            self._binding.bind_cpu_input(self._feature_input, self._features_in)
        try:
            count = len(token_ids)
            if count == 1 and cache is self._stepping and cache.length < cache.capacity:
                return self._step(token_ids[0], cache)
            if 0 < count < self.min_pass_tokens:
                return self._run_beside(token_ids, cache)
            logits = self._pass(token_ids, count, cache)
            cache.tokens += token_ids if type(token_ids) is list else np.asarray(token_ids).tolist()
            return logits
        except BaseException:  # an error or Ctrl-C mid-pass: tokens and positions back in step
            cache.truncate(min(len(cache.tokens), cache.length))
            raise

    def prefill(self, context: list[int], cache: KVCache | SharedKVCache, limit: int | None = None) -> bool:
        """Make cache hold context (reusing its prefix), or run at most `limit` more tokens of it; returns
        whether it holds all of it. Chunks of PREFILL_CHUNK tokens (a limit that is a multiple of it
        keeps the passes one call's): the graphs compute logits at every position, which nobody reads."""
        rest = cache.truncate_to_prefix(context)
        run = rest if limit is None else rest[:limit]
        for start in range(0, len(run), PREFILL_CHUNK):
            self.run(run[start : start + PREFILL_CHUNK], cache)
        return len(run) == len(rest)

    def logits_after(self, context: list[int], cache: KVCache | SharedKVCache) -> np.ndarray:
        """Logits [vocab] of the token that follows context (a long catch-up goes in prefill chunks)."""
        rest = cache.truncate_to_prefix(context, min_rest=1)
        while len(rest) > PREFILL_CHUNK:
            self.run(rest[:PREFILL_CHUNK], cache)
            rest = rest[PREFILL_CHUNK:]
        return self.run(rest, cache)[-1]

    def takes_short_path(self, cache: KVCache | SharedKVCache) -> bool:
        """Whether run([token], cache) takes the short path now (nothing rebound: _step), as a draft's loop should."""
        return cache is self._stepping and cache.length < cache.capacity

    def _step(self, token: int, cache: SharedKVCache) -> np.ndarray:
        """run([token]) right after a one-token scratch pass on the same cache, on the CPU: the binding
        holds everything but the token and one more 1 in the cache's mask, so nothing is bound. The
        draft's inner loop; each statement runs cold after a pass, so there are as few as can be."""
        self._first_id[0] = token
        total = cache.length + 1
        cache.mask_to(total)
        start = time.perf_counter()
        self._run(self._binding, None)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        cache.length = total
        cache.tokens.append(token)
        return self._scratch_rows[1]

    def _run_beside(self, token_ids, cache: KVCache | SharedKVCache) -> np.ndarray:
        """Fewer tokens than min_pass_tokens (one): run them beside others (see the class docstring)."""
        if cache.tokens:  # the previous token again in front
            previous = cache.tokens[-1]
            cache.truncate(cache.length - 1)
            return self.run([previous, *token_ids], cache)[1:]
        # nothing before it: a padding copy behind it, dropped again (causal: it changes nothing before)
        logits = self.run(list(token_ids) * 2, cache)[: len(token_ids)]
        cache.truncate(len(token_ids))
        return logits

    def _pass(self, token_ids, count: int, cache: KVCache | SharedKVCache) -> np.ndarray:
        """One session run of count tokens after the cache's valid positions; logits [count, vocab]."""
        total = cache.length + count
        if total > cache.capacity:
            raise SpecdeployError(f"context of {total} tokens exceeds the bundle's max context {cache.capacity}")
        if self._mask_ones.shape[1] < total:
            self._mask_ones = np.ones((1, cache.capacity), dtype=np.int64)  # slices stay contiguous
            self._positions = np.arange(cache.capacity, dtype=np.int64)[None]
            self._mask_values = [None] * (cache.capacity + 1)  # views of the old array go with it
        if cache.shared_buffer:
            logits = self._pass_shared(token_ids, count, total, cache)
        else:
            logits = self._pass_concat(token_ids, count, total, cache)
        return logits if self.float32_logits else logits.astype(np.float32)

    def _pass_concat(self, token_ids, count: int, total: int, cache: KVCache) -> np.ndarray:
        """optimum's graphs: the past goes in as the cache's tensors, the presents come back as new OrtValues
        that the cache keeps as they are (no copy into NumPy) and binds as the next pass's past."""
        binding = self._binding
        token_ids = np.ascontiguousarray(token_ids, dtype=np.int64).reshape(1, count)
        binding.bind_cpu_input("input_ids", token_ids)
        if self._has_mask:
            binding.bind_cpu_input("attention_mask", self._mask_ones[:, :total])
        if self._has_positions:
            binding.bind_cpu_input("position_ids", self._positions[:, cache.length : total])
        for name, tensor in zip(self._past_names, cache.past()):
            binding.bind_ortvalue_input(name, tensor)
        binding.bind_output("logits", "cpu")
        for name in self._present_names:
            binding.bind_output(name, self._device)
        self._bound_ids = self._bound_logits = self._stepping = None
        self._timed_run()
        outputs = binding.get_outputs()  # OrtValues, owned by us from here on
        cache.update([outputs[i] for i in range(1, len(outputs))])
        return outputs[0].numpy()[0]  # [n, vocab]; a view on the CPU

    def _pass_shared(self, token_ids, count: int, total: int, cache: SharedKVCache) -> np.ndarray:
        """The fused graphs: each present is bound to its past's buffer and written in place.

        The cache's buffers stay bound from one pass to the next, and so does its mask on the CPU
        (written in place; see SharedKVCache); the ids and the logits are rebound only when a pass's
        length differs from the last one's, each from an OrtValue made once. Every line here runs
        cold after a pass has streamed the weights through the caches, so it does as little as it can."""
        self._stepping = None  # until this pass has run (a failed one may leave other ids or logits bound)
        self._bind_ids(token_ids, count)
        if cache is not self._bound_cache:
            self._bind_cache(cache)
        if cache.mask_value is not None:  # on the CPU: the cache's full-width mask, written in place
            cache.mask_to(total)
        else:  # a GPU: one mask per valid length, as wide as the context (the layout the GPU kernels were written for)
            mask = self._mask_values[total]
            if mask is None:
                mask = self._mask_values[total] = ort_value(self._mask_ones[:, :total], "cpu")
            self._binding.bind_ortvalue_input("attention_mask", mask)
        logits = self._bind_logits(count)
        if self.features is not None:  # this pass's feature rows, at their positions in the cache's buffer
            rows = cache.features[None, cache.length : total]  # [1, count, F]
            self._binding.bind_ortvalue_output(self.features, ort_value(rows, "cpu"))
        self._timed_run()
        cache.length = total
        if (count == 1 and self.scratch_logits and self.float32_logits and cache.mask is not None
                and self.features is None and self._feature_input is None):
            self._stepping = cache  # the binding is as _step needs it: only the token and the mask change
        return logits

    def _bind_ids(self, token_ids, count: int) -> None:
        if count > BOUND_IDS:  # the binding does not keep the array alive: the engine does, until the next pass
            self._long_ids = np.ascontiguousarray(token_ids, dtype=np.int64).reshape(1, count)
            self._binding.bind_cpu_input("input_ids", self._long_ids)
            self._bound_ids = None
            return
        if count == 1:
            self._first_id[0] = token_ids[0]
        else:
            self._ids[0, :count] = token_ids
        ids = self._ids_values[count]
        if ids is not self._bound_ids:  # a binding stays until rebound: runs of equal length skip it
            self._binding.bind_ortvalue_input("input_ids", ids)
            self._bound_ids = ids

    def _bind_cache(self, cache: SharedKVCache) -> None:
        """Each layer's buffer as its past and its present; the CPU's mask too (both stay bound)."""
        binding = self._binding
        for name, tensor in zip(self._past_names, cache.tensors):
            binding.bind_ortvalue_input(name, tensor)
        for name, tensor in zip(self._present_names, cache.tensors):
            binding.bind_ortvalue_output(name, tensor)
        if cache.mask_value is not None:
            binding.bind_ortvalue_input("attention_mask", cache.mask_value)
        self._bound_cache = cache

    def _bind_logits(self, count: int) -> np.ndarray:
        """Where this pass's logits land: the scratch buffer's first count rows, or a fresh array."""
        if self.scratch_logits and count <= SCRATCH_ROWS:
            if self._scratch is None:
                self._make_scratch()
            output = self._scratch_values[count]
            if output is not self._bound_logits:
                self._binding.bind_ortvalue_output("logits", output)
                self._bound_logits = output
            return self._scratch_rows[count]
        # A fresh array: the caller may keep it. The engine holds it, since the binding points into
        # its memory, until the next pass rebinds the output.
        self._logits = fresh = np.empty((1, count, self.columns), dtype=self.logits_dtype)
        self._binding.bind_ortvalue_output("logits", ort_value(fresh, "cpu"))
        self._bound_logits = None
        return fresh[0]

    def _make_scratch(self) -> None:
        """One [1, SCRATCH_ROWS, vocab] buffer; a pass of n tokens writes its first n rows (contiguous)."""
        self._scratch = np.empty((1, SCRATCH_ROWS, self.columns), dtype=self.logits_dtype)
        self._scratch_values = [None] + [ort_value(self._scratch[:, :n], "cpu") for n in range(1, SCRATCH_ROWS + 1)]
        self._scratch_rows = [None] + [self._scratch[0, :n] for n in range(1, SCRATCH_ROWS + 1)]

    def _timed_run(self) -> None:  # (_step has its own copy of these lines: one call fewer on the hot path)
        start = time.perf_counter()
        self._run(self._binding, None)
        self.seconds += time.perf_counter() - start
        self.calls += 1
