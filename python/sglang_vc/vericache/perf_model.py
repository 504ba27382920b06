"""Throughput model of VeriCache for long-context decoding (paper appendix B.1, with the
simplified Eq. 3 of §4.2.1). Pure functions of measured or nominal parameters.

Symbols (paper Table 3), all sizes in bytes, bandwidths in bytes/s, times in seconds:

* ``M`` ``weights_bytes``: model weights size.
* ``KV_full`` ``kv_full_bytes``: full KV cache per request.
* ``c`` ``compression``: kept fraction, ``KV_compressed = c * KV_full``, ``0 < c < 1``.
* ``x`` ``draft_len``: draft (speculation) length; a cycle is ``x`` drafts + 1 verify.
* ``gamma(x, c)``: acceptance rate; we take the measured *acceptance length*
  ``A = gamma * x + 1`` (tokens committed per verify round; docs/architecture.md, "Definitions").
* ``B`` ``batch_size``: concurrent requests; ``B_c`` ``offloaded`` of them keep full KV on
  the host, ``B_g = B - B_c`` keep it on device.
* ``ell`` ``cycles_per_load``: iterations one full-KV reload spans.
* ``BW_hbm`` ``hbm_bw``, ``BW_inter`` ``interconnect_bw``, ``GPU_mem`` ``gpu_mem_bytes``.

Appendix B.2 (remote prefix caching: the six routes, their resource costs and the
throughput-optimal mix) lives in :mod:`.remote.model` and is re-exported here; the
per-request P1/P2 choice a remote server makes at run time is
:func:`.remote.stream.choose_path`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from .remote.model import Cluster, Mix, Route, RouteCost, best_mix, choose_route, route_costs  # noqa: F401 (B.2)


# ------------------------------------------------------------------------ equations


def acceptance_length(gamma: float, draft_len: int) -> float:
    """``A = gamma * x + 1``: tokens committed per round (accepted + correction/bonus)."""
    return gamma * draft_len + 1.0


def acceptance_rate(accept_len: float, draft_len: int) -> float:
    """Inverse of :func:`acceptance_length`: ``gamma = (A - 1) / x``."""
    return (accept_len - 1.0) / draft_len


def avg_kv_per_offloaded(kv_full_bytes: float, compression: float, draft_len: int) -> float:
    """Eq. 5: ``KV_avg = KV_full * (x c + 1) / (x + 1)``, the mean device KV of an
    offloaded request (compressed during ``x`` drafts, full during its verify)."""
    x = draft_len
    return kv_full_bytes * (x * compression + 1.0) / (x + 1.0)


def full_kv_batch(gpu_mem_bytes: float, weights_bytes: float, kv_full_bytes: float) -> int:
    """Full-KV baseline batch ``floor((GPU_mem - M) / KV_full)`` (end of B.1)."""
    return max(0, math.floor((gpu_mem_bytes - weights_bytes) / kv_full_bytes))


def max_offloaded_batch(
    gpu_mem_bytes: float,
    weights_bytes: float,
    kv_full_bytes: float,
    compression: float,
    draft_len: int,
    non_offloaded: int = 0,
) -> int:
    """Largest ``B_c`` with Eq. 6: ``M + B_g KV_full + B_c KV_avg <= GPU_mem``."""
    room = gpu_mem_bytes - weights_bytes - non_offloaded * kv_full_bytes
    kv_avg = avg_kv_per_offloaded(kv_full_bytes, compression, draft_len)
    return max(0, math.floor(room / kv_avg + 1e-9))


def gpu_time(weights_bytes: float, batch_size: int, kv_avg_bytes: float, hbm_bw: float) -> float:
    """Eq. 7: ``T_gpu = (M + B * KV_avg) / BW_hbm`` (HBM-bandwidth-bound iteration)."""
    return (weights_bytes + batch_size * kv_avg_bytes) / hbm_bw


def xfer_time(
    offloaded: int,
    reload_bytes: float,
    draft_len: int,
    interconnect_bw: float,
    cycles_per_load: float = 1.0,
) -> float:
    """Eq. 8: ``T_xfer = B_c (1 - c) KV_full / ((x + 1) BW_inter ell)``, with
    ``reload_bytes = (1 - c) KV_full`` (or the measured bytes per verify reload).

    Note: as printed, Eq. 8 divides by ``ell``; the link's average busy time per
    iteration, ``B_c * reload_bytes / ((x + 1) BW_inter)``, does not depend on ``ell``
    (``PerfPrediction.link_utilization`` reports it), so for ``ell > 1`` Eq. 8 is
    optimistic. ``ell = 1`` (the default) makes the two agree.
    """
    return offloaded * reload_bytes / ((draft_len + 1.0) * interconnect_bw * cycles_per_load)


def link_concurrency(offloaded: int, draft_len: int, cycles_per_load: float = 1.0) -> float:
    """Left side of Eq. 9, ``B_c ell / (x + 1)``: reloads in flight at once (<= 1)."""
    return offloaded * cycles_per_load / (draft_len + 1.0)


def staggered_iter_time(
    weights_bytes: float,
    batch_size: int,
    kv_full_bytes: float,
    compression: float,
    draft_len: int,
    hbm_bw: float,
    interconnect_bw: float,
) -> tuple[float, float, float]:
    """Eq. 3 (§4.2.1, simplified model, ``B/x`` verifies per iteration):
    ``T_iter = max((M + B KV_full (c + 1/x)) / BW_hbm, B KV_full / (x BW_inter))``.
    Returns ``(T_iter, T_gpu, T_xfer)``."""
    b, kv, x = batch_size, kv_full_bytes, draft_len
    t_gpu = (weights_bytes + b * kv * (compression + 1.0 / x)) / hbm_bw
    t_xfer = b * kv / (x * interconnect_bw)
    return max(t_gpu, t_xfer), t_gpu, t_xfer


# ------------------------------------------------------------------------ predictions


@dataclass(frozen=True)
class PerfPrediction:
    tokens_per_s: float  # objective of Eq. 11
    tokens_per_iter: float  # B * (gamma x + 1) / (x + 1)
    t_iter: float  # Eq. 10
    t_gpu: float  # Eq. 7 (or measured)
    t_xfer: float  # Eq. 8
    batch_size: int  # B
    offloaded: int  # B_c
    link_concurrency: float  # Eq. 9 left side
    link_utilization: float  # B_c reload_bytes / ((x+1) BW_inter T_iter), <= 1 to sustain
    feasible: bool  # Eq. 9 (and Eq. 6 when memory is known)

    @property
    def bottleneck(self) -> str:
        return "interconnect" if self.t_xfer > self.t_gpu else "hbm"


def predict_throughput(
    *,
    batch_size: int,
    draft_len: int,
    accept_len: float,
    t_gpu: float,
    reload_bytes: float,
    interconnect_bw: float,
    offloaded: int | None = None,
    cycles_per_load: float = 1.0,
) -> PerfPrediction:
    """Tokens/s of VeriCache from measured values (Eqs. 8-11 at one operating point).

    Args:
        batch_size: ``B`` achieved with compressed KV.
        draft_len: ``x``.
        accept_len: measured mean acceptance length ``A = gamma x + 1``.
        t_gpu: measured mean iteration time of the mixed draft+verify batch (``T_gpu``).
        reload_bytes: bytes moved per verify reload (``(1 - c) KV_full`` in B.1).
        interconnect_bw: ``BW_inter`` (measured reload bandwidth).
        offloaded: ``B_c`` (default all ``B``).
        cycles_per_load: ``ell``.
    """
    b_c = batch_size if offloaded is None else offloaded
    if not 0 <= b_c <= batch_size:
        raise ValueError("need 0 <= offloaded <= batch_size")
    t_x = xfer_time(b_c, reload_bytes, draft_len, interconnect_bw, cycles_per_load)
    t_iter = max(t_gpu, t_x)  # Eq. 10
    per_iter = batch_size * accept_len / (draft_len + 1.0)
    conc = link_concurrency(b_c, draft_len, cycles_per_load)
    util = b_c * reload_bytes / ((draft_len + 1.0) * interconnect_bw * t_iter) if t_iter > 0 else 0.0
    return PerfPrediction(
        tokens_per_s=per_iter / t_iter if t_iter > 0 else math.inf,
        tokens_per_iter=per_iter,
        t_iter=t_iter,
        t_gpu=t_gpu,
        t_xfer=t_x,
        batch_size=batch_size,
        offloaded=b_c,
        link_concurrency=conc,
        link_utilization=util,
        feasible=conc <= 1.0 + 1e-9,
    )


def predict_from_hardware(
    *,
    weights_bytes: float,
    kv_full_bytes: float,
    compression: float,
    draft_len: int,
    accept_len: float,
    hbm_bw: float,
    interconnect_bw: float,
    gpu_mem_bytes: float,
    batch_size: int | None = None,
    non_offloaded: int = 0,
    cycles_per_load: float = 1.0,
) -> PerfPrediction:
    """Appendix B.1 end to end from nominal hardware numbers: ``B_c`` from Eq. 6 unless
    ``batch_size`` is given, ``T_gpu`` from Eqs. 5 and 7, then :func:`predict_throughput`.
    ``feasible`` also checks Eq. 6."""
    kv_avg = avg_kv_per_offloaded(kv_full_bytes, compression, draft_len)
    if batch_size is None:
        b_c = max_offloaded_batch(
            gpu_mem_bytes, weights_bytes, kv_full_bytes, compression, draft_len, non_offloaded
        )
        batch_size = b_c + non_offloaded
    b_c = batch_size - non_offloaded
    t_g = gpu_time(weights_bytes, batch_size, kv_avg, hbm_bw)
    pred = predict_throughput(
        batch_size=batch_size,
        draft_len=draft_len,
        accept_len=accept_len,
        t_gpu=t_g,
        reload_bytes=(1.0 - compression) * kv_full_bytes,
        interconnect_bw=interconnect_bw,
        offloaded=b_c,
        cycles_per_load=cycles_per_load,
    )
    fits = weights_bytes + non_offloaded * kv_full_bytes + b_c * kv_avg <= gpu_mem_bytes * (1 + 1e-9)
    return replace(pred, feasible=pred.feasible and fits)


def full_kv_throughput(*, batch_size: int, t_iter: float) -> float:
    """Full-KV baseline tokens/s: one token per request per iteration, ``B / T_iter``
    (``batch_size`` and ``t_iter`` measured, or from :func:`full_kv_from_hardware`)."""
    return batch_size / t_iter


def full_kv_from_hardware(
    *, weights_bytes: float, kv_full_bytes: float, hbm_bw: float, gpu_mem_bytes: float,
    batch_size: int | None = None,
) -> tuple[float, int, float]:
    """Baseline (``B_c = 0``, ``c = 1``): ``(tokens/s, B, T_iter)`` with
    ``T_iter = (M + B KV_full) / BW_hbm`` and ``B`` the full-KV batch by default."""
    b = full_kv_batch(gpu_mem_bytes, weights_bytes, kv_full_bytes) if batch_size is None else batch_size
    t = gpu_time(weights_bytes, b, kv_full_bytes, hbm_bw)
    return full_kv_throughput(batch_size=b, t_iter=t), b, t


# ------------------------------------------------------------------------ Eq. 11 solved


class Bound(str, enum.Enum):
    """What limits the optimum of Eq. 11."""

    MEMORY = "memory (Eq. 6)"  # no further request fits on the device
    LINK_CONCURRENCY = "one reload in flight (Eq. 9)"  # no further offloaded request can reload
    REQUESTS = "requests available"  # every request is already served
    HBM = "HBM bandwidth (T_gpu >= T_xfer)"
    INTERCONNECT = "interconnect (T_xfer > T_gpu)"


@dataclass(frozen=True)
class Optimum:
    """The best feasible operating point of Eq. 11 (Eqs. 6 and 9 hold)."""

    tokens_per_s: float
    draft_len: int  # x
    accept_len: float  # A(x) = gamma x + 1
    compression: float  # c
    batch_size: int  # B = B_g + B_c
    offloaded: int  # B_c: full KV on the host, reloaded to verify
    on_device: int  # B_g: full KV stays on the device
    cycles_per_load: int  # ell
    t_gpu: float
    t_xfer: float
    full_kv_tokens_per_s: float  # the baseline at the same memory (B_c = 0, no speculation)
    full_kv_batch: int
    binding: tuple[Bound, ...]

    @property
    def ratio_to_full(self) -> float:
        return self.tokens_per_s / self.full_kv_tokens_per_s if self.full_kv_tokens_per_s else math.inf


def best_feasible(
    *,
    weights_bytes: float,
    kv_full_bytes: float,
    compression: float,
    acceptance: dict[int, float],
    hbm_bw: float,
    interconnect_bw: float,
    gpu_mem_bytes: float,
    max_requests: int | None = None,
    reload_fraction: float | None = None,
) -> Optimum:
    """Eq. 11 maximised over ``x`` (the keys of ``acceptance``, each with its measured or
    predicted acceptance length ``A(x)``), ``B_c``, ``B_g`` and ``ell``, subject to Eq. 6
    (device memory) and Eq. 9 (``B_c ell <= x + 1``, ``ell >= 1``): never an infeasible
    point. ``ell`` is the largest whole number of iterations Eq. 9 allows (Eq. 8 falls with
    it); ``B_g`` fills the memory the offloaded requests leave (throughput grows with the
    batch at fixed ``x``: the weights are read once per iteration), up to ``max_requests``.

    Priced as the server runs them (not Eq. 7's ``B KV_avg`` for all): an offloaded
    request reads ``KV_avg`` an iteration and commits ``A / (x + 1)`` tokens; a request
    kept at full KV on the device (``B_g``) decodes it, reading ``KV_full`` and committing
    one token an iteration. A verify reloads ``reload_fraction`` of a request's full KV:
    ``1 - c`` (the default) for a token-dropping drafter, whose kept rows stay on the
    device; pass 1 for a quantizer (KIVI, SpeCache), whose device copy is low-bit and
    whose verify reloads every row.

    The baseline is full-KV decoding at the same memory: ``B = floor((GPU_mem - M) /
    KV_full)`` requests, one token each per ``(M + B KV_full) / BW_hbm``."""
    if not acceptance:
        raise ValueError("best_feasible: need the acceptance length of at least one draft length")
    if not 0 < compression < 1:
        raise ValueError("best_feasible: the compression fraction c must be in (0, 1)")
    base_b = full_kv_batch(gpu_mem_bytes, weights_bytes, kv_full_bytes)
    if max_requests is not None:
        base_b = min(base_b, max_requests)
    base_tps = full_kv_from_hardware(weights_bytes=weights_bytes, kv_full_bytes=kv_full_bytes, hbm_bw=hbm_bw,
                                     gpu_mem_bytes=gpu_mem_bytes, batch_size=base_b)[0] if base_b else 0.0
    reload = (1 - compression if reload_fraction is None else reload_fraction) * kv_full_bytes
    best: Optimum | None = None
    for x, accept_len in sorted(acceptance.items()):
        if x < 1:
            raise ValueError(f"best_feasible: draft lengths are >= 1, got {x}")
        kv_avg = avg_kv_per_offloaded(kv_full_bytes, compression, x)
        mem_c = max_offloaded_batch(gpu_mem_bytes, weights_bytes, kv_full_bytes, compression, x)
        for b_c in range(0, min(mem_c, x + 1) + 1):  # Eq. 9 with ell >= 1: B_c <= x + 1
            ell = (x + 1) // b_c if b_c else 1
            room = gpu_mem_bytes - weights_bytes - b_c * kv_avg
            b_g = max(0, math.floor(room / kv_full_bytes + 1e-9))
            if max_requests is not None:
                if b_c > max_requests:
                    break
                b_g = min(b_g, max_requests - b_c)
            b = b_c + b_g
            if b == 0:
                continue
            t_g = (weights_bytes + b_g * kv_full_bytes + b_c * kv_avg) / hbm_bw
            t_x = xfer_time(b_c, reload, x, interconnect_bw, ell)
            tps = (b_c * accept_len / (x + 1) + b_g) / max(t_g, t_x)
            if best is None or tps > best.tokens_per_s * (1 + 1e-12):
                best = Optimum(tps, x, accept_len, compression, b, b_c, b_g, ell, t_g, t_x, base_tps, base_b, ())
    if best is None:
        raise ValueError("best_feasible: no request fits in the device memory")
    return replace(best, binding=_binding(best, weights_bytes, kv_full_bytes, gpu_mem_bytes, max_requests))


def _binding(o: Optimum, weights_bytes, kv_full_bytes, gpu_mem_bytes, max_requests) -> tuple[Bound, ...]:
    kv_avg = avg_kv_per_offloaded(kv_full_bytes, o.compression, o.draft_len)
    used = weights_bytes + o.on_device * kv_full_bytes + o.offloaded * kv_avg
    out = []
    if used + min(kv_avg, kv_full_bytes) > gpu_mem_bytes:
        out.append(Bound.MEMORY)
    if o.offloaded + 1 > o.draft_len + 1:  # one more offloaded request breaks Eq. 9 even at ell = 1
        out.append(Bound.LINK_CONCURRENCY)
    if max_requests is not None and o.batch_size >= max_requests:
        out.append(Bound.REQUESTS)
    out.append(Bound.INTERCONNECT if o.t_xfer > o.t_gpu else Bound.HBM)
    return tuple(out)


# ------------------------------------------------------------ in-pool self-speculation


@dataclass(frozen=True)
class RowCosts:
    """Seconds an iteration spends, fitted from the server's own iterations
    (:class:`.policy.ModePolicy`): MagicDec's memory-bound analysis in measured units.
    ``fixed`` is paid once per iteration (the weights read, launches), ``token`` per
    forwarded query token (the linear layers' compute), ``row`` per KV row a request's
    attention reads (once per request: a verify of ``x + 1`` tokens reads its rows once,
    so on a GPU it costs about one full-KV step plus ``x`` tokens), ``query_row`` per
    query and row (the scores' compute: what makes a verify dearer than a decode step
    where attention is not purely memory-bound, as on a CPU)."""

    fixed: float
    token: float
    row: float
    query_row: float = 0.0
    offload_draft: float = 0.0  # per draft step over compressed KV (the offload drafter's own work)


def full_kv_token_time(costs: RowCosts, length: int, batch: int) -> float:
    """Seconds per token of full-KV decoding for a request of ``length`` tokens, its
    share of the iteration's fixed cost included."""
    return costs.fixed / max(1, batch) + costs.token + (costs.row + costs.query_row) * length


def in_pool_cycle_time(costs: RowCosts, length: int, batch: int, draft_len: int, budget: int) -> float:
    """Seconds of one in-pool cycle of one request: ``x`` draft steps over ``min(budget,
    length)`` rows, then a verify of ``x + 1`` tokens over all ``length`` rows, each of the
    ``x + 1`` iterations carrying its share of the fixed cost."""
    x = draft_len
    view = min(budget, length)
    return ((x + 1) * costs.fixed / max(1, batch) + x * (costs.token + (costs.row + costs.query_row) * view)
            + (x + 1) * costs.token + (costs.row + (x + 1) * costs.query_row) * length)


def in_pool_speedup(costs: RowCosts, acceptance: float, length: int, batch: int, draft_len: int,
                    budget: int) -> float:
    """Committed tokens per second of in-pool self-speculation over full-KV decoding's,
    for a batch of requests of ``length`` tokens: ``A(x)`` tokens per cycle against one
    per full-KV token time."""
    cycle = in_pool_cycle_time(costs, length, batch, draft_len, budget)
    return acceptance * full_kv_token_time(costs, length, batch) / cycle if cycle > 0 else 0.0


# ------------------------------------------------------------------- offload, priced alike


def full_kv_request_time(costs: RowCosts, length: int) -> float:
    """Seconds a full-KV request of ``length`` tokens adds to an iteration (one token)."""
    return costs.token + (costs.row + costs.query_row) * length


def offload_request_time(costs: RowCosts, length: int, draft_len: int) -> float:
    """Seconds an offloaded request adds to an iteration, on average over its cycle: ``x``
    draft steps over its compressed KV, then a verify of ``x + 1`` tokens over its full
    ``length`` rows (staged from the host)."""
    x = draft_len
    cycle = x * (costs.token + costs.offload_draft) + (x + 1) * costs.token + (costs.row + (x + 1) * costs.query_row) * length
    return cycle / (x + 1)


def offload_gain(costs: RowCosts, acceptance: float, draft_len: int, length: int, full: int, offloaded: int,
                 admitted: float) -> float:
    """Committed tokens per second of a batch of ``full`` full-KV and ``offloaded``
    offloaded requests (all of ``length`` tokens) when one of its full-KV requests is
    offloaded and ``admitted`` waiting requests take the rows that frees at full KV, over
    the batch's as it is (appendix B.1's tokens per iteration over the fitted iteration
    time: ``A / (x + 1)`` tokens an iteration per offloaded request, one per full-KV one)."""
    now = mix_tokens_per_s(costs, acceptance, draft_len, length, full, offloaded)
    after = mix_tokens_per_s(costs, acceptance, draft_len, length, full - 1 + admitted, offloaded + 1)
    return after / now if now > 0 else 0.0


def mix_tokens_per_s(costs: RowCosts, acceptance: float, draft_len: int, length: int, full: float,
                     offloaded: float) -> float:
    """Committed tokens per second of a batch of ``full`` full-KV and ``offloaded``
    offloaded requests of ``length`` tokens, at the fitted costs."""
    t = (costs.fixed + full * full_kv_request_time(costs, length)
         + offloaded * offload_request_time(costs, length, draft_len))
    return (full + offloaded * acceptance / (draft_len + 1)) / t if t > 0 else 0.0

