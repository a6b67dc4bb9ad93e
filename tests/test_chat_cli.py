"""`specdeploy chat`: replies equal the Python API's on the same conversation, commands, the history
kept within the context, Ctrl-C, and the demo pair's chat template. Driven through click's runner."""

import shutil

import pytest
from click.testing import CliRunner

import specdeploy
from specdeploy.chat_cli import ChatConfig, Conversation, read_lines, run_chat
from specdeploy.cli import main
from specdeploy.defaults import DEMO_DIR
from specdeploy.runtime.generate import GenerationConfig, GenerationOutput, GenerationStats

DEMO_TEMPLATE = (DEMO_DIR / "target" / "chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def bundle(agreeing_bundle, tmp_path_factory):
    """The agreeing bundle (<s>, </s>) given the demo pair's template: a turn ends at EOS."""
    copy = tmp_path_factory.mktemp("chat-cli") / "bundle"
    shutil.copytree(agreeing_bundle, copy)
    (copy / "tokenizer" / "chat_template.jinja").write_text(DEMO_TEMPLATE)
    return str(copy)


def chat(bundle, *args, input=""):
    result = CliRunner().invoke(main, ["chat", bundle, *args], input=input)
    return result.exit_code, result.stdout, result.stderr


def shown(replies):
    """stdout for these replies: each followed by a newline unless it ends with one."""
    return "".join(reply if reply.endswith("\n") else reply + "\n" for reply in replies if reply)


def test_replies_equal_generate_on_the_whole_conversation(bundle):
    code, stdout, stderr = chat(bundle, "--max-new-tokens", "12", "--stats", input="def f(x):\nreturn it\n")
    assert code == 0, stderr
    generator = specdeploy.load(bundle)  # the same calls in the same order: the same cache reuse
    first = generator.generate(messages=[{"role": "user", "content": "def f(x):"}], max_new_tokens=12).text
    second = generator.generate(messages=[{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": first},
                                          {"role": "user", "content": "return it"}], max_new_tokens=12).text
    assert stdout == shown([first, second])
    assert sum("tok/s" in line for line in stderr.splitlines()) == 2  # --stats: one line per reply


def test_commands_system_reset_exit_and_the_seed_per_reply(bundle):
    lines = "/system Be brief.\nhi\n/reset\nhi\n/frob\n/exit\nnot read\n"
    code, stdout, stderr = chat(bundle, "--max-new-tokens", "10", "--temperature", "0.8", "--seed", "5", input=lines)
    assert code == 0, stderr
    generator = specdeploy.load(bundle)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    replies = [generator.generate(messages=messages, max_new_tokens=10, temperature=0.8, seed=seed).text
               for seed in (5, 6)]  # reply i samples with seed + i; /reset keeps the system message
    assert stdout == shown(replies)
    assert "(system message set)" in stderr and "(conversation cleared; system message kept)" in stderr
    assert "unknown command /frob" in stderr


def test_continued_lines_slash_escape_and_end_of_input(bundle):
    code, stdout, stderr = chat(bundle, "--max-new-tokens", "8", input="def f(x):\\\n    return\n//x\n")
    assert code == 0, stderr  # end of input ends the session like /exit
    generator = specdeploy.load(bundle)
    first = generator.generate(messages=[{"role": "user", "content": "def f(x):\n    return"}], max_new_tokens=8).text
    second = generator.generate(messages=[{"role": "user", "content": "def f(x):\n    return"},
                                          {"role": "assistant", "content": first}, {"role": "user", "content": "/x"}],
                                max_new_tokens=8).text
    assert stdout == shown([first, second])


def test_a_command_continued_on_the_next_line_takes_it_as_its_argument(bundle):
    generator = specdeploy.load(bundle)
    for command in ("/system\\\nBe\\\nbrief.", "/system Be\\\nbrief."):
        code, stdout, stderr = chat(bundle, "--max-new-tokens", "8", input=command + "\nhi\n")
        assert code == 0, stderr
        assert "unknown command" not in stderr and "(system message set)" in stderr
        messages = [{"role": "system", "content": "Be\nbrief."}, {"role": "user", "content": "hi"}]
        assert stdout == shown([generator.generate(messages=messages, max_new_tokens=8).text])


def test_a_full_context_drops_the_oldest_turns_and_says_so(bundle):
    message = "\\\n".join(["x = 1"] * 25) + "\n"  # one message of 25 lines, about 100 tokens of the bundle's 256
    code, stdout, stderr = chat(bundle, "--max-new-tokens", "40", input=message * 4)
    assert code == 0, stderr
    assert "note: dropped the oldest" in stderr and "256-token context" in stderr
    assert "error" not in stderr


def test_a_message_too_long_for_the_context_is_refused_and_the_session_goes_on(bundle):
    code, stdout, stderr = chat(bundle, "--max-new-tokens", "6", input="x = 1 " * 300 + "\nhi\n")
    assert code == 0, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "the context holds 256" in errors[0]
    generator = specdeploy.load(bundle)
    assert stdout == shown([generator.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=6).text])


def test_bad_options_and_a_bundle_without_a_template_are_one_error_line(bundle, agreeing_bundle):
    for args, message in ((["--temperature", "-1"], "error: --temperature must be"), (["--seed", "-1"], "'--seed'")):
        code, stdout, stderr = chat(bundle, *args, input="hi\n")
        assert code == 2 and stdout == "" and stderr.startswith("error: ") and message in stderr
        assert len(stderr.strip().splitlines()) == 1
    code, stdout, stderr = chat(str(agreeing_bundle), input="hi\n")
    assert code == 2 and stdout == "" and "has no chat template" in stderr and len(stderr.strip().splitlines()) == 1


def test_fit_keeps_the_system_message_and_drops_whole_turns():
    conversation = Conversation("sys")
    conversation.turns = [("a" * 30, "b" * 30), ("c" * 30, "d" * 30), ("e" * 10, "f" * 10)]

    def encode(messages):  # one token per character
        return [0] * sum(len(m["content"]) for m in messages)

    messages, dropped = conversation.fit("q" * 10, encode, max_context=100, reply_tokens=20)
    assert dropped == 2 and conversation.turns == [("e" * 10, "f" * 10)]
    assert [m["content"] for m in messages] == ["sys", "e" * 10, "f" * 10, "q" * 10]
    # a reply budget beyond half the context reserves half: history is not dropped for it
    conversation.turns = [("e" * 10, "f" * 10)]
    assert conversation.fit("q" * 10, encode, max_context=100, reply_tokens=1000)[1] == 0


class ScriptedGenerator:
    """A generator whose first reply is interrupted (Ctrl-C) after two pieces; later replies finish."""

    max_context = 1000

    def __init__(self):
        self.calls = []

    def encode_chat(self, messages):
        return [0] * len(messages)

    def stream(self, messages, **options):
        self.calls.append(messages)
        return ScriptedStream(interrupted=len(self.calls) == 1)


class ScriptedStream:
    """Generator.stream's Stream: two pieces, then Ctrl-C or the end; `output` once it has ended."""

    def __init__(self, interrupted: bool):
        self.interrupted, self.output = interrupted, None
        self._pieces = iter(["par", "tial"])

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._pieces)
        except StopIteration:
            reason = "interrupted" if self.interrupted else "eos"
            self.output = GenerationOutput("partial", [1, 2], GenerationStats(finish_reason=reason))
            if self.interrupted:
                raise KeyboardInterrupt from None
            raise

    def close(self):
        pass


