"""Path P2 of VeriCache's remote prefix caching, and the fallback of path P1: the full KV
of a stored prefix reaches the remote server, which then serves the prefix exactly by
itself (paper appendix B.2).

The remote server drafts from the compressed copy it loaded; meanwhile the context's
full storage copy streams over the same slow link (:class:`FullCopies`, one reader
thread: one link). When it has arrived the worker writes it over the device rows of the
lossy copy (:meth:`EvicPressRadixCache.install_full`), and every request running on that
context is retracted with SGLang's own retraction: requeued, it prefills the tokens
after the context over the now exact prefix (its committed tokens were all verified),
and from there decodes as any full-KV request, with no more verify rounds. A verify that
fails (the local server is down or too slow) takes the same way, the full copy read at
once: slower, never wrong.

On an emulated link (``--vc-storage-read-gbps``) a stream is background traffic: its
slices wait while a read a request waits for is on the link. Deviation: the paper
streams the remainder ``(1 - c) KV`` on top of the compressed copy;
the store here holds independent copies, so P2 reads the whole full copy (``KV`` bytes).

The choice per request (:func:`choose_path`): P2 when the full copy would arrive before
the request is done and decoding the rest by itself beats verifying it round by round;
P1 otherwise (short outputs): B.2's comparison of the two paths for one request, priced
with this server's measured link speed, round time and draft step.
"""

from __future__ import annotations

import enum
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)


class RemotePath(str, enum.Enum):
    P1 = "p1"  # every round verified by the local server
    P2 = "p2"  # ... until the full copy has arrived; then this server alone
    AUTO = "auto"  # per request, by choose_path
    TIERING = "tiering"  # no verifier: the full copy from this server's own storage (.tiering)


@dataclass(frozen=True)
class PathInputs:
    """What the choice of a request's path is priced with (seconds, bytes, bytes/s)."""

    new_tokens: int  # the request's max_new_tokens
    full_bytes: float  # the context's full KV
    link_bytes_per_s: Optional[float]  # measured reads of this server's storage link
    round_s: Optional[float]  # measured verify round (X drafts + the local verify)
    commits_per_round: Optional[float]  # measured tokens committed per verified round
    step_s: Optional[float]  # measured draft (decode) forward of this server
    draft_tokens: int  # X


def choose_path(p: PathInputs) -> RemotePath:
    """P1 or P2 for one request. Before anything is measured: P2 for outputs of at least
    two rounds (``2 X`` tokens), P1 for shorter ones."""
    if None in (p.link_bytes_per_s, p.round_s, p.commits_per_round, p.step_s) or p.link_bytes_per_s <= 0:
        return RemotePath.P2 if p.new_tokens >= 2 * p.draft_tokens else RemotePath.P1
    per_token_p1 = p.round_s / max(p.commits_per_round, 1e-9)
    p1 = p.new_tokens * per_token_p1
    arrive = p.full_bytes / p.link_bytes_per_s
    if arrive >= p1:
        return RemotePath.P1  # done before the full copy would be here
    done_by_then = arrive / per_token_p1
    p2 = arrive + (p.new_tokens - done_by_then) * p.step_s
    return RemotePath.P2 if p2 < p1 else RemotePath.P1


class FullCopies:
    """Full storage copies of contexts, read off the scheduler thread (one reader: one
    link) and handed to the scheduler thread to install. ``read`` is the callable that
    reads one (``EvicPressManager.read_storage_copy``)."""

    def __init__(self, read):
        from sglang_vc.storage_link import background_reads  # SGLang's storage types: not at flag parsing

        self._read = read
        self._background = background_reads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vc-full-copy")
        self._lock = threading.Lock()
        self._inflight: dict[str, tuple[object, Future]] = {}  # ctx_id -> (ctx, read)

    def stream(self, ctx) -> bool:
        """Start reading ``ctx``'s full copy unless a read is in flight; True if started."""
        with self._lock:
            if ctx.ctx_id in self._inflight:
                return False
            self._inflight[ctx.ctx_id] = (ctx, self._pool.submit(self._read_behind, ctx))
            return True

    def _read_behind(self, ctx):
        """A stream is background traffic on the link: the compressed copies requests
        wait for go first (``storage_link.background_reads``)."""
        with self._background():
            return self._read(ctx)

    def streaming(self, ctx_id: str) -> bool:
        with self._lock:
            return ctx_id in self._inflight

    def ready(self, ctx_id: str) -> bool:
        """No read of ``ctx_id`` in flight (none started, or it has finished)."""
        with self._lock:
            entry = self._inflight.get(ctx_id)
            return entry is None or entry[1].done()

    def arrived(self) -> list[tuple[object, Optional[object]]]:
        """The reads that finished since the last call: (ctx, FullKV or None)."""
        with self._lock:
            done = [cid for cid, (_, f) in self._inflight.items() if f.done()]
            out = [self._inflight.pop(cid) for cid in done]
        return [(ctx, _result(f)) for ctx, f in out]

    def read_now(self, ctx):
        """``ctx``'s full copy, waiting for it: the read in flight, else one read here (not
        queued behind another context's stream)."""
        with self._lock:
            entry = self._inflight.pop(ctx.ctx_id, None)
        if entry is not None:
            return _result(entry[1])
        try:
            return self._read(ctx)
        except Exception:
            logger.exception("VERICACHE_REMOTE: reading a full copy failed")
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _result(future: Future):
    try:
        return future.result()
    except Exception:
        logger.exception("VERICACHE_REMOTE: reading a full copy failed")
        return None
