"""Each token's own bytes and text, as OpenAI's logprobs name them: the tokenizer's bytes (the byte-level
alphabet of GPT-2 style tokenizers, `<0xNN>` byte fallback and `▁` spaces of SentencePiece ones),
and those bytes as UTF-8, or `bytes:\\xNN...` (OpenAI's legacy spelling) when they are not whole
characters. Special tokens (an EOS) are their own text. `run --json --logprobs` and the server's
logprobs both name their tokens here."""

from __future__ import annotations

import json
import re

BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
SENTENCEPIECE_SPACE = "\u2581"


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (its bytes_to_unicode, inverted)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[chr(byte)] = byte
        else:
            characters[chr(256 + extra)] = byte
            extra += 1
    return characters


class TokenText:
    """The bytes and text of single token ids, from a `tokenizers.Tokenizer` (cached per id; one thread
    reads it, the event loop's)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = json.dumps(json.loads(tokenizer.to_str()).get("decoder"), ensure_ascii=False)  # "▁" as it is
        self._byte_level = byte_level_alphabet() if '"ByteLevel"' in decoder else None
        self._sentencepiece = SENTENCEPIECE_SPACE in decoder
        added = tokenizer.get_added_tokens_decoder()
        self._added = {token_id: token.content for token_id, token in added.items()}
        self.special = frozenset(token_id for token_id, token in added.items() if token.special)
        self._bytes: dict[int, bytes] = {}
        self.leading_strip = self._leading_strip() if self._sentencepiece else 0

    def bytes(self, token_id: int) -> bytes:
        data = self._bytes.get(token_id)
        if data is None:
            data = self._bytes[token_id] = self._token_bytes(token_id)
        return data

    def text(self, token_id: int) -> str:
        data = self.bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        fallback = BYTE_FALLBACK.match(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if self._sentencepiece:
            return piece.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8")
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def _leading_strip(self) -> int:
        """How many spaces the decoder drops from the start of what it decodes, and only there: one for
        Llama 2's Strip(" ", 1, 0) after Fuse and for Metaspace, none for most others (probed on a
        `▁word` token, alone and twice over)."""
        for piece, token_id in self.tokenizer.get_vocab().items():
            if len(piece) > 1 and piece[0] == SENTENCEPIECE_SPACE and piece[1].isalpha():
                own = self.bytes(token_id).decode("utf-8")
                decoded = self.tokenizer.decode([token_id], skip_special_tokens=False)
                cut = len(own) - len(decoded)
                twice = self.tokenizer.decode([token_id, token_id], skip_special_tokens=False)
                if 0 < cut and own[cut:] == decoded and not own[:cut].strip() and twice == (own + own)[cut:]:
                    return cut
                return 0
        return 0
