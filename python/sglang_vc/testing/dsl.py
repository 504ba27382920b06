"""SGLang's own frontend-language test programs (``sglang/test/test_programs.py``, shipped
in the sglang wheel) run greedy against a server, with every ``/generate`` exchange
recorded, so that two servers' runs can be compared exchange by exchange.

The programs assert what SGLang's own tests assert of a capable model; on the small
embedded model some of those assertions fail on any server, so a program's outcome
(``ok`` or its exception) is recorded and compared too, never required to be ``ok``.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from dataclasses import dataclass, field

# Programs not run, with the reason. Everything else in test_programs.py is.
SKIPPED = {
    "test_image_qa": "needs a vision model",
    "test_completion_speculative": "reads the OpenAI backend's token_usage, which RuntimeEndpoint does not have "
                                   "(AttributeError before any request)",
    "test_chat_completion_speculative": "API speculative execution (num_api_spec_tokens): against a "
                                        "RuntimeEndpoint it sends no /generate request, nothing to compare",
    "test_parallel_encoding": "needs /concate_and_append_request, which SGLang 0.5.23's server does not "
                              "serve (404), and the program then waits forever",
    "test_gen_min_new_tokens": "reads sgl.Runtime's endpoint (default_backend.endpoint), which a "
                               "RuntimeEndpoint backend does not have",
}


@dataclass
class Exchange:
    request: str  # the /generate body, JSON with sorted keys
    response: object  # (text, output ids, finish reason) per prompt; a stream's last chunk


@dataclass
class ProgramRun:
    outcome: str
    exchanges: list[Exchange] = field(default_factory=list)

    def key(self) -> list[tuple[str, str]]:
        """Order-free (the parallel programs fork threads): sorted (request, response)."""
        return sorted((e.request, json.dumps(e.response, sort_keys=True)) for e in self.exchanges)


def program_names() -> list[str]:
    from sglang.test import test_programs

    return [n for n in dir(test_programs) if n.startswith("test_") and callable(getattr(test_programs, n))
            and n not in SKIPPED]


def _summary(obj):
    items = obj if isinstance(obj, list) else [obj]
    return [(o.get("text"), o.get("output_ids"), o.get("meta_info", {}).get("finish_reason")) for o in items]


class _RecordedStream:
    """A streamed response whose chunks are recorded as the program reads them (it stops
    reading at ``[DONE]``): the exchange's response is the last chunk read."""

    def __init__(self, res, exchange: Exchange):
        self._res, self._exchange = res, exchange
        self.status_code = res.status_code

    def json(self):
        return self._res.json()

    def iter_lines(self, **kwargs):
        for line in self._res.iter_lines(**kwargs):
            text = line.decode("utf-8") if isinstance(line, bytes) else line
            if text.startswith("data:") and text != "data: [DONE]":
                self._exchange.response = _summary(json.loads(text[5:]))
            yield line


def run_programs(url: str, names: list[str], max_new_tokens: int = 32) -> dict[str, ProgramRun]:
    """Run each named program against ``url`` greedy (``temperature`` 0 in every request,
    ``max_new_tokens`` capped), recording its ``/generate`` exchanges."""
    import sglang as sgl
    from sglang.lang.backend import runtime_endpoint
    from sglang.test import test_programs

    original = runtime_endpoint.http_request
    lock = threading.Lock()
    current: list[Exchange] = []

    def recorded(target, json=None, stream=False, **kwargs):
        if not target.endswith("/generate") or json is None:
            return original(target, json=json, stream=stream, **kwargs)
        params = json.setdefault("sampling_params", {})
        params["temperature"] = 0
        if params.get("max_new_tokens") is None or params["max_new_tokens"] > max_new_tokens:
            params["max_new_tokens"] = max_new_tokens
        exchange = Exchange(_json_key(json), None)
        with lock:
            current.append(exchange)
        res = original(target, json=json, stream=stream, **kwargs)
        if stream:
            return _RecordedStream(res, exchange)
        exchange.response = _summary(res.json()) if res.status_code == 200 else ("HTTP", res.status_code)
        return res

    runs: dict[str, ProgramRun] = {}
    runtime_endpoint.http_request = recorded
    try:
        sgl.set_default_backend(sgl.RuntimeEndpoint(url))
        for name in names:
            current.clear()
            program = getattr(test_programs, name)
            kwargs = {"check_answer": False} if "check_answer" in inspect.signature(program).parameters else {}
            try:
                program(**kwargs)
                outcome = "ok"
            except Exception as e:  # the program's own assertion on the small model
                outcome = re.sub(r" at 0x[0-9a-f]+", "", f"{type(e).__name__}: {e}")[:300]
            runs[name] = ProgramRun(outcome, list(current))
    finally:
        runtime_endpoint.http_request = original
    return runs


def _json_key(body: dict) -> str:
    return json.dumps(body, sort_keys=True, default=str)
