"""Verify rounds on another server: VeriCache's remote prefix caching, path P1 (paper
sections 4.2.2 and 5.3).

A server behind a slow link to the shared store (the *remote* server) loads a
compressed copy of a stored prefix and drafts from it; a server near the store (the
*local* server, any sglang-vc or SGLang server whose radix tree holds the prefix, loaded
by HiCache or EvicPress from the store) verifies. One verify is one request on the local
server's own ``/generate`` path::

    input_ids = committed ++ drafts       (committed = prompt ++ output so far)
    sampling_params = {temperature: 0, max_new_tokens: 1, ignore_eos: true}
    return_logprob, logprob_start_len = len(committed) - 1, top_logprobs_num = 1

The local server matches ``committed`` but its last token in its radix tree (SGLang
clamps the match at ``logprob_start_len``), prefills that token and the drafts, and
returns, for each draft position,
its own top-1 token given everything before it (``input_top_logprobs``), then one more
token after the last draft (``output_ids``): the full-KV greedy token at each of the
``X + 1`` positions. The remote commits the matching drafts and the local server's token
after them (:func:`~.sampling.greedy_verify_ids`), so every committed token is the
full-KV argmax given committed tokens only. A verify with no drafts is the request's
first token.

Greedy only (argmax = top-1 logprob; an exact tie between two logits could order them
differently in SGLang's top-k than in its argmax: not observed, not excluded). A local
server that does not answer in ``timeout_s`` fails the round (:class:`RemoteVerifyError`);
the worker then finishes the request with that error rather than commit unverified tokens.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import requests

from sglang_vc import stats

logger = logging.getLogger(__name__)

__all__ = ["RemoteVerifier", "RemoteVerifyError", "VerifyCall", "STATS"]

STATS = "vericache_remote"  # the counters' group in /server_info and /metrics


class RemoteVerifyError(RuntimeError):
    """The local server did not verify (unreachable, timed out, an error answer)."""


@dataclass
class VerifyCall:
    """One request's verify: the committed token ids and the drafts after them."""

    committed: Sequence[int]
    drafts: Sequence[int]


class RemoteVerifier:
    """A client of one local server's ``/generate``; :meth:`submit` runs one call per
    request concurrently (``max_parallel`` at a time)."""

    def __init__(self, url: str, timeout_s: float = 60.0, max_parallel: int = 16):
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="vericache-remote")
        self._session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=max_parallel)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)

    def _one(self, call: VerifyCall) -> list[int]:
        committed, drafts = list(map(int, call.committed)), list(map(int, call.drafts))
        body = {
            "input_ids": committed + drafts,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True},
            "return_logprob": bool(drafts),
            # from the last committed token: SGLang gives no prediction for the first token
            # of the range (its predecessor's logits are not recomputed), so the range
            # starts one earlier and that entry is dropped
            "logprob_start_len": len(committed) - 1 if drafts else -1,
            "top_logprobs_num": 1 if drafts else 0,
            "return_text_in_logprobs": False,
        }
        try:
            r = self._session.post(self.url + "/generate", json=body, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise RemoteVerifyError(f"verifier {self.url} unreachable: {exc}") from None
        if r.status_code != 200:
            raise RemoteVerifyError(f"verifier {self.url} answered {r.status_code}: {r.text[:300]}")
        out = r.json()
        meta = out.get("meta_info", {})
        targets = []
        if drafts:
            tops = (meta.get("input_top_logprobs") or [])[1:]
            # one entry per input token from logprob_start_len on: the distribution that
            # predicts it, i.e. the verifier's token at each draft's position
            if len(tops) != len(drafts) or any(not t for t in tops):
                raise RemoteVerifyError(
                    f"verifier {self.url} returned {len(tops)} input top-logprobs for {len(drafts)} drafts")
            targets = [int(t[0][1]) for t in tops]
        ids = out.get("output_ids") or []
        if len(ids) != 1:
            raise RemoteVerifyError(f"verifier {self.url} returned {len(ids)} output tokens, expected 1")
        return targets + [int(ids[0])]

    def submit(self, calls: Sequence[VerifyCall]) -> Callable[[], list]:
        """Send ``calls`` now; the function returned waits for their answers: per call,
        the verifier's token at each of its ``len(drafts) + 1`` positions (the position
        of each draft, then the one after the last), or the :class:`RemoteVerifyError`
        that call failed with."""
        t0 = time.perf_counter()
        futures = [self._pool.submit(self._one, c) for c in calls]

        def answers() -> list:
            out, failed = [], 0
            for f in futures:
                try:
                    out.append(f.result())
                except RemoteVerifyError as exc:
                    logger.warning("VERICACHE_REMOTE: %s", exc)
                    out.append(exc)
                    failed += 1
            stats.add(STATS, verify_calls=len(calls), verify_call_failures=failed,
                      verify_tokens_sent=sum(len(c.drafts) + 1 for c in calls),
                      verify_wait_seconds=time.perf_counter() - t0)
            return out

        return answers

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._session.close()
