"""The `specdeploy` command: parses flags into config dataclasses and calls the library; nothing else."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import defaults
from .cli_input import read_constraint, run_request
from .cli_options import (CONSTRAINT_OPTIONS, DEFAULTS, LOAD_OPTIONS, PENALTY_OPTIONS, SAMPLING_OPTIONS, SEED, TEXT,
                          resolve_bundle)
from .cli_support import (DEBUG_HELP, EXIT_INTERRUPTED, ErrorMappingGroup, checked_generation, end_text, format_stats,
                          note_debug, parse_draft_tokens, parse_prompt_tokens, require_chat_template, require_export_extra,
                          stream_text, export_with_progress as _export)
from .errors import SpecdeployError
from .export.config import DTYPES, GRAPHS, QUANTIZE


@click.group(cls=ErrorMappingGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specdeploy")
@click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=note_debug, help=DEBUG_HELP)
def main() -> None:
    """Speculative decoding bundles for ONNX Runtime: export a target (and a draft), then run it.

    Without BUNDLE, every command uses the default bundle ($SPECDEPLOY_HOME/demo-bundle, default
    ~/.cache/specdeploy/demo-bundle, where export writes without --out) or, until one is exported
    there, the demo pair's bundle that ships with specdeploy.
    stdout carries only what was asked for (generated text, JSON, a path); progress, stats and
    errors go to stderr. Every error is one 'error: ...' line and exit code 2 (Ctrl-C: 130)."""


@main.command()
@click.option("--target", default=None,
              help="Target checkpoint: a Hugging Face folder or a .gguf file (its quantized blocks kept: --quantize). "
                   "Default: the demo pair.")
@click.option("--draft", default=None,
              help="Draft: a Hugging Face folder or a .gguf file (same tokenizer as the target), or a folder "
                   "`specdeploy distill` wrote (either kind). Without it the bundle holds the target alone, drafted "
                   "by prompt lookup.")
@click.option("--out", default=None, type=click.Path(),
              help="Bundle folder to create. Default: the default bundle, which commands without a BUNDLE run.")
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True, help="The activations' precision.")
@click.option("--quantize", type=click.Choice(("auto", *QUANTIZE)), default="auto", show_default=True,
              help="Both models' weights. gguf: a .gguf file's own quantized blocks, llama.cpp's "
                   "weights exactly (Llama, Qwen2, Gemma 3); int8 | int4: weight-only MatMulNBits rounded from fp32; "
                   "auto: gguf for a .gguf checkpoint that allows it, else none.")
@click.option("--draft-quantize", type=click.Choice(("auto", *QUANTIZE)), default="auto", show_default=True,
              help="The draft's weights alone; auto: gguf for a .gguf draft, else int8 for an "
                   "fp32 draft (kept fp32 if that fails parity), else as --quantize. Output is unchanged either way: the "
                   "target checks every token.")
@click.option("--max-context", type=int, default=None, help="Max tokens of context (default: the models' limit).")
@click.option("--draft-window", type=int, default=None,
              help="Each draft query attends to its last N positions (fused graph; default: all). Output is "
                   "unchanged; a draft trained on short windows proposes better past them.")
@click.option("--draft-vocab", type=int, default=None,
              help="The draft proposes from the N most frequent tokens: of its distillation data for a folder "
                   "`specdeploy distill` wrote, else of --draft-vocab-text (default: the distilled folder's own "
                   "subset, if any; 0: the whole vocabulary). Output is unchanged.")
@click.option("--draft-vocab-text", type=click.Path(dir_okay=False), multiple=True,
              help="With --draft-vocab N and a draft without draft_vocab.json (a .gguf, a Hugging Face folder): a UTF-8 "
                   "text file, say a sample of your own traffic, whose tokens under the target's tokenizer rank the N "
                   "kept (special tokens always; repeatable). Default: code that specdeploy ships.")
@click.option("--graph", type=click.Choice(GRAPHS), default="auto", show_default=True,
              help="fused: GroupQueryAttention with an in-place KV cache (Llama, Mistral, "
                   "Qwen2, Phi-3, Gemma 3); optimum: optimum's export (every architecture); auto: fused where it applies.")
@click.option("--force", is_flag=True,
              help="Replace --out if it holds a specdeploy bundle, or fill it if it is an empty folder (nothing else "
                   "is ever replaced).")
@click.option("--trust-remote-code", is_flag=True, help="Allow checkpoints that ship their own model code (auto_map).")
@click.option("--allow-pickle", is_flag=True,
              help="Load pytorch_model.bin (pickle) weights, which can run code; safetensors are used whenever present.")
@click.option("--allow-lossy", is_flag=True,
              help="Keep a quantized or fp16 target whose greedy agreement with fp32 is below 0.95 (recorded in the manifest).")
def export(target, draft, out, dtype, quantize, draft_quantize, max_context, draft_window, draft_vocab, draft_vocab_text,
           graph, force, trust_remote_code, allow_pickle, allow_lossy) -> None:
    """Export a target checkpoint, and a draft if given (else prompt lookup drafts), into a validated bundle."""
    if target is None and draft is not None:
        raise SpecdeployError("--draft needs --target: pass --target (with or without --draft), or neither "
                              "(to export the embedded demo pair)")
    require_export_extra("exporting")
    if target is None:
        target, draft = defaults.demo_checkpoints()
    replaced = None
    if out is None:
        out = str(defaults.default_bundle())
        defaults.default_bundle().parent.mkdir(parents=True, exist_ok=True)
        replaced = (Path(out) / "specdeploy.json").is_file()
    _export(target, draft, out, dtype=dtype, quantize=quantize, draft_quantize=draft_quantize, max_context=max_context,
            draft_window=draft_window, draft_vocab=draft_vocab, draft_vocab_text=tuple(draft_vocab_text), graph=graph,
            force=force, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, allow_lossy=allow_lossy)
    if replaced is not None:  # no --out: say what every command without a BUNDLE now runs
        click.echo(f"{'replaced' if replaced else 'wrote'} the default bundle, which commands without a BUNDLE run", err=True)
    click.echo(str(Path(out).expanduser().resolve()))


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@click.option("--verify", is_flag=True, help="Also re-hash every file and compare it with the manifest.")
def inspect(bundle, as_json, verify) -> None:
    """Summarize a bundle's manifest (BUNDLE defaults to the demo bundle); 80 columns wide."""
    from .bundle import load_manifest
    from .inspect_output import inspect_lines
    from .runtime.chat import load_chat_template

    bundle = resolve_bundle(bundle)
    manifest = load_manifest(bundle, verify=verify)
    if as_json:
        click.echo(json.dumps(manifest.to_dict(), indent=2))
        return
    template = load_chat_template(Path(bundle) / manifest.tokenizer.path)
    end_of_turn = template.end_of_turn_text().strip() if template is not None else ""
    chat = None if template is None else (f"yes; a reply ends at {end_of_turn!r}" if end_of_turn else "yes")
    click.echo("\n".join(inspect_lines(bundle, manifest, chat)))


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--lossless", is_flag=True,
              help="Then check that speculative decoding gives the target's own output: greedy token ids equal "
                   "target-only's (exact; each drafter, k 1, 2, 4, 8), sampled continuations follow the target's exact "
                   "distribution (chi-square; nine settings). Minutes on a real model.")
