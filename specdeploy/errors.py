"""The one exception type a user sees: its message is the whole one-line explanation."""

from __future__ import annotations

import traceback


class SpecdeployError(Exception):
    """Bad input or an unusable artifact; the CLI prints the message and exits non-zero."""


def describe_unexpected(exc: BaseException) -> str:
    """One line for an exception that is not a SpecdeployError (the CLI prints it after 'error: ').

    An ONNX Runtime failure inside a pass names the model and the pass, read from the engine frame
    the exception passed through (its `self.spec`, the tokens in the pass and the cached length);
    anything else is its type and first line."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if not type(exc).__module__.startswith("onnxruntime"):
        return f"{type(exc).__name__}: {first}"
    engine, pass_kind = None, "pass"
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "prefill":
            pass_kind = "prefill pass"
        if hasattr(owner, "spec") and hasattr(owner, "session"):
            engine = frame.f_locals
    if engine is None:
        return f"ONNX Runtime failed: {first}"
    spec = engine["self"].spec
    count = engine.get("count", 1 if "token" in engine else None)
    cache = engine.get("cache")
    if pass_kind == "pass" and count is not None:
        pass_kind = "single-token step" if count == 1 else ("verify pass" if spec.role == "target" else "draft pass")
    where = f"{count} tokens after {getattr(cache, 'length', '?')} cached" if count is not None else "a step"
    return f"ONNX Runtime failed in the {spec.role} model's {pass_kind} ({where}; {spec.onnx_path}): {first}"
