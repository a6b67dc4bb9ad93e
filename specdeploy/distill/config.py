"""The one configuration of a distillation run, and the fields a resumed run must share with its checkpoint."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import SpecdeployError

KINDS = ("model", "eagle")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class DistillConfig:
    target: str                       # a Hugging Face folder, or a .gguf file
    out: str                          # the draft folder to write (a new or empty folder, or a run to --resume)
    kind: str = "model"               # model: a small causal LM; eagle: a head over the target's last hidden state
    data: tuple[str, ...] = ()        # text files, folders (every UTF-8 file under them) or glob patterns
    generate_tokens: int = 16384      # tokens of the target's own text from the seed prompts (0: none)
    max_text_tokens: int = 2_000_000  # tokens read from --data at most (files in a seeded order)
    minutes: float | None = 60.0      # this invocation's whole run, generations and saves included (None: no limit)
    steps: int | None = None          # optimizer steps in all, resumed runs included (None: no limit)
    layers: int | None = None         # decoder layers of the draft (None: 2 for model, 1 for eagle)
    hidden_size: int | None = None    # model kind: the draft's width (None: the target's, so its weights can be copied)
    draft_vocab: int | None = None    # the draft's head covers the N most frequent token ids (None: the whole vocabulary)
    device: str = "cpu"
    threads: int | None = None        # PyTorch's CPU threads (None: its default); 1 is faster on a CPU shared with other work
    resume: bool = False
    seed: int = 0
    seq_len: int = 256                # tokens per training window
    batch_size: int = 8               # windows per optimizer step
    lr: float | None = None           # None: 3e-4 for model, 1e-3 for eagle
    warmup_steps: int = 20
    top_k: int = 64                   # the divergence is taken over the target's top-k tokens (renormalized)
    feature_weight: float = 1.0       # eagle: weight of the smooth-L1 loss on the predicted hidden state
    unroll: int = 1                   # eagle: training steps that feed the head its own predicted features (1: EAGLE-1)
    feature_noise: float = 0.1        # eagle: uniform noise on the input features, relative to their RMS (EAGLE-1)
    eval_every: int = 50              # steps between progress lines (each measures held-out agreement)
    checkpoint_minutes: float = 5.0   # wall-clock time between checkpoints
    checkpoint_steps: int | None = None  # also checkpoint every N steps (None: by time only)
    heldout_tokens: int = 2048        # held-out tokens per source (chat, code, text)
    num_draft_tokens: int = 4         # k of the accepted-tokens-per-round estimate

    @property
    def num_layers(self) -> int:
        return self.layers if self.layers is not None else (2 if self.kind == "model" else 1)

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (3e-4 if self.kind == "model" else 1e-3)

    def validate(self) -> "DistillConfig":
        """Checks that need no target; the target's limits (layers, width, vocabulary) are checked once it is loaded."""
        if self.kind not in KINDS:
            raise SpecdeployError(f"--kind {self.kind}: unknown kind (model | eagle)")
        if self.device not in DEVICES:
            raise SpecdeployError(f"--device {self.device}: unknown device (cpu | cuda)")
        positive = {"--layers": self.layers, "--hidden-size": self.hidden_size, "--steps": self.steps,
                    "--seq-len": self.seq_len, "--batch-size": self.batch_size, "--eval-every": self.eval_every,
                    "--checkpoint-steps": self.checkpoint_steps, "--draft-vocab": self.draft_vocab,
                    "--unroll": self.unroll, "--top-k": self.top_k, "--threads": self.threads}
        for flag, value in positive.items():
            if value is not None and value < 1:
                raise SpecdeployError(f"{flag} {value}: must be at least 1")
        for flag, value in (("--minutes", self.minutes), ("--lr", self.lr), ("--checkpoint-minutes", self.checkpoint_minutes)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise SpecdeployError(f"{flag} {value}: must be a positive number")
        if self.generate_tokens < 0 or self.max_text_tokens < 0 or self.heldout_tokens < 0:
            raise SpecdeployError("--generate-tokens and token limits cannot be negative")
        if not self.data and self.generate_tokens == 0:
            raise SpecdeployError("no training text: pass --data, or let the target generate some (--generate-tokens > 0)")
        if self.data and self.max_text_tokens == 0:
            raise SpecdeployError("--max-text-tokens 0 reads no text from --data: raise it, or leave --data out")
        if self.kind == "eagle" and self.seq_len < self.unroll + 1:  # S tokens give S - 1 head inputs, step s uses S - s
            raise SpecdeployError(f"--seq-len {self.seq_len}: an eagle head needs at least --unroll + 1 "
                                  f"({self.unroll + 1}) tokens a window")
        if self.kind == "model" and self.unroll != 1:
            raise SpecdeployError("--unroll applies to --kind eagle only")
        if self.kind == "eagle" and self.hidden_size is not None:
            raise SpecdeployError("--hidden-size applies to --kind model only (an eagle head has the target's width)")
        return self

    def fingerprint(self) -> dict:
        """What fixes the draft's shape and the data order: a resumed run must match its checkpoint on each."""
        fields = ("kind", "data", "generate_tokens", "max_text_tokens", "layers", "hidden_size", "draft_vocab", "seed",
                  "seq_len", "batch_size", "top_k", "unroll", "heldout_tokens")
        values = dataclasses.asdict(self)
        values["layers"] = self.num_layers
        values["data"] = list(self.data)
        return {name: values[name] for name in fields}


# How each fingerprint field is spelled on the command line, for the resume-mismatch message.
FLAGS = {"kind": "--kind", "data": "--data", "generate_tokens": "--generate-tokens", "max_text_tokens": "--max-text-tokens",
         "layers": "--layers", "hidden_size": "--hidden-size", "draft_vocab": "--draft-vocab", "seed": "--seed",
         "seq_len": "--seq-len", "batch_size": "--batch-size", "top_k": "--top-k", "unroll": "--unroll",
         "heldout_tokens": "--heldout-tokens"}
