"""``python -m sglang_vc.bench.gpu_step --json OUT``: one decode layer of an 8B model at
long context on a GPU, cut into the costs VeriCache's model (appendix B.1) is made of, on
the same tensors, per layer and for a batch of requests:

* ``weights``: the layer's matrix products (Llama-3-8B shapes) for the batch's tokens;
* ``full_decode``: full-KV decode attention (torch SDPA, flash where it applies), and the
  project's paged kernel over every row (the drafter's kernel without compression);
* ``draft_*``: one draft step of each drafter family over its compressed rows:
  ``snapkv`` (the paged kernel over the kept quarter), ``kivi2`` (2-bit payload, the fused
  kernel per request; ``_batched``: the server's batched call, ``decode_index.attend``),
  ``specache`` (2-bit scores, top-k and the synchronous fetch of the top-k full rows from
  pinned host memory, per request; ``_batched``: the server's ``attend_batch``);
* ``draft_in_pool``: in-pool self-speculation's draft step, the server's own
  ``vericache.draft_view`` functions: a sink+window view of ``--budget`` rows of each
  request's own pool rows (``in_pool_view_build``, once per forward), then one gather and
  one SDPA per layer for the batch; its ratio to ``full_decode_sdpa`` is reported;
* ``verify``: a verify window of ``X + 1`` queries per request over the full prefix
  (torch SDPA with the chain mask, the stand-in for FlashInfer's prefill that SGLang runs
  on a GPU, and the project's paged kernel);
* ``reload``: one layer of one request's full KV from pinned host memory on a copy stream
  (GB/s), alone and while the device computes (does the copy slow the compute?).

Needs CUDA and nothing of SGLang (the lent GPU machine has PyTorch and Triton only).
Writes JSON and a bar plot; ``python -m sglang_vc.bench.gpu_predict --gpu-step OUT``
turns it into a labelled prediction of VeriCache against full KV on that GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_vc.bench.kernels import time_us

# Llama-3-8B: hidden 4096, 32 query heads, 8 KV heads, head dim 128, MLP 14336, 32 layers.
HIDDEN, HQ, HKV, D, MLP, LAYERS = 4096, 32, 8, 128, 14336, 32


def _time_us(fn, repeats: int) -> float:
    if not torch.cuda.is_available():  # the CPU smoke test of the shapes (test_gpu_step.py)
        return _wall_us(fn, 1)
    return time_us(fn, repeats)


def _wall_us(fn, repeats: int) -> float:
    """Wall clock for paths that synchronise with the host themselves."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats * 1e6


