"""A GGUF's text tokenizes, and its generated ids read, as llama.cpp tokenizes and reads them: a SentencePiece
vocabulary merges by its scores and matches its user-defined tokens whole; a byte-level BPE splits text as its
tokenizer.ggml.pre names; a reply keeps its leading space. Tiny GGUF files written here; the oracle for
SentencePiece is llama.cpp's algorithm, written out below."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_gguf import GEMMA, HEADS, HIDDEN, KV_HEADS, LAYERS, _write_shape, _write_tensors, write_gemma3_gguf  # noqa: E402

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6
USER = ["    ", "\n\n"]  # user-defined: matched whole before any merging (Gemma's runs of spaces and newlines)
TEXTS = ["def insort_left(a, x, lo=0, hi=None):", "    return heapq.heappush(heap, item)\n\n\n",
         "Prüfung: naïve café — 中文 🎉", "a  b    c\td", "<start_of_turn>user\nhi<end_of_turn>\n", "x=1;y=22;z=333"]


def _sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style BPE (spaces as ▁, scores by merge order) trained on a slice of the standard library,
    after Gemma's control tokens, 256 byte tokens and two user-defined tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [(stdlib / name).read_text() for name in ("textwrap.py", "bisect.py", "heapq.py")]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, show_progress=False))
    tokens = GEMMA + [f"<0x{b:02X}>" for b in range(256)] + USER
    learned = [item for item in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]) if item[0] not in tokens]
    types = [CONTROL] * len(GEMMA) + [BYTE] * 256 + [USER_DEFINED] * len(USER)
    scores = [0.0] * len(tokens)
    tokens += [token for token, _ in learned]
    types += [NORMAL] * len(learned)
    scores += [-float(rank) for rank in range(len(learned))]  # the later a merge, the lower its token's score
    return tokens, scores, types


def llama_cpp_spm(text: str, tokens: list[str], scores: list[float], types: list[int]) -> list[int]:
    """llama.cpp's SentencePiece tokenization (llama-vocab.cpp, add_space_prefix off): control and user-defined
    tokens matched whole first; each piece between them merged pairwise, the adjacent pair whose merged token
    scores highest first (leftmost on ties); a character no token holds falls back to its UTF-8 bytes."""
    index = {token: i for i, token in enumerate(tokens)}
    whole = sorted((t for t, kind in zip(tokens, types) if kind in (CONTROL, USER_DEFINED)), key=len, reverse=True)
    ids: list[int] = []
    while text:
        starts = [(text.find(token), -len(token), token) for token in whole if token in text]
        at, _, token = min(starts) if starts else (len(text), 0, None)
        ids += _merge(text[:at].replace(" ", "▁"), index, scores)
        if token is None:
            break
        ids.append(index[token])
        text = text[at + len(token):]
    return ids


def _merge(piece: str, index: dict[str, int], scores: list[float]) -> list[int]:
    symbols = list(piece)
    while True:
        pairs = [(scores[index[a + b]], -at) for at, (a, b) in enumerate(zip(symbols, symbols[1:])) if a + b in index]
        if not pairs:
            break
        at = -max(pairs)[1]
        symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
    return [i for s in symbols for i in ([index[s]] if s in index else [index[f"<0x{b:02X}>"] for b in s.encode()])]


def _converted(path: Path, tmp_path: Path):
    from tokenizers import Tokenizer

    from specdeploy.export.gguf import gguf_to_folder

    work = tmp_path / "work"
    work.mkdir()
    folder, _ = gguf_to_folder(path, "target", work)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_a_sentencepiece_gguf_tokenizes_as_llama_cpp(tmp_path):
    """transformers reads a Gemma GGUF's scores as a Unigram model's, which segments otherwise."""
    tokens, scores, types = vocab = _sentencepiece_vocab()
    tokenizer = _converted(write_gemma3_gguf(tmp_path / "spm.gguf", vocab), tmp_path)
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False).ids == llama_cpp_spm(text, tokens, scores, types), text
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text
    assert tokenizer.encode("a    b", add_special_tokens=False).ids[1] == tokens.index("    ")


def _tiny_llama_gguf(path: Path, vocab_size: int, seed: int, write_tokenizer) -> Path:
    """A tiny Llama whose tokenizer metadata write_tokenizer(writer) writes."""
    import gguf
    import torch
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                            max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_shape(writer)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(vocab_size)
    write_tokenizer(writer)
    _write_tensors(writer, tf.LlamaForCausalLM(config), gguf.MODEL_ARCH.LLAMA)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_bpe_gguf(path: Path, pre: str, tokens: list[str], merges: list[str]) -> Path:
    """A byte-level BPE (tokenizer.ggml.model "gpt2") split as `pre` names."""
    def write_tokenizer(writer) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([CONTROL if t.startswith("<|") else NORMAL for t in tokens])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        writer.add_add_bos_token(False)

    return _tiny_llama_gguf(path, len(tokens), 7, write_tokenizer)


# (pre, text, the pieces llama.cpp gives): Llama 3 splits digits in threes and takes a piece that is a token whole
# without merging it (ignore_merges), as Smaug's split does not; SmolLM2 and StarCoder split every digit, as do
# DeepSeek Coder and Qwen 3.5; DeepSeek LLM parts an apostrophe from the letters after it; Falcon splits three digits
# off a number; GPT-4o's split (Llama 4's) parts "CamelCase" where Llama 3's keeps the word whole, and, as Tekken's
# (Mistral Nemo's), keeps a combining mark out of the word before it; Tekken splits every digit and takes whole
# tokens unmerged; BLOOM's splits only at spaces and punctuation, so "1l" stays one piece; DeepSeek's character
# ranges hold no whitespace (an ideographic space and a space are one piece). "default" is not rebuilt: these rows are
# transformers' reading, GPT-2's split, which llama.cpp's default split is not ("1234" as "123", "4" there).
SPLITS = [("llama-bpe", "1234", ["123", "4"]), ("llama-bpe", "ab", ["ab"]), ("llama-bpe", "Ġab", ["Ġ", "a", "b"]),
          ("llama-bpe", "CamelCase", ["C", "a", "m", "e", "lC", "a", "s", "e"]),
          ("smaug-bpe", "1234", ["123", "4"]), ("smaug-bpe", "ab", ["a", "b"]),
          ("smollm", "1234", ["1", "2", "3", "4"]), ("starcoder", "1234", ["1", "2", "3", "4"]),
          ("deepseek-coder", "1234", ["1", "2", "3", "4"]), ("deepseek-llm", "don't", ["d", "o", "n", "'", "t"]),
          ("qwen35", "1234", ["1", "2", "3", "4"]), ("falcon", "12345", ["123", "4", "5"]),
          ("llama4", "CamelCase", ["C", "a", "m", "e", "l", "C", "a", "s", "e"]), ("llama4", "e\u0301", ["e", "Ì", "ģ"]),
          ("tekken", "1234", ["1", "2", "3", "4"]), ("tekken", "ab", ["ab"]), ("tekken", "e\u0301", ["e", "Ì", "ģ"]),
          ("bloom", "1l", ["1l"]), ("deepseek-llm", "\u3000 ", ["ãĢĢĠ"]), ("deepseek-coder", "\u3000 ", ["ãĢĢĠ"]),
          ("default", "1234", ["1234"]), ("default", "ab", ["a", "b"]), ("default", "1l", ["1", "l"]),
          ("default", "don't", ["d", "o", "n", "'t"])]


@pytest.mark.parametrize("pre", sorted({pre for pre, _, _ in SPLITS}))
def test_a_byte_level_gguf_splits_text_as_its_pre_tokenizer_names(tmp_path, pre):
    from tokenizers import pre_tokenizers

    tokens = (["<|begin_of_text|>", "<|end_of_text|>"] + sorted(pre_tokenizers.ByteLevel.alphabet())
              + ["12", "123", "1234", "ab", "lC", "1l", "'t", "eÌ", "ãĢ", "ãĢĢ", "ãĢĢĠ"])
    merges = ["1 2", "12 3", "123 4", "l C", "1 l", "' t", "e Ì", "ã Ģ", "ãĢ Ģ", "ãĢĢ Ġ"]
    tokenizer = _converted(_write_bpe_gguf(tmp_path / f"{pre}.gguf", pre, tokens, merges), tmp_path)
    for text, pieces in ((text.replace("Ġ", " "), pieces) for p, text, pieces in SPLITS if p == pre):
        assert [tokens[i] for i in tokenizer.encode(text, add_special_tokens=False).ids] == pieces, text


@pytest.mark.parametrize("pre", ["qwen2", "qwen35"])
def test_a_rebuilt_byte_level_split_leaves_text_uncomposed(tmp_path, pre):
    """transformers' reading of a Qwen GGUF composes text (an NFC normalizer); llama.cpp tokenizes it as it comes,
    so 'e' + a combining acute is two pieces' bytes there, not the one character é."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from specdeploy.export.gguf_vocab import GgufVocab, rebuild_tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({token: i for i, token in enumerate(alphabet)}, []))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    assert rebuild_tokenizer(path, GgufVocab(model="gpt2", pre=pre, tokens=tuple(alphabet), types=(), scores=(),
                                             add_space_prefix=False, unk_token_id=None))
    pieces = [alphabet[i] for i in Tokenizer.from_file(str(path)).encode("e\u0301").ids]
    assert pieces == ["e", "Ì", "ģ"]  # U+0301's bytes CC 81; composed, é would be C3 A9 ("Ã", "©")


