"""ONNX Runtime sessions for bundle models: the options, the execution providers, the thread pools.

`open_session` makes a bundle model's InferenceSession (OrtEngine calls it), after checking that
the engine can run it; `open_packed_session` makes one of its packed graphs' (packed.py), with the same
options. No other module creates a session.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..bundle import ModelSpec, check_graph_io
from ..errors import SpecdeployError, install_hint

DEVICES = ("cpu", "cuda", "tensorrt")
KV_LAYOUT = "batch,kv_heads,sequence,head_dim"  # the only past/present layout the caches bind
PREFILL_CHUNK = 64  # tokens per prefill pass (see OrtEngine.prefill); TensorRT's profiles cover it


@dataclass(frozen=True)
class SessionConfig:
    device: str = "cpu"  # cpu | cuda | tensorrt
    intra_op_threads: int = 0  # 0: ONNX Runtime picks (one per physical core)
    # Per-session pools only (shared_threads=False): two sessions that spin-wait fight over the same
    # cores when draft and target alternate. The shared pool always spins (ONNX Runtime's Python
    # API sizes it and nothing else), so there it changes nothing.
    allow_spinning: bool = False
    graph_optimization: str = "all"  # disable | basic | extended | all
    # One process-wide ONNX Runtime thread pool for all sessions (sized by the first one), spinning:
    # draft and target alternate, and two per-session pools only wake and park threads against each
    # other. Process-wide: once it exists, ONNX Runtime refuses sessions with their own pools, so
    # it is off for engines built directly and on for `specdeploy.load` (see there).
    shared_threads: bool = False
    trt_cache_dir: str | None = None  # TensorRT engines are built once and cached here
    # ONNX Runtime's CPU arena keeps freed activation memory for reuse; the fused graphs run as
    # fast without it, with a lower peak.
    memory_arena: bool = False
    # ONNX Runtime repacks MatMul weights into its kernels' layout at load: faster passes, a second
    # copy of the weights in memory. A session that runs a few passes (export's parity check) skips it.
    prepack_weights: bool = True
    # The weight files read into memory at load (model_weights), not mapped: a bundle file changed in
    # place (truncated, copied over) then cannot fault a pass (SIGBUS on a mapped page past the end).
    # Costs up to the files' size in RAM over mapping them; a server turns it on.
    weights_in_memory: bool = False


def trt_profiles(spec: ModelSpec, max_context: int, max_new: int = 33) -> dict[str, str]:
    """Explicit TensorRT optimization profiles (min/opt/max shapes) for every dynamic input.

    Format from the ONNX Runtime TensorRT EP docs: "name:1x4x0x64,name2:...". Inputs run 1..max_new
    tokens per pass (k + 1 <= 33) or a prefill chunk, on a past of 0..max_context - 1 positions.
    TensorRT needs min <= opt <= max on every axis, and each of the three points must be shapes the
    graph runs: a concatenating graph's mask is past + tokens long at each (TensorRT checks the
    graph's shape rules there). A shared buffer is always max_context long, its mask independent of it.
    An eagle draft's features [1, tokens, F] follow the tokens."""
    longest_pass = min(max(max_new, PREFILL_CHUNK), max_context)
    tokens = (1, min(5, longest_pass), longest_pass)
    if spec.kv_cache.shared_buffer:
        past = (max_context,) * 3
        mask = (1, min(512, max_context), max_context)
    else:
        past = (0, max(0, min(512, max_context - tokens[1])), max_context - 1)
        mask = tuple(p + t for p, t in zip(past, tokens))
    shapes = {"min": [], "opt": [], "max": []}
    for tensor in spec.inputs:
        if tensor.name in ("input_ids", "position_ids"):
            dims = [(1, n) for n in tokens]
        elif tensor.name == "attention_mask":
            dims = [(1, n) for n in mask]
        elif len(tensor.shape) == 3:  # features [1, tokens, F]
            dims = [(1, n, tensor.shape[2]) for n in tokens]
        else:  # past keys and values [1, kv_heads, past, head_dim]
            dims = [(1, tensor.shape[1], n, tensor.shape[3]) for n in past]
        for key, value in zip(shapes, dims):
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


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise SpecdeployError(f"unknown device '{device}' (choose from {', '.join(DEVICES)})")


