"""ADMIT(r): place a request's next verify in the lookahead window (VeriCache paper,
Algorithm 1, §5.1-5.2).

Notation (paper): ``KV_full^(r)`` bytes to reload for request ``r``, ``BW`` link bandwidth,
``T_iter`` iteration time, ``W`` lookahead windows, ``x`` the anchored draft length.

1. ``ell_r = KV_full^(r) / (BW * T_iter)``; ``S_r = max(1, ceil(ell_r))``.
2. ``anchor = clamp(x, S_r, W-1)``.
3. candidates ``anchor, anchor-1, anchor+1, anchor-2, anchor+2, ...`` within ``[S_r, W-1]``.
4-8. the first ``d`` whose span ``[d-S_r+1, d]`` satisfies the BW-ring and HBM-ring
   constraints on every window is reserved: ``d_r = d``, ``mode[r] = SPECULATIVE``.
11. otherwise ``r`` returns to the waiting queue (``admit`` returns ``None``).

The lower clamp ``S_r`` keeps the span out of window 0 (the iteration now running), so a
reload is always kicked off in a future iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from sglang_vc.vericache.rings import BwRing, HbmRing, Ring


class AdmitState(str, Enum):
    """``mode[r]`` of Algorithm 1, plus FALLBACK (ours): speculation abandoned and the
    request decodes from full KV (it can never fit, or was deferred too often)."""

    SPECULATIVE = "speculative"
    WAITING = "waiting"
    FALLBACK = "fallback"


def load_span(kv_bytes: float, bandwidth: float, iter_time: float) -> tuple[float, int]:
    """Algorithm 1 line 1: ``(ell_r, S_r)``, the reload's iteration-equivalent duration
    and the number of windows it spans."""
    if bandwidth <= 0 or iter_time <= 0:
        raise ValueError("bandwidth and iter_time must be > 0")
    ell = max(0.0, float(kv_bytes)) / (bandwidth * iter_time)
    # ceil with a little slack: 2.0000000001 from float error is 2 windows, not 3
    return ell, max(1, math.ceil(ell - 1e-9))


def bw_profile(ell: float, span: int, iter_time: float) -> tuple[float, ...]:
    """Link seconds the reload takes in each window of its span, oldest first.

    The reload is kicked off at the span's first window (§5.2 step i) and, the link being
    serialised, runs back to back: it fills the first ``S_r - 1`` windows and takes the
    remainder ``(ell_r - S_r + 1) * T_iter`` of the last one.
    """
    full = [iter_time] * (span - 1)
    return tuple(full + [max(0.0, ell - (span - 1)) * iter_time])


def candidate_offsets(x: int, span: int, window: int, max_offset: int | None = None) -> list[int]:
    """Algorithm 1 lines 2-3: verify offsets to try, in order. Empty if the span cannot
    fit in the window at all (``S_r > W - 1``). ``max_offset`` (ours): the most drafts the
    request may make before this verify (it has few tokens left); never below ``S_r``
    (the reload must have time to land)."""
    lo, hi = span, window - 1
    if lo > hi:
        return []
    if max_offset is not None:
        hi = max(lo, min(hi, max_offset))
    anchor = min(max(int(x), lo), hi)
    out = [anchor]
    k = 1
    while anchor - k >= lo or anchor + k <= hi:
        if anchor - k >= lo:  # shorter draft first, as in §5.2 ("x-1, then x+1")
            out.append(anchor - k)
        if anchor + k <= hi:
            out.append(anchor + k)
        k += 1
    return out


@dataclass(frozen=True)
class Placement:
    """A reservation made by ADMIT, in windows relative to the iteration it ran in.

    ``verify_offset`` is ``d_r``; the reload occupies windows
    ``start_offset .. verify_offset`` (``S_r`` of them) on both rings: ``bw[k]`` link
    seconds and ``hbm`` bytes in window ``start_offset + k``.
    """

    verify_offset: int
    span: int
    load_iters: float
    bw: tuple[float, ...]
    hbm: float

    @property
    def start_offset(self) -> int:
        return self.verify_offset - self.span + 1

    def reserve(self, bw_ring: Ring, hbm_ring: Ring, verify_ring: Ring | None, shift: int = 0) -> None:
        """Add this placement to the rings (``shift`` = iterations advanced since)."""
        s = self.start_offset - shift
        bw_ring.add(s, self.bw)
        hbm_ring.add(s, [self.hbm] * self.span)
        if verify_ring is not None:
            verify_ring.add(self.verify_offset - shift, [1.0])

    def unreserve(self, bw_ring: Ring, hbm_ring: Ring, verify_ring: Ring | None, shift: int = 0) -> None:
        """Remove what is left of this placement ``shift`` iterations after it was made
        (windows already retired are skipped)."""
        s = self.start_offset - shift
        bw_ring.remove(s, self.bw)
        hbm_ring.remove(s, [self.hbm] * self.span)
        if verify_ring is not None:
            verify_ring.remove(self.verify_offset - shift, [1.0])


def admit(
    bw_ring: BwRing,
    hbm_ring: HbmRing,
    kv_bytes: float,
    bandwidth: float,
    draft_len: int,
    *,
    hbm_bytes: float | None = None,
    verify_ring: Ring | None = None,
    verify_cap: float | None = None,
    max_draft_len: int | None = None,
) -> Placement | None:
    """ADMIT(r) of Algorithm 1: find and reserve the verify window, or return ``None``
    (request goes back to the waiting queue).

    ``kv_bytes`` is the reload size ``KV_full^(r)`` (for token dropping the caller may pass
    ``(1 - c) * KV_full`` when the kept part is already on device, as in appendix B.1);
    ``hbm_bytes`` the transient device memory the reload holds until its verify (defaults
    to ``kv_bytes``). ``verify_ring``/``verify_cap`` optionally cap verifies per window:
    our addition that makes §4.2's "about B/x requests verify per iteration" hold even
    when neither the link nor HBM is the constraint. ``max_draft_len`` caps the verify
    offset (the drafts before it).
    """
    iter_time = bw_ring.iter_time
    ell, span = load_span(kv_bytes, bandwidth, iter_time)
    bw = bw_profile(ell, span, iter_time)
    hbm = float(kv_bytes if hbm_bytes is None else hbm_bytes)
    for d in candidate_offsets(draft_len, span, bw_ring.window, max_draft_len):
        start = d - span + 1
        if not bw_ring.fits(start, bw):
            continue
        if not hbm_ring.fits(start, [hbm] * span):
            continue
        if verify_ring is not None and verify_cap is not None:
            if not verify_ring.fits(d, [1.0], capacity=verify_cap):
                continue
        placement = Placement(verify_offset=d, span=span, load_iters=ell, bw=bw, hbm=hbm)
        placement.reserve(bw_ring, hbm_ring, verify_ring)
        return placement
    return None
