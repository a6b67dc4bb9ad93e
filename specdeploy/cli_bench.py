"""`specdeploy bench --url`: the load test (load_test.py) of a running OpenAI-compatible server, from bench's
options; and the check that each option a user set belongs to the mode they run (a bundle, or a server)."""

from __future__ import annotations

import json

import click
from click.core import ParameterSource

from .errors import SpecdeployError, install_hint

# bench's options that only a server's load test takes, and those that only a bundle's benchmark takes.
URL_ONLY = ("concurrency", "requests", "ignore_eos", "api_key", "model")
BUNDLE_ONLY = ("prompt_tokens", "draft_confidence", "device", "drafter", "verify", "exact", "plot")
# Request fields sent only where the user set them: top_p is OpenAI's, the others extensions that a server may
# not know (ours takes them all; num_draft_tokens is ours alone).
OPTIONAL_FIELDS = ("top_p", "top_k", "min_p", "repetition_penalty")


def options_given(ctx: click.Context, names) -> list[str]:
    """The command-line spelling of each of these parameters that the user set (not left at its default)."""
    return [param.opts[0] for param in ctx.command.params if param.name in names
            and ctx.get_parameter_source(param.name) not in (None, ParameterSource.DEFAULT)]


def parse_levels(value: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise SpecdeployError(f"--concurrency takes comma-separated integers, like 1,8 (got {value!r})") from None
    if min(levels) < 1:
        raise SpecdeployError(f"--concurrency: every level must be at least 1 (got {value!r})")
    return levels


def request_fields(ctx: click.Context) -> dict:
    """The sampling and drafting fields every request carries: temperature always (a server's default is often
    1.0), the others as the user set them."""
    params = ctx.params
    fields = {"temperature": params["temperature"]}
    for name in OPTIONAL_FIELDS:
        if options_given(ctx, (name,)):
            fields[name] = params[name]
    if options_given(ctx, ("num_draft_tokens",)):
        try:
            fields["num_draft_tokens"] = int(params["num_draft_tokens"])
        except ValueError:
            raise SpecdeployError(f"with --url, -k is one number, sent as the request's num_draft_tokens "
                                  f"(got {params['num_draft_tokens']!r})") from None
    return fields


def bench_servers(ctx: click.Context) -> None:
    """bench with --url: concurrent streaming clients against each server; a Markdown table (or --json) on stdout."""
    from rich.console import Console

    from .cli_input import bench_prompts

    params = ctx.params
    misplaced = (["BUNDLE"] if params["bundle"] is not None else []) + options_given(ctx, BUNDLE_ONLY)
    if misplaced:
        raise SpecdeployError(f"--url measures a running server, which holds its own bundle and settings: drop "
                              f"{', '.join(misplaced)}")
    try:
        from .load_test import LoadTestConfig, load_test_table, run_load_test
    except ImportError as exc:  # aiohttp, the clients' HTTP library
        raise SpecdeployError(f"bench --url needs the bench extra ({exc.name} is not installed): {install_hint('bench')}") from None
    prompts = bench_prompts(params["prompts_file"], params["prompt_file"])
    if params["chat"]:
        prompts = [[{"role": "user", "content": text}] for text in prompts]
    config = LoadTestConfig(urls=tuple(url.rstrip("/") for url in params["urls"]), prompts=tuple(prompts),
                            chat=params["chat"], concurrency=parse_levels(params["concurrency"] or "1,2,4,8"),
                            requests=params["requests"], max_tokens=params["max_new_tokens"],
                            ignore_eos=params["ignore_eos"], repeat=params["repeat"], seed=params["seed"],
                            fields=request_fields(ctx), api_key=params["api_key"], model=params["model"])
    with Console(stderr=True).status("bench") as status:
        report = run_load_test(config, progress=status.update)
    click.echo(json.dumps(report) if params["as_json"] else load_test_table(report))
    failed = [cell for cell in report["cells"] if cell["failed"]]
    if failed:
        total = sum(cell["requests"] for cell in report["cells"])
        click.echo(f"note: {sum(c['failed'] for c in failed)} of {total} requests failed (first: {failed[0]['failures'][0]})",
                   err=True)


def check_url_options(ctx: click.Context) -> bool:
    """Whether bench runs against servers (--url); the server-only options without it are refused."""
    if ctx.params["urls"]:
        return True
    given = options_given(ctx, URL_ONLY)
    if given:
        raise SpecdeployError(f"{', '.join(given)}: only with --url http://HOST:PORT (a running server's load test)")
    return False
