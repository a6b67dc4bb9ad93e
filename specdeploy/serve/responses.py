"""OpenAI response bodies and server-sent-event chunks for completions and chat completions.

Every response carries `usage` and `finish_reason`; the speculative statistics of the request
travel in the extension field `specdeploy` (acceptance rate, tokens per round, by position).
"""

from __future__ import annotations

import json
import time
import uuid

from .worker import Finished, finish_reason

DONE = "data: [DONE]\n\n"


def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


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

    def __init__(self, model: str, chat: bool, options: dict, include_usage: bool = False):
        self.model, self.chat, self.options, self.include_usage = model, chat, options, include_usage
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
        return self._event([self._choice({"role": "assistant", "content": ""})]) if self.chat else ""

    def piece(self, text: str) -> str:
        return self._event([self._choice({"content": text} if self.chat else text)])

    def finish(self, done: Finished) -> str:
        """The chunk with the finish reason (and our statistics), the usage chunk if asked for, then [DONE]."""
        choice = self._choice({} if self.chat else "", finish_reason(done.output.stats.finish_reason))
        events = self._event([choice], specdeploy=extension(done, self.options))
        if self.include_usage:
            events += self._event([], usage=usage(done.output.stats))
        return events + DONE

    def error(self, body: dict) -> str:
        """An error after the stream began: one event with the OpenAI error body, then [DONE]."""
        return f"data: {json.dumps(body)}\n\n" + DONE

    def _choice(self, content, reason: str | None = None) -> dict:
        if self.chat:
            return {"index": 0, "delta": content, "logprobs": None, "finish_reason": reason}
        return {"index": 0, "text": content, "logprobs": None, "finish_reason": reason}

    def _event(self, choices: list, **extra) -> str:
        chunk = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": choices}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        chunk.update(extra)
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
