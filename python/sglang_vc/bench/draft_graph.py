"""The server's drafting layers captured in a CUDA graph and replayed for another batch
of the same launch shape (issue #46, item 3: the layer-level part of capturing draft-only
iterations): SpeCache's (``SpeCacheDrafter.attend_batch``) and KIVI's
(``kvruntime.decode_index.attend``).

A drafting batch's launches are sized by its batch size and bucketed sizes only (its
tables' ``shape``): payload rows, tail rows and top-k rounded up to buckets (four per doubling), the
true lengths read by the kernels from the device. So a graph captured over one batch
serves every batch of its shape once ``load`` has copied that batch's tables into the
captured one's.

:func:`specache` and :func:`kivi` make batches of requests of chosen lengths through the
server's own code (``HostKVStore``, ``SpeCacheDrafter.batch``, ``decode_index.build``, a
KIVI payload per request); :func:`replay` captures the layer over one batch, loads
another and compares the replay with that batch's eager call, and times both. A replay
runs no Python: the drafter's counters (rows fetched, fetch misses) would be a runner's
to add per replay. It needs CUDA for the graph; on a machine without
one, :func:`eager_load_matches` checks the load alone (the test suite runs it under a
stand-in CUDA platform). Run by ``bench.gpu_check``; no SGLang needed.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable, Sequence

import torch

from sglang_vc.bench.kernels import time_us


@dataclasses.dataclass
class Requests:
    """The lengths of one drafting batch: per request, payload rows (before KIVI's group
    rounding), tail rows in the pool (the draft token's included) and top-k."""

    payload: Sequence[int]
    tail: Sequence[int]
    topk: Sequence[int]


@dataclasses.dataclass
class Fixture:
    layer: Callable  # (q [B, Hq, D], tables) -> [B, Hq, Dv]: one drafting layer, the server's call
    batches: list  # the tables per Requests (SpeCacheBatch or DecodeIndex: each has shape and load)
    queries: list  # one [B, Hq, D] per Requests
    keep: list  # what the tables point at (payloads, host copies, the pool)


@dataclasses.dataclass
class _Pool:
    """Requests of ``sets`` over one pool: each its own KIVI payload (entry ``i`` of
    ``entries``, its rows ``full[i]``) and its tail in the pool (``req_to_token`` row
    ``i``); ``lens``: each request's length, its tail included."""

    rand: Callable
    entries: list
    lens: list
    full: list  # (k, v) rows each payload quantized
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    req_to_token: torch.Tensor


def _pool(sets: Sequence[Requests], device: str, hkv: int, d: int, dtype, seed: int,
          bits: Sequence[int] = ()) -> _Pool:
    import sgl_kernel_ext as ext

    from sglang_vc.compress.kivi import KIVI

    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device).to(dtype)  # noqa: E731
    reqs = [(s, i, j) for j, s in enumerate(sets) for i in range(len(s.payload))]
    width = max(n + t for s in sets for n, t in zip(s.payload, s.tail)) + 1
    slots = sum(sum(s.tail) for s in sets) + 1  # slot 0: the null slot
    k_buf, v_buf = rand(slots, hkv, d), rand(slots, hkv, d)
    req_to_token = torch.zeros(len(reqs), width, dtype=torch.int32, device=device)
    kivi_ = KIVI(residual_length=0)
    entries, lens, full, free = [], [], [], 1
    for row, (s, i, j) in enumerate(reqs):
        kr, vr = rand(s.payload[i], hkv, d), rand(s.payload[i], hkv, d)
        c = kivi_.compress(0, kr, vr, bits[j] if bits else 2)
        packed = ext.Payload(c.bits, c.group_size, c.value_group_size, c.k_payload, c.k_scales, c.k_zeros,
                             c.v_payload, c.v_scales, c.v_zeros, d, d)
        n, t = c.num_quantized, s.tail[i]
        req_to_token[row, n : n + t] = torch.arange(free, free + t, dtype=torch.int32)
        free += t
        entries.append(types.SimpleNamespace(rid=f"r{row}", req_pool_idx=row, num_payload_rows=n, row_start=n,
                                             packed=packed, topk=s.topk[i],
                                             payload=types.SimpleNamespace(layers={0: c}, addresses=None)))
        lens.append(n + t)
        full.append((kr[:n], vr[:n]))
    return _Pool(rand, entries, lens, full, k_buf, v_buf, req_to_token)


def _per_set(sets: Sequence[Requests], items: list):
    """``items`` (one per request, in order) cut into one slice per set, with its first index."""
    at = 0
    for s in sets:
        yield at, items[at : at + len(s.payload)]
        at += len(s.payload)


