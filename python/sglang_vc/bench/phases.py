"""Decode-phase throughput: the tokens a server decodes while no prefill runs, over that
time, from SGLang's own per-request timestamps.

SGLang's scheduler runs one batch at a time, either a prefill (every chunk of it) or a
decode step, and reports per request (``meta_info``) when it entered its first forward
(``forward_entry_time``) and when its prefill finished (``prefill_finished_time``), both
wall-clock. So over a run whose requests are all submitted at once:

* the prefill time is the union of the requests' windows ``[forward_entry, prefill_finished]``;
* the decode time is the rest of the span from the first forward to the last reply (the
  server is never idle while a request is outstanding);
* the decoded tokens are all generated tokens but the first of each request, which its
  prefill produces.

The same definition for every configuration (full KV, lossy, VERICACHE): a VERICACHE
iteration that drafts and commits nothing is decode time, as it should be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RequestTimes:
    """One request's SGLang timestamps (seconds, wall clock) and its output length."""

    forward_entry: float
    prefill_finished: float
    finished: float  # the reply's arrival at the client
    completion_tokens: int

    @classmethod
    def of(cls, meta_info: dict, finished: float) -> Optional["RequestTimes"]:
        """From a ``/generate`` reply's ``meta_info``; None when SGLang did not report the
        prefill window (then the run has no decode-phase figure)."""
        start, end = meta_info.get("forward_entry_time"), meta_info.get("prefill_finished_time")
        if not start or not end or end < start:
            return None
        return cls(float(start), float(end), finished, int(meta_info["completion_tokens"]))


@dataclass(frozen=True)
class Phases:
    prefill_s: float
    decode_s: float
    decode_tokens: int

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None

    def as_dict(self) -> dict:
        return {"prefill_s": self.prefill_s, "decode_s": self.decode_s, "decode_tokens": self.decode_tokens,
                "decode_tokens_per_s": self.decode_tokens_per_s}


def split(times: list[Optional[RequestTimes]]) -> Optional[Phases]:
    """The run's prefill and decode time and its decoded tokens; None when a request's
    prefill window is unknown."""
    if not times or any(t is None for t in times):
        return None
    prefill, end = 0.0, float("-inf")
    for t in sorted(times, key=lambda t: t.forward_entry):  # union of the windows
        lo = max(t.forward_entry, end)
        if t.prefill_finished > lo:
            prefill += t.prefill_finished - lo
        end = max(end, t.prefill_finished)
    span = max(t.finished for t in times) - min(t.forward_entry for t in times)
    decoded = sum(max(0, t.completion_tokens - 1) for t in times)
    return Phases(prefill, max(0.0, span - prefill), decoded)
