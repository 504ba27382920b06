"""``python -m sglang_vc.bench.kernels --json OUT``: time of sgl-kernel-ext's Triton
kernels on a GPU against the torch path the CPU runs (the same call with
``SGL_KERNEL_EXT_BACKEND=torch``) and against FlashInfer's dense paged decode attention
over the same number of rows, per context length; JSON and a plot.

Needs CUDA: the Triton interpreter that runs the kernels on a CPU says nothing about their
speed. Each case also records the compiled kernel's largest deviation from the torch path
(``max_abs_err``); the run writes its figures and then fails if one exceeds ``ERR_BOUND``.
Cases (one decode query row per request, ``--batch`` requests, Llama-like heads):

* ``paged``: decode attention over a compressed node's kept rows through its index list;
* ``kivi2``/``kivi1``: the payload dequantized inside the attention vs dequantize + attend;
* ``specache_topk``: payload scores from the 1-bit keys and the top-k vs the eager path;
* ``host_gather``: SpeCache's fetch of 64 rows per KV head and request from a pinned host
  copy at indices on the device, read by the GPU itself (``gather_head_rows``) vs the torch
  path (indices to the host, a gather there, the rows back: a host round trip).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


ERR_BOUND = 2e-2  # float16 inputs, float32 accumulation in both paths


def time_us(fn, repeats: int) -> float:
    """Mean microseconds of ``fn`` on the GPU (CUDA events, three warm-up calls)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1e3  # microseconds


def _err(a, b) -> float:
    """The compiled kernel's largest deviation from the torch path (the interpreter tests
    prove the kernel code on a CPU; this checks what CUDA compiled)."""
    return float((a.float() - b.float()).abs().max())


def _backend(name: str):
    os.environ["SGL_KERNEL_EXT_BACKEND"] = name


