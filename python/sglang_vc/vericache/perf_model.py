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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


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