@click.option("--runs", type=int, default=4000, show_default=True, help="With --lossless: seeded generations per sampled check.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True, help="With --lossless: tokens per greedy generation.")
@click.option("--prompts", "prompts_file", type=click.Path(), default=None,
              help="With --lossless: the greedy check's prompts, a JSON list or JSONL with 'prompt' (default: 20 built-in "
                   "code prompts); the sampled checks use the first.")
@click.option("--seed", type=SEED, default=0, show_default=True,
              help="With --lossless: the first seed of each sampled check (a lone p-value under 0.001 is worth another).")
@click.option("--json", "as_json", is_flag=True, help="With --lossless: print the report as one JSON object.")
@click.pass_context
def verify(ctx, bundle, lossless, runs, max_new_tokens, prompts_file, seed, as_json) -> None:
    """Re-hash every file of a bundle against its manifest; name each damaged one (exit 2 if any).
    With --lossless, then check the bundle's speculative output against the target's (exit 2 if it differs).

    BUNDLE defaults to the demo bundle."""
    import time

    from .bundle import listed_files, load_manifest
    from .cli_bench import options_given
    from .inspect_output import format_size

    given = options_given(ctx, ("runs", "max_new_tokens", "prompts_file", "seed", "as_json"))
    if given and not lossless:
        raise SpecdeployError(f"{', '.join(given)}: only with --lossless")
    bundle = resolve_bundle(bundle)
    start = time.perf_counter()
    manifest = load_manifest(bundle, verify=True)
    entries = listed_files(manifest)
    size = sum(entry.size for entry in entries)
    click.echo(f"ok: {len(entries)} files, {format_size(size)}, match their sha256 ({time.perf_counter() - start:.2f} s)",
               err=as_json)
    if lossless:
        from rich.console import Console

        from .cli_input import read_prompts_file
        from .lossless import LosslessConfig, check_lossless, lossless_lines

        config = LosslessConfig(prompts=tuple(read_prompts_file(prompts_file)) if prompts_file else (),
                                max_new_tokens=max_new_tokens, runs=runs, seed=seed)
        with Console(stderr=True).status("lossless") as status:
            report = check_lossless(bundle, config, progress=status.update)
        click.echo(json.dumps(report) if as_json else "\n".join(lossless_lines(report)))
        if not report["passed"]:
            raise SpecdeployError("speculative decoding did not give the target's output on this bundle (above)")


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--prompt", default=None, type=TEXT, help="Prompt text (UTF-8), as it is; '-' reads standard input.")
@click.option("--prompt-file", default=None, type=click.Path(),
              help="Read the prompt from this UTF-8 file, byte for byte (a trailing newline is kept).")
@click.option("--chat", default=None, type=TEXT,
              help="A user message, rendered by the bundle's chat template; the reply ends at its end of turn. "
                   "'-' reads standard input.")
@click.option("--system", default=None, type=TEXT, help="A system message before --chat's or --messages' messages.")
@click.option("--messages", "messages_file", type=click.Path(), default=None,
              help='A JSON file: a list of {"role", "content"} messages for the chat template (roles: system, '
                   'user, assistant, tool).')
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="Tokens to generate at most.")
@SAMPLING_OPTIONS
@PENALTY_OPTIONS
@CONSTRAINT_OPTIONS
@click.option("--num-draft-tokens", "-k", type=int, default=DEFAULTS.num_draft_tokens, show_default=True,
              help="Draft tokens per round at most (the policy may draft fewer where that is faster).")