def test_ctrl_c_stops_the_answer_not_the_session(capsys):
    generator = ScriptedGenerator()
    inputs = iter(["first", KeyboardInterrupt, "second", None])

    def read():
        item = next(inputs)
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt  # at the prompt: a fresh prompt
        return item

    run_chat(generator, ChatConfig(generation=GenerationConfig(max_new_tokens=4), stats=True), read)
    out = capsys.readouterr()
    assert out.out == "partial\npartial\n"
    assert "(interrupted)" in out.err and "Ctrl-D or /exit quits" in out.err
    assert out.err.count("/exit") == 1  # the way out named once
    assert generator.calls[1][:2] == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "partial"}]
    assert "[interrupted]" in out.err and "[eos]" in out.err


def test_the_demo_pairs_template_ends_a_turn_at_eos():
    from specdeploy.export.special_tokens import end_of_turn_tokens
    from specdeploy.runtime.chat import load_chat_template

    for role in ("target", "draft"):
        assert (DEMO_DIR / role / "chat_template.jinja").read_text() == DEMO_TEMPLATE
    template = load_chat_template(DEMO_DIR / "target")
    text = template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nS</s>\n<|im_start|>user\nhi</s>\n<|im_start|>assistant\n"
    assert end_of_turn_tokens(DEMO_TEMPLATE, ["<s>", "</s>"], "<s>", "</s>") == ["</s>"]  # EOS: nothing to add


