"""Constrained output through the server: OpenAI's response_format, vLLM's guided_* fields and llama.cpp's
json_schema and grammar, on both endpoints, several requests at once beside free ones; and the 400s.

Servers run in this process on the tiny chat bundle (test_serve.py).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_serve import MESSAGES, PROMPT, chat_bundle, server  # noqa: F401 (fixtures)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "size": {"type": "integer"}},
          "required": ["name", "size"], "additionalProperties": False}
REGEX = r"(return|yield) [a-z_]{1,12}\(x\)"
GBNF = 'root ::= "x = " num ("," num)*\nnum ::= [0-9] [0-9]?'


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, timeout=60, json={"max_tokens": 200, "temperature": 0, **body})


def chat_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"]


def completion_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["text"]


CASES = [
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"}},
     lambda text: isinstance(json.loads(text), dict)),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}},
     lambda text: set(json.loads(text)) == {"name", "size"}),
    ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     lambda text: set(json.loads(text)) == {"name", "size"}),
    ("/v1/completions", {"prompt": PROMPT, "guided_regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
    ("/v1/chat/completions", {"messages": MESSAGES, "guided_json": SCHEMA},
     lambda text: set(json.loads(text)) == {"name", "size"}),
    ("/v1/completions", {"prompt": PROMPT, "grammar": GBNF},
     lambda text: re.fullmatch(r"x = [0-9]{1,2}(,[0-9]{1,2})*", text)),
    ("/v1/completions", {"prompt": PROMPT, "json_schema": SCHEMA, "temperature": 0.8, "seed": 3},
     lambda text: set(json.loads(text)) == {"name", "size"}),
]


def test_constrained_requests_beside_free_ones_each_match_their_constraint(server):
    """Seven constrained requests and three free ones at once: they share passes, and every constrained
    output is complete and in its language."""
    free = [("/v1/completions", {"prompt": PROMPT, "max_tokens": 40}, None)] * 3
    with ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(lambda case: post(server, case[0], case[1]), CASES + free))
    for (path, _, check), response in zip(CASES, responses):
        text = chat_text(response) if "chat" in path else completion_text(response)
        assert check(text), (path, text)
    assert all(response.status_code == 200 for response in responses[len(CASES):])


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_regex": "a", "guided_json": SCHEMA}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"grammar": 5}, "grammar"),
    ({"json_schema": "[1, 2]"}, "json_schema"),
], ids=["bad-regex", "two", "unknown-type", "no-schema", "grammar-type", "schema-not-object"])
def test_a_bad_constraint_is_a_400_naming_it(server, body, param):
    response = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
