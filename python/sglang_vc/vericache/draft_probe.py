"""What one SpeCache draft step costs this machine against the full-KV decode step it
stands for: both timed on tensors of a request's shape (one layer, one request).

On the CPU a draft pays off only where it is cheaper than the full-KV token it stands
for. Two calls on the same tensors:

* ``full``: SGLang's own ``torch_native`` decode (``_run_sdpa_forward_decode``, what a
  plain CPU server runs) for one request whose rows are scattered over the pool;
* ``specache``: the calls VERICACHE's drafter makes on the CPU (``SpeCacheDrafter.attend``
  without a GPU): the 2-bit payload dequantized (``KIVI.dequantize``), the tail gathered
  from the pool, SpeCache's attention with ``topk`` rows per KV head fetched and
  substituted (``specache.core.attend_fetching``).

The mode policy prices an offload drafter's step and a full-KV request's attention by
them before any request was offloaded to measure it (:meth:`.policy.ModePolicy.offload`);
``bench.cpu_draft_step`` reports them per length.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

logger = logging.getLogger(__name__)


def _ms(fn, repeats: int) -> float:
    fn()
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def step_times(n: int, hq: int, h: int, d: int, topk: int, bits: int, repeats: int,
               dtype: torch.dtype = torch.float32) -> dict:
    """Milliseconds of one full-KV decode step and of one SpeCache draft step over ``n``
    tokens (``hq`` query heads, ``h`` KV heads of ``d`` channels), and their ratio."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sglang_vc.compress.kivi import KIVI
    from sglang_vc.specache import core

    gen = torch.Generator().manual_seed(n)
    pool_k = torch.randn(2 * n, h, d, generator=gen).to(dtype)
    pool_v = torch.randn(2 * n, h, d, generator=gen).to(dtype)
    slots = torch.randperm(2 * n, generator=gen)[:n]
    k, v = pool_k[slots], pool_v[slots]
    ckv = KIVI().compress(0, k, v, bits)
    n_q = ckv.num_quantized
    tail = slots[n_q:]
    q = torch.randn(1, hq, d, generator=gen).to(dtype)
    scale = d ** -0.5

    def fetch(positions):
        return core.gather_rows(k[:n_q], v[:n_q], positions)

    backend = object.__new__(TorchNativeAttnBackend)  # its decode reads no state of the backend
    req_to_token, one, lens = slots[None].to(torch.int32), torch.zeros(1, dtype=torch.int64), torch.tensor([n])
    out = torch.empty_like(q)

    def full():
        return TorchNativeAttnBackend._run_sdpa_forward_decode(
            backend, q, out, pool_k, pool_v, req_to_token, one, lens, scaling=scale, enable_gqa=True)

    def specache():
        kq, vq = KIVI.dequantize(ckv)
        return core.attend_fetching(q, kq.to(dtype), vq.to(dtype), pool_k[tail], pool_v[tail], q_start=n - 1,
                                    scale=scale, topk=topk, fetch=fetch)[0].out

    row = {"tokens": n, "full_ms": _ms(full, repeats), "specache_ms": _ms(specache, repeats)}
    row["specache_x_full"] = row["specache_ms"] / row["full_ms"]
    return row


@functools.lru_cache(maxsize=32)
def step_seconds(n: int, hq: int, h: int, d: int, topk: int, bits: int, dtype: torch.dtype) -> tuple[float, float]:
    """Seconds of one layer's full-KV decode step and SpeCache draft step for a request of
    ``n`` tokens (:func:`step_times`, measured once per shape; the caller rounds ``n`` to a
    few lengths)."""
    t0 = time.perf_counter()
    row = step_times(n, hq, h, d, topk, bits, repeats=8, dtype=dtype)
    logger.info("VERICACHE: at %d tokens a SpeCache draft step costs %.2f ms a layer, a full-KV decode step %.2f ms "
                "(x%.2f; measured in %.2f s): the mode policy prices offloading by them until it has measured "
                "offloads", n, row["specache_ms"], row["full_ms"], row["specache_x_full"], time.perf_counter() - t0)
    return row["full_ms"] / 1e3, row["specache_ms"] / 1e3