# ------------------------------------------------- the text of generated ids, and metadata llama.cpp refuses


def _folder(path: Path, tmp_path: Path) -> Path:
    from specdeploy.export.gguf import gguf_to_folder

    work = tmp_path / "work"
    work.mkdir()
    folder, _ = gguf_to_folder(path, "target", work)
    return folder


def _streamed(folder: Path, ids: list[int], bos: int | None) -> str:
    """The text the runtime shows for generated ids: TextStream over the bundle's TextCodec."""
    from specdeploy.runtime.text import TextCodec, TextStream

    stream = TextStream(TextCodec(folder, SimpleNamespace(bos_token_id=bos)))
    return "".join(stream.push(token) for token in ids) + stream.finish()


def _write_spm_llama_gguf(path: Path, tokens: list[str], scores: list[float], types: list[int]) -> Path:
    """A Llama 2 layout: a SentencePiece vocabulary (tokenizer.ggml.model "llama"), no add_space_prefix key, so
    llama.cpp's default for SentencePiece holds: a space before the text."""
    def write_tokenizer(writer) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)

    return _tiny_llama_gguf(path, len(tokens), 5, write_tokenizer)


def test_a_sentencepiece_gguf_continuation_keeps_its_leading_space(tmp_path):
    """Llama 2 / Mistral / Phi-3 GGUFs (add_space_prefix): llama-server's text for generated ids is each token's
    piece, '▁' as a space, so a reply that starts with '▁Paris' reads ' Paris'. The exported decoder ends with
    Strip(' ', 1, 0), and the runtime decodes only the generated ids: the reply reads 'Paris', and prompt + reply
    runs the words together ('The capital of France isParis')."""
    words = ["▁The", "▁capital", "▁is", "▁Paris"]
    pieces = sorted({c for w in words for c in w} | {"."})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + words
    types = [CONTROL] * 3 + [BYTE] * 256 + [NORMAL] * (len(pieces) + len(words))
    scores = [0.0] * (3 + 256) + [-1.0] * len(pieces) + [-2.0] * len(words)
    folder = _folder(_write_spm_llama_gguf(tmp_path / "spm.gguf", tokens, scores, types), tmp_path)
    reply = [tokens.index("▁Paris"), tokens.index(".")]
    assert _streamed(folder, reply, bos=1) == " Paris."  # llama.cpp: ' Paris' + '.'