@click.option("--no-speculative", is_flag=True, help="Target-only decoding (the baseline).")
@click.option("--stop", multiple=True, type=TEXT, help="Stop before this string (repeatable).")
@LOAD_OPTIONS
@click.option("--stream/--no-stream", default=True, show_default=True, help="Print text as it is accepted.")
@click.option("--json", "as_json", is_flag=True, help='Print one JSON object {"text", "token_ids", "stats"}.')
@click.option("--logprobs", type=int, default=None,
              help="With --json: each token's log-probability under the target and the N most likely tokens (0-20).")
def run(bundle, prompt, prompt_file, chat, system, messages_file, max_new_tokens, temperature, top_k, top_p, min_p,
        repetition_penalty, seed, num_draft_tokens, draft_confidence, no_speculative, stop, device, drafter, verify,
        exact, stream, as_json, logprobs, presence_penalty, frequency_penalty, json_schema, regex, grammar) -> None:
    """Generate from a prompt (--prompt, --prompt-file) or a conversation (--chat, --messages) with
    speculative decoding (BUNDLE defaults to the demo bundle).

    stdout gets exactly the generated text (or --json's one JSON line), nothing else: no newline the
    model did not write, except after text shown on a terminal. The stats line goes to stderr.
    Ctrl-C stops generation: the text so far and the stats are printed, and the exit code is 130."""
    from .runtime import load

    request = run_request(prompt, prompt_file, chat, system, messages_file)
    if logprobs is not None and not as_json:
        raise SpecdeployError("--logprobs needs --json (the log-probabilities are printed in its JSON object)")
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                   repetition_penalty=repetition_penalty, seed=seed, num_draft_tokens=num_draft_tokens, draft_confidence=draft_confidence,
                   speculative=not no_speculative, stop=stop, logprobs=logprobs, presence_penalty=presence_penalty,
                   frequency_penalty=frequency_penalty, **read_constraint(json_schema, regex, grammar))
    checked_generation(**options)
    generator = load(bundle := resolve_bundle(bundle), device=device, drafter=drafter, verify=verify, exact=exact)
    if "messages" in request:
        require_chat_template(generator, bundle, "use --prompt or --prompt-file")
    interrupted, shown = False, []
    pieces = generator.stream(**request, **options)  # JSON and --no-stream read the pieces without printing them
    try:
        if as_json or not stream:
            for _ in pieces:
                pass
        else:
            stream_text(pieces, shown)
    except KeyboardInterrupt:
        interrupted = True
        if pieces.output is None:  # before the generation started: nothing to show
            raise
    output = pieces.output
    if as_json:
        record = {"text": output.text, "token_ids": output.token_ids, "stats": output.stats.to_dict()}
        if output.logprobs is not None:
            from .runtime.token_text import TokenText

            names = TokenText(generator.codec.tokenizer)

            def named(token_id: int, logprob: float) -> dict:  # as OpenAI's chat logprobs name a token, and its id
                return {"token": names.text(token_id), "token_id": token_id, "logprob": logprob,
                        "bytes": list(names.bytes(token_id))}
            record["logprobs"] = [{**named(e.token_id, e.logprob), "top_logprobs": [named(t, lp) for t, lp in e.top]}
                                  for e in output.logprobs]
        click.echo(json.dumps(record))
    else:
        if not stream:
            click.echo(output.text, nl=False)
        end_text("".join(shown) if stream else output.text)
    click.echo(format_stats(output.stats), err=True)
    if output.stats.note:
        click.echo(f"note: {output.stats.note}", err=True)
    if interrupted:
        sys.exit(EXIT_INTERRUPTED)


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--system", default=None, type=TEXT, help="The system message the conversation starts with.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True, help="Tokens per reply at most.")
@SAMPLING_OPTIONS
@PENALTY_OPTIONS
@CONSTRAINT_OPTIONS
@click.option("--num-draft-tokens", "-k", type=int, default=DEFAULTS.num_draft_tokens, show_default=True,
              help="Draft tokens per round at most (the policy may draft fewer where that is faster).")