def test_a_message_refused_for_its_length_keeps_the_conversation():
    """A message too long for the context even alone is refused; the turns before it stay in the history."""
    from specdeploy.errors import SpecdeployError

    conversation = Conversation("sys")
    turns = [("a" * 10, "b" * 10), ("c" * 10, "d" * 10)]
    conversation.turns = list(turns)

    def encode(messages):  # one token per character
        return [0] * sum(len(m["content"]) for m in messages)

    with pytest.raises(SpecdeployError, match="the context holds 100"):
        conversation.fit("q" * 200, encode, max_context=100, reply_tokens=20)
    assert conversation.turns == turns  # the next (shorter) message still continues the conversation


def test_reply_i_samples_with_seed_plus_i_when_a_message_before_it_was_refused(bundle):
    """A message refused for its length gets no reply, so the next reply is still reply 0 (--seed + 0)."""
    too_long = "x = 1 " * 300
    options = ["--max-new-tokens", "12", "--temperature", "0.8", "--seed", "5"]
    code, stdout, stderr = chat(bundle, *options, input=f"{too_long}\nhi\n")
    assert code == 0, stderr
    assert "the context holds 256" in stderr
    code, alone, stderr = chat(bundle, *options, input="hi\n")
    assert code == 0, stderr
    generator = specdeploy.load(bundle)
    reply = generator.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=12, temperature=0.8,
                               seed=5).text
    assert alone == shown([reply])
    assert stdout == shown([reply])  # the same first reply, as `--seed`'s help promises


def test_ctrl_c_right_after_a_piece_is_written_keeps_that_piece_in_the_history(capsys, monkeypatch):
    """Ctrl-C lands while the last piece is being flushed to the terminal (the moment a user sees it):
    the piece is on the screen, so it is part of the reply the next turn sends back."""
    import click

    generator = ScriptedGenerator()
    real_echo = click.echo

    def echo(message=None, *args, **kwargs):
        real_echo(message, *args, **kwargs)
        if message == "tial":  # the signal arrives as the piece reaches the terminal
            raise KeyboardInterrupt

    monkeypatch.setattr(click, "echo", echo)
    inputs = iter(["first", "second", None])
    run_chat(generator, ChatConfig(generation=GenerationConfig(max_new_tokens=4)), lambda: next(inputs))
    out = capsys.readouterr()
    assert out.out.startswith("partial\n") and "(interrupted)" in out.err
    assert generator.calls[1][1] == {"role": "assistant", "content": "partial"}  # what was shown, all of it


def test_an_empty_system_option_is_an_empty_system_message_as_in_run():
    """`--system ""` sends a system message with no text (a template's default system prompt then stays
    out, as `run --chat x --system ""` has it); /system alone clears it, and no system message is sent."""
    generator = ScriptedGenerator()
    inputs = iter(["first", "second", "/system", "third", None])
    run_chat(generator, ChatConfig(generation=GenerationConfig(max_new_tokens=4), system=""), lambda: next(inputs))
    assert generator.calls[0][0] == {"role": "system", "content": ""}
    assert generator.calls[1][0] == {"role": "system", "content": ""}
    assert generator.calls[2][0]["role"] == "user"


def test_ctrl_c_while_the_history_is_fitted_stops_that_message_not_the_session(capsys):
    class SlowToEncode(ScriptedGenerator):
        def encode_chat(self, messages):
            if not self.calls:  # the first message: Ctrl-C before its answer starts
                self.calls.append(None)
                raise KeyboardInterrupt
            return super().encode_chat(messages)

    generator = SlowToEncode()
    inputs = iter(["first", "second", None])
    run_chat(generator, ChatConfig(generation=GenerationConfig(max_new_tokens=4)), lambda: next(inputs))
    out = capsys.readouterr()
    assert "(interrupted)" in out.err
    assert generator.calls[1] == [{"role": "user", "content": "second"}]  # "first" got no reply, kept no turn