def test_a_llama3_gguf_continuation_keeps_its_leading_space(tmp_path):
    """Llama 3 GGUFs (gpt2 with tokenizer.ggml.pre llama-bpe): the rebuild keeps transformers' decoder, which ends
    with Strip(' ', 1, 0); llama.cpp (and Meta's own tokenizer.json, a plain ByteLevel decoder) give 'Ġab' as ' ab'.
    The runtime's reply drops that space."""
    from tokenizers import pre_tokenizers

    tokens = (["<|begin_of_text|>", "<|end_of_text|>"] + sorted(pre_tokenizers.ByteLevel.alphabet())
              + ["12", "123", "1234", "ab", "Ġab"])
    folder = _folder(_write_bpe_gguf(tmp_path / "llama3.gguf", "llama-bpe", tokens, ["1 2", "12 3", "123 4", "a b", "Ġ ab"]),
                     tmp_path)
    reply = [tokens.index("Ġab"), tokens.index("Ġab")]
    assert _streamed(folder, reply, bos=0) == " ab ab"  # llama.cpp: ' ab' + ' ab'


def test_a_sentencepiece_gguf_whose_scores_all_tie_is_refused(tmp_path):
    """convert_hf_to_gguf's LlamaHfVocab writes -1000.0 for every token of a Llama with only a tokenizer.json: the
    merge order is gone, llama.cpp then merges the leftmost pair first ('abc' as 'ab', 'c'), which no BPE
    tokenizer.json expresses. The export says so and names the way out."""
    from specdeploy.errors import SpecdeployError
    from specdeploy.export.gguf import gguf_to_folder

    tokens = GEMMA + [f"<0x{b:02X}>" for b in range(256)] + ["b", "c", "a", "▁", "bc", "ab"]
    types = [CONTROL] * len(GEMMA) + [BYTE] * 256 + [NORMAL] * 6
    scores = [0.0] * (len(GEMMA) + 256) + [-1000.0] * 6
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(SpecdeployError, match="one score.*Hugging Face folder"):
        gguf_to_folder(write_gemma3_gguf(tmp_path / "tie.gguf", (tokens, scores, types)), "target", work)


