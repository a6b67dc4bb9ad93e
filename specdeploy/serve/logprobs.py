"""Log-probabilities in OpenAI's layouts: each token's text and bytes, and a stream's tokens sent with
the text they make. The tokens' names are runtime.token_text's (TokenText).

The values are the runtime's (GenerationOutput.logprobs): the target's log-softmax of its raw
logits at each emitted token, from the verify or target-only row the token came from. This module
only names the tokens. A token's bytes are the tokenizer's own (the byte-level alphabet of GPT-2
style tokenizers, `<0xNN>` byte fallback and `▁` spaces of SentencePiece ones); its text is those
bytes as UTF-8, or `bytes:\\xNN...` (OpenAI's legacy spelling) when they are not whole characters.
Special tokens (an EOS) are their own text, which the completion's text does not contain.
"""

from __future__ import annotations

import codecs
import threading

from ..runtime.token_text import TokenText

class LazyTokenText:
    """A TokenText built on first use (parsing a large tokenizer's JSON once), by any thread."""

    def __init__(self, tokenizer_of):
        self._tokenizer_of, self._value, self._lock = tokenizer_of, None, threading.Lock()

    def get(self) -> TokenText:
        with self._lock:
            if self._value is None:
                self._value = TokenText(self._tokenizer_of())
            return self._value


class ChoiceLogprobs:
    """One choice's token logprobs on their way out, each with its character offset in the choice's text.

    add() takes entries as the runtime emits them; take(chars) gives those whose text lies within
    the first `chars` characters sent so far (a stream's chunk carries the tokens of its own text;
    text held back, an unfinished UTF-8 character or a possible stop string, holds its tokens too);
    rest(all_entries) gives every entry not yet taken once the choice has ended."""

    def __init__(self, tokens: TokenText):
        self.tokens = tokens
        self.received = 0  # entries add() has seen
        self._pending: list[list] = []  # [TokenLogprob, start, end] not yet taken (end None: bytes still open)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0
        self._strip = tokens.leading_strip  # spaces the text drops before its first character

    def add(self, entries) -> None:
        for entry in entries:
            start, data = self._chars, self.tokens.bytes(entry.token_id)
            if data and entry.token_id not in self.tokens.special:  # special tokens write no text
                # The first byte settles where this token starts: the characters it lets out before
                # its own are the replacements of earlier bytes that could not be completed.
                out = self._visible(self._decoder.decode(data[:1]))
                start += len(out) if self._decoder.getstate()[0] else max(len(out) - 1, 0)
                self._chars += len(out) + len(self._visible(self._decoder.decode(data[1:])))
            self._pending.append([entry, start, None])
            if not self._decoder.getstate()[0]:  # no bytes left open: every token so far has its end
                for item in self._pending:
                    if item[2] is None:
                        item[2] = self._chars
        self.received += len(entries)

    def _visible(self, text: str) -> str:
        """Text as the choice's text has it: the decoder's leading spaces dropped, as TokenText probed them."""
        while self._strip and text.startswith(" "):
            text, self._strip = text[1:], self._strip - 1
        if text:
            self._strip = 0
        return text

    def take(self, chars: int) -> list[tuple[object, int]]:
        count = 0
        while count < len(self._pending) and self._pending[count][2] is not None and self._pending[count][2] <= chars:
            count += 1
        taken, self._pending = self._pending[:count], self._pending[count:]
        return [(entry, start) for entry, start, _ in taken]

    def rest(self, all_entries) -> list[tuple[object, int]]:
        self.add(list(all_entries[self.received :]))
        taken, self._pending = self._pending, []
        return [(entry, start) for entry, start, _ in taken]


def completion_layout(entries: list[tuple[object, int]], tokens: TokenText) -> dict:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset. Each
    top_logprobs entry holds the N likeliest tokens and the sampled one (up to N + 1), as OpenAI's does."""
    top_logprobs = []
    for entry, _ in entries:
        best: dict[str, float] = {}
        for token_id, logprob in entry.top:
            best.setdefault(tokens.text(token_id), logprob)  # two ids may share a text: the likelier one
        best.setdefault(tokens.text(entry.token_id), entry.logprob)  # OpenAI's: the sampled token's, always
        top_logprobs.append(best)
    return {"tokens": [tokens.text(entry.token_id) for entry, _ in entries],
            "token_logprobs": [entry.logprob for entry, _ in entries],
            "top_logprobs": top_logprobs,
            "text_offset": [start for _, start in entries]}


def chat_layout(entries: list[tuple[object, int]], tokens: TokenText) -> dict:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    def named(token_id: int, logprob: float) -> dict:
        return {"token": tokens.text(token_id), "logprob": logprob, "bytes": list(tokens.bytes(token_id))}

    return {"content": [{**named(entry.token_id, entry.logprob),
                         "top_logprobs": [named(token_id, logprob) for token_id, logprob in entry.top]}
                        for entry, _ in entries]}
