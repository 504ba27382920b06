"""The HTTP client of :mod:`.evicpress`: streamed requests (TTFT, text), the server's
EvicPress counters and the tier a request hit."""

from __future__ import annotations

import json
import time
from typing import Optional

import requests


class Client:
    """HTTP calls to the server, one connection each: a pooled keep-alive connection
    left idle for the server's keep-alive timeout (uvicorn's 5 s, exactly the profiling
    poll interval) is closed by the server as the next request reuses it, which the
    client sees as "connection reset by peer"."""

    def __init__(self, url: str, admin_key: Optional[str] = None) -> None:
        self.url = url
        # the server's --admin-api-key, where it has one (SGLang's admin routes need it)
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}

    def api(self, method: str, path: str, body=None, timeout: float = 1800, allow: tuple = (),
            params: Optional[dict] = None) -> dict:
        r = requests.request(method, self.url + path, json=body, params=params, timeout=timeout)
        if r.status_code in allow:
            return {}
        if r.status_code != 200:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:500]}")
        return r.json()

    def clear_storage(self) -> None:
        """Empty the HiCache storage backend (SGLang's route, which answers in text)."""
        r = requests.post(self.url + "/hicache/storage-backend/clear", headers=self.headers, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"POST /hicache/storage-backend/clear: {r.status_code} {r.text[:500]}")

    def counters(self) -> dict:
        info = self.api("GET", "/server_info")
        return dict(info["sglang_vc"]["counters"].get("evicpress", {}))

    def stream(self, input_ids, max_new_tokens: int, extra_key: Optional[str] = None, rid: Optional[str] = None,
               timeout: float = 1800) -> tuple[float, str, dict]:
        """(TTFT seconds, text, meta_info) of a streamed greedy request."""
        body = {"input_ids": input_ids, "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
        if extra_key:
            body["extra_key"] = extra_key
        if rid:
            body["rid"] = rid
        t0 = time.perf_counter()
        ttft = None
        last = {}
        with requests.post(self.url + "/generate", json=body, stream=True, timeout=timeout) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                last = json.loads(data)
                if ttft is None:
                    ttft = time.perf_counter() - t0
        return (ttft if ttft is not None else time.perf_counter() - t0), last.get("text", ""), last.get("meta_info", {})


TIERS = ("device", "host", "disk", "miss")


def tier_of(before: dict, after: dict) -> str:
    for t, key in (("device", "hits_device"), ("host", "hits_host"), ("disk", "hits_disk"), ("miss", "misses")):
        if after.get(key, 0) > before.get(key, 0):
            return t
    return "none"
