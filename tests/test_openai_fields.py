"""OpenAI request fields the server must check rather than ignore: every value a client sends is either used
or refused with a 400 naming it (docs/serve.md: "each field is checked once, when the request arrives").

Servers run in this process on the tiny chat bundle (test_serve.py).
"""

from __future__ import annotations

import httpx
import pytest

from test_serve import MESSAGES, PROMPT, chat_bundle, server  # noqa: F401 (fixtures)


@pytest.mark.parametrize("max_tokens", ["lots", -5, 2.5, True], ids=["string", "negative", "float", "bool"])
def test_an_invalid_max_tokens_beside_max_completion_tokens_is_a_400(server, max_tokens):
    """max_completion_tokens wins when both are given, but a max_tokens that is no valid value is still
    an invalid request: refused, not silently dropped (it is refused when sent alone)."""
    alone = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0})
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "max_tokens", alone.text
    both = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                      json={"messages": MESSAGES, "max_completion_tokens": 2, "max_tokens": max_tokens,
                            "temperature": 0})
    assert both.status_code == 400, both.text
    assert both.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
], ids=["completions", "chat"])
@pytest.mark.parametrize("user", [5, {"id": "u"}, ["u"], True], ids=["int", "object", "list", "bool"])
def test_a_user_that_is_not_a_string_is_a_400(server, path, body, user):
    """OpenAI's `user` is a string (OpenAI answers 400 'Invalid type for user'); `model`, the other field
    accepted and not used, is type-checked already."""
    response = httpx.post(server.url + path, timeout=30, json={**body, "max_tokens": 2, "temperature": 0, "user": user})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "user" and error["type"] == "invalid_request_error"
    fine = httpx.post(server.url + path, timeout=30, json={**body, "max_tokens": 2, "temperature": 0, "user": "u-1"})
    assert fine.status_code == 200, fine.text