@pytest.mark.parametrize("short", ["scores", "types"])
def test_a_gguf_with_fewer_scores_or_types_than_tokens_is_refused(tmp_path, short):
    """llama.cpp refuses such a file ("Index out of array bounds for scores/toktypes"). The export either crashed in
    the rebuild (IndexError from gguf_vocab._sentencepiece, types) or silently kept transformers' reading, which
    tokenizes otherwise than llama.cpp (scores)."""
    from specdeploy.errors import SpecdeployError
    from specdeploy.export.gguf import gguf_to_folder

    tokens = GEMMA + [f"<0x{b:02X}>" for b in range(256)] + ["b", "c", "a", "▁", "bc", "ab"]
    types = [CONTROL] * len(GEMMA) + [BYTE] * 256 + [NORMAL] * 6
    scores = [0.0] * (len(GEMMA) + 256) + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    if short == "scores":
        scores = scores[:-3]
    else:
        types = types[:-3]
    path = write_gemma3_gguf(tmp_path / "short.gguf", (tokens, scores, types))
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(SpecdeployError, match=short[:-1]):
        gguf_to_folder(path, "target", work)


def test_unknown_typed_tokens_typed_in_text_are_matched_whole(tmp_path):
    """llama.cpp partitions text on every CONTROL, USER_DEFINED and UNKNOWN-typed token before merging (with special
    tokens parsed, as llama-server's /tokenize and prompts parse them). Phi-3's GGUFs type their [PAD32011]..
    padding tokens UNKNOWN: llama.cpp reads '[PAD32011] x' as '[PAD32011]', '▁x' (checked on
    ggml-vocab-phi-3.gguf); the export neither adds them as special tokens nor matches them whole."""
    from tokenizers import Tokenizer

    unknown = "[PAD300]"
    chars = sorted(set(unknown) | {"▁", "x"})
    tokens = GEMMA + [f"<0x{b:02X}>" for b in range(256)] + chars + [unknown]
    types = [CONTROL] * len(GEMMA) + [BYTE] * 256 + [NORMAL] * len(chars) + [2]  # gguf.TokenType.UNKNOWN
    scores = [0.0] * (len(GEMMA) + 256) + [-1.0] * len(chars) + [0.0]
    folder = _folder(write_gemma3_gguf(tmp_path / "unknown.gguf", (tokens, scores, types)), tmp_path)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert [tokens[i] for i in tokenizer.encode(f"{unknown} x", add_special_tokens=False).ids] == [unknown, "▁", "x"]
