"""Constrained output on a real bundle: how many outputs parse and validate, speed constrained against free
(target-only and speculative, greedy, in one interleaved run), tokens forced by the schema, what the mask
costs against a target-only step; and, with --llama-server, llama.cpp's server with the same schemas on
the same GGUF beside `specdeploy serve`, both driven by the same sequential chat requests.

    python -m benchmarks.constrained BUNDLE [--rounds 2] [--max-new-tokens 256] [--drafter prompt-lookup]
    python -m benchmarks.constrained BUNDLE --llama-server PATH/llama-server --gguf MODEL.gguf
    python -m benchmarks.constrained BUNDLE --libraries     # llguidance against xgrammar (in another venv:
                                                            # xgrammar brings torch, transformers and triton)

Ten chat prompts, each asking for a JSON object of its own schema (TASKS; none was tuned on), each
string field at most 40 characters (a small model can repeat inside an unbounded string until the
budget ends, which no schema would let an application store). Greedy, --max-new-tokens 256 (every
constrained output completes within it). The served comparison starts llama-server with 2 threads, one
slot, its default sampling chain at temperature 0, and `specdeploy serve --max-batch 1`: one request at a
time each, the same JSON bodies (`response_format` json_schema, strict), tokens/s end to end (the usage's
completion tokens over the request's wall time, prefill included). Prints a Markdown table, then one JSON
object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from .servers import start_llama_server, start_server, stop_server

TASKS = [
    ("Describe a fictional person as JSON: name, age and city.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
      "required": ["name", "age", "city"], "additionalProperties": False}),
    ("Give a product for an online shop as JSON, with its name, price in dollars and whether it is in stock.",
     {"type": "object", "properties": {"name": {"type": "string"}, "price": {"type": "number"},
                                       "in_stock": {"type": "boolean"}},
      "required": ["name", "price", "in_stock"], "additionalProperties": False}),
    ("Write a postal address in London as JSON.",
     {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                       "postcode": {"type": "string"}, "country": {"type": "string"}},
      "required": ["street", "city", "postcode", "country"], "additionalProperties": False}),
    ("Plan a team meeting as JSON: a title, a date (YYYY-MM-DD), and a list of attendees.",
     {"type": "object", "properties": {"title": {"type": "string"}, "date": {"type": "string"},
                                       "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 6}},
      "required": ["title", "date", "attendees"], "additionalProperties": False}),
    ("Recommend a classic novel as JSON with its title, author and year of publication.",
     {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"}},
      "required": ["title", "author", "year"], "additionalProperties": False}),
    ("Report today's weather in Paris as JSON: temperature in Celsius, conditions, and wind speed in km/h.",
     {"type": "object", "properties": {"temperature_c": {"type": "number"},
                                       "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rainy", "snowy"]},
                                       "wind_kmh": {"type": "number"}},
      "required": ["temperature_c", "conditions", "wind_kmh"], "additionalProperties": False}),
    ("List three tasks for a weekend as a JSON to-do list, each with a title and a priority from 1 to 3.",
     {"type": "object", "properties": {"tasks": {"type": "array", "maxItems": 5, "items": {
         "type": "object", "properties": {"title": {"type": "string"}, "priority": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 3}},
         "required": ["title", "priority"], "additionalProperties": False}}},
      "required": ["tasks"], "additionalProperties": False}),
    ("Give a simple pancake recipe as JSON: its name, the number of servings and the ingredients.",
     {"type": "object", "properties": {"name": {"type": "string"}, "servings": {"type": "integer"},
                                       "ingredients": {"type": "array", "items": {"type": "string"}, "maxItems": 8}},
      "required": ["name", "servings", "ingredients"], "additionalProperties": False}),
    ("Describe a science-fiction film as JSON with its title, director, and a rating out of 10.",
     {"type": "object", "properties": {"title": {"type": "string"}, "director": {"type": "string"},
                                       "rating": {"type": "number", "minimum": 0, "maximum": 10}},
      "required": ["title", "director", "rating"], "additionalProperties": False}),
    ("Create a user profile for a website as JSON: username, email, and whether they subscribed to the newsletter.",
     {"type": "object", "properties": {"username": {"type": "string"}, "email": {"type": "string"},
                                       "newsletter": {"type": "boolean"}},
      "required": ["username", "email", "newsletter"], "additionalProperties": False}),
]


def bounded(schema):
    """The schema with every string field at most 40 characters (those that give no maxLength)."""
    if isinstance(schema, dict):
        schema = {key: bounded(value) for key, value in schema.items()}
        if schema.get("type") == "string" and "maxLength" not in schema and "enum" not in schema:
            schema["maxLength"] = 40
    elif isinstance(schema, list):
        schema = [bounded(item) for item in schema]
    return schema


TASKS = [(prompt, bounded(schema)) for prompt, schema in TASKS]


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def in_process(bundle: str, rounds: int, max_new_tokens: int, drafter: str) -> dict:
    """Every task in every cell (target-only / speculative, free / constrained), cells interleaved per task."""
    import specdeploy

    generator = specdeploy.load(bundle, drafter=drafter)
    cells = {(mode, kind): {"tokens": 0, "ms": 0.0, "forced": 0, "valid": 0, "outputs": 0}
             for mode in ("target-only", "speculative") for kind in ("free", "constrained")}
    replay = []
    generator.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=8, json_schema=TASKS[0][1])  # warm-up
    for _ in range(rounds):
        for prompt, schema in TASKS:
            messages = [{"role": "user", "content": prompt}]
            for mode in ("target-only", "speculative"):
                for kind in ("free", "constrained"):
                    options = {"json_schema": schema} if kind == "constrained" else {}
                    out = generator.generate(messages=messages, max_new_tokens=max_new_tokens,
                                             speculative=mode == "speculative", **options)
                    cell = cells[(mode, kind)]
                    cell["tokens"] += out.stats.new_tokens
                    cell["ms"] += out.stats.decode_ms
                    cell["forced"] += out.stats.forced_tokens
                    cell["outputs"] += 1
                    cell["valid"] += valid(out.text, schema)
                    if kind == "constrained" and mode == "target-only":
                        replay.append((schema, out.token_ids))
    step_ms = cells[("target-only", "free")]["ms"] / cells[("target-only", "free")]["tokens"]
    mask_us = mask_cost(generator, replay)
    return {"cells": {f"{mode} {kind}": dict(cell, tokens_per_s=1000 * cell["tokens"] / cell["ms"])
                      for (mode, kind), cell in cells.items()},
            "target_only_step_ms": step_ms, "mask_us_per_token": mask_us, "mask_share_of_step": mask_us / 1000 / step_ms}


def mask_cost(generator, replay) -> float:
    """Mean microseconds per token of what a constrained target-only step adds: the mask in the matcher's
    state, the logits row masked, the token committed (the constrained outputs replayed)."""
    compiler = generator.constraint_compiler()
    from specdeploy.runtime.constraint import ConstraintSpec

    vocab = generator.target.spec.vocab_size
    logits = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    total, count = 0.0, 0
    for schema, tokens in replay:
        constraint = compiler.constraint(ConstraintSpec("json_schema", json.dumps(schema)))
        for token in tokens:
            start = time.perf_counter()
            constraint.apply(logits)
            constraint.commit([token])
            total += time.perf_counter() - start
            count += 1
    return 1e6 * total / max(count, 1)


def libraries(bundle: str) -> dict:
    """The mask per token of llguidance and of xgrammar on the bundle's tokenizer: every task's schema, a
    valid object of it replayed token by token (the mask filled, the token checked and consumed)."""
    import llguidance
    import llguidance.numpy as llg_numpy
    from tokenizers import Tokenizer

    folder = os.path.join(bundle, "tokenizer")
    manifest = json.load(open(os.path.join(bundle, "specdeploy.json"), encoding="utf-8"))
    vocab = manifest["target"]["vocab_size"]
    tokenizer_json = open(os.path.join(folder, "tokenizer.json"), encoding="utf-8").read()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    documents = [(schema, tokenizer.encode(json.dumps(example(schema)), add_special_tokens=False).ids)
                 for _, schema in TASKS]
    results = {}
    llg_tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab)
    times = []
    for schema, ids in documents:
        matcher = llguidance.LLMatcher(llg_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema))
        mask = llg_numpy.allocate_token_bitmask(1, vocab)
        for token in ids:
            start = time.perf_counter()
            llg_numpy.fill_next_token_bitmask(matcher, mask, 0)
            times.append(time.perf_counter() - start)
            assert matcher.consume_token(token), matcher.get_error()
    results["llguidance"] = 1e6 * float(np.mean(times))
    try:
        import xgrammar
        from transformers import AutoTokenizer
    except ImportError:
        results["xgrammar"] = None  # not installed here
        return results
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(folder),
                                                                                vocab_size=vocab))
    times = []
    for schema, ids in documents:
        matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
        mask = xgrammar.allocate_token_bitmask(1, vocab)
        for token in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(token)
    results["xgrammar"] = 1e6 * float(np.mean(times))
    return results


def example(schema: dict):
    """A value of the schema (TASKS' kinds only): the first enum value, short strings, small numbers."""
    kind = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if kind == "object":
        return {key: example(value) for key, value in schema["properties"].items()}
    if kind == "array":
        return [example(schema["items"]), example(schema["items"])]
    return {"string": "text", "integer": 2, "number": 1.5, "boolean": True}[kind]


def served(bundle: str, llama_server: str, gguf: str, rounds: int, max_new_tokens: int, drafter: str) -> dict:
    """Sequential chat requests, each task constrained (response_format json_schema) and free, to both servers
    in turn; tokens/s end to end (completion tokens over the request's wall time)."""
    import httpx

    processes, urls = {}, {}
    try:
        processes["specdeploy"], urls["specdeploy"] = start_server(bundle, "--max-batch", "1", "--drafter", drafter)
        processes["llama-server"], urls["llama-server"] = start_llama_server(llama_server, gguf)
        results = {f"{name} {kind}": {"tokens": 0, "s": 0.0, "valid": 0, "outputs": 0}
                   for name in urls for kind in ("free", "constrained")}
        for _ in range(rounds):
            for prompt, schema in TASKS:
                for kind in ("free", "constrained"):
                    for name, url in urls.items():
                        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_new_tokens,
                                "temperature": 0}
                        if kind == "constrained":
                            body["response_format"] = {"type": "json_schema",
                                                       "json_schema": {"name": "answer", "schema": schema, "strict": True}}
                        start = time.perf_counter()
                        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
                        spent = time.perf_counter() - start
                        response.raise_for_status()
                        answer = response.json()
                        cell = results[f"{name} {kind}"]
                        cell["tokens"] += answer["usage"]["completion_tokens"]
                        cell["s"] += spent
                        cell["outputs"] += 1
                        cell["valid"] += valid(answer["choices"][0]["message"]["content"], schema)
        for cell in results.values():
            cell["tokens_per_s"] = cell["tokens"] / cell["s"]
        return results
    finally:
        for process in processes.values():
            stop_server(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--drafter", default="hybrid", help="the drafter of the speculative cells (run's --drafter)")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary: serve both and compare")
    parser.add_argument("--gguf", help="the GGUF llama-server loads (the bundle's source, for the same weights)")
    parser.add_argument("--libraries", action="store_true", help="time llguidance's mask against xgrammar's")
    args = parser.parse_args()
    report = {"bundle": args.bundle, "tasks": len(TASKS), "rounds": args.rounds}
    if args.libraries:
        report["mask_us_per_token"] = libraries(args.bundle)
        for name, value in report["mask_us_per_token"].items():
            print(f"{name}: " + ("not installed" if value is None else f"{value:.1f} us a token"))
    elif args.llama_server:
        if not args.gguf:
            raise SystemExit("error: --llama-server needs --gguf")
        report["served"] = served(args.bundle, args.llama_server, args.gguf, args.rounds, args.max_new_tokens,
                                  args.drafter)
        print("| server | free tok/s | constrained tok/s | valid |\n|---|---|---|---|")
        for name in ("specdeploy", "llama-server"):
            free, constrained = report["served"][f"{name} free"], report["served"][f"{name} constrained"]
            print(f"| {name} | {free['tokens_per_s']:.1f} | {constrained['tokens_per_s']:.1f} | "
                  f"{constrained['valid']}/{constrained['outputs']} |")
    else:
        report.update(in_process(args.bundle, args.rounds, args.max_new_tokens, args.drafter))
        cells = report["cells"]
        print("| cell | tok/s | tokens | forced | valid JSON |\n|---|---|---|---|---|")
        for name, cell in cells.items():
            print(f"| {name} | {cell['tokens_per_s']:.1f} | {cell['tokens']} | {cell['forced']} | "
                  f"{cell['valid']}/{cell['outputs']} |")
        free = cells["speculative free"]["tokens_per_s"] / cells["target-only free"]["tokens_per_s"]
        constrained = cells["speculative constrained"]["tokens_per_s"] / cells["target-only constrained"]["tokens_per_s"]
        print(f"\nspeculative / target-only: free {free:.2f}x, constrained {constrained:.2f}x; mask "
              f"{report['mask_us_per_token']:.0f} us a token = {report['mask_share_of_step']:.1%} of a target-only step "
              f"({report['target_only_step_ms']:.2f} ms)")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