def check_exact(spec: ModelSpec) -> None:
    """Refuse exact decoding (OrtEngine's `exact`) of a target whose graph concatenates its KV cache: running
    the previous token again would copy the whole cache each step."""
    if spec.role == "target" and not spec.kv_cache.shared_buffer:
        raise SpecdeployError("exact decoding needs a target graph whose KV cache is written in place (a fused "
                              "graph: export --graph fused); this bundle's target concatenates its cache")


def providers_for(config: SessionConfig, spec: ModelSpec | None = None) -> list:
    import onnxruntime as ort

    check_device(config.device)
    available = set(ort.get_available_providers())
    if config.device == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in available:
        raise SpecdeployError(
            f"device '{config.device}' needs onnxruntime-gpu ({install_hint('gpu')}); this onnxruntime has "
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
    import onnxruntime as ort

    if not _GLOBAL_POOL:
        ort.set_global_thread_pool_sizes(threads, 1)
        _GLOBAL_POOL.append(threads)


LEVELS = ("disable", "basic", "extended", "all")


def check_session_config(config: SessionConfig) -> None:
    """Each field of the type and range it is declared with, and a pool ONNX Runtime can give (SpecdeployError)."""
    if not isinstance(config, SessionConfig):
        raise SpecdeployError(f"session must be a SessionConfig (got {type(config).__name__})")
    for name in ("allow_spinning", "shared_threads", "memory_arena", "prepack_weights", "weights_in_memory"):
        if not isinstance(getattr(config, name), bool):
            raise SpecdeployError(f"SessionConfig.{name} must be True or False (got {getattr(config, name)!r})")
    threads = config.intra_op_threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise SpecdeployError(f"SessionConfig.intra_op_threads must be an integer >= 0 (got {threads!r})")
    if config.graph_optimization not in LEVELS:
        raise SpecdeployError(f"SessionConfig.graph_optimization must be one of {', '.join(LEVELS)} "
                              f"(got {config.graph_optimization!r})")
    if not config.shared_threads and global_pool_active():
        raise SpecdeployError("this process already runs ONNX Runtime on its shared thread pool (an earlier "
                              "specdeploy.load), and ONNX Runtime then opens no session with a pool of its own: "
                              "load with shared_threads=True, or set SPECDEPLOY_SHARED_THREADS=0 before the first load")


def session_options(config: SessionConfig, spec: ModelSpec | None = None):
    import onnxruntime as ort

    check_session_config(config)
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
    if not config.shared_threads:  # the shared pool ignores per-session thread settings
        options.intra_op_num_threads = config.intra_op_threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.allow_spinning else "0")
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.enable_cpu_mem_arena = config.memory_arena
    if not config.prepack_weights:
        options.add_session_config_entry("session.disable_prepacking", "1")
    # ONNX Runtime keeps one memory pattern per distinct set of input shapes, for as long as the
    # session lives. A concatenating KV cache (a new past length every pass), or a GPU pass's mask
    # as wide as the context, makes a new set nearly every pass: the patterns then grow without
    # bound (resident memory then grows with every token). Only a CPU shared-buffer graph, whose shapes
    # are the buffers' plus 1..PREFILL_CHUNK ids, keeps them (its packed graphs do not: packed.py).
    options.enable_mem_pattern = spec is not None and spec.kv_cache.shared_buffer and config.device == "cpu"

    options.log_severity_level = 4  # fatal only: a failed run is reported as one line, by the caller
    return options


def model_weights(model_path: Path) -> dict:
    """The external data files of the model at model_path, read into memory: {location the graph names: bytes [size]}."""
    import numpy as np
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    names = sorted({entry.value for tensor in graph.initializer for entry in tensor.external_data if entry.key == "location"})
    try:
        return {name: np.fromfile(model_path.parent / name, dtype=np.uint8) for name in names}
    except OSError as exc:
        raise SpecdeployError(f"cannot read the weights of {model_path}: {exc}") from None


def _use_weights(options, weights: dict | None) -> None:
    """Give the session its weight files from memory (model_weights), used where they lie: the caller keeps
    them alive as long as the session."""
    if weights:
        options.add_external_initializers_from_files_in_memory(list(weights), list(weights.values()),
                                                               [buffer.size for buffer in weights.values()])
        options.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")


