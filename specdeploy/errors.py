"""The one exception type a user sees: its message is the whole one-line explanation."""

from __future__ import annotations

import traceback

EXIT_ERROR, EXIT_INTERRUPTED = 2, 130  # the CLI's exit statuses: bad input or a failure, and a Ctrl-C


def install_hint(extra: str) -> str:
    """How to add an optional extra, as the README says: from the clone (the package is on no index)."""
    return f"pip install '.[{extra}]' in the specdeploy clone"


class SpecdeployError(Exception):
    """Bad input or an unusable artifact; the CLI prints the message and exits non-zero."""


def describe_unexpected(exc: BaseException) -> str:
    """One line for an exception that is not a SpecdeployError (the CLI prints it after 'error: ').

    A failure raised by ONNX Runtime inside an engine's pass (its run raises a plain RuntimeError,
    so it is told by where it was raised: the innermost frame outside ONNX Runtime's own Python
    is an engine method) names the
    model and the pass, from that frame's `self.spec`, tokens in the pass and cached length;
    anything else is its type and first line."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    ours = [frame for frame in frames if not frame.f_globals.get("__name__", "").startswith("onnxruntime")]
    innermost = ours[-1].f_locals if ours else {}
    owner = innermost.get("self")
    if not (hasattr(owner, "spec") and hasattr(owner, "session")):
        if type(exc).__module__.startswith("onnxruntime"):
            return f"ONNX Runtime failed: {first}"
        return f"{type(exc).__name__}: {first}"
    spec = owner.spec
    # The pass's own frame (the engine method that holds its token count and cache), innermost first.
    engine_frames = [frame.f_locals for frame in reversed(frames) if frame.f_locals.get("self") is owner]
    pass_frame = next((f for f in engine_frames if "cache" in f and ("count" in f or "token" in f)), innermost)
    count = pass_frame.get("count", 1 if "token" in pass_frame else None)
    cache = pass_frame.get("cache")
    if any("prefill" in frame.f_code.co_name for frame in frames):  # prefill, the runner's _prefill_alone and _prefill_apart
        pass_kind = "prefill pass"
    elif count == 1:
        pass_kind = "single-token step"
    else:
        pass_kind = "verify pass" if spec.role == "target" else "draft pass"
    where = f"{count} tokens after {getattr(cache, 'length', '?')} cached; " if count is not None else ""
    return f"ONNX Runtime failed in the {spec.role} model's {pass_kind} ({where}{spec.onnx_path}): {first}"