def run_case(case: str, n: int, batch: int, hq: int, hkv: int, d: int, repeats: int) -> dict:
    import sgl_kernel_ext as ext

    from sglang_vc.compress.kivi import KIVI
    from sglang_vc.compress.kivi1 import KIVI1

    dev, dtype = "cuda", torch.float16
    scale = d ** -0.5
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
    row = {"case": case, "tokens": n, "batch": batch}
    if case == "paged":
        k_buf = torch.randn(batch * n + 1, hkv, d, device=dev, dtype=dtype)
        v_buf = torch.randn_like(k_buf)
        indices = torch.randperm(batch * n, device=dev) + 1
        indptr = torch.arange(0, batch * n + 1, n, device=dev)
        pos = torch.arange(n, device=dev).repeat(batch)
        args = (q, k_buf, v_buf, torch.arange(batch, device=dev), torch.full((batch,), n, device=dev),
                indptr, indices, pos, scale)
        timings, outs = {}, {}
        for name in ("triton", "torch"):
            _backend(name)
            outs[name] = ext.paged_attention(*args)[0]
            timings[name] = time_us(lambda: ext.paged_attention(*args), repeats)
        row["max_abs_err"] = _err(outs["triton"], outs["torch"])
        try:
            import flashinfer

            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD")
            wrapper.plan(indptr.int(), indices.int(), torch.ones(batch, dtype=torch.int32, device=dev), hq, hkv, d, 1,
                         data_type=dtype, q_data_type=dtype)
            kv = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))
            timings["flashinfer_dense"] = time_us(lambda: wrapper.run(q, kv), repeats)
        except ImportError:
            timings["flashinfer_dense"] = None
        row["us"] = timings
        return row
    if case == "host_gather":
        src = [torch.randn(n, hkv, d, dtype=dtype).pin_memory() for _ in range(batch)]
        idx = [torch.randint(0, n, (hkv, 64), device=dev) for _ in range(batch)]
        timings, outs = {}, {}
        for name in ("triton", "torch"):
            _backend(name)
            outs[name] = torch.stack([ext.gather_head_rows(s, i) for s, i in zip(src, idx)])
            timings[name] = time_us(lambda: [ext.gather_head_rows(s, i) for s, i in zip(src, idx)], repeats)
        row["max_abs_err"] = _err(outs["triton"], outs["torch"])
        row["us"] = timings
        return row
    quantizer = {"kivi2": KIVI(), "kivi1": KIVI1(), "specache_topk": KIVI1()}[case]
    bits = quantizer.supported_bits[0]
    k = torch.randn(n, hkv, d, device=dev, dtype=dtype)
    qkv = quantizer.compress(0, k, torch.randn_like(k), bits)
    payload = ext.Payload(qkv.bits, qkv.group_size, qkv.value_group_size, qkv.k_payload, qkv.k_scales, qkv.k_zeros,
                          qkv.v_payload, qkv.v_scales, qkv.v_zeros, d, d)
    q1 = q[:1]
    timings = {}
    if case.startswith("kivi"):
        def torch_path():
            kq, vq = KIVI.dequantize(qkv)
            return torch.nn.functional.scaled_dot_product_attention(
                q1.transpose(0, 1), kq.transpose(0, 1), vq.transpose(0, 1), enable_gqa=True, scale=scale)

        _backend("triton")
        row["max_abs_err"] = _err(ext.kivi_attention(q1, payload, scale)[0], torch_path().transpose(0, 1))
        timings["triton"] = time_us(lambda: ext.kivi_attention(q1, payload, scale), repeats)
        timings["torch"] = time_us(torch_path, repeats)
    else:
        _backend("triton")
        _, lse = ext.kivi_attention(q1, payload, scale)
        scores = ext.payload_scores(q1[0], lse[0], payload, scale)
        timings["triton"] = time_us(lambda: ext.select_topk(ext.payload_scores(q1[0], lse[0], payload, scale), 64),
                                  repeats)
        _backend("torch")
        row["max_abs_err"] = _err(scores, ext.payload_scores(q1[0], lse[0], payload, scale))
        timings["torch"] = time_us(lambda: ext.select_topk(ext.payload_scores(q1[0], lse[0], payload, scale), 64),
                                 repeats)
    row["us"] = timings
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_vc.bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--lengths", default="1024,4096,16384,32768")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (on a CPU the kernels run in Triton's interpreter: "
                     "correctness only, see test/test_kernel_ext.py)")
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        hq, hkv, d = (int(x) for x in args.heads.split(","))
    except ValueError:
        parser.error("--lengths and --heads take comma-separated integers")
    rows = []
    chosen = os.environ.get("SGL_KERNEL_EXT_BACKEND")  # each case switches it; restored after
    try:
        for case in ("paged", "kivi2", "kivi1", "specache_topk", "host_gather"):
            for n in lengths:
                row = run_case(case, n, args.batch, hq, hkv, d, args.repeats)
                print(f"[kernels] {case} n={n}: " + ", ".join(f"{k} {v:.1f} us" for k, v in row["us"].items() if v)
                      + f", max abs error vs torch {row['max_abs_err']:.2e}", file=sys.stderr)
                rows.append(row)
    finally:
        if chosen is None:
            os.environ.pop("SGL_KERNEL_EXT_BACKEND", None)
        else:
            os.environ["SGL_KERNEL_EXT_BACKEND"] = chosen
    report = {"benchmark": "kernels", "device": torch.cuda.get_device_name(), "settings": vars(args), "rows": rows,
              "command": " ".join(["python -m sglang_vc.bench.kernels", *(argv or sys.argv[1:])])}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.5))
    for ax, case in zip(axes, cases):
        sel = [r for r in rows if r["case"] == case]
        for impl in sel[0]["us"]:
            ys = [r["us"][impl] for r in sel]
            if all(y is not None for y in ys):
                ax.plot([r["tokens"] for r in sel], ys, marker="o", label=impl)
        ax.set(title=case, xlabel="tokens", ylabel="us", xscale="log", yscale="log")
        ax.legend()
    fig.suptitle(f"sgl-kernel-ext on {report['device']}")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"[kernels] wrote {out}", file=sys.stderr)
    wrong = [r for r in rows if not r["max_abs_err"] <= ERR_BOUND]
    if wrong:  # the figures are written, and the run fails
        sys.exit(f"python -m sglang_vc.bench.kernels: error: {len(wrong)} case(s) differ from the torch path by "
                 f"more than {ERR_BOUND}: " + ", ".join(f"{r['case']}@{r['tokens']}" for r in wrong))


if __name__ == "__main__":
    main()
