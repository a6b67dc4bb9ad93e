#!/usr/bin/env python3
"""How often a draft token is kept when sampling: the exact rejection rule against Gumbel-max coupling.

The runtime keeps a sampled draft token x with probability min(1, p(x) / q(x)), so a token is kept
with probability sum_x min(p(x), q(x)) at each position. Gumbel-max coupling draws one Gumbel vector g
per position and takes argmax(log q + g) as the draft's token and argmax(log p + g) as the target's:
the target's token is then the same whether the draft proposed or not (the output would not depend on
k), and the draft's is kept when both argmaxes agree. This script measures both rates per position on
text the target samples itself from `specdeploy bench`'s code prompts (an approximation of the text a
speculative run checks), from two Hugging Face checkpoints in fp32 (PyTorch: the export extra), so that
the price of such a rule in acceptance is known before building it. The target samples at the
temperature alone: no top-k, top-p or penalty from its generation config.

    python scripts/coupling_acceptance.py --target PAIR/target --draft PAIR/draft --temperature 0.8,1.0 \
        [--tokens 128] [--samples 2000] [--seed 0]

Prints one line per temperature: positions, the rejection rule's mean acceptance, the coupling's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

PROMPTS = Path(__file__).resolve().parents[1] / "specdeploy" / "data" / "code_prompts.json"


def acceptances(log_p: torch.Tensor, log_q: torch.Tensor, samples: int, generator: torch.Generator):
    """Per position ([positions, vocab] log-probabilities): the rejection rule's probability of keeping the
    draft's token, exact, and the coupling's, estimated from `samples` Gumbel vectors."""
    rejection = torch.minimum(log_p.exp(), log_q.exp()).sum(-1)
    coupling = torch.empty(log_p.shape[0])
    for i in range(log_p.shape[0]):
        uniform = torch.rand(samples, log_p.shape[1], generator=generator).clamp_min(torch.finfo(torch.float32).tiny)
        gumbel = -torch.log(-torch.log(uniform))
        coupling[i] = ((log_p[i] + gumbel).argmax(-1) == (log_q[i] + gumbel).argmax(-1)).float().mean()
    return rejection, coupling


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--temperature", default="0.8", help="comma-separated")
    parser.add_argument("--tokens", type=int, default=128, help="tokens the target samples per prompt")
    parser.add_argument("--samples", type=int, default=2000, help="Gumbel vectors per position")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, torch_dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, torch_dtype=torch.float32).eval()
    for temperature in (float(t) for t in args.temperature.split(",")):
        rejection, coupling = [], []
        with torch.no_grad():
            # a fresh config: the checkpoint's own may add top-k, top-p or penalties the scores below leave out
            config = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, max_new_tokens=args.tokens,
                                      pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
            for prompt in json.loads(PROMPTS.read_text()):
                ids = tokenizer(prompt, return_tensors="pt").input_ids
                text = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
                span = slice(ids.shape[1] - 1, -1)  # the positions that predict the sampled tokens
                log_p = torch.log_softmax(target(text).logits[0, span] / temperature, -1)
                log_q = torch.log_softmax(draft(text).logits[0, span] / temperature, -1)
                kept, coupled = acceptances(log_p, log_q, args.samples, generator)
                rejection.append(kept)
                coupling.append(coupled)
        rejection, coupling = torch.cat(rejection), torch.cat(coupling)
        print(f"T {temperature}: {rejection.numel()} positions, rejection rule {rejection.mean():.3f}, "
              f"Gumbel-max coupling {coupling.mean():.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
