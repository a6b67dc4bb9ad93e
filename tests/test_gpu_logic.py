"""GPU paths checked on the CPU: the decisions and strings the CUDA and TensorRT execution providers get.

No GPU is needed: ONNX Runtime's provider list is faked where a test needs a GPU build, and TensorRT's
optimization profiles are checked against what the graphs themselves accept on the CPU provider."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from specdeploy.bundle import TensorSpec, load_manifest
from specdeploy.defaults import SHIPPED_BUNDLE
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.session import SessionConfig, open_session, trt_profiles


def _fake_gpu_build(monkeypatch, *providers: str) -> None:
    """This onnxruntime claims GPU providers, as onnxruntime-gpu does whether or not its CUDA (or
    TensorRT) libraries load; sessions then get whichever providers really start."""
    import onnxruntime as ort

    real = ort.get_available_providers
    monkeypatch.setattr(ort, "get_available_providers", lambda: [*providers, *real()])


@pytest.mark.parametrize("device, providers", [("cuda", ("CUDAExecutionProvider",)),
                                               ("tensorrt", ("TensorrtExecutionProvider", "CUDAExecutionProvider"))])
def test_a_gpu_session_that_runs_on_another_provider_is_refused(bundles, monkeypatch, device, providers):
    """onnxruntime-gpu lists CUDAExecutionProvider (and TensorRT's) even when its CUDA, cuDNN or TensorRT
    libraries fail to load; the session then starts on the next provider with a warning only. The engine
    would then allocate its caches on a device the session does not run on (a confusing ORT error), or run
    --device tensorrt on plain CUDA without a word. The session's own providers must be the ones asked for."""
    _fake_gpu_build(monkeypatch, *providers)
    bundle = bundles("gpt2")  # optimum's graphs: allowed on both GPU devices at fp32
    spec = load_manifest(bundle).target
    with pytest.raises(SpecdeployError, match=f"(?i){device}"):
        session = open_session(bundle / spec.onnx_path, spec, SessionConfig(device=device))
        print("the session runs on", session.get_providers())


def _profile_points(spec) -> dict[str, dict[str, tuple[int, ...]]]:
    profiles = trt_profiles(spec, spec.max_context)
    points = {}
    for key in ("min", "opt", "max"):
        shapes = {}
        for item in profiles[f"trt_profile_{key}_shapes"].split(","):
            name, dims = item.rsplit(":", 1)
            shapes[name] = tuple(int(d) for d in dims.split("x"))
        points[key] = shapes
    return points


@pytest.mark.parametrize("arch, role", [("gpt2", "target"), ("gpt2", "draft"), ("llama", "target"), ("llama", "draft")])
def test_every_tensorrt_profile_point_is_a_shape_set_the_graph_runs(bundles, arch, role):
    """TensorRT builds its engine at each profile's min, opt and max shapes and refuses a profile whose
    shapes violate the network's own constraints ("kOPT values for profile 0 violate shape constraints").
    In optimum's graphs the mask is as long as past + tokens: the opt point (5 tokens after 512 positions,
    a mask of 512) and the max point (64 tokens after max_context - 1, a mask of max_context) are shapes
    no pass has, and the graph cannot compute them."""
    import onnxruntime as ort

    bundle = bundles(arch)
    spec = getattr(load_manifest(bundle), role)
    session = ort.InferenceSession(str(bundle / spec.onnx_path), providers=["CPUExecutionProvider"])
    dtypes = {tensor.name: np.dtype(tensor.dtype) for tensor in spec.inputs}
    for key, shapes in _profile_points(spec).items():
        feeds = {name: (np.ones if name == "attention_mask" else np.zeros)(shape, dtype=dtypes[name])
                 for name, shape in shapes.items()}
        try:
            session.run(None, feeds)
        except Exception as exc:  # noqa: BLE001 - the point is what fails
            summary = {name: shape for name, shape in shapes.items() if not name.startswith("past") or name.endswith(".0.key")}
            pytest.fail(f"{arch} {role} ({spec.graph}): the {key} profile point {summary} does not run: "
                        f"{str(exc).splitlines()[0][:160]}")


def test_tensorrt_profiles_cover_an_eagle_drafts_feature_input():
    """An eagle draft has a [batch, tokens, F] feature input beside the ids, mask and caches: the profiles
    must give it its own shapes (trt_profiles reads every other input as a 4-D KV tensor: IndexError)."""
    spec = load_manifest(SHIPPED_BUNDLE).draft
    feature = TensorSpec(name="hidden_states", dtype="float32", shape=("batch_size", "sequence_length", 320))
    eagle_like = dataclasses.replace(spec, inputs=(spec.inputs[0], feature, *spec.inputs[1:]))
    points = _profile_points(eagle_like)
    for key, shapes in points.items():
        assert shapes["hidden_states"][0] == 1 and shapes["hidden_states"][2] == 320
        assert shapes["hidden_states"][1] == shapes["input_ids"][1]


def test_load_with_a_session_config_does_not_drop_the_device(monkeypatch):
    """load(bundle, device="cuda", session=SessionConfig(...)) (the docstring's way to opt out of the shared
    pool) ran on the CPU without a word: the device argument was ignored whenever a session was given.
    On this CPU-only machine the GPU device must be refused (or the conflict named), not replaced by the CPU."""
    from specdeploy.runtime import load

    with pytest.raises(SpecdeployError):
        generator = load(SHIPPED_BUNDLE, device="cuda", session=SessionConfig(shared_threads=False), warm_up=False)
        print("loaded on", generator.target.config.device)


def test_a_ray_replica_on_tensorrt_keeps_the_bundles_engine_cache(monkeypatch):
    """`specdeploy load` caches TensorRT engines in BUNDLE/trt_cache; a Ray Serve replica passes its own
    SessionConfig, and its sessions then got no cache: every replica start rebuilt every engine."""
    ray_module = pytest.importorskip("specdeploy.ray")
    from specdeploy.runtime import loader
    from specdeploy.serve import ServeConfig

    class Stop(Exception):
        pass

    seen = []

    def engine(model_path, spec, config, **kwargs):
        seen.append(config)
        raise Stop

    monkeypatch.setattr(loader, "OrtEngine", engine)
    monkeypatch.setattr(ray_module.serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="replica-1")))
    server = ray_module.SpecdeployServer
    init = next(klass.__dict__["__init__"] for klass in server.__mro__
                if "__init__" in klass.__dict__ and inspect.getsourcefile(klass.__dict__["__init__"]).endswith("specdeploy/ray.py"))
    config = ServeConfig(bundle=str(SHIPPED_BUNDLE), device="tensorrt")
    with pytest.raises(Stop):
        asyncio.run(init(object.__new__(server), config, 1, None))
    assert seen and seen[0].device == "tensorrt"
    assert seen[0].trt_cache_dir is not None and Path(seen[0].trt_cache_dir).resolve() == (SHIPPED_BUNDLE / "trt_cache").resolve()