def specache(sets: Sequence[Requests], device: str, hq: int = 4, hkv: int = 2, d: int = 16,
             dtype=torch.float32, seed: int = 0, bits: Sequence[int] = ()) -> Fixture:
    """Every set of ``sets`` as one SpeCache drafting batch over one pool, through the
    server's drafter: each request its own KIVI payload, its full rows in the
    ``HostKVStore`` (pinned on CUDA), its tail in the pool. ``bits``: each set's KIVI
    bits (default 2)."""
    from sglang_vc.vericache.reload import HostKVStore
    from sglang_vc.vericache.specache_drafter import SpeCacheDrafter

    pl = _pool(sets, device, hkv, d, dtype, seed, bits)
    host = HostKVStore(pin=torch.device(device).type == "cuda")
    for e, (kr, vr) in zip(pl.entries, pl.full):
        host.sink(e.rid, e.req_pool_idx, 0, 0, kr, vr)
    host.flush()
    pool = types.SimpleNamespace(get_key_buffer=lambda layer_id: pl.k_buf, get_value_buffer=lambda layer_id: pl.v_buf,
                                 start_layer=0, layer_num=1, head_num=hkv)
    runtime = types.SimpleNamespace(kv_pool=pool, req_to_token=pl.req_to_token,
                                    packed_payload=lambda entry, layer_id: entry.packed)
    drafter = SpeCacheDrafter(host, runtime, topk=8)
    drafter.topk_of.update({e.rid: e.topk for e in pl.entries})
    batches, queries = [], []
    for at, es in _per_set(sets, pl.entries):
        (sb,) = drafter.batch(es, pl.lens[at : at + len(es)], device)
        batches.append(sb)
        queries.append(pl.rand(len(es), hq, d))
    layer = types.SimpleNamespace(layer_id=0, scaling=d ** -0.5)
    return Fixture(lambda q, sb: drafter.attend_batch(q, sb, layer), batches, queries, [pl, host])


def kivi(sets: Sequence[Requests], device: str, hq: int = 4, hkv: int = 2, d: int = 16, dtype=torch.float32,
         seed: int = 0) -> Fixture:
    """Every set of ``sets`` as one batch of KIVI 2-bit drafters over one pool, through the
    server's decode index (``kvruntime.decode_index``: what ``vc_torch``'s batched decode
    and VERICACHE's KIVI drafters attend with): each request its own payload, its tail in
    the pool (``Requests.topk`` unused)."""
    from sglang_vc.kvruntime import decode_index

    pl = _pool(sets, device, hkv, d, dtype, seed)
    runtime = types.SimpleNamespace(packed_payload=lambda entry, layer_id: entry.packed)
    indices, queries = [], []
    for at, es in _per_set(sets, pl.entries):
        seq = pl.lens[at : at + len(es)]
        indices.append(decode_index.build(runtime, pl.req_to_token, torch.arange(at, at + len(es), device=device),
                                          torch.tensor(seq, device=device), seq, [e.row_start for e in es], es))
        queries.append(pl.rand(len(es), hq, d))
    scale = d ** -0.5
    return Fixture(lambda q, idx: decode_index.attend(q, pl.k_buf, pl.v_buf, idx, 0, scale), indices, queries, [pl])


def eager_load_matches(fx: Fixture) -> float:
    """Batch 0 with batch 1's tables loaded drafts batch 1's requests: the largest
    difference from batch 1's own call (0 expected)."""
    want = fx.layer(fx.queries[1], fx.batches[1])
    fx.batches[0].load(fx.batches[1])
    got = fx.layer(fx.queries[1], fx.batches[0])
    return float((got - want).abs().max())


def replay(fx: Fixture, repeats: int = 50) -> dict:
    """Capture the layer over batch 0, replay it for batch 0 and then (loaded) batch 1,
    each against its eager call; the eager and replayed layer's time."""
    layer, (a, b), (qa, qb) = fx.layer, fx.batches, fx.queries
    want_a = layer(qa, a)
    want_b = layer(qb, b)
    eager_us = time_us(lambda: layer(qb, b), repeats)
    q = qa.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compilations, allocator) off the capture
        for _ in range(2):
            layer(q, a)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(q, a)
    graph.replay()
    err_a = float((out - want_a).abs().max())
    a.load(b)
    q.copy_(qb)
    graph.replay()
    err_b = float((out - want_b).abs().max())
    replay_us = time_us(graph.replay, repeats)
    return {"max_abs_err_same_batch": err_a, "max_abs_err_loaded_batch": err_b, "eager_us": eager_us,
            "replay_us": replay_us, "shape": repr(a.shape), "ok": max(err_a, err_b) <= 1e-5}


def gpu_sets(batch: int = 8, tokens: int = 32768) -> list[Requests]:
    """Two batches of other requests in one bucket (``tokens`` a power of two; at batch 4
    and 8): payloads of 0.65-1.0x and 0.6-0.95x ``tokens``, tails of other lengths and
    totals, top-k up to 64 and up to 60, so the second batch pads where the first does
    not."""
    ks = range(batch)
    first = Requests([tokens - (tokens * 2 // 5) * k // batch for k in ks], [1 + (7 * k) % 40 for k in ks],
                     [64 - 8 * (k % 3) for k in ks])
    second = Requests([tokens * 19 // 20 - (tokens * 2 // 5) * ((k + 3) % batch) // batch for k in ks],
                      [3 + (11 * k) % 30 for k in ks], [60 - 8 * (k % 3) for k in ks])
    return [first, second]


def main_check(device: str = "cuda", batch: int = 8, tokens: int = 32768) -> dict:
    """``bench.gpu_check``'s step: 8B shapes (32 query heads, 8 KV heads, 128 dims, fp16),
    SpeCache's drafting layer and KIVI's."""
    out = {"check": "draft_graph", "batch": batch, "tokens": tokens}
    for name, make in (("specache", specache), ("kivi", kivi)):
        try:
            fx = make(gpu_sets(batch, tokens), device, hq=32, hkv=8, d=128, dtype=torch.float16)
            out[name] = replay(fx)
            del fx
        except Exception as exc:  # noqa: BLE001 (a family whose capture fails is a finding; the other still runs)
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        torch.cuda.empty_cache()
    out["ok"] = all(out[name]["ok"] for name in ("specache", "kivi"))
    return out
