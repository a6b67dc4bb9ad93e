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
post-processor). Checked against llama.cpp's own test vectors and llama-server on the real models
(docs/performance.md, "Tokenization against llama.cpp").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecdeployError

# gguf.TokenType's values (constants here so that the reading needs no import of gguf)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
# The split before BPE, as llama.cpp's llama-vocab.cpp (regex_exprs) has it for the byte-level vocabularies
# transformers reads otherwise: each regex splits the pieces the ones before it left, its matches and the text
# between them each a piece. Where llama.cpp writes case-insensitive contractions out for C++, the (?i:...) form.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# DeepSeek's "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+" less the whitespace in its ranges (U+1680, U+2000-U+200A,
# U+2028, U+2029, U+202F, U+205F, U+3000): llama.cpp turns non-ASCII whitespace into one control character before a
# regex without \p{...} reads the text, so no range of such a regex holds it there (deepseek-llm's U+3000-U+3002 too)
DEEPSEEK_CJK = ("[\u4e00-\u9fa5\u0800-\u167f\u1681-\u1fff\u200b-\u2027\u202a-\u202e\u2030-\u205e\u2060-\u2fff"
                "\u3001-\u4e00\uac00-\ud7ff]+")
SPLITS = {
    "llama3": (LLAMA3_SPLIT,),
    "starcoder": (r"\p{N}", GPT2_SPLIT),  # each numeric character alone, then GPT-2's split
    # (their character classes written as escapes: the ranges run between code points that NFC would change)
    "deepseek-llm": (
        r"[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
        "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
        "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
        "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
        "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
        "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
        "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
        "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
        "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3001-\u3002]+",
        r"\s+$",
        DEEPSEEK_CJK,
        r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_SPLIT, r"[0-9][0-9][0-9]"),
    "qwen35": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+",),
    # llama.cpp's form of GPT-4o's and Tekken's letter classes, not their tokenizer.json's: a non-ASCII letter counts
    # as both cases there, and a combining mark is no part of a word ("ПриветМир" one piece, "e" + U+0301 two)
    "gpt-4o": (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
               r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
               r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "tekken": (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|"
               r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|"
               r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+",),
    "bloom": (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",),
}
# tokenizer.ggml.pre -> (its split, whether a piece that is a token whole is that token unmerged: ignore_merges),
# as llama-vocab.cpp maps the names to its pre-tokenizer types
PRE_SPLITS = {
    **{name: ("llama3", True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                           "midm-2.0", "lfm2", "jina-v5-nano", "glm4", "glm5")},
    **{name: ("llama3", False) for name in ("dbrx", "smaug-bpe", "chatglm-bpe")},
    **{name: ("starcoder", False) for name in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                                               "minerva-7b", "mellum2")},
    "deepseek-llm": ("deepseek-llm", False), "deepseek-coder": ("deepseek-coder", False), "falcon": ("falcon", False),
    "qwen35": ("qwen35", False),
    **{name: ("gpt-4o", False) for name in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")},
    **{name: ("qwen2", False) for name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2",
                                           "hunyuan", "solar-open", "grok-2")},
    "tekken": ("tekken", True),
    **{name: ("bloom", False) for name in ("bloom", "poro-chat", "gpt3-finnish")},
}


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
    elif vocab.model == "gpt2" and vocab.pre in PRE_SPLITS:
        _split(tokenizer, *PRE_SPLITS[vocab.pre])
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


def _split(tokenizer, split: str, ignore_merges: bool) -> None:
    """The byte-level BPE's split before merging, as llama.cpp's (SPLITS), no normalizer (llama.cpp normalizes no
    byte-level text, where transformers' reading of a Qwen file composes it, NFC), and a plain byte-level decoder
    (transformers' strips the first space of what it decodes: a reply's first 'Ġab' must read ' ab')."""
    from tokenizers import Regex, decoders, pre_tokenizers

    tokenizer.normalizer = None
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.model.ignore_merges = ignore_merges
    if split == "starcoder":  # the same split in the form the hosts read: tokenizers' Digits splits every numeric
        # character ("½" too), and ByteLevel's own regex is GPT-2's. onnxruntime-genai reads Digits (a Split on \p{N}
        # it does not); the Node host's Digits splits ASCII digits only.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
        return
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in SPLITS[split]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
