"""Chat: templates rendered as transformers' apply_chat_template renders them, and conversations through
`generate(messages=...)`, `stream`, `run --chat/--messages` and `bench --chat`, ending at the end of turn.

The chat bundle's tokenizer has ChatML's turn markers as special tokens and a post-processor that
adds BOS; its target is trained briefly on short ChatML conversations, so that its replies end
with `<|im_end|>` as an instruct model's do.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import specdeploy
from specdeploy.cli import main
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.chat import load_chat_template

from conftest import BOS, SIZES, VOCAB, build_checkpoint, export_pair, model_config

CHATML = """{% for message in messages %}
  {% if loop.first and messages[0]['role'] != 'system' %}
{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}
  {% endif %}
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|im_start|>assistant\\n' }}
{% endif %}"""
# Gemma 3's template as its tokenizer_config.json ships it (the system message joins the first user turn).
GEMMA = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)
# What transformers' environment adds: its tojson (no HTML escaping), strftime_now, loop controls,
# the generation tag, the special tokens as variables.
FEATURES = """{{ bos_token }}{% for message in messages %}
{% if message['role'] == 'system' %}{% continue %}{% endif %}
{{ message | tojson }} {{ "<a&b>" | tojson }}
{% generation %}{{ message['content'] | upper }}{% endgeneration %}{{ eos_token }}
{% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}{{ strftime_now('%Y') }}{% if add_generation_prompt %}[reply]{% endif %}"""
# The chat bundle's: ChatML after the BOS token.
BUNDLE_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                   "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                   "<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = {
    "user": [{"role": "user", "content": "insort_left"}],
    "system": [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "bisect_right"}],
    "turns": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é ünïcode"},
              {"role": "assistant", "content": "Hello \"there\" <b>"}, {"role": "user", "content": "heappush"}],
}
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def stdlib_text() -> str:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "".join((stdlib / name).read_text() for name in ("textwrap.py", "bisect.py", "heapq.py", "colorsys.py"))


def definitions() -> list[tuple[str, str]]:
    """(name, 'def name(args):') for each one-line function definition in the training text."""
    found = []
    for line in stdlib_text().splitlines():
        line = line.strip()
        if line.startswith("def ") and line.endswith(":") and "(" in line:
            found.append((line[4 : line.index("(")], line))
    return found


def write_tokenizer(folder: Path, template: str | None) -> None:
    """A byte-level BPE with ChatML's markers as special tokens and a post-processor that adds BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([stdlib_text()], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="</s>",
                                   additional_special_tokens=SPECIALS[2:])
    fast.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def hf_render(folder: Path, messages: list[dict]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def chat_bundle(tmp_path_factory) -> Path:
    """A Llama target trained on ChatML conversations (user: a function's name; assistant: its def line),
    a noisy copy of it as the draft, the tokenizer above with BUNDLE_TEMPLATE."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    root = tmp_path_factory.mktemp("chat")
    tokenizer_dir = root / "tokenizer"
    write_tokenizer(tokenizer_dir, BUNDLE_TEMPLATE)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    template = load_chat_template(tokenizer_dir)
    pairs = definitions()
    random.Random(0).shuffle(pairs)
    ids = []
    for name, line in pairs * 4:
        text = template.render([{"role": "user", "content": name}, {"role": "assistant", "content": line}],
                               add_generation_prompt=False)
        ids += tokenizer.encode(text, add_special_tokens=False).ids
    ids = torch.tensor(ids)

    torch.manual_seed(21)
    model = AutoModelForCausalLM.from_config(model_config("llama", *SIZES["target"]))
    generator = torch.Generator().manual_seed(21)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(300):
        starts = torch.randint(0, len(ids) - 65, (16,), generator=generator)
        batch = torch.stack([ids[s : s + 65] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=1, pad_token_id=1)
    target = root / "target"
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            (target / name).write_bytes((tokenizer_dir / name).read_bytes())
    draft = build_checkpoint(root / "draft", "llama", 0, 0, seed=22, tokenizer_dir=target, noisy_copy_of=target,
                             noise=0.05)
    out = root / "bundle"
    export_pair({"target": target, "draft": draft}, out)
    return out


@pytest.fixture(scope="module")
def generator(chat_bundle):
    return specdeploy.load(chat_bundle)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name, template", [("chatml", CHATML), ("gemma", GEMMA), ("features", FEATURES)])
def test_rendering_equals_transformers_apply_chat_template(tmp_path, name, template, conversation):
    messages = CONVERSATIONS[conversation]
    write_tokenizer(tmp_path, template)
    assert load_chat_template(tmp_path).render(messages) == hf_render(tmp_path, messages)


def test_a_models_named_special_tokens_reach_the_template_as_in_transformers(tmp_path):
    template = "{{ bos_token }}{{ image_token }}|{{ boi_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    write_tokenizer(tmp_path, template)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = {"image_token": "<|im_start|>", "boi_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    rendered = load_chat_template(tmp_path).render(CONVERSATIONS["user"])
    assert rendered == hf_render(tmp_path, CONVERSATIONS["user"]) == "<s><|im_start|>|<|im_end|>insort_left"


def test_template_sources_and_end_of_turn(tmp_path):
    write_tokenizer(tmp_path, None)
    assert load_chat_template(tmp_path) is None
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": GEMMA}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path).end_of_turn_text() == "<end_of_turn>\n"
    (tmp_path / "chat_template.jinja").write_text(CHATML)  # the file newer checkpoints save wins
    template = load_chat_template(tmp_path)
    assert template.end_of_turn_text() == "<|im_end|>\n\n"  # an expression's line keeps its newline
    assert template.render(CONVERSATIONS["system"]) == hf_render(tmp_path, CONVERSATIONS["system"])


def test_generate_messages_equals_the_rendered_prompt_and_stops_at_end_of_turn(generator, chat_bundle):
    from tokenizers import Tokenizer

    im_end = SPECIALS.index("<|im_end|>")
    assert generator.end_of_turn_ids == (im_end,)
    tokenizer = Tokenizer.from_file(str(chat_bundle / "tokenizer" / "tokenizer.json"))
    for messages in (CONVERSATIONS["user"], CONVERSATIONS["system"]):
        ids = tokenizer.encode(hf_render(chat_bundle / "tokenizer", messages), add_special_tokens=False).ids
        assert ids[0] == BOS and ids[1] != BOS
        assert generator.encode_chat(messages) == ids
        for options in (dict(temperature=0), dict(temperature=0.8, seed=5)):
            plain = generator.generate(ids, max_new_tokens=60, **options)  # only EOS ends it
            assert im_end in plain.token_ids, plain.text  # the trained target ends its turn
            reply = generator.generate(messages=messages, max_new_tokens=60, **options)
            assert reply.token_ids == plain.token_ids[: plain.token_ids.index(im_end) + 1]
            assert reply.stats.finish_reason == "eos"
            assert reply.text == generator.codec.decode(reply.token_ids) and "<|im_end|>" not in reply.text
            assert "".join(generator.stream(messages=messages, max_new_tokens=60, **options)) == reply.text


def test_a_templated_prompt_gets_one_bos(generator, chat_bundle):
    messages = CONVERSATIONS["user"]
    rendered = hf_render(chat_bundle / "tokenizer", messages)
    assert rendered.startswith("<s>")
    codec = generator.codec
    assert codec.encode("def f") == [BOS] + codec.encode("def f", add_special_tokens=False)  # the post-processor's BOS
    assert codec.encode(rendered) == codec.encode(rendered, add_special_tokens=False) == generator.encode_chat(messages)
    assert generator.generate(prompt=rendered, max_new_tokens=8).token_ids == \
        generator.generate(generator.encode_chat(messages), max_new_tokens=8).token_ids


def run_json(bundle, *args, input=None) -> dict:
    result = subprocess.run([sys.executable, "-m", "specdeploy", "run", str(bundle), "--json", *args],
                            capture_output=True, text=True, input=input, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_run_chat_system_and_messages_are_generate_messages(generator, chat_bundle, tmp_path):
    system, question = CONVERSATIONS["system"]
    expected = generator.generate(messages=[system, question], max_new_tokens=60, temperature=0)
    payload = run_json(chat_bundle, "--chat", question["content"], "--system", system["content"], "--max-new-tokens", "60")
    assert payload["token_ids"] == expected.token_ids and payload["stats"]["finish_reason"] == "eos"
    (tmp_path / "messages.json").write_text(json.dumps([system, question]))
    assert run_json(chat_bundle, "--messages", str(tmp_path / "messages.json"), "--max-new-tokens", "60")["token_ids"] \
        == expected.token_ids
    alone = generator.generate(messages=[question], max_new_tokens=60, temperature=0)
    assert run_json(chat_bundle, "--chat", "-", "--max-new-tokens", "60", input=question["content"])["token_ids"] \
        == alone.token_ids


def test_bench_chat_sends_user_messages(chat_bundle, tmp_path):
    prompts = [name for name, _ in definitions()[:2]]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    result = CliRunner().invoke(main, ["bench", str(chat_bundle), "--chat", "--prompts", str(tmp_path / "prompts.json"),
                                       "--max-new-tokens", "60", "-k", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["chat"] is True and report["identical_outputs"] is True
    generator = specdeploy.load(chat_bundle)
    expected = sum(len(generator.generate(messages=[{"role": "user", "content": p}], max_new_tokens=60,
                                          temperature=0).token_ids) for p in prompts)
    assert report["target_only"]["new_tokens"] == expected < 60 * len(prompts)


def one_error_line(args, input=None) -> str:
    result = CliRunner().invoke(main, args, input=input)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_bad_chat_input_is_one_error_line(chat_bundle, agreeing_bundle, tmp_path):
    bundle = str(chat_bundle)
    assert "no chat template" in one_error_line(["run", str(agreeing_bundle), "--chat", "hi"])
    assert "no chat template" in one_error_line(["bench", str(agreeing_bundle), "--chat", "--max-new-tokens", "4"])
    assert "pass one of --prompt, --chat or --messages (got --prompt and --chat)" in \
        one_error_line(["run", bundle, "--prompt", "x", "--chat", "y"])
    assert "--system goes with --chat" in one_error_line(["run", bundle, "--prompt", "x", "--system", "y"])
    cases = {"broken.json": ("[{\"role\": ", "is not JSON"),
             "object.json": ('{"role": "user", "content": "x"}', "non-empty list"),
             "empty.json": ("[]", "non-empty list"),
             "role.json": ('[{"role": "robot", "content": "x"}]', "messages[0]: unknown role 'robot'"),
             "content.json": ('[{"role": "user", "content": 3}]', "messages[0] (user) needs a string \"content\""),
             "system.json": ('[{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]', "keep one")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        extra = ["--system", "s"] if name == "system.json" else []
        assert message in one_error_line(["run", bundle, "--messages", str(tmp_path / name), *extra]), name
    assert "cannot read --messages" in one_error_line(["run", bundle, "--messages", str(tmp_path / "none.json")])


def test_bad_messages_in_python(generator, agreeing_bundle):
    with pytest.raises(SpecdeployError, match="unknown role 'robot'"):
        generator.generate(messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(SpecdeployError, match="one of them"):
        generator.generate("x", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(SpecdeployError, match="one of them"):
        generator.generate()
    with pytest.raises(SpecdeployError, match="no chat template"):
        specdeploy.load(agreeing_bundle, warm_up=False).generate(messages=[{"role": "user", "content": "x"}])
    with pytest.raises(SpecdeployError, match="stop_token_ids must be in"):
        generator.generate("x", stop_token_ids=[VOCAB])


def test_serve_chat_stops_at_end_of_turn(generator, chat_bundle):
    from test_serve import LiveServer

    from specdeploy.serve.config import ServeConfig

    messages = CONVERSATIONS["system"]
    reply = generator.generate(messages=messages, max_new_tokens=60, temperature=0)
    assert reply.stats.finish_reason == "eos"
    live = LiveServer(ServeConfig(bundle=str(chat_bundle), model_name="chat"))
    try:
        client = live.client()
        response = client.chat.completions.create(model="chat", messages=messages, max_tokens=60, temperature=0)
        assert response.choices[0].message.content == reply.text
        assert response.choices[0].finish_reason == "stop"
        assert response.usage.completion_tokens == len(reply.token_ids)
        chunks = client.chat.completions.create(model="chat", messages=messages, max_tokens=60, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.text
    finally:
        live.close()


def test_a_template_that_fails_with_a_python_error_is_a_specdeploy_error():
    """A template bug that Jinja raises as a Python error (str + int) is refused like raise_exception's, in
    render and in the end-of-turn probe generate(messages=...) runs, never as a bare TypeError."""
    from specdeploy.runtime.chat import ChatTemplate

    template = ChatTemplate("{% for m in messages %}{{ '[' + loop.index + '] ' + m['content'] }}{% endfor %}", {})
    with pytest.raises(SpecdeployError, match="chat template"):
        template.render([{"role": "user", "content": "hi"}])
    assert template.end_of_turn_text() == ""  # the probe fails like a refused conversation: no end of turn


@pytest.mark.parametrize("name, text", [("surrogate.json", '[{"role": "user", "content": "hi \\ud800"}]'),
                                        ("deep.json", "[" * 100_000 + "]" * 100_000)])
def test_bad_messages_file_is_a_handled_error(tmp_path, name, text):
    """--messages holding a lone surrogate (as --chat refuses one) or JSON nested past Python's recursion limit:
    a specdeploy error naming the file, not the catch-all for unexpected exceptions."""
    from specdeploy.defaults import SHIPPED_BUNDLE

    (tmp_path / name).write_text(text)
    result = CliRunner().invoke(main, ["run", str(SHIPPED_BUNDLE), "--messages", str(tmp_path / name),
                                       "--max-new-tokens", "2"])
    assert result.exit_code == 2
    assert "--messages" in result.stderr and "run with --debug" not in result.stderr, result.stderr


def test_streamed_text_equals_the_decoded_text_for_byte_fallback_runs(tmp_path):
    """A SentencePiece byte-fallback tokenizer (Llama 2, Gemma from GGUF) decodes a run of byte tokens that is not
    valid UTF-8 to one U+FFFD per byte, the valid ones before it included: the stream must show the same text as
    decode (and generate's text), not an 'H' that the final text does not have."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models

    from specdeploy.runtime.text import TextCodec, TextStream

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁hi": 257}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec(tmp_path, SimpleNamespace(bos_token_id=None))
    for ids in ([1 + 0x48, 1 + 0x9B], [257, 1 + 0x48, 1 + 0xE2, 257]):  # 'H' + a stray continuation byte, ...
        stream = TextStream(codec)
        streamed = "".join(stream.push(token) for token in ids) + stream.finish()
        assert streamed == stream.text == codec.decode(ids), ids


@pytest.mark.parametrize("special", [True, False])
def test_the_end_of_turn_is_the_turn_marker_special_or_merely_added(tmp_path, special):
    """Some tokenizers add their turn markers without the special flag: the reply must still end there.
    A blank added token after a reply (a template with no marker) is not an end of turn."""
    from types import SimpleNamespace

    from tokenizers import AddedToken, Tokenizer

    from specdeploy.runtime.chat import ChatTemplate
    from specdeploy.runtime.generate import Generator
    from specdeploy.runtime.text import TextCodec

    tokenizer = Tokenizer.from_file(str(build_plain_tokenizer(tmp_path)))
    tokenizer.add_tokens([AddedToken("<|end|>", special=special), AddedToken("\n\n", special=False)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec(tmp_path, SimpleNamespace(bos_token_id=None))
    end, blank = tokenizer.token_to_id("<|end|>"), tokenizer.token_to_id("\n\n")

    def end_of_turn(template: str) -> tuple[int, ...]:
        holder = SimpleNamespace(chat_template=ChatTemplate(template, {}), codec=codec, _end_of_turn_ids=None)
        return Generator.end_of_turn_ids.fget(holder)

    assert end_of_turn("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n\n<|end|>\n{% endfor %}") == (end,)
    assert end_of_turn("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}") == ()
    assert blank not in codec.added_token_ids() | codec.added_token_ids(special=False)


def build_plain_tokenizer(folder: Path) -> Path:
    """A byte-level BPE trained on a little text, with no added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["def f(x):\n    return x\n"] * 20, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"
