"""Tiny random-weight checkpoints (GPT-2, Llama, Qwen2, Mistral, Phi-3) built here, and their bundles.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a slice of this interpreter's
standard library, the models are random configs with seeded weights.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
# The suite exports and loads bundles in one process; ONNX Runtime's shared pool would refuse the
# per-session pools optimum's exporter uses (test_runtime_imports covers the shared pool).
os.environ["SPECDEPLOY_SHARED_THREADS"] = "0"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BOS, EOS = 0, 1
VOCAB = 384
ARCHITECTURES = ("gpt2", "llama", "qwen2", "mistral", "phi3")
# (layers, hidden) per role: the draft is always the smaller.
SIZES = {"target": (2, 64), "draft": (1, 32)}


def build_tokenizer(folder: Path) -> None:
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [(stdlib / name).read_text() for name in ("textwrap.py", "bisect.py", "heapq.py", "colorsys.py")]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    assert tokenizer.get_vocab_size() == VOCAB
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.save_pretrained(folder)


def model_config(arch: str, layers: int, hidden: int):
    import transformers as tf

    common = dict(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS, initializer_range=0.2)
    if arch == "gpt2":
        return tf.GPT2Config(n_layer=layers, n_embd=hidden, n_head=4, n_positions=256, **common)
    kwargs = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, **common)
    if arch == "llama":
        return tf.LlamaConfig(**kwargs)
    if arch == "qwen2":
        return tf.Qwen2Config(**kwargs)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=None, **kwargs)
    if arch == "phi3":
        return tf.Phi3Config(original_max_position_embeddings=256, **kwargs)
    raise ValueError(arch)


def corpus_ids(tokenizer_dir: Path):
    import sysconfig

    from tokenizers import Tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    text = "".join((stdlib / name).read_text() for name in ("textwrap.py", "bisect.py", "heapq.py", "colorsys.py"))
    return tokenizer.encode(text).ids


def train_briefly(model, tokenizer_dir: Path, steps: int, seed: int) -> None:
    """A few seconds of next-token training: confident, realistic predictions (random weights are near-flat)."""
    import torch

    ids = torch.tensor(corpus_ids(tokenizer_dir))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (16,), generator=generator)
        batch = torch.stack([ids[s : s + 65] for s in starts])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def build_checkpoint(folder: Path, arch: str, layers: int, hidden: int, seed: int, tokenizer_dir: Path,
                     noisy_copy_of: Path | None = None, noise: float = 0.0, train_steps: int = 0) -> Path:
    """A random model (or a noisy copy of another, for a draft that agrees partly) plus the tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    if noisy_copy_of is not None:
        model = AutoModelForCausalLM.from_pretrained(noisy_copy_of)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(noise * parameter.std() * torch.randn_like(parameter))
    else:
        model = AutoModelForCausalLM.from_config(model_config(arch, layers, hidden))
    if train_steps:
        train_briefly(model, tokenizer_dir, train_steps, seed)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, folder / name)
    return folder


def export_pair(pair: dict, out: Path, **options):
    """export_bundle on a {"target": folder, "draft": folder} pair; returns the manifest."""
    from specdeploy.export import ExportConfig, export_bundle

    return export_bundle(ExportConfig(target=str(pair["target"]), draft=str(pair["draft"]), out=str(out), **options))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer_dir):
    """arch -> {"target": Path, "draft": Path}; built on first use."""
    cache: dict[str, dict[str, Path]] = {}

    def get(arch: str) -> dict[str, Path]:
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"ckpt-{arch}")
            cache[arch] = {
                role: build_checkpoint(root / role, arch, *SIZES[role], seed=1 + i, tokenizer_dir=tokenizer_dir)
                for i, role in enumerate(("target", "draft"))
            }
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def trained_pair(tmp_path_factory, tokenizer_dir):
    """A Llama target and draft, each trained briefly on the same code: confident and partly agreeing."""
    root = tmp_path_factory.mktemp("trained")
    return {
        role: build_checkpoint(root / role, "llama", *SIZES[role], seed=11 + i, tokenizer_dir=tokenizer_dir, train_steps=150)
        for i, role in enumerate(("target", "draft"))
    }


