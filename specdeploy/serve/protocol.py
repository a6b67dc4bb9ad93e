"""The OpenAI request bodies: validated and turned into a prompt plus GenerationConfig keyword arguments.

Parameters OpenAI defines and this server cannot honour (logit_bias, echo, suffix, tools, best_of other than n...)
are refused with a 400 naming them, never ignored; unknown fields are refused as OpenAI refuses them.
Sampling extensions (`top_k`, `min_p`, `repetition_penalty`, `num_draft_tokens`, `speculative`,
`draft_confidence`) pass through to the generator by name; a name the runtime's GenerationConfig
does not have is a 400. `ignore_eos` (vLLM's extension) generates max_tokens whatever EOS or the
end of turn says (GenerationConfig.ignore_eos). `n` asks for n choices of one prompt: n sequences,
choice i seeded `seed + i` (mod 2**64) when the request gives a seed, each its own fresh seed
otherwise. Completions' `logprobs` (0..5) and chat's `logprobs` + `top_logprobs` (0..20) become
GenerationConfig.logprobs. A constraint on the output, on both endpoints (as vLLM takes it): OpenAI's
`response_format` (`json_object`; `json_schema` with its `schema`, `strict` or not: the output always
matches), vLLM's `guided_json`, `guided_regex` and `guided_grammar`, or llama.cpp's `json_schema` and
`grammar` (GBNF; Lark too); one per request. The values are checked here, once, by GenerationConfig's own
validation: the server passes on only options that passed it.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

from ..errors import SpecdeployError
from ..runtime import GenerationConfig
from ..runtime.config import MAX_LOGPROBS, SEED_LIMIT

# name -> the JSON type its value must have (float takes integers too)
EXTENSIONS = {"top_k": int, "min_p": float, "repetition_penalty": float, "num_draft_tokens": int, "speculative": bool,
              "draft_confidence": float}
# The constraint's request fields: name -> (GenerationConfig's field, the JSON types its value may have)
CONSTRAINTS = {"guided_json": ("json_schema", (dict, str)), "json_schema": ("json_schema", (dict, str)),
               "guided_regex": ("regex", (str,)), "guided_grammar": ("grammar", (str,)), "grammar": ("grammar", (str,))}
COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user",
          "ignore_eos", "n", "logprobs", "presence_penalty", "frequency_penalty", "response_format", *CONSTRAINTS,
          *EXTENSIONS)
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")  # the ones read; others are ignored
# name -> the values that mean "not used"; anything else is refused.
UNSUPPORTED_COMMON = {"logit_bias": (None, {})}
UNSUPPORTED = {
    "completion": {**UNSUPPORTED_COMMON, "echo": (None, False), "suffix": (None, "")},
    "chat": {**UNSUPPORTED_COMMON, "tools": (None, []), "tool_choice": (None, "none"),
             "parallel_tool_calls": (None, True, False), "functions": (None, []), "function_call": (None, "none")},
}
ACCEPTED = {"completion": frozenset(COMMON + ("prompt", "best_of") + tuple(UNSUPPORTED["completion"])),
            "chat": frozenset(COMMON + ("messages", "max_completion_tokens", "top_logprobs")
                              + tuple(UNSUPPORTED["chat"]))}
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat defaults to the rest of the context
MAX_STOP_STRINGS = 16
# Each token checks whether the text ends in a prefix of each stop string, in time growing with the square of
# its length: past this, one request's stop strings would slow every sequence the worker steps.
MAX_STOP_CHARS = 1000
MAX_CHOICES = 16  # n: sequences one request may run (each takes a KV slot while it decodes)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's legacy completions allow 0..5 alternatives
MAX_TOP_LOGPROBS = MAX_LOGPROBS  # chat's top_logprobs: 0..20


class ApiError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | list[int] | list[dict]  # text or token ids; chat: the messages, rendered once the model is known
    options: dict  # GenerationConfig keyword arguments (ignore_eos among them), validated; choice 0's seed
    seeds: tuple[int, ...]  # one per choice (n of them)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk carrying usage
    continuous_usage: bool  # stream_options.continuous_usage_stats (with include_usage): usage on every chunk
    chat: bool
    constraint_param: str | None = None  # the request field that carried a constraint (a refused one's 400 names it)


def parse_request(body, kind: str, num_draft_tokens: int, max_context: int) -> GenerationRequest:
    """Validate a /v1/completions (kind "completion") or /v1/chat/completions ("chat") body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - ACCEPTED[kind])
    if unknown:
        raise ApiError(400, f"unrecognized request argument: {unknown[0]}", param=unknown[0])
    for name, unused in UNSUPPORTED[kind].items():
        if name in body and body[name] not in unused:
            raise ApiError(400, f"{name}={body[name]!r} is not supported by this server", param=name)
    _check_type(body, "model", str)
    _check_type(body, "user", str)  # accepted, not used; OpenAI's is a string
    stream = _check_type(body, "stream", bool) or False
    stream_options = _check_type(body, "stream_options", dict) or {}
    if stream_options and not stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
    include_usage, continuous_usage = (
        _check_type(stream_options, name, bool, f"stream_options.{name}") or False for name in STREAM_OPTIONS)
    prompt = _messages(body) if kind == "chat" else _prompt(body)
    n = _choices(body, kind)
    constraint = _constraint(body)
    options = _checked({**_options(body, kind, num_draft_tokens, max_context), **dict(constraint.values())})
    return GenerationRequest(prompt=prompt, options=options, seeds=_seeds(body, options["seed"], n), stream=stream,
                             include_usage=include_usage, continuous_usage=include_usage and continuous_usage,
                             chat=kind == "chat", constraint_param=next(iter(constraint), None))


