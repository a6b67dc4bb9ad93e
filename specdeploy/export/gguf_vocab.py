"""A GGUF's tokenizer as llama.cpp reads it, where transformers' conversion reads it otherwise.

transformers turns a GGUF's vocabulary into a tokenizer.json, and two of its readings tokenize text
differently from llama.cpp (and from the model's own training):
- A SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama 2, Mistral, Phi-3, Gemma) is a
  BPE whose merges follow the token scores. transformers builds a Unigram model from the scores for
  Gemma, and its own merges for the others, and leaves the user-defined tokens (Gemma's runs of
  spaces, tabs and newlines) to the model. On Gemma 3 270M, 15 of 26 probe texts came out
  different ("leading" as 'le', 'ad', 'ing'); on llama.cpp's Phi-3 test vocabulary, 45 of 47.
- A byte-level BPE (`tokenizer.ggml.model` "gpt2") keeps its merges, but the text is split before
  BPE by a regular expression that `tokenizer.ggml.pre` names, and transformers takes GPT-2's for
  every Llama-architecture file. Llama 3 splits digits in threes and contractions in any case.

So the export rebuilds those parts from the GGUF metadata, as llama.cpp's llama-vocab.cpp tokenizes
(llama.cpp of llama-cpp-python 0.3.36), and keeps the rest of transformers' file (added tokens,
post-processor). scripts/gguf_tokenizers.py checks the result against llama.cpp's own test vectors
and against llama-server on the real models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecdeployError

# gguf.TokenType's values (constants here so that the reading needs no import of gguf)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
# Llama 3's split (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_LLAMA3), as Meta's tokenizer.json writes it.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "llama4"})
# Each numeric character alone, then GPT-2's split (LLAMA_VOCAB_PRE_TYPE_SMOLLM and the others llama.cpp splits so).
DIGIT_GPT2_PRE = frozenset({"smollm", "smaug-bpe"})


@dataclass(frozen=True)
class GgufVocab:
    """The vocabulary as the GGUF's metadata states it (by token id)."""

    model: str | None  # tokenizer.ggml.model: "llama" (SentencePiece), "gpt2" (byte-level BPE), ...
    pre: str | None  # tokenizer.ggml.pre: the BPE split's name
    tokens: tuple[str, ...]
    types: tuple[int, ...]
    scores: tuple[float, ...]
    add_space_prefix: bool  # SentencePiece: a space before the text (llama.cpp's default: yes)
    unk_token_id: int | None


def read_vocab(value) -> GgufVocab:
    """The vocabulary from a GGUF reader's metadata (`value(key)` -> contents or None). Fewer scores or types
    than tokens is refused, as llama.cpp refuses it; more are ignored, as there."""
    tokens = tuple(str(t) for t in value("tokenizer.ggml.tokens") or ())
    types = tuple(int(t) for t in value("tokenizer.ggml.token_type") or ())
    scores = tuple(float(s) for s in value("tokenizer.ggml.scores") or ())
    for key, values in (("tokenizer.ggml.scores", scores), ("tokenizer.ggml.token_type", types)):
        if values and len(values) < len(tokens):
            raise SpecdeployError(f"the GGUF's {key} has {len(values)} entries for {len(tokens)} tokens")
    types, scores = types[: len(tokens)], scores[: len(tokens)]
    space = value("tokenizer.ggml.add_space_prefix")
    unk = value("tokenizer.ggml.unknown_token_id")
    return GgufVocab(model=value("tokenizer.ggml.model"), pre=value("tokenizer.ggml.pre"), tokens=tokens,
                     types=types or (NORMAL,) * len(tokens), scores=scores, unk_token_id=None if unk is None else int(unk),
                     add_space_prefix=True if space is None else bool(space))


def rebuild_tokenizer(tokenizer_json: Path, vocab: GgufVocab) -> bool:
    """Rewrite transformers' tokenizer.json where it tokenizes otherwise than llama.cpp; False: left as it was."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    if vocab.model == "llama" and vocab.tokens and vocab.scores:
        _sentencepiece(tokenizer, vocab)
    elif vocab.model == "gpt2" and (vocab.pre in LLAMA3_PRE or vocab.pre in DIGIT_GPT2_PRE):
        _split(tokenizer, vocab.pre)
    else:
        return False
    tokenizer.save(str(tokenizer_json))
    return True


def _sentencepiece(tokenizer, vocab: GgufVocab) -> None:
    """A SentencePiece BPE: tokens merge pairwise, the pair whose token scores highest first (llama.cpp's
    llm_tokenizer_spm), which a BPE whose merges are ranked by the merged token's score reproduces; an
    unknown character falls back to its bytes; user-defined tokens match whole before BPE, as added tokens."""
    from tokenizers import AddedToken, decoders, models, normalizers

    index = {token: i for i, token in enumerate(vocab.tokens)}
    if len(index) != len(vocab.tokens):  # an id without its own text would decode to nothing
        raise SpecdeployError(f"the GGUF's vocabulary repeats a token: {len(vocab.tokens)} tokens, {len(index)} distinct")
    merges = []
    for i, token in enumerate(vocab.tokens):
        if vocab.types[i] != NORMAL or len(token) < 2:
            continue
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))
                 if token[:cut] in index and token[cut:] in index]
        merges += [(vocab.scores[i], index[left], index[right], left, right)
                   for left, right in pairs]
    if len(merges) > 1 and len({merge[0] for merge in merges}) == 1:
        raise SpecdeployError("the GGUF's SentencePiece vocabulary gives every token one score, so its merge order is "
                              "lost (llama.cpp then merges the leftmost pair first, which no tokenizer.json can "
                              "express): export from the checkpoint's Hugging Face folder instead")
    # A few tokens may share a score (Llama 2's 15 at -1e9): llama.cpp merges the leftmost of tied pairs first, here
    # the one of the lower ids.
    merges.sort(key=lambda merge: (-merge[0], merge[1], merge[2]))
    unk = vocab.tokens[vocab.unk_token_id] if vocab.unk_token_id is not None and vocab.unk_token_id < len(vocab.tokens) else None
    tokenizer.model = models.BPE(index, [(left, right) for *_, left, right in merges], unk_token=unk, fuse_unk=True,
                                 byte_fallback=True)
    steps = [normalizers.Prepend("▁")] if vocab.add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = None
    # Each token's piece, '▁' as a space, and no space stripped from the start: the runtime decodes only the
    # generated ids, so a reply's first '▁Paris' must read ' Paris', as llama-server gives it.
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token, kind in zip(vocab.tokens, vocab.types) if kind == USER_DEFINED])


def _split(tokenizer, pre: str) -> None:
    """The byte-level BPE's split before merging, as llama.cpp's for this pre-tokenizer name, and a plain byte-level
    decoder (transformers' strips the first space of what it decodes: a reply's first 'Ġab' must read ' ab')."""
    from tokenizers import Regex, decoders, pre_tokenizers

    tokenizer.decoder = decoders.ByteLevel()

    if pre in LLAMA3_PRE:
        tokenizer.model.ignore_merges = True  # a piece that is a token whole is that token (llama.cpp's too)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    else:  # llama.cpp's \p{N}: tokenizers' Digits splits every numeric character ("½" too). onnxruntime-genai
        # reads Digits (a Split on \p{N} it does not); the Node host's Digits splits ASCII digits only.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