def test_a_distill_checkpoint_from_another_device_resumes(checkpoints, tmp_path):
    """`--device` is not one of the options a resumed run must repeat, but the checkpoint holds the noise
    generator's state in its device's format (16 bytes on CUDA, 5,056 on the CPU): resuming a CUDA run on the
    CPU (or the reverse) failed in torch.Generator.set_state with a RuntimeError, even for a model draft,
    which never draws noise."""
    import torch

    from specdeploy.distill import DistillConfig, distill

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = tmp_path / "code.py"
    text.write_text((stdlib / "textwrap.py").read_text() + (stdlib / "bisect.py").read_text())
    out = tmp_path / "run"
    tiny = dict(target=str(checkpoints("llama")["target"]), out=str(out), data=(str(text),), layers=1, seq_len=32,
                batch_size=2, heldout_tokens=64, generate_tokens=32, eval_every=1000, minutes=None, threads=1)
    distill(DistillConfig(steps=2, **tiny))
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    state["noise_rng"] = torch.zeros(16, dtype=torch.uint8)  # torch.Generator("cuda").get_state(): seed and offset
    torch.save(state, out / "checkpoint.pt")
    try:
        result = distill(DistillConfig(steps=3, resume=True, **tiny))
    except SpecdeployError as exc:  # refused in one line that says why is acceptable too
        assert "device" in str(exc)
    else:
        assert result.step == 3