def measure(n: int, batch: int, x: int, keep: float, topk: int, repeats: int, dev: str = "cuda",
            budget: int = 512) -> dict:
    import sgl_kernel_ext as ext

    from sglang_vc.compress.kivi import KIVI

    dt = torch.float16 if dev == "cuda" else torch.float32
    scale = D ** -0.5
    out: dict = {}

    # weights: one layer's products for `tokens` rows (decode: batch; verify: batch * (x + 1))
    w = {name: torch.randn(a, b, device=dev, dtype=dt) * 0.02 for name, (a, b) in {
        "qkv": (HIDDEN, (HQ + 2 * HKV) * D), "o": (HQ * D, HIDDEN), "gate_up": (HIDDEN, 2 * MLP),
        "down": (MLP, HIDDEN)}.items()}

    def layer_mm(h):
        h2 = h @ w["qkv"]
        h = h2[:, :HIDDEN] @ w["o"]
        g = h @ w["gate_up"]
        return (F.silu(g[:, :MLP]) * g[:, MLP:]) @ w["down"]

    for label, tokens in (("weights_decode", batch), ("weights_verify", batch * (x + 1))):
        h = torch.randn(tokens, HIDDEN, device=dev, dtype=dt)
        out[label] = {"us": _time_us(lambda: layer_mm(h), repeats), "tokens": tokens}
    layer_bytes = sum(t.numel() * t.element_size() for t in w.values())
    out["weights_decode"]["bytes"] = layer_bytes

    # full KV of the batch, contiguous per request: [batch, HKV, n, D]
    k = torch.randn(batch, HKV, n, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    kv_bytes = 2 * k.numel() * k.element_size()
    q = torch.randn(batch, HQ, 1, D, device=dev, dtype=dt)
    sdpa = _time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=scale), repeats)
    out["full_decode_sdpa"] = {"us": sdpa, "bytes": kv_bytes, "gb_s": kv_bytes / sdpa / 1e3}

    # the same rows in a paged buffer (one slot per token, slot 0 the null slot)
    k_buf = torch.cat([torch.zeros(1, HKV, D, device=dev, dtype=dt), k.transpose(1, 2).reshape(-1, HKV, D)])
    v_buf = torch.cat([torch.zeros(1, HKV, D, device=dev, dtype=dt), v.transpose(1, 2).reshape(-1, HKV, D)])
    del k, v
    q1 = q[:, :, 0]
    reqs = torch.arange(batch, device=dev)

    def paged(rows_per_req: int, stride: int, queries: int):
        """Index lists over every `stride`-th row of each request (a kept set), `queries`
        queries per request at the positions after its prefix."""
        idx = (torch.arange(0, n, stride, device=dev)[:rows_per_req] + 1)
        indices = (idx[None, :] + (reqs * n)[:, None]).reshape(-1)
        pos = ((idx - 1)[None, :].expand(batch, -1)).reshape(-1)
        indptr = torch.arange(0, batch * rows_per_req + 1, rows_per_req, device=dev)
        qq = torch.randn(batch * queries, HQ, D, device=dev, dtype=dt)
        q_req = reqs.repeat_interleave(queries)
        q_pos = (n + torch.arange(queries, device=dev)).repeat(batch)
        return lambda: ext.paged_attention(qq, k_buf, v_buf, q_req, q_pos, indptr, indices, pos, scale)

    out["full_decode_paged"] = {"us": _time_us(paged(n, 1, 1), repeats)}

    # in-pool self-speculation's draft step, the server's own functions (vericache.draft_view):
    # each request's sink+window view over its own rows of the pool, built once per forward,
    # then one gather + one SDPA per layer for the whole batch
    from sglang_vc.vericache import draft_view

    req_to_token = torch.arange(n, device=dev)[None, :] + 1 + (reqs * n)[:, None]
    lengths = torch.full((batch,), n, device=dev)
    budgets = torch.full((batch,), budget, device=dev)
    out["in_pool_view_build"] = {"us": _time_us(
        lambda: draft_view.view_slots(req_to_token, reqs, lengths, budgets, budget), repeats), "per": "forward"}
    slots, valid = draft_view.view_slots(req_to_token, reqs, lengths, budgets, budget)
    draft = _time_us(lambda: draft_view.attend_view(q1, k_buf, v_buf, slots, valid, scale), repeats)
    out["draft_in_pool"] = {"us": draft, "budget": budget, "ratio_to_full_decode_sdpa": draft / sdpa,
                            **_runtime_calls(lambda: draft_view.attend_view(q1, k_buf, v_buf, slots, valid, scale))}
    out["in_pool_view_build"].update(_runtime_calls(
        lambda: draft_view.view_slots(req_to_token, reqs, lengths, budgets, budget)))
    del req_to_token, slots, valid
    kept = int(n * keep)
    out["draft_snapkv"] = {"us": _time_us(paged(kept, int(round(1 / keep)), 1), repeats), "kept": kept}
    out["verify_paged"] = {"us": _time_us(paged(n, 1, x + 1), repeats), "queries": x + 1,
                           "note": "the window's own rows are not in the index lists: prefix only"}

    # the verify window through SDPA: x + 1 queries over n prefix rows + their own (chain mask)
    w_len = x + 1
    kw = torch.randn(batch, HKV, n + w_len, D, device=dev, dtype=dt)
    vw = torch.randn_like(kw)
    qw = torch.randn(batch, HQ, w_len, D, device=dev, dtype=dt)
    mask = torch.ones(w_len, n + w_len, dtype=torch.bool, device=dev).tril(diagonal=n)
    out["verify_sdpa"] = {"us": _time_us(lambda: F.scaled_dot_product_attention(
        qw, kw, vw, attn_mask=mask, enable_gqa=True, scale=scale), repeats), "queries": w_len}
    # the same window as FlashInfer's prefill runs it: the prefix without a mask, a GQA group's
    # queries folded into one tile (SDPA's flash path; the window's own (x+1)^2 part is left out)
    q_fold = qw.view(batch, HKV, HQ // HKV * w_len, D)
    out["verify_flash"] = {"us": _time_us(lambda: F.scaled_dot_product_attention(
        q_fold, kw[:, :, :n], vw[:, :, :n], scale=scale), repeats), "queries": w_len,
        "note": "prefix only, GQA group folded into the query tile, no mask (flash)"}
    del kw, vw

    # KIVI 2-bit drafter: one fused launch per request (as the server's drafter runs it)
    kr = torch.randn(n, HKV, D, device=dev, dtype=dt)
    vr = torch.randn_like(kr)

    def payload(quantizer):
        bits = quantizer.supported_bits[0]
        c = quantizer.compress(0, kr, vr, bits)
        return ext.Payload(c.bits, c.group_size, c.value_group_size, c.k_payload, c.k_scales, c.k_zeros,
                           c.v_payload, c.v_scales, c.v_zeros, D, D), c

    p2, c2 = payload(KIVI())
    p2_bytes = sum(t.numel() * t.element_size() for t in (c2.k_payload, c2.k_scales, c2.k_zeros, c2.v_payload,
                                                          c2.v_scales, c2.v_zeros))
    qr = q1[:1]

    def kivi2_step():
        for _ in range(batch):
            ext.kivi_attention(qr, p2, scale)

    out["draft_kivi2"] = {"us": _time_us(kivi2_step, repeats), "payload_bytes_per_req": p2_bytes}
    # the same through the server's own call (vericache.attention -> kvruntime.kernels.attend_pool):
    # the payload, the request's own new row from the pool, the merge; per request
    from sglang_vc.kvruntime import kernels as vc_kernels

    tail_slots = torch.arange(1, batch + 1, device=dev)[:, None]
    tail_pos = torch.full((1,), n, dtype=torch.int64, device=dev)

    def kivi2_worker_step():
        for i in range(batch):
            vc_kernels.attend_pool(q1[i : i + 1], k_buf, v_buf, tail_slots[i], tail_pos, q_start=n, scale=scale,
                                   payload=p2)

    out["draft_kivi2_worker"] = {"us": _time_us(kivi2_worker_step, repeats),
                                 "note": "the server's kvruntime.kernels.attend_pool, per request",
                                 **_runtime_calls(kivi2_worker_step)}
    batched = _kivi_batched_step(c2, p2, q1, k_buf, v_buf, batch, n, scale, dev)
    out["draft_kivi2_batched"] = {"us": _time_us(batched, repeats),
                                  "note": "the server's kvruntime.decode_index.attend: the whole batch in one paged "
                                          "and one payload launch (the CUDA path)", **_runtime_calls(batched)}

    # SpeCache 2-bit drafter: scores and top-k on the device, then the synchronous fetch of
    # the top-k rows per KV head from pinned host memory, per request (the server's path)
    p1 = p2  # SpeCache 2-bit: its scores come from the same 2-bit keys the kivi2 drafter reads
    pin = dev == "cuda"
    host_k = kr.cpu().pin_memory() if pin else kr.clone()
    host_v = vr.cpu().pin_memory() if pin else vr.clone()
    heads = torch.arange(HKV)[:, None]

    def specache_step():
        for _ in range(batch):
            _, lse = ext.kivi_attention(qr, p1, scale)
            top = ext.select_topk(ext.payload_scores(qr[0], lse[0], p1, scale), topk)  # [HKV, topk]
            idx = top.cpu()  # the host read the synchronous fetch needs
            rows_k, rows_v = host_k[idx, heads], host_v[idx, heads]  # [HKV, topk, D]
            if pin:
                rows_k, rows_v = rows_k.pin_memory(), rows_v.pin_memory()
            rows_k = rows_k.to(dev, non_blocking=pin)[None]
            rows_v = rows_v.to(dev, non_blocking=pin)[None]
            F.scaled_dot_product_attention(qr.view(1, HQ, 1, D), rows_k, rows_v, enable_gqa=True, scale=scale)

    out["draft_specache"] = {"us": _wall_us(specache_step, max(3, repeats // 5)), "topk": topk}
    dev_scores = lambda: [ext.select_topk(ext.payload_scores(qr[0], ext.kivi_attention(qr, p1, scale)[1][0], p1,  # noqa: E731
                                                              scale), topk) for _ in range(batch)]
    out["draft_specache_device_only"] = {"us": _time_us(dev_scores, repeats)}
    # where the device part goes: the payload scores alone, and the top-k alone
    lse0 = ext.kivi_attention(qr, p1, scale)[1][0]
    out["specache_scores_only"] = {"us": _time_us(lambda: [ext.payload_scores(qr[0], lse0, p1, scale)
                                                          for _ in range(batch)], repeats)}
    sc = ext.payload_scores(qr[0], lse0, p1, scale)
    out["specache_topk_only"] = {"us": _time_us(lambda: [ext.select_topk(sc, topk) for _ in range(batch)], repeats)}

    worker_step = _specache_worker_step(kr, vr, c2, p2, q1, batch, topk, scale, dev)
    out["draft_specache_worker"] = {"us": _wall_us(worker_step, max(3, repeats // 5)), "topk": topk,
                                    "note": "the server's SpeCacheDrafter.attend, per request (the CPU path)",
                                    **_runtime_calls(worker_step)}
    batched_step = _specache_worker_step(kr, vr, c2, p2, q1, batch, topk, scale, dev, batched=True)
    out["draft_specache_batched"] = {"us": _time_us(batched_step, repeats), "topk": topk,
                                     "note": "the server's SpeCacheDrafter.attend_batch: the whole batch (CUDA path)",
                                     **_runtime_calls(batched_step)}

    # reload: one layer of one request's full KV from pinned host memory on a copy stream
    if dev != "cuda":
        return out
    layer_req = torch.empty(2, n, HKV, D, dtype=dt, pin_memory=True)
    dst = torch.empty(2, n, HKV, D, dtype=dt, device=dev)
    copy = torch.cuda.Stream()

    def reload():
        with torch.cuda.stream(copy):
            dst.copy_(layer_req, non_blocking=True)
        torch.cuda.current_stream().wait_stream(copy)

    r_us = _time_us(reload, repeats)
    nbytes = layer_req.numel() * layer_req.element_size()
    out["reload_h2d"] = {"us": r_us, "bytes": nbytes, "gb_s": nbytes / r_us / 1e3}
    back = torch.empty(layer_req.shape, dtype=dt, pin_memory=True)  # the prefill's write-back target
    d2h = _time_us(lambda: back.copy_(dst, non_blocking=True), repeats)
    out["writeback_d2h"] = {"us": d2h, "gb_s": nbytes / d2h / 1e3}

    # overlap: the verify attention on the compute stream while a reload runs on the copy stream
    compute = paged(n, 1, x + 1)
    done = torch.cuda.Event()

    def both():
        with torch.cuda.stream(copy):
            dst.copy_(layer_req, non_blocking=True)
            done.record(copy)
        compute()
        torch.cuda.current_stream().wait_event(done)

    out["overlap"] = {"us": _time_us(both, repeats), "compute_alone_us": out["verify_paged"]["us"],
                      "copy_alone_us": r_us}
    return out


def _runtime_calls(fn) -> dict:
    """CUDA kernels launched and host-blocking CUDA runtime calls made by one ``fn()``
    (``torch.profiler``); empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    blocking = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D")
    return {"launches": sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
                            for n in names),
            "host_syncs": sum(n in blocking for n in names),  # (the closing synchronize is cudaDeviceSynchronize)
            "memcpy_async": sum(n == "cudaMemcpyAsync" for n in names)}


def _kivi_batched_step(compressed, packed, q1, k_buf, v_buf, batch: int, n: int, scale: float, dev: str):
    """One layer of KIVI drafting for ``batch`` requests through the server's own batched
    call (``kvruntime.decode_index``, as ``vc_torch``'s decode and VERICACHE's KIVI drafters
    run it on CUDA): each request the payload of ``compressed`` and its new row at pool slot
    ``i + 1``; the index built once, outside the step."""
    import types

    from sglang_vc.kvruntime import decode_index

    req_to_token = torch.zeros(batch, n + 1, dtype=torch.int32, device=dev)
    req_to_token[:, n] = torch.arange(1, batch + 1, dtype=torch.int32, device=dev)
    entries = [types.SimpleNamespace(num_payload_rows=compressed.num_quantized, packed=packed,
                                     payload=types.SimpleNamespace(layers={0: compressed}, addresses=None))
               for _ in range(batch)]
    runtime = types.SimpleNamespace(packed_payload=lambda entry, layer_id: entry.packed)
    seq = [n + 1] * batch
    idx = decode_index.build(runtime, req_to_token, torch.arange(batch, device=dev), torch.tensor(seq, device=dev),
                             seq, [compressed.num_quantized] * batch, entries)
    return lambda: decode_index.attend(q1[:batch], k_buf, v_buf, idx, 0, scale)


def _specache_worker_step(kr, vr, compressed, packed, q1, batch: int, topk: int, scale: float, dev: str,
                          batched: bool = False):
    """One layer of SpeCache drafting for ``batch`` requests through the server's own code
    (``vericache.specache_drafter.SpeCacheDrafter``): ``attend`` per request as
    ``vericache.attention`` calls it on the CPU, or ``batched``: ``attend_batch`` for the
    whole batch as it calls it on CUDA (its per-forward state built once, outside the
    step). The payload of ``compressed``, the full rows in the server's ``HostKVStore``
    (pinned on a GPU), a pool holding each request's new row."""
    import types

    from sglang_vc.compress.kivi import KIVI
    from sglang_vc.vericache.reload import HostKVStore
    from sglang_vc.vericache.specache_drafter import SpeCacheDrafter

    n = kr.shape[0]
    host = HostKVStore(pin=dev == "cuda")
    gen = torch.Generator().manual_seed(batch)  # on the host: the same rows whatever the device
    k_buf = torch.randn(batch + 1, *kr.shape[1:], generator=gen).to(dev, kr.dtype)  # slot i + 1: request i's new row
    v_buf = torch.randn(k_buf.shape, generator=gen).to(dev, kr.dtype)
    req_to_token = torch.zeros(batch, n + 1, dtype=torch.int32, device=dev)
    req_to_token[:, n] = torch.arange(1, batch + 1, dtype=torch.int32, device=dev)
    entries = []
    for i in range(batch):
        rid = f"r{i}"
        host.sink(rid, i, 0, 0, kr, vr)
        # each request its own payload object (its address table is cached on it)
        entries.append(types.SimpleNamespace(rid=rid, req_pool_idx=i, payload=types.SimpleNamespace(layers={0: compressed}, addresses=None),
                                             num_payload_rows=n))
    host.flush()
    pool = types.SimpleNamespace(get_key_buffer=lambda layer_id: k_buf, get_value_buffer=lambda layer_id: v_buf,
                                 start_layer=0, layer_num=1, head_num=kr.shape[1])
    runtime = types.SimpleNamespace(kv_pool=pool, req_to_token=req_to_token,
                                    packed_payload=lambda entry, layer_id: packed,
                                    payload_kv=lambda entry, layer_id: KIVI.dequantize(compressed))
    drafter = SpeCacheDrafter(host, runtime, topk)
    layer = types.SimpleNamespace(layer_id=0, scaling=scale)
    if batched:
        (sb,) = drafter.batch(entries, [n + 1] * batch, dev)
        return lambda: drafter.attend_batch(q1[:batch], sb, layer)

    def step() -> list:
        return [drafter.attend(q1[i : i + 1], entry, layer, n + 1) for i, entry in enumerate(entries)]

    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_vc.bench.gpu_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--tokens", type=int, default=32768, help="context length of each request")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--draft-len", type=int, default=30, help="X: a verify window is X + 1 queries")
    parser.add_argument("--keep", type=float, default=0.25, help="snapkv's kept fraction")
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--budget", type=int, default=512, help="in-pool drafting's view: rows per request")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if not 0 < args.keep <= 1 or args.tokens < 64 or args.batch < 1 or args.draft_len < 1 or args.budget < 5:
        parser.error("--keep in (0, 1], --tokens >= 64, --batch >= 1, --draft-len >= 1, --budget >= 5")
    rows = measure(args.tokens, args.batch, args.draft_len, args.keep, args.topk, args.repeats,
                   budget=args.budget)
    for name, row in rows.items():
        print(f"[gpu_step] {name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in row.items()), file=sys.stderr)
    report = {"benchmark": "gpu_step", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "gpu_mem_bytes": torch.cuda.get_device_properties(0).total_memory,
              "settings": vars(args), "model": {"hidden": HIDDEN, "q_heads": HQ, "kv_heads": HKV, "head_dim": D,
                                               "mlp": MLP, "layers": LAYERS, "dtype": "float16"},
              "per_layer": rows,
              "command": " ".join(["python -m sglang_vc.bench.gpu_step", *(argv if argv is not None else sys.argv[1:])])}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k in rows if "us" in rows[k]]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(names, [rows[k]["us"] for k in names])
    ax.set(xscale="log", xlabel="us per layer (batch of %d, %d tokens each)" % (args.batch, args.tokens))
    ax.set_title(f"one decode layer, 8B shapes, on {report['device']}")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"[gpu_step] wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
