"""The options several commands share (`run`, `chat`, `bench`, `serve`), and the bundle a command runs
when none is named."""

from __future__ import annotations

import click

from . import defaults
from .cli_input import Utf8Text
from .cli_support import EXACT_HELP, combine_options
from .runtime.config import SEED_LIMIT, GenerationConfig
from .runtime.loader import DRAFTERS
from .runtime.session import DEVICES

SEED = click.IntRange(0, SEED_LIMIT - 1)
TEXT = Utf8Text()
DEFAULTS = GenerationConfig  # the defaults of the options below are its fields'


# Generation controls of `run` and `bench`: the sampling ones named as Hugging Face's GenerationConfig
# names them, then the seed and the drafting threshold.
SAMPLING_OPTIONS = combine_options(
    click.option("--temperature", type=float, default=DEFAULTS.temperature, show_default=True, help="0 is greedy."),
    click.option("--top-k", type=int, default=DEFAULTS.top_k, show_default=True, help="0 is off."),
    click.option("--top-p", type=float, default=DEFAULTS.top_p, show_default=True, help="1.0 is off."),
    click.option("--min-p", type=float, default=DEFAULTS.min_p, show_default=True,
                 help="Keep tokens at least this fraction as likely as the most likely one; 0 is off."),
    click.option("--repetition-penalty", type=float, default=DEFAULTS.repetition_penalty, show_default=True,
                 help="Divide positive / multiply negative logits of tokens already in the context (HF's); 1.0 is off."),
    click.option("--seed", type=SEED, default=DEFAULTS.seed, show_default=True, help="0 .. 2**64 - 1."),
    click.option("--draft-confidence", type=float, default=DEFAULTS.draft_confidence, show_default=True,
                 help="Stop drafting once the draft's top probability falls below this (0: always draft k)."),
)
# OpenAI's penalties, for `run` and `chat`.
PENALTY_OPTIONS = combine_options(
    click.option("--presence-penalty", type=float, default=DEFAULTS.presence_penalty, show_default=True,
                 help="Subtracted once from the logit of each token generated so far (OpenAI's); -2..2, 0 is off."),
    click.option("--frequency-penalty", type=float, default=DEFAULTS.frequency_penalty, show_default=True,
                 help="Subtracted per occurrence among the tokens generated so far (OpenAI's); -2..2, 0 is off."),
)
# A constraint on the output, for `run` and `chat`: one of them (runtime/constraint.py).
CONSTRAINT_OPTIONS = combine_options(
    click.option("--json-schema", type=click.Path(dir_okay=False), default=None,
                 help="Hold the output to the JSON schema in this file (the output is one JSON value)."),
    click.option("--regex", type=TEXT, default=None, help="Hold the output to this regular expression (all of it matches)."),
    click.option("--grammar", type=click.Path(dir_okay=False), default=None,
                 help="Hold the output to the grammar in this file: Lark (llguidance's) or GBNF (llama.cpp's)."),
)
# How `run`, `bench` and `serve` load a bundle.
DEVICE_OPTION = click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True,
                             help="Where the models run (cuda and tensorrt need onnxruntime-gpu).")
DRAFTER_OPTION = click.option("--drafter", type=click.Choice(DRAFTERS), default=defaults.DRAFTER, show_default=True,
                              help="hybrid: the draft model (if any), its proposal continued by prompt lookup where "
                                   "the text repeats and the model's first token agrees; model: the draft model every "
                                   "round; prompt-lookup: no model. None changes the output.")
VERIFY_OPTION = click.option("--verify", is_flag=True, help="Re-hash every bundle file before loading (sizes are always checked).")
EXACT_OPTION = click.option("--exact", is_flag=True, default=False, help=EXACT_HELP)
LOAD_OPTIONS = combine_options(DEVICE_OPTION, DRAFTER_OPTION, VERIFY_OPTION, EXACT_OPTION)  # run, chat, bench


def resolve_bundle(bundle: str | None) -> str:
    """The named bundle, or the one defaults.bundle_to_run picks (the exported default, else the shipped demo)."""
    return bundle if bundle is not None else str(defaults.bundle_to_run())