def test_a_message_a_strict_terminal_cannot_decode_fails_alone(monkeypatch, capsys):
    """Under a strict UTF-8 locale input() raises UnicodeDecodeError on a bad byte: that message gets one
    error line and the session reads the next."""

    lines = iter([UnicodeDecodeError("utf-8", b"caf\xe9", 3, 4, "invalid continuation byte"), "hello", EOFError()])

    def fake_input(prompt=""):
        item = next(lines)
        if isinstance(item, BaseException):
            raise item
        return item

    monkeypatch.setattr("builtins.input", fake_input)
    generator = ScriptedGenerator()
    generator.calls.append(None)  # the scripted interruption is spent: the reply finishes
    run_chat(generator, ChatConfig(generation=GenerationConfig(max_new_tokens=4)), read_lines(interactive=True))
    out = capsys.readouterr()
    assert "error: this message is not valid utf-8 (the terminal's encoding): byte 0xe9 at offset 3" in out.err
    assert generator.calls[1] == [{"role": "user", "content": "hello"}] and out.out == "partial\n"
    assert out.err.endswith("> \n")  # Ctrl-D at the prompt: the shell's prompt comes back on a line of its own


class SeedRecorder(ScriptedGenerator):
    """Every reply finishes ("partial"); the seed each reply was asked to sample with is kept."""

    def __init__(self):
        super().__init__()
        self.calls.append(None)  # the scripted interruption is spent: every reply finishes
        self.seeds = []

    def stream(self, messages, **options):
        self.seeds.append(options.get("seed"))
        return super().stream(messages, **options)


def echo_raising_on(monkeypatch, when):
    """click.echo, with Ctrl-C landing right after the first call `when` accepts."""
    import click

    real_echo = click.echo
    fired = []

    def echo(message=None, *args, **kwargs):
        real_echo(message, *args, **kwargs)
        if not fired and when(message, kwargs):
            fired.append(message)
            raise KeyboardInterrupt

    monkeypatch.setattr(click, "echo", echo)
    return fired


def test_ctrl_c_as_a_finished_replys_newline_is_written_keeps_the_reply_in_the_history(capsys, monkeypatch):
    """The whole reply is on the screen when Ctrl-C lands as its closing newline is written: the next
    message sends it back as the assistant's turn (what was shown is what the history keeps)."""
    fired = echo_raising_on(monkeypatch, lambda message, kwargs: message is None and not kwargs.get("err"))
    generator = SeedRecorder()
    inputs = iter(["first", "second", None])
    run_chat(generator, ChatConfig(generation=GenerationConfig(max_new_tokens=4)), lambda: next(inputs))
    assert fired and capsys.readouterr().out.startswith("partial\n")
    assert generator.calls[2][:2] == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "partial"}]


def test_ctrl_c_as_the_stats_line_is_written_still_counts_the_reply_for_the_next_seed(capsys, monkeypatch):
    """Reply i samples with --seed + i counting the replies in the history: a reply that joined the history
    counts even when Ctrl-C lands while its stats line is written, so the next one samples with seed + 1."""
    fired = echo_raising_on(monkeypatch, lambda message, kwargs: isinstance(message, str) and "tok/s" in message)
    generator = SeedRecorder()
    inputs = iter(["first", "second", None])
    run_chat(generator, ChatConfig(generation=GenerationConfig(max_new_tokens=4, seed=5), stats=True),
             lambda: next(inputs))
    assert fired
    assert generator.calls[2][1] == {"role": "assistant", "content": "partial"}  # the first reply is history
    assert generator.seeds == [5, 6]


def test_a_valid_utf8_message_the_terminal_encoding_cannot_decode_is_not_called_invalid_utf8(monkeypatch, capsys):
    """Under a terminal encoding other than UTF-8 (PYTHONIOENCODING=ascii:strict, say) input() fails on
    'café', which is valid UTF-8: the error names the encoding that failed, not UTF-8."""
    lines = iter([UnicodeDecodeError("ascii", "café".encode(), 3, 4, "ordinal not in range(128)"), EOFError()])

    def fake_input(prompt=""):
        raise next(lines)

    monkeypatch.setattr("builtins.input", fake_input)
    run_chat(SeedRecorder(), ChatConfig(generation=GenerationConfig(max_new_tokens=4)), read_lines(interactive=True))
    err = capsys.readouterr().err
    assert "error:" in err and "ascii" in err and "not valid UTF-8" not in err, err
