"""OpenAI response bodies and server-sent-event chunks for completions and chat completions.

Every response carries `usage` and each choice its `finish_reason` (and its `logprobs` when asked
for); the speculative statistics travel in the extension field `specdeploy` (acceptance rate,
tokens per round, by position): a whole response's is the request's, summed over its choices
(with each choice's under `choices` when n > 1), and a stream's finishing chunk of each choice
carries that choice's. n choices stream interleaved, each chunk naming its `index`; each choice
ends with its own finishing chunk. A stream asked for `include_usage` ends with a usage chunk
(the prompt counted once, the choices' tokens summed, as OpenAI does); `continuous_usage_stats`
as well puts the usage so far on every chunk whose count the backend knows, as vLLM does.
"""

from __future__ import annotations

import json
import time
import uuid

from ..runtime.token_text import TokenText
from .logprobs import ChoiceLogprobs, chat_layout, completion_layout
from .job import Finished, Piece, finish_reason

DONE = "data: [DONE]\n\n"


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
        "drafted_by_position": stats.drafted_by_position,
        "finish_reason": stats.finish_reason,  # the runtime's own: eos | stop | length
        "queue_ms": done.queue_s * 1000,
        "time_to_first_token_ms": done.first_token_s * 1000,
        "prefill_ms": stats.prefill_ms,
        "decode_ms": stats.decode_ms,
        "tokens_per_s": stats.tokens_per_s,
    }


def request_extension(finished: list[Finished], choices: list[dict]) -> dict:
    """A whole response's `specdeploy`: the one choice's, or the choices' summed (counts added, the
    longest timings, acceptance over every draft) with each choice's own under `choices`."""
    parts = [extension(done, choices[done.index]) for done in finished]
    if len(parts) == 1:
        return parts[0]
    stats = [done.output.stats for done in finished]
    rounds, drafted, accepted = (sum(getattr(s, name) for s in stats) for name in ("rounds", "drafted", "accepted"))
    decode_ms = max(s.decode_ms for s in stats)
    return {
        "speculative": parts[0]["speculative"],
        "num_draft_tokens": parts[0]["num_draft_tokens"],
        "seed": parts[0]["seed"],
        "rounds": rounds,
        "draft_rounds": sum(s.draft_rounds for s in stats),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_round": sum(s.new_tokens for s in stats) / rounds if rounds else 0.0,  # as mean_accepted_tokens
        "accepted_by_position": [sum(column) for column in zip(*(s.accepted_by_position for s in stats))],
        "drafted_by_position": [sum(column) for column in zip(*(s.drafted_by_position for s in stats))],
        "queue_ms": min(part["queue_ms"] for part in parts),
        "time_to_first_token_ms": min(part["time_to_first_token_ms"] for part in parts),
        "prefill_ms": max(s.prefill_ms for s in stats),
        "decode_ms": decode_ms,
        "tokens_per_s": sum(s.new_tokens for s in stats) / (decode_ms / 1000) if decode_ms > 0 else 0.0,
        "choices": [{"index": done.index, **part} for done, part in zip(finished, parts)],
    }


