"""Text in and out: the bundle's tokenizer, incremental detokenization and stop strings."""

from __future__ import annotations

from pathlib import Path

from ..bundle import TokenizerSpec
from ..errors import SpecdeployError


def check_unicode(text: str, what: str) -> None:
    """Refuse text holding a lone surrogate (from JSON's \\udXXX or undecodable argv bytes): it is not
    Unicode that any tokenizer, or UTF-8, can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SpecdeployError(f"{what} is not valid Unicode: a lone surrogate at character {exc.start}") from None


class TextCodec:
    """The bundle tokenizer (the `tokenizers` library, no transformers)."""

    def __init__(self, folder: Path, spec: TokenizerSpec):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:
            raise SpecdeployError(f"cannot read {folder / 'tokenizer.json'}: {str(exc).splitlines()[0]}") from None
        self.spec = spec
        self.byte_tokens = self._byte_run_tokens()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Prompt text -> ids, with the tokenizer's own special tokens unless add_special_tokens=False (text
        a chat template wrote holds them already); an empty prompt is just BOS.

        Text that starts with the BOS token's string (a prompt rendered from a template) keeps that
        BOS only: the tokenizer's post-processor would put a second one in front of it."""
        check_unicode(text, "the prompt")
        # encode_batch lets go of the GIL while it runs (encode holds it: a 1 MB prompt stalled every other
        # thread of a server, its event loop included, for the second it took); one text, the same ids.
        ids = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids if text else []
        bos = self.spec.bos_token_id
        if add_special_tokens and bos is not None and ids[:2] == [bos, bos]:
            bos_text = self.tokenizer.id_to_token(bos)
            if bos_text and text.startswith(bos_text):
                ids = ids[1:]
        if not ids:
            if self.spec.bos_token_id is None:
                raise SpecdeployError("the prompt is empty and the tokenizer has no BOS token to start from")
            ids = [self.spec.bos_token_id]
        return ids

    def _byte_run_tokens(self) -> frozenset[int]:
        """The ids of SentencePiece byte-fallback pieces (`<0xNN>`) when the decoder decodes a run of them as a
        whole (ByteFallback): one U+FFFD per byte when the run is not valid UTF-8, the valid bytes before the
        fault included. Probed on 'H' and a lone continuation byte; empty for other tokenizers."""
        ids = {self.tokenizer.token_to_id(f"<0x{byte:02X}>") for byte in range(256)} - {None}
        probe = [self.tokenizer.token_to_id("<0x48>"), self.tokenizer.token_to_id("<0x9B>")]
        if None in probe or self.tokenizer.decode(probe, skip_special_tokens=False) != "\ufffd\ufffd":
            return frozenset()
        return frozenset(ids)

    def added_token_ids(self, special: bool = True) -> frozenset[int]:
        """The ids of the tokenizer's special added tokens (BOS, EOS, a chat template's turn markers), or with
        special=False of the others that are not blank: markup some tokenizers add without the special flag
        (turn markers among them), matched whole as special tokens are."""
        return frozenset(i for i, token in self.tokenizer.get_added_tokens_decoder().items()
                         if token.special == special and (special or token.content.strip()))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class TextStream:
    """Turns accepted tokens into text pieces, never emitting past a stop string.

    Decoding works on a short window of recent tokens (as TGI and vLLM do), so each token costs the
    same however long the output grows; pieces that end in an incomplete UTF-8 sequence or a run of
    byte-fallback tokens wait (a later byte can turn the whole run into replacement characters),
    and text that could still become a stop string is held back until it cannot.
    """

    def __init__(self, codec: TextCodec, stop: tuple[str, ...] = ()):
        self.codec = codec
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # decoded so far
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token: int) -> str:
        """Add one token; returns the text that is now safe to show (maybe empty)."""
        self.ids.append(token)
        prefix = self.codec.decode(self.ids[self._prefix_offset : self._read_offset])
        window = self.codec.decode(self.ids[self._prefix_offset :])
        if len(window) > len(prefix) and not window.endswith("\ufffd") and token not in self.codec.byte_tokens:
            self.text += window[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        if self._cut_at_stop():
            return self._emit(len(self.text))
        return self._emit(len(self.text) - (self._held_back() if self.stop else 0))

    def finish(self) -> str:
        """The rest of the text once generation ends (incomplete UTF-8 included), cut at a stop string
        that text completes (then `stopped`)."""
        if not self.stopped:
            prefix = self.codec.decode(self.ids[self._prefix_offset : self._read_offset])
            window = self.codec.decode(self.ids[self._prefix_offset :])
            self.text += window[len(prefix) :]
            self._cut_at_stop()
        return self._emit(len(self.text))

    def _cut_at_stop(self) -> bool:
        """End the text before the first stop string in what was not handed out yet; whether one was found."""
        if not self.stop:
            return False
        search_from = max(0, self.emitted - max(len(s) for s in self.stop))
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return bool(hits)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string.

        Only tails that start with a stop's first character are compared (16 stops of 1,000 characters
        cost 6.3 ms a token when every tail length was, 0.43 ms this way)."""
        text, longest = self.text, 0
        for stop in self.stop:
            start = text.find(stop[0], len(text) - min(len(stop) - 1, len(text)))
            while start != -1 and len(text) - start > longest:
                if stop.startswith(text[start:]):
                    longest = len(text) - start
                    break
                start = text.find(stop[0], start + 1)
        return longest

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        piece = self.text[self.emitted : upto]
        self.emitted = upto
        return piece
