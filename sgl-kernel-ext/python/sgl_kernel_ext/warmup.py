"""Every public wrapper called once, as the mechanisms call it: the server's start-up
compiles the Triton kernels with it (:func:`warm_up`), and the compile test records its
launches and compiles them for ``sm_90`` with no GPU (``test_kernel_compile``).

Triton compiles a kernel at its first launch of each specialization (dtypes, constexprs:
head dim, GQA group, bits, block sizes; an integer argument's divisibility by 16). A
server that left that to its first compressed request would stall that request, on the
scheduler thread, for seconds per kernel; :func:`warm_up` takes that time at start-up
for the server's dtype and head shapes. Launches whose blocks follow the data (the
number of KV splits of a long paged decode, a top-k width) may still compile once more
when first seen.
"""

from __future__ import annotations

import time

import torch

from .copy_rows import copy_rows, gather_head_rows, scatter_head_rows
from .kivi_attention import Payload, kivi_attention
from .kv_indices import build_kv_indices
from .merge_state import merge_state
from .paged_attention import paged_attention
from .payload_batch import kivi_attention_batch, payload_batch, payload_scores_batch
from .position_mask import position_mask
from .specache_rows import fetch_rows, rows_attention
from .specache_topk import payload_scores


def _payload(bits: int, n: int, h: int, d: int, dtype, gen, group: int) -> Payload:
    """A KIVI payload of ``n`` tokens (groups of ``group`` tokens for keys, ``min(group,
    d)`` channels for values), its scales in the model's dtype, as ``compress.kivi``
    stores them."""
    per, gv = 8 // bits, min(group, d)
    codes = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)  # noqa: E731
    rand = lambda *shape: torch.rand(*shape, generator=gen).to(dtype)  # noqa: E731
    return Payload(bits, group, gv, codes(n, h, -(-d // per)), rand(n // group, h, d), rand(n // group, h, d),
                   codes(n, h, -(-d // per)), rand(n, h, d // gv), rand(n, h, d // gv), d, d)


def exercise(dtype: torch.dtype, head_dim: int, num_q_heads: int = 6, num_kv_heads: int = 2,
             device="cpu", group: int = 32, topk: int = 4) -> None:
    """Each wrapper once, with the argument dtypes of its call sites (SGLang's
    ``req_to_token`` is int32, its batch tensors int64; q and the KV pool in the model's
    dtype), on ``device``; host rows that a kernel reads by address stay in (pinned)
    host memory, as SpeCache's host copy does."""
    d, hq, hkv, n_slots = head_dim, num_q_heads, num_kv_heads, 256
    device = torch.device(device)
    on_gpu = device.type != "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.device(device):
        req_to_token = torch.randint(1, n_slots, (4, 128), dtype=torch.int32, generator=gen)
        req_to_token[:, ::3] = 0  # dropped rows point at the null slot
        kv = build_kv_indices(req_to_token, torch.tensor([2, 0]), torch.tensor([0, 5]), torch.tensor([100, 40]), 0)
        k_buf = torch.randn(n_slots, hkv, d, generator=gen).to(dtype)
        v_buf = torch.randn(n_slots, hkv, d, generator=gen).to(dtype)
        q = torch.randn(2, hq, d, generator=gen).to(dtype)
        out, lse = paged_attention(q, k_buf, v_buf, torch.tensor([0, 1]), torch.tensor([99, 39]), kv.indptr,
                                   kv.indices, kv.positions, d ** -0.5)
        for bits in (2, 1):
            p = _payload(bits, 2 * group, hkv, d, dtype, gen, group)
            kivi_attention(q, p, d ** -0.5)
            exclude = torch.zeros(hkv, 2 * group, dtype=torch.bool)
            exclude[:, ::5] = True
            p_out, p_lse = kivi_attention(q[:1], p, d ** -0.5, exclude=exclude)
            payload_scores(q[0], p_lse[0], p, d ** -0.5, exclude=exclude)
            payload_scores(q[0], p_lse[0], p, d ** -0.5)
        copy_rows(k_buf.clone(), torch.arange(10), k_buf, torch.arange(20, 30))
        pos = torch.stack([torch.randperm(40, generator=gen)[:8] for _ in range(hkv)])
        scatter_head_rows(torch.zeros(40, hkv, d, dtype=dtype), pos, torch.randn(8, hkv, d, generator=gen).to(dtype))
        position_mask(torch.tensor([3, 11, 20]), torch.tensor([0, 2, 9, 15]), num_prefix=2)
        gather_head_rows(torch.randn(40, hkv, d, generator=gen).to(dtype), pos)
        # the batched drafters: payloads by address, SpeCache's scores, fetch and rows, merges
        members = [_payload(2, n, hkv, d, dtype, gen, group) for n in (2 * group, group)]
        pb = payload_batch(members)
        p_out, p_lse = kivi_attention_batch(q, pb, d ** -0.5)
        scores = payload_scores_batch(q, p_lse, pb, d ** -0.5, lse2=lse)
        host = [torch.randn(2 * group, hkv, d, device="cpu").to(dtype) for _ in range(2)]
        if on_gpu:
            host = [t.pin_memory() for t in host]
        fetched = fetch_rows(scores.topk(min(topk, group), dim=-1).indices,
                             torch.tensor([[t.data_ptr()] * 2 for t in host]), host[0], torch.tensor([8, 0]),
                             torch.tensor([4, 2], dtype=torch.int32), pb.num_tokens, torch.tensor([2, 0]),
                             req_to_token, k_buf, v_buf)
        r_out, r_lse = rows_attention(q, fetched, d ** -0.5)
        kivi_attention_batch(q, pb, d ** -0.5, exclude=fetched.selected, merge=((r_out, r_lse), (out, lse)))
        kivi_attention_batch(q, pb, d ** -0.5, merge=((out, lse),))
        merge_state(p_out, p_lse, out, lse)
        if on_gpu:
            torch.cuda.synchronize(device)


def warm_up(dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int, device,
            group: int = 32, topk: int = 4) -> float:
    """Compile every kernel for these shapes now (:func:`exercise`); the seconds it took."""
    start = time.perf_counter()
    exercise(dtype, head_dim, num_q_heads, num_kv_heads, device, group=group, topk=topk)
    return time.perf_counter() - start
