"""``python -m sglang_vc.bench.cpu_draft_step --json OUT``: what one SpeCache draft step
costs the CPU per layer and request, against full-KV decode attention over the same
context, per context length; JSON and a plot.

On the CPU a draft pays off only when it is cheaper than the full-KV token it stands
for. Two calls on the same tensors (smollm2-135m's heads by default, float32):

* ``full``: SGLang's own ``torch_native`` decode (``_run_sdpa_forward_decode``, what a
  plain CPU server runs) for one request whose rows are scattered over the pool;
* ``specache``: the calls VERICACHE's drafter makes on the CPU (``SpeCacheDrafter.attend``
  without a GPU, outside its runtime): the 2-bit payload dequantized (``KIVI.dequantize``), the tail gathered from the
  pool, SpeCache's attention with ``--topk`` rows per KV head fetched and substituted
  (``specache.core.attend_fetching``).

The ratio is what the CPU draft step costs against the full-KV token it replaces; the
throughput benchmark's cost fit (``draft_s_per_request``) is the same cost over all layers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_vc.bench.plots import plot_lines
from sglang_vc.compress.kivi import KIVI
from sglang_vc.specache import core


def _ms(fn, repeats: int) -> float:
    fn()
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def run_length(n: int, hq: int, h: int, d: int, topk: int, bits: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(n)
    pool_k, pool_v = torch.randn(2 * n, h, d, generator=gen), torch.randn(2 * n, h, d, generator=gen)
    slots = torch.randperm(2 * n, generator=gen)[:n]
    k, v = pool_k[slots], pool_v[slots]
    ckv = KIVI().compress(0, k, v, bits)
    n_q = ckv.num_quantized
    tail = slots[n_q:]
    q = torch.randn(1, hq, d, generator=gen)
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
        return core.attend_fetching(q, kq, vq, pool_k[tail], pool_v[tail], q_start=n - 1, scale=scale, topk=topk,
                                    fetch=fetch)[0].out

    row = {"tokens": n, "full_ms": _ms(full, repeats), "specache_ms": _ms(specache, repeats)}
    row["specache_x_full"] = row["specache_ms"] / row["full_ms"]
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_vc.bench.cpu_draft_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim (smollm2-135m)")
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--bits", type=int, default=2, choices=(1, 2, 4))
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    try:
        hq, h, d = (int(x) for x in args.heads.split(","))
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--heads and --lengths are comma-separated integers, got {args.heads!r}, {args.lengths!r}")
    if hq % h or min(lengths) < 256:
        parser.error("query heads must be a multiple of KV heads, and every length at least 256")
    rows = []
    for n in lengths:
        rows.append(run_length(n, hq, h, d, args.topk, args.bits, args.repeats))
        r = rows[-1]
        print(f"[cpu_draft_step] {n} tokens: full-KV decode {r['full_ms']:.3f} ms, SpeCache draft step "
              f"{r['specache_ms']:.3f} ms (x{r['specache_x_full']:.2f}) per layer and request", flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"threads": torch.get_num_threads(), "heads": [hq, h, d], "topk": args.topk, "bits": args.bits,
              "rows": rows}
    out.write_text(json.dumps(report, indent=2))
    xs = [r["tokens"] for r in rows]
    plot_lines({"full-KV decode (torch_native)": (xs, [r["full_ms"] for r in rows]),
                "SpeCache draft step": (xs, [r["specache_ms"] for r in rows])}, "context tokens",
               "ms per layer and request",
               f"One decode step on the CPU ({torch.get_num_threads()} threads, {args.bits}-bit drafts)",
               out.with_suffix(".png"),
               markers=True)
    print(f"[cpu_draft_step] wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
