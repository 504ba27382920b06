"""Decoding throughput over the window in which every request of a run decodes together.

A run submits all its requests at once. Its decode-phase figure (:mod:`.phases`) counts
what decodes while no prefill runs, but where prefills end at different times the batch
that decodes in those gaps varies in size and mix between configurations, so two rows do
not measure the same work. Here each request is streamed and every chunk's arrival is
kept (the tokens it had by then), and the rate is taken over the **steady window**: from
the moment the last request had its first token (every prefill done) to the moment the
first request finished (the batch still whole). Inside it every request of the run
decodes, no prefill runs and, with its prompts already in the radix cache (``warm``: the
benchmark prefills them in a run of its own first), every configuration starts it with
the same requests from the same lengths.

No SGLang dependency: the chunks are SGLang's ``/generate`` stream.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import time
from typing import Optional

import requests


@dataclasses.dataclass(frozen=True)
class Stream:
    """One request's streamed reply: when each chunk came (wall clock) and how many
    tokens the request had then; its last chunk's ``meta_info`` and output."""

    times: list[float]
    tokens: list[int]
    output_ids: list[int]
    meta_info: dict

    def tokens_at(self, t: float) -> int:
        """Tokens the request had out at time ``t`` (0 before its first chunk)."""
        k = bisect.bisect_right(self.times, t)
        return self.tokens[k - 1] if k else 0

    @property
    def first(self) -> float:
        return self.times[0]

    @property
    def last(self) -> float:
        return self.times[-1]


def stream_generate(url: str, ids: list[int], sampling_params: dict, timeout: float = 7200) -> Stream:
    """``/generate`` streamed on token ids; each chunk's arrival time and token count."""
    times, tokens, last = [], [], None
    with requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": sampling_params, "stream": True},
                       stream=True, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            last = json.loads(line[5:])
            if "error" in last:
                raise RuntimeError(f"/generate failed: {last['error']}")
            times.append(time.time())
            tokens.append(int(last["meta_info"]["completion_tokens"]))
    if last is None:
        raise RuntimeError("/generate streamed nothing")
    return Stream(times, tokens, list(last["output_ids"]), last["meta_info"])


@dataclasses.dataclass(frozen=True)
class Window:
    start: float  # every request had its first token
    end: float  # the first request finished
    tokens: int  # tokens the requests decoded inside it
    requests: int

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "seconds": self.seconds, "tokens": self.tokens,
                "requests": self.requests, "tokens_per_s": self.tokens_per_s}


def steady_window(streams: list[Stream]) -> Optional[Window]:
    """The window in which every request decodes (None when one request finished before
    another had its first token: the run never held them all)."""
    start = max(s.first for s in streams)
    end = min(s.last for s in streams)
    if end <= start:
        return None
    tokens = sum(s.tokens_at(end) - s.tokens_at(start) for s in streams)
    return Window(start, end, tokens, len(streams))


def iterations_in(records: list[dict], window: Window) -> dict:
    """The schedule-trace iterations (``--vc-schedule-trace`` records with their ``wall``
    end time) that ended inside the window, the mean batch they held, and what their
    verifies committed: the window's own A and mean anchor X. A run's mean A is not the
    window's where requests accept very differently (a 16k document: five requests at
    A ~8 finish early, three at A ~1.7 verify four times as often in the tail)."""
    inside = [r for r in records if r.get("wall") is not None and window.start < r["wall"] <= window.end]
    verifies = [q for r in inside for q in r["requests"] if q.get("role") == "verify"]
    anchors = [q["draft_len"] for q in verifies if q.get("draft_len")]
    return {"iterations": len(inside),
            "mean_batch": sum(len(r["requests"]) for r in inside) / len(inside) if inside else None,
            "verifies": len(verifies),
            "acceptance": sum(q["committed"] for q in verifies) / len(verifies) if verifies else None,
            "draft_len": round(sum(anchors) / len(anchors)) if anchors else None}
