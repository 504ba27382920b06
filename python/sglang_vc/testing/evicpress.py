"""The ``/evicpress`` HTTP API of a test server, as the EvicPress serving tests use it."""

from __future__ import annotations

import requests

QUESTION = "\n\nQuestion: What is this text about?\nAnswer:"
CTX_TOKENS = 200  # the tests' contexts: 9 MB of float32 KV each for SmolLM2-135M


def auth(server) -> dict:
    """The header presenting the server's ``--admin-api-key`` (tests set ``admin_key`` on
    a server started with one); empty otherwise."""
    key = getattr(server, "admin_key", None)
    return {"Authorization": f"Bearer {key}"} if key else {}


def api(server, method: str, path: str, body=None) -> dict:
    """Call ``/evicpress...`` (or any JSON route); asserts HTTP 200 and shows the log tail."""
    r = requests.request(method, server.url + path, json=body, headers=auth(server), timeout=300)
    assert r.status_code == 200, (r.status_code, r.text, server.log_tail(30))
    return r.json()


def counters(server) -> dict:
    # /evicpress/status runs after the stores the backend deferred to the next step
    return api(server, "GET", "/evicpress/status")["counters"]


def placement(server, ctx_id: str) -> dict:
    return api(server, "GET", f"/evicpress/contexts/{ctx_id}")["placement"]


def kv_pool(server) -> dict:
    """The device KV pool gauge of ``/server_info``."""
    return server.server_info()["sglang_vc"]["counters"]["kv_pool"]


def register(server, tokenizer, ctx_id: str, passage: str, tokens: int = CTX_TOKENS, **extra):
    """Register the first ``tokens`` tokens of ``passage`` as context ``ctx_id``; returns
    (token ids, the API's answer)."""
    ids = tokenizer(passage)["input_ids"][:tokens]
    info = api(server, "POST", "/evicpress/contexts", {"id": ctx_id, "token_ids": ids, **extra})
    return ids, info


def ask(server, tokenizer, ids, n: int = 8, **sampling) -> dict:
    """A greedy answer to the tests' question about the context ``ids``."""
    q = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    return server.generate(input_ids=ids + q, max_new_tokens=n, **sampling)
