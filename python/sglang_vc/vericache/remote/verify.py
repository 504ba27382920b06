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

(a round's calls together, as one batched request: lists of each).
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
    """A client of one local server's ``/generate``: :meth:`submit` sends a round's calls
    as ONE batched request (SGLang's list form of ``input_ids`` and the per-request
    logprob options), so the local server takes them in one scheduler step, not one
    per HTTP request; the request runs on a thread while the caller goes on."""

    def __init__(self, url: str, timeout_s: float = 60.0):
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vericache-remote")
        self._session = requests.Session()

    @staticmethod
    def body(calls: Sequence[VerifyCall]) -> dict:
        ids, starts, drafts = [], [], []
        for c in calls:
            committed, d = [int(t) for t in c.committed], [int(t) for t in c.drafts]
            ids.append(committed + d)
            # from the last committed token: SGLang gives no prediction for the first token
            # of the range (its predecessor's logits are not recomputed), so the range
            # starts one earlier and that entry is dropped
            starts.append(len(committed) - 1)
            drafts.append(len(d))
        return {
            "input_ids": ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True},
            "return_logprob": [True] * len(calls),
            "logprob_start_len": starts,
            "top_logprobs_num": [1] * len(calls),
            "return_text_in_logprobs": False,
        }

    def _answer(self, out: dict, n_drafts: int) -> list[int]:
        meta = out.get("meta_info", {})
        # one entry per input token from logprob_start_len on, the first one empty: the
        # distribution that predicts each token, i.e. the verifier's token at each draft
        tops = (meta.get("input_top_logprobs") or [])[1:]
        if len(tops) != n_drafts or any(not t for t in tops):
            raise RemoteVerifyError(f"verifier {self.url} returned {len(tops)} input top-logprobs for {n_drafts} drafts")
        ids = out.get("output_ids") or []
        if len(ids) != 1:
            raise RemoteVerifyError(f"verifier {self.url} returned {len(ids)} output tokens, expected 1")
        return [int(t[0][1]) for t in tops] + [int(ids[0])]

    def _post(self, calls: Sequence[VerifyCall]) -> list:
        try:
            r = self._session.post(self.url + "/generate", json=self.body(calls), timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise RemoteVerifyError(f"verifier {self.url} unreachable: {exc}") from None
        if r.status_code != 200:
            raise RemoteVerifyError(f"verifier {self.url} answered {r.status_code}: {r.text[:300]}")
        outs = r.json()
        if not isinstance(outs, list) or len(outs) != len(calls):
            raise RemoteVerifyError(f"verifier {self.url} returned {type(outs).__name__} for {len(calls)} calls")
        answers = []
        for out, c in zip(outs, calls):
            try:
                answers.append(self._answer(out, len(c.drafts)))
            except RemoteVerifyError as exc:
                answers.append(exc)
        return answers

    def submit(self, calls: Sequence[VerifyCall]) -> Callable[[], list]:
        """Send ``calls`` now; the function returned waits for their answers: per call,
        the verifier's token at each of its ``len(drafts) + 1`` positions (the position
        of each draft, then the one after the last), or the :class:`RemoteVerifyError`
        that call failed with (a failed request fails every call in it)."""
        t0 = time.perf_counter()
        future = self._pool.submit(self._post, list(calls)) if calls else None

        def answers() -> list:
            if future is None:
                return []
            try:
                out = future.result()
            except RemoteVerifyError as exc:
                out = [exc] * len(calls)
            failed = sum(isinstance(a, RemoteVerifyError) for a in out)
            if failed:
                logger.warning("VERICACHE_REMOTE: %d of %d verify calls failed: %s", failed, len(calls),
                               next(a for a in out if isinstance(a, RemoteVerifyError)))
            stats.add(STATS, verify_requests=1, verify_calls=len(calls), verify_call_failures=failed,
                      verify_tokens_sent=sum(len(c.drafts) + 1 for c in calls),
                      verify_wait_seconds=time.perf_counter() - t0)
            return out

        return answers

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._session.close()