@click.option("--no-speculative", is_flag=True, help="Target-only decoding (the baseline).")
@click.option("--stop", multiple=True, type=TEXT, help="End a reply before this string (repeatable).")
@LOAD_OPTIONS
@click.option("--stats", is_flag=True, help="Print the stats line (stderr) after each reply.")
def chat(bundle, system, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed,
         num_draft_tokens, draft_confidence, no_speculative, stop, device, drafter, verify, exact, stats, presence_penalty,
         frequency_penalty, json_schema, regex, grammar) -> None:
    """Chat with a bundle on its tokenizer's chat template, the reply streaming as it decodes
    (BUNDLE defaults to the demo bundle).

    One line is one message (end a line with \\ to continue it on the next). /reset forgets the
    conversation, /system TEXT sets the system message, /exit or Ctrl-D ends the session; Ctrl-C
    stops an answer, not the session. The history is kept within the context: the oldest turns
    are dropped when it is full (a note on stderr says so). Reply i samples with --seed + i."""
    from .chat_cli import ChatConfig, read_lines, run_chat
    from .runtime import load

    generation = checked_generation(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                    min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                                    num_draft_tokens=num_draft_tokens, draft_confidence=draft_confidence,
                                    speculative=not no_speculative, stop=stop, presence_penalty=presence_penalty,
                                    frequency_penalty=frequency_penalty, **read_constraint(json_schema, regex, grammar))
    bundle = resolve_bundle(bundle)
    generator = load(bundle, device=device, drafter=drafter, verify=verify, exact=exact)
    require_chat_template(generator, bundle, "use run --prompt")
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401 - line editing and history for input()

        click.echo(f"chat with {bundle}: one line per message; /reset, /system TEXT, /exit or Ctrl-D; Ctrl-C "
                   "stops an answer", err=True)
    run_chat(generator, ChatConfig(generation=generation, system=system, stats=stats), read_lines(interactive=interactive))


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--prompts", "prompts_file", type=click.Path(), default=None,
              help="JSON list of prompts, or JSONL with a 'prompt' field (default: 10 built-in code prompts).")
