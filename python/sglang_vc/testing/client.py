"""Small HTTP helpers the serving tests share: a greedy ``/generate`` on token ids, and
running calls concurrently so that they share the server's batches."""

from __future__ import annotations

import threading

import requests


def generate(server, ids, max_new, custom_params=None, timeout: float = 900, **sampling) -> dict:
    """``/generate`` on ``ids`` (greedy, EOS ignored unless ``sampling`` says otherwise);
    asserts HTTP 200 and returns the JSON reply."""
    params = {**_greedy_params(max_new, custom_params), **sampling}
    r = requests.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": params},
                      timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def concurrently(fn, args_list):
    """``[fn(*args) for args in args_list]``, each call in its own thread; re-raises the
    first error."""
    results, errors = [None] * len(args_list), []

    def run(i, args):
        try:
            results[i] = fn(*args)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _greedy_params(max_new, custom_params=None) -> dict:
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    if custom_params is not None:
        params["custom_params"] = custom_params
    return params


def stream_chunks(server, ids, max_new, custom_params=None, timeout: float = 900):
    """The chunks of a streamed greedy ``/generate`` (EOS ignored), parsed; each holds every
    output id so far, the last one the finish reason too."""
    import json

    with requests.post(server.url + "/generate", json={"input_ids": ids, "stream": True,
                       "sampling_params": _greedy_params(max_new, custom_params)},
                       stream=True, timeout=timeout) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                yield json.loads(line[5:])


def stream_with_pool_snapshot(server, ids, max_new, custom_params=None, after_tokens: int = 2,
                              timeout: float = 900) -> tuple[dict, dict]:
    """A streamed greedy ``/generate`` that reads the server's ``kv_pool`` gauge
    (``/server_info``) once ``after_tokens`` tokens have come out, i.e. while the request
    is decoding. Returns (the last streamed chunk, the gauge)."""
    last, gauge = None, None
    for last in stream_chunks(server, ids, max_new, custom_params, timeout):
        if gauge is None and after_tokens <= len(last["output_ids"]) < max_new:
            info = requests.get(server.url + "/server_info", timeout=60).json()
            gauge = info["sglang_vc"]["counters"]["kv_pool"]
    assert last is not None and gauge is not None, "the stream ended before the gauge was read"
    return last, gauge


def stream_generate(server, ids, max_new, custom_params=None, first_token=None, timeout: float = 900) -> dict:
    """A streamed greedy ``/generate`` (EOS ignored); sets the ``first_token`` event once
    the first token has come out (the request is then decoding). Returns the last chunk,
    which holds every output id and the finish reason."""
    last = None
    try:
        for last in stream_chunks(server, ids, max_new, custom_params, timeout):
            if first_token is not None:
                first_token.set()
    finally:
        if first_token is not None:
            first_token.set()
    assert last is not None, "the stream ended before its first token"
    return last