def _choices(body: dict, kind: str) -> int:
    n = _check_type(body, "n", int)
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n must be an integer in 1..{MAX_CHOICES} (got {n})", param="n")
    best_of = _check_type(body, "best_of", int) if kind == "completion" else None
    if best_of is not None and best_of != n:  # best_of > n ranks by likelihood: not done here
        raise ApiError(400, f"best_of={best_of} is not supported by this server (only best_of = n)", param="best_of")
    return n


def _seeds(body: dict, seed: int, n: int) -> tuple[int, ...]:
    """Each choice's seed: seed + i when the request gave one, else a fresh one each (the first is `seed`)."""
    if body.get("seed") is not None:
        return tuple((seed + i) % SEED_LIMIT for i in range(n))
    return (seed,) + tuple(secrets.randbelow(SEED_LIMIT) for _ in range(n - 1))


def _logprobs(body: dict, kind: str) -> int | None:
    """GenerationConfig.logprobs: the alternatives asked for at each position (None: no logprobs)."""
    if kind == "completion":
        count = _check_type(body, "logprobs", int)
        if count is not None and not 0 <= count <= MAX_COMPLETION_LOGPROBS:
            raise ApiError(400, f"logprobs must be an integer in 0..{MAX_COMPLETION_LOGPROBS} (got {count})",
                           param="logprobs")
        return count
    wanted = _check_type(body, "logprobs", bool)
    top = _check_type(body, "top_logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS} (got {top})",
                       param="top_logprobs")
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    return (top or 0) if wanted else None


def _options(body: dict, kind: str, num_draft_tokens: int, max_context: int) -> dict:
    limits = {}
    for name in ("max_tokens", "max_completion_tokens") if kind == "chat" else ("max_tokens",):  # each checked
        limits[name] = _check_type(body, name, int)
        if limits[name] is not None and limits[name] < 0:
            raise ApiError(400, f"{name} must be >= 0 (got {limits[name]})", param=name)
    max_tokens = next((v for v in (limits.get("max_completion_tokens"), limits["max_tokens"]) if v is not None),
                      None)  # chat's newer name wins
    if max_tokens is None:  # chat's default runs to the context's end, where the loop stops
        max_tokens = DEFAULT_MAX_TOKENS if kind == "completion" else max_context
    seed = _check_type(body, "seed", int)
    options = {
        "max_new_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0),  # OpenAI's default: sampling, not greedy
        "top_p": _number(body, "top_p", 1.0),
        "seed": seed if seed is not None else secrets.randbelow(SEED_LIMIT),  # a fresh seed per request, as OpenAI does
        "stop": _stop(body),
        "num_draft_tokens": num_draft_tokens,
        "ignore_eos": _check_type(body, "ignore_eos", bool) or False,
        "logprobs": _logprobs(body, kind),
        "presence_penalty": _number(body, "presence_penalty", 0.0),  # OpenAI's, over the generated tokens
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
    }
    fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    for name, kind in EXTENSIONS.items():
        if body.get(name) is None:
            continue
        if name not in fields:
            raise ApiError(400, f"{name} is not supported by this server's runtime", param=name)
        options[name] = _number(body, name, 0.0) if kind is float else _check_type(body, name, kind)
    return options


def _constraint(body: dict) -> dict:
    """{the request field: (GenerationConfig's field, its value)} of the request's constraint ({} without one);
    more than one is a 400."""
    given = {}
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            given["response_format"] = ("json_schema", {"type": "object"})
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format.json_schema.schema must be a JSON schema (an object)",
                               param="response_format")
            given["response_format"] = ("json_schema", schema)
        elif kind != "text":
            raise ApiError(400, "response_format.type must be text, json_object or json_schema", param="response_format")
    for name, (field, types) in CONSTRAINTS.items():
        if body.get(name) is not None:
            if not isinstance(body[name], types):
                raise ApiError(400, f"{name} must be {' or '.join('an object' if t is dict else 'a string' for t in types)}",
                               param=name)
            given[name] = (field, body[name])
    if len(given) > 1:
        raise ApiError(400, f"one constraint per request: got {', '.join(given)}", param=sorted(given)[1])
    return given


def _checked(options: dict) -> dict:
    """The options, once GenerationConfig's validation has passed them (a 400 naming the field otherwise)."""
    fields = {key: value for key, value in options.items() if key != "stop"}
    try:
        GenerationConfig(stop=tuple(options["stop"]), **fields).validate()
    except (SpecdeployError, TypeError) as exc:
        message = str(exc)
        name = message.split(" ", 1)[0]
        raise ApiError(400, message, param=name if name in options else None) from None
    return options


def _prompt(body: dict) -> str | list[int]:
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "this server takes one prompt per request", param="prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    rendered = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{index}] must be an object with a string role", param="messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text can be read by a text model
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in content):
                raise ApiError(400, f"messages[{index}].content: only text parts are supported", param="messages")
            content = "".join(part["text"] for part in content)
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{index}].content must be a string or a list of text parts",
                           param="messages")
        role = "system" if message["role"] == "developer" else message["role"]  # OpenAI's newer name for it
        rendered.append({**message, "role": role, "content": content or ""})
    return rendered


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    if "" in stops:
        raise ApiError(400, "stop strings must not be empty", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"a stop string has at most {MAX_STOP_CHARS} characters", param="stop")
    return stops


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{name} must be a number", param=name)
    return float(value)


def _check_type(body: dict, name: str, kind: type, param: str | None = None):
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise ApiError(400, f"{param or name} must be {'an' if kind is int else 'a'} {kind.__name__}", param=param or name)
    return value