@click.option("--prompt-file", default=None, type=click.Path(),
              help="One prompt: this UTF-8 file's text, byte for byte (instead of --prompts).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="Tokens per prompt.")
@click.option("--prompt-tokens", default=None,
              help="Lengthen every prompt to this many tokens (decode speed at a long context); a list like "
                   "128,1920 benches each length in one run and compares them.")
@click.option("--num-draft-tokens", "-k", default="4", show_default=True, help="K, a list (2,4,8) or auto.")
@SAMPLING_OPTIONS
@click.option("--repeat", type=int, default=1, show_default=True,
              help="Passes over the prompts (each with new seeds); the figures total their tokens and times.")
@click.option("--chat", is_flag=True,
              help="Send each prompt as a user message through the bundle's chat template (replies end at its end of turn).")
@LOAD_OPTIONS
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line of stdout.")
@click.option("--plot", type=click.Path(), default=None, help="Draw speedup vs k and acceptance by position (PNG).")
@click.option("--url", "urls", multiple=True,
              help="Measure this running OpenAI-compatible server (ours, llama-server, vLLM; repeatable: the servers "
                   "alternate) with concurrent streaming clients instead of a bundle. Needs the bench extra.")
@click.option("--concurrency", default=None, help="With --url: the concurrent clients of each cell, a list (default 1,2,4,8).")
@click.option("--requests", type=int, default=None, help="With --url: requests per cell (default: 2 per client, at least 4).")
@click.option("--ignore-eos", is_flag=True, help='With --url: send "ignore_eos": true (exactly --max-new-tokens each).')
@click.option("--api-key", default=None, help="With --url: sent as Authorization: Bearer KEY.")
@click.option("--model", default=None, help="With --url: the requests' model (default: the first one /v1/models lists).")
@click.pass_context
def bench(ctx, bundle, prompts_file, prompt_file, max_new_tokens, prompt_tokens, num_draft_tokens, temperature, top_k, top_p,
          min_p, repetition_penalty, draft_confidence, repeat, chat, seed, device, drafter, verify, exact, as_json, plot, **_) -> None:
    """Target-only vs speculative decoding on the same prompts: speed, acceptance, cost model. With --url, a running
    server instead: tokens/s, time to first token and inter-token latency at each --concurrency, failures.

    Each k is measured as given (policy "always", as the cost model assumes); `serve` may draft fewer."""
    from datetime import datetime

    from rich.console import Console

    from .bench import BenchConfig, context_sweep, lengthen_prompts, run_bench
    from .bench_output import machine_description, plot_file, plot_report, print_bench, print_context_sweep
    from .cli_bench import bench_servers, check_url_options
    from .cli_input import bench_prompts
    from .runtime.loader import drafter_for, load

    if check_url_options(ctx):  # a running server, not a bundle
        return bench_servers(ctx)
    if repeat < 1 or max_new_tokens < 1:
        raise SpecdeployError("--repeat and --max-new-tokens must be at least 1")
    ks = parse_draft_tokens(num_draft_tokens)
    checked_generation(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                       draft_confidence=draft_confidence, seed=seed)
    plot = plot_file(plot) if plot else None  # checked before the benchmark, not after it
    prompts = bench_prompts(prompts_file, prompt_file)
    bundle = resolve_bundle(bundle)
    generator = load(bundle, device=device, drafter=drafter, verify=verify, policy="always", exact=exact)
    lengths = parse_prompt_tokens(prompt_tokens, max_new_tokens, generator.max_context)
    texts, encode, stop_token_ids = prompts, generator.codec.encode, ()
    if chat:  # each prompt's ids through the template, rendered before any run
        require_chat_template(generator, bundle, "drop --chat")
        encode = lambda text: generator.encode_chat([{"role": "user", "content": text}])  # noqa: E731
        prompts, stop_token_ids = [tuple(encode(text)) for text in texts], generator.end_of_turn_ids
    console = Console(stderr=True)
    reports = []
    runs = [(length, [tuple(ids) for ids in lengthen_prompts(texts, encode, length)] if length else prompts)
            for length in lengths]  # every length checked before the first runs
    for length, lengthened in runs:
        config = BenchConfig(prompts=tuple(lengthened), max_new_tokens=max_new_tokens, num_draft_tokens=ks,
                             temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             repetition_penalty=repetition_penalty, draft_confidence=draft_confidence,
                             repeat=repeat, seed=seed, stop_token_ids=stop_token_ids)
        with console.status("bench") as status:
            report = run_bench(generator, config, progress=lambda message: status.update(f"{length or ''} {message}"))
        report.update(drafter=drafter_for(generator.manifest, drafter, bundle), exact=exact, prompt_tokens=length,
                      chat=chat)  # the drafter load ran
        reports.append(report)
    report = reports[0] if len(reports) == 1 else context_sweep(reports)
    report.update(bundle=str(Path(bundle).resolve()), date=datetime.now().astimezone().isoformat(timespec="seconds"),
                  machine=machine_description())
    if as_json:  # the figures first: a plot that fails to draw loses nothing
        click.echo(json.dumps(report))
    else:
        for each in report.get("by_prompt_tokens", [report]):
            print_bench(each)
        if "context_sweep" in report:
            print_context_sweep(report["context_sweep"])
    if plot:
        plot_report(report, plot)
        click.echo(f"plot: {plot}", err=True)


from .cli_serve import serve as _serve  # noqa: E402
from .distill.cli import distill as _distill  # noqa: E402  (imports no torch until it runs)
main.add_command(_serve)
main.add_command(_distill)
if __name__ == "__main__":  # python -m specdeploy.cli, as python -m specdeploy
    main()
