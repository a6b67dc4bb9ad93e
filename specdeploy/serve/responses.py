"""OpenAI response bodies and server-sent-event chunks for completions and chat completions.

Every response carries `usage` and `finish_reason`; the speculative statistics of the request
travel in the extension field `specdeploy` (acceptance rate, tokens per round, by position).
A stream asked for `include_usage` ends with a usage chunk; `continuous_usage_stats` as well puts
the usage so far on every chunk whose count the backend knows, as vLLM does.
"""

from __future__ import annotations

import json
import time
import uuid

from .worker import Finished, Piece, finish_reason

DONE = "data: [DONE]\n\n"


def usage(stats) -> dict:
    return token_usage(stats.prompt_tokens, stats.new_tokens)


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def extension(done: Finished, options: dict) -> dict:
    """The `specdeploy` field: what speculation did for this request, and the seed that reproduces it."""
    stats = done.output.stats
    return {
        "speculative": bool(options.get("speculative", True)),
        "num_draft_tokens": options["num_draft_tokens"],
        "seed": options["seed"],
        "rounds": stats.rounds,
        "draft_rounds": stats.draft_rounds,
        "drafted_tokens": stats.drafted,
        "accepted_tokens": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_round": stats.mean_accepted_tokens if stats.rounds else 0.0,
        "accepted_by_position": stats.accepted_by_position,
        "finish_reason": stats.finish_reason,  # the runtime's own: eos | stop | length | context
        "queue_ms": done.queue_s * 1000,
        "time_to_first_token_ms": done.first_token_s * 1000,
        "prefill_ms": stats.prefill_ms,
        "decode_ms": stats.decode_ms,
        "tokens_per_s": stats.tokens_per_s,
    }


class Responder:
    """Builds one request's bodies: the same id, creation time and model in every chunk."""

    def __init__(self, model: str, chat: bool, options: dict, include_usage: bool = False,
                 continuous_usage: bool = False, prompt_tokens: int = 0):
        self.model, self.chat, self.options, self.include_usage = model, chat, options, include_usage
        self.continuous_usage, self.prompt_tokens = continuous_usage, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def body(self, done: Finished) -> dict:
        """The whole (non-streaming) response."""
        output = done.output
        reason = finish_reason(output.stats.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": output.text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": output.text, "logprobs": None, "finish_reason": reason}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(output.stats), "specdeploy": extension(done, self.options)}

    def first(self) -> str:
        """Chat streams open with the assistant's role; completions have no opening chunk."""
        if not self.chat:
            return ""
        return self._event([self._choice({"role": "assistant", "content": ""})], self._usage_so_far(0))

    def piece(self, piece: Piece) -> str:
        text = piece.text
        return self._event([self._choice({"content": text} if self.chat else text)],
                           self._usage_so_far(piece.num_new_tokens))

    def finish(self, done: Finished) -> str:
        """The chunk with the finish reason (and our statistics), the usage chunk if asked for, then [DONE]."""
        choice = self._choice({} if self.chat else "", finish_reason(done.output.stats.finish_reason))
        so_far = usage(done.output.stats) if self.continuous_usage else None
        events = self._event([choice], so_far, specdeploy=extension(done, self.options))
        if self.include_usage:
            events += self._event([], usage(done.output.stats))
        return events + DONE

    def error(self, body: dict) -> str:
        """An error after the stream began: one event with the OpenAI error body, then [DONE]."""
        return f"data: {json.dumps(body)}\n\n" + DONE

    def _choice(self, content, reason: str | None = None) -> dict:
        if self.chat:
            return {"index": 0, "delta": content, "logprobs": None, "finish_reason": reason}
        return {"index": 0, "text": content, "logprobs": None, "finish_reason": reason}

    def _usage_so_far(self, completion_tokens: int | None) -> dict | None:
        """Continuous usage: the counts so far (null where the backend does not know them yet)."""
        if not self.continuous_usage or completion_tokens is None:
            return None
        return token_usage(self.prompt_tokens, completion_tokens)

    def _event(self, choices: list, usage_now: dict | None = None, **extra) -> str:
        chunk = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage_now  # as OpenAI: null on every chunk but the last, unless continuous
        chunk.update(extra)
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