def open_session(model_path: Path, spec: ModelSpec, config: SessionConfig, weights: dict | None = None):
    """The ONNX Runtime session for spec, once it is clear the engine can run it. weights: its weight
    files in memory (model_weights; SessionConfig.weights_in_memory), kept alive by the caller."""
    import onnxruntime as ort

    if spec.kv_cache.layout != KV_LAYOUT:
        raise SpecdeployError(f"the {spec.role}'s KV cache layout '{spec.kv_cache.layout}' is not one this runtime "
                              f"binds ({KV_LAYOUT})")
    providers = providers_for(config, spec)  # validates the device first
    if config.device != "cpu" and spec.graph == "fused" and spec.dtype == "fp32":
        # ONNX Runtime's CUDA GroupQueryAttention runs fp16/bf16 only: an fp32 fused graph would
        # send every attention node, and the KV buffers with it, back to the CPU each pass.
        raise SpecdeployError(
            f"the {spec.role} is an fp32 fused graph, which ONNX Runtime's GPU kernels do not run: "
            "export with --dtype fp16 (or --graph optimum) for --device cuda/tensorrt"
        )
    options = session_options(config, spec)  # its own errors name the setting, not the model
    _use_weights(options, weights)
    try:
        session = ort.InferenceSession(str(model_path), options, providers=providers)
    except Exception as exc:
        raise SpecdeployError(f"ONNX Runtime cannot load {model_path}: {str(exc).splitlines()[0]}") from None
    wanted = providers[0] if isinstance(providers[0], str) else providers[0][0]
    if session.get_providers()[0] != wanted:  # onnxruntime-gpu falls back, with a warning only, when its libraries fail
        raise SpecdeployError(f"--device {config.device}: ONNX Runtime started the {spec.role} on "
                              f"{session.get_providers()[0]}, not {wanted} (its CUDA, cuDNN or TensorRT libraries "
                              "did not load: see ONNX Runtime's warning above)")
    check_graph_io(spec, session.get_inputs(), session.get_outputs())
    check_graph(model_path, spec)
    return session


def check_graph(model_path: Path, spec: ModelSpec) -> None:
    """What the manifest says of the graph ONNX Runtime loaded, read from the graph itself (without weights).
    Skipped where the onnx package is not installed: a single-row runtime runs without it."""
    try:
        import onnx
    except ImportError:
        return
    try:
        graph = onnx.load(str(model_path), load_external_data=False).graph
    except Exception as exc:  # ONNX Runtime has just loaded it; a failure here is the file changing under us
        raise SpecdeployError(f"cannot read {model_path}: {exc}") from None
    check_rotary_positions(graph, spec)
    listed = {entry.path for entry in spec.files}
    folder = PurePosixPath(spec.onnx_path).parent
    for tensor in graph.initializer:  # a weights file the manifest leaves out would never be size- or hash-checked
        location = next((e.value for e in tensor.external_data if e.key == "location"), None)
        if location is not None and str(folder / location) not in listed:
            raise SpecdeployError(f"the {spec.role} graph reads its weights from {folder / location}, "
                                  "which the manifest does not list")


def check_rotary_positions(graph, spec: ModelSpec) -> None:
    """A fused graph's rotary tables (cos_cache, one row per position) must reach the manifest's max_context:
    past them ONNX Runtime's GroupQueryAttention refuses every pass."""
    if spec.graph != "fused":
        return
    rows = [t.dims[0] for t in graph.initializer if t.name.startswith("cos_cache") and t.dims]
    if rows and min(rows) < spec.max_context:
        raise SpecdeployError(f"the {spec.role} graph's rotary tables hold {min(rows)} positions, fewer than the "
                              f"manifest's max_context {spec.max_context}: this manifest does not belong to these graphs")


def open_packed_session(graph: bytes, model_path: Path, spec: ModelSpec, config: SessionConfig, weights: dict | None = None):
    """The CPU session of a packed graph (packed.py) of the model at model_path, whose weights stay in the
    bundle's data file beside it (or come from memory: open_session's weights)."""
    import onnxruntime as ort

    options = session_options(config, spec)
    # Passes take many lengths (packed rows, kept positions): a memory pattern per set of shapes would
    # grow with them (SmolLM2 int8: about 2.4 MiB per 100 sets), for no speed this host could tell.
    options.enable_mem_pattern = False
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(model_path.parent))
    _use_weights(options, weights)
    try:
        return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise SpecdeployError(f"ONNX Runtime cannot load the packed graph of {model_path}: "
                              f"{str(exc).splitlines()[0]}") from None