class Responder:
    """Builds one request's bodies: the same id, creation time and model in every chunk.

    choices: the options of each choice (GenerationConfig keyword arguments; their seeds differ);
    tokens: names the tokens of logprobs (needed when the choices ask for them)."""

    def __init__(self, model: str, chat: bool, choices: list[dict], include_usage: bool = False,
                 continuous_usage: bool = False, prompt_tokens: int = 0, tokens: TokenText | None = None):
        self.model, self.chat, self.choices, self.include_usage = model, chat, choices, include_usage
        self.continuous_usage, self.prompt_tokens, self.tokens = continuous_usage, prompt_tokens, tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.with_logprobs = choices[0].get("logprobs") is not None
        n = len(choices)
        self._logprobs = [ChoiceLogprobs(tokens) for _ in range(n)] if self.with_logprobs else None
        self._sent_chars = [0] * n  # text characters sent, per choice
        self._counts: list[int | None] = [0] * n  # tokens generated so far, per choice
        self._ended = [False] * n

    def body(self, finished: tuple[Finished, ...]) -> dict:
        """The whole (non-streaming) response."""
        finished = sorted(finished, key=lambda done: done.index)
        choices = []
        for done in finished:
            output = done.output
            logprobs = None
            if self.with_logprobs:
                logprobs = self._layout(ChoiceLogprobs(self.tokens).rest(output.logprobs))
            content = {"message": {"role": "assistant", "content": output.text}} if self.chat else {"text": output.text}
            choices.append({"index": done.index, **content, "logprobs": logprobs,
                            "finish_reason": finish_reason(output.stats.finish_reason)})
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": self._total_usage(finished), "specdeploy": request_extension(finished, self.choices)}

    def first(self) -> str:
        """Chat streams open with the assistant's role, once per choice; completions have no opening chunk."""
        if not self.chat:
            return ""
        return "".join(self._event([self._choice(index, {"role": "assistant", "content": ""})], self._usage_so_far())
                       for index in range(len(self.choices)))

    def piece(self, piece: Piece) -> str:
        index, text = piece.index, piece.text
        self._counts[index] = piece.num_new_tokens
        self._sent_chars[index] += len(text)
        logprobs = None
        if self.with_logprobs:
            stream = self._logprobs[index]
            stream.add(piece.logprobs)
            logprobs = self._layout(stream.take(self._sent_chars[index]))
        return self._event([self._choice(index, {"content": text} if self.chat else text, logprobs=logprobs)],
                           self._usage_so_far())

    def finish(self, done: Finished) -> str:
        """One choice's finishing chunk: its finish reason, its logprobs not sent yet, its statistics."""
        index, stats = done.index, done.output.stats
        if self._ended[index]:
            return ""
        self._ended[index] = True
        self._counts[index] = stats.new_tokens
        logprobs = None
        if self.with_logprobs:
            rest = self._logprobs[index].rest(done.output.logprobs)
            logprobs = self._layout(rest) if rest else None
        choice = self._choice(index, {} if self.chat else "", finish_reason(stats.finish_reason), logprobs)
        return self._event([choice], self._usage_so_far(), specdeploy=extension(done, self.choices[index]))

    def end(self, finished: tuple[Finished, ...]) -> str:
        """After the last choice: the finishing chunks not sent yet, the usage chunk if asked for, then [DONE]."""
        finished = sorted(finished, key=lambda done: done.index)
        events = "".join(self.finish(done) for done in finished)
        if self.include_usage:
            events += self._event([], self._total_usage(finished))
        return events + DONE

    def error(self, body: dict) -> str:
        """An error after the stream began: one event with the OpenAI error body, then [DONE]."""
        return f"data: {json.dumps(body)}\n\n" + DONE

    def _layout(self, entries: list) -> dict:
        return (chat_layout if self.chat else completion_layout)(entries, self.tokens)

    def _choice(self, index: int, content, reason: str | None = None, logprobs: dict | None = None) -> dict:
        if self.chat:
            return {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": reason}
        return {"index": index, "text": content, "logprobs": logprobs, "finish_reason": reason}

    def _total_usage(self, finished: list[Finished]) -> dict:
        prompt_tokens = finished[0].output.stats.prompt_tokens  # once: the choices share the prompt
        return token_usage(prompt_tokens, sum(done.output.stats.new_tokens for done in finished))

    def _usage_so_far(self) -> dict | None:
        """Continuous usage: the counts so far, every choice's summed (null where the backend does not know one)."""
        if not self.continuous_usage or any(count is None for count in self._counts):
            return None
        return token_usage(self.prompt_tokens, sum(self._counts))

    def _event(self, choices: list, usage_now: dict | None = None, **extra) -> str:
        chunk = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage_now  # as OpenAI: null on every chunk but the last, unless continuous
        chunk.update(extra)
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