@pytest.fixture(scope="session")
def bundles(tmp_path_factory, checkpoints):
    """arch -> an exported fp32 bundle of that architecture's pair; built on first use."""
    from specdeploy.export import ExportConfig, export_bundle

    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            pair = checkpoints(arch)
            out = tmp_path_factory.mktemp(f"bundle-{arch}") / "bundle"
            export_bundle(ExportConfig(target=str(pair["target"]), draft=str(pair["draft"]), out=str(out)))
            cache[arch] = out
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def agreeing_bundle(tmp_path_factory, checkpoints):
    """A Llama target with a draft that is the target plus weight noise: partial, realistic acceptance."""
    from specdeploy.export import ExportConfig, export_bundle

    pair = checkpoints("llama")
    root = tmp_path_factory.mktemp("agreeing")
    draft = build_checkpoint(root / "draft", "llama", 0, 0, seed=7, tokenizer_dir=pair["target"],
                             noisy_copy_of=pair["target"], noise=0.1)
    out = root / "bundle"
    export_bundle(ExportConfig(target=str(pair["target"]), draft=str(draft), out=str(out)))
    return out


@pytest.fixture(scope="session")
def self_draft_bundle(tmp_path_factory, checkpoints):
    """Draft == target: every draft token is accepted (the bonus-token path every round)."""
    from specdeploy.export import ExportConfig, export_bundle

    pair = checkpoints("llama")
    out = tmp_path_factory.mktemp("self") / "bundle"
    # fp32 draft: an int8 copy of the target would not agree with it on every token.
    export_bundle(ExportConfig(target=str(pair["target"]), draft=str(pair["target"]), out=str(out), draft_quantize="none"))
    return out


LONG_CONTEXT = 4608


@pytest.fixture(scope="session")
def long_bundle(tmp_path_factory, checkpoints):
    """The Llama pair with a 4,608-token context and no EOS token: generation always runs to its budget."""
    import json
    import shutil

    from specdeploy.export import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("long")
    pair = {}
    for role, source in checkpoints("llama").items():
        folder = pair[role] = root / role
        shutil.copytree(source, folder)
        for name, changes in (("config.json", {"max_position_embeddings": LONG_CONTEXT, "eos_token_id": None}),
                              ("generation_config.json", {"eos_token_id": None}),
                              ("tokenizer_config.json", {"eos_token": None}),
                              ("special_tokens_map.json", {"eos_token": None})):
            config = json.loads((folder / name).read_text())
            (folder / name).write_text(json.dumps({key: value for key, value in {**config, **changes}.items()
                                                   if value is not None or key not in ("eos_token",)}))
    out = root / "bundle"
    export_bundle(ExportConfig(target=str(pair["target"]), draft=str(pair["draft"]), out=str(out),
                               max_context=LONG_CONTEXT))
    return out


@pytest.fixture(scope="session")
def demo_bundle(tmp_path_factory):
    """The embedded demo pair, exported as `specdeploy export` does with no options (int8 draft)."""
    from specdeploy.defaults import demo_checkpoints
    from specdeploy.export import ExportConfig, export_bundle

    target, draft = demo_checkpoints()
    out = tmp_path_factory.mktemp("demo") / "bundle"
    export_bundle(ExportConfig(target=target, draft=draft, out=str(out)))
    return out


@pytest.fixture(scope="session")
def draftless_bundle(tmp_path_factory, trained_pair):
    """The trained Llama target alone (`export --target` without `--draft`): drafted by prompt lookup."""
    from specdeploy.export import ExportConfig, export_bundle

    out = tmp_path_factory.mktemp("draftless") / "bundle"
    export_bundle(ExportConfig(target=str(trained_pair["target"]), draft=None, out=str(out)))
    return out


DISTILLED_VOCAB = 192  # of VOCAB: the distilled drafts' head covers half the tokens


@pytest.fixture(scope="session")
def distilled_drafts(tmp_path_factory, trained_pair):
    """kind -> a draft folder `specdeploy distill` wrote for the trained Llama target (a few steps, a
    vocabulary subset of DISTILLED_VOCAB): an eagle head and a model draft."""
    import sysconfig

    from specdeploy.distill import DistillConfig, distill

    root = tmp_path_factory.mktemp("distilled")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = root / "code.py"
    text.write_text((stdlib / "textwrap.py").read_text() + (stdlib / "bisect.py").read_text())
    folders = {}
    for kind, steps in (("eagle", 150), ("model", 30)):  # the head learns slower: 150 steps take it to ~0.4 acceptance
        folders[kind] = root / kind
        distill(DistillConfig(target=str(trained_pair["target"]), out=str(folders[kind]), kind=kind, data=(str(text),),
                              steps=steps, draft_vocab=DISTILLED_VOCAB, seq_len=32, batch_size=4, heldout_tokens=64,
                              generate_tokens=0, eval_every=30, minutes=None, threads=1))
    return folders


@pytest.fixture(scope="session")
def eagle_bundle(tmp_path_factory, trained_pair, distilled_drafts):
    """The trained target with its distilled eagle head (fp32, so that parity pins the graph's math) over
    the distilled vocabulary subset."""
    out = tmp_path_factory.mktemp("eagle") / "bundle"
    export_pair({"target": trained_pair["target"], "draft": distilled_drafts["eagle"]}, out, draft_quantize="none")
    return out


@pytest.fixture(scope="session")
def subset_bundle(tmp_path_factory, trained_pair, distilled_drafts):
    """The trained target with its distilled model draft, whose head covers the vocabulary subset."""
    out = tmp_path_factory.mktemp("subset") / "bundle"
    export_pair({"target": trained_pair["target"], "draft": distilled_drafts["model"]}, out)
    return out


def check_two_token_distribution(generator, prompt_ids: list[int], options: dict, runs: int,
                                 min_accepted: float = 0.05, max_accepted: float = 0.95) -> None:
    """The first two tokens of `runs` seeded k = 1 runs through the whole speculative loop (draft rows, the
    verify scan with its rejections and bonus tokens, target-only steps) against the exact joint target
    distribution at `options` (cells expected fewer than 5 times pooled): a chi-square p-value above 1e-3,
    with both the acceptance and the rejection paths taken. The sampled check of `specdeploy verify --lossless`,
    whose chi-square test_lossless.py checks against scipy's."""
    from specdeploy.lossless import sampled_continuations

    result = sampled_continuations(generator, prompt_ids, options, 2, 1, runs)
    assert runs * min_accepted < result["accepted"] < runs * max_accepted  # both the acceptance and the rejection paths ran
    assert result["cells"] >= 11  # at least 10 pairs expected 5 times or more, and the pooled rest
    assert result["chi_square_p"] > 1e-3


NODE_HOST_DIR = Path(__file__).resolve().parents[1] / "examples" / "node"


@pytest.fixture(scope="session")
def node():
    """The node binary, with examples/node's locked packages installed (again only when the lock file changed)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("the Node host needs node and npm (Node.js 18 or later) on PATH")
    digest = hashlib.sha256((NODE_HOST_DIR / "package-lock.json").read_bytes()).hexdigest()
    stamp = NODE_HOST_DIR / "node_modules" / ".installed-lock-sha256"
    with open(NODE_HOST_DIR / "package-lock.json", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time: test processes running side by side share the folder
        if not stamp.is_file() or stamp.read_text() != digest:
            # --ignore-scripts: onnxruntime-node's install script downloads optional GPU binaries; its CPU library ships in the package.
            result = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=NODE_HOST_DIR,
                                    capture_output=True, text=True)
            assert result.returncode == 0, result.stderr
            stamp.write_text(digest)
    return node
