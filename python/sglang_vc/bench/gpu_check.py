"""``python -m sglang_vc.bench.gpu_check --out DIR``: the prepared GPU check, one command
(about a minute on an H200), for a lent CUDA machine with PyTorch and Triton only (no
SGLang, no network):

1. the server's SpeCache drafter (``SpeCacheDrafter.attend``) on CUDA, where its fetch
   reads pinned host memory from the GPU, against the same call on the CPU's torch path:
   the same attention output (float32, both devices);
2. ``bench.kernels``: every Triton kernel against its torch path, time and error;
3. the server's reload (``LayerwiseReload``) of one 8k-token 8B request from pinned host
   memory into pool slots, contiguous and scattered (as SGLang's allocator hands them out):
   rows equal, GB/s each (``reload_staging.json``);
4. ``bench.gpu_step`` at batch 8 and batch 32 (in-pool view budget 512): one 8B decode
   layer at 32k tokens, each drafter through the server's own functions where it has one,
   with kernel launches and host-blocking CUDA calls counted by ``torch.profiler``;
5. ``bench.draft_graph``: the server's SpeCache and KIVI drafting layers
   (``SpeCacheDrafter.attend_batch``, ``kvruntime.decode_index.attend``; batch 8, 8B
   shapes, 19-32k-token payloads), each captured in a CUDA graph, replayed for its own batch
   and, its tables loaded (``SpeCacheBatch.load``, ``DecodeIndex.load``), for another batch of the same launch
   shape: each replay against that batch's eager call, and eager against replayed time
   (``draft_graph.json``), run last (a capture that breaks the CUDA context cannot cost the
   figures before it);
6. ``bench.view_step``: VERICACHE's in-pool draft step (the server's ``ViewRows.write``,
   then a paged decode over the view rows of ``req_to_token``) against a full-KV decode
   step, both replayed from a CUDA graph, 32 layers of 8B shapes, batch 32, 32k tokens
   (``view_step.json``; #63's check: the draft step at <= 0.3x the full one).

Writes ``DIR/gpu_check.json`` (1), ``kernels.json``, ``reload_staging.json``,
``draft_graph.json``, ``gpu_step.json``, ``gpu_step_b32.json``, ``view_step.json`` and
their plots; exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def drafter_matches_cpu(n: int = 4096, batch: int = 4, hq: int = 32, hkv: int = 8, d: int = 128,
                        topk: int = 64) -> dict:
    import sgl_kernel_ext as ext

    from sglang_vc.bench.gpu_step import _specache_worker_step
    from sglang_vc.compress.kivi import KIVI

    g = torch.Generator().manual_seed(0)
    kr, vr = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    q = torch.randn(batch, hq, d, generator=g)
    outs = {}
    for dev in ("cuda", "cpu"):
        k, v = kr.to(dev), vr.to(dev)
        c = KIVI().compress(0, k, v, 2)
        packed = ext.Payload(c.bits, c.group_size, c.value_group_size, c.k_payload, c.k_scales, c.k_zeros,
                             c.v_payload, c.v_scales, c.v_zeros, d, d)
        step = _specache_worker_step(k, v, c, packed, q.to(dev), batch, topk, d ** -0.5, dev)
        outs[dev] = torch.cat([o.float().cpu() for o in step()])
    err = float((outs["cuda"] - outs["cpu"]).abs().max())
    return {"check": "specache_drafter_cuda_vs_cpu", "max_abs_err": err, "ok": err < 1e-2,
            "uva_launches": ext.launches.get("gather_head_rows", 0)}


def reload_staging(device: str = "cuda", n: int = 8192, layers: int = 32, hkv: int = 8, d: int = 128,
                   dtype=torch.bfloat16, repeats: int = 3) -> dict:
    """The server's reload (``LayerwiseReload`` on the copy stream, every layer ahead of the
    verify: the staggered schedule's) of one request's full KV (8B shapes, ``n`` tokens)
    from pinned host memory into pool slots of a KV pool twice its size, contiguous and
    scattered: the slots' rows equal the host copy, and the link rate of each."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from sglang_vc.kvruntime import CopyStream
    from sglang_vc.vericache.reload import HostKVStore, LayerwiseReload

    stream = CopyStream(device)
    store = HostKVStore(copy_stream=stream)
    store.admit("r", 0, 0, n, 0)
    g = torch.Generator(device=device).manual_seed(0)
    for lid in range(layers):
        store.sink("r", 0, lid, 0, torch.randn(n, hkv, d, generator=g, device=device).to(dtype),
                   torch.randn(n, hkv, d, generator=g, device=device).to(dtype))
    store.flush()
    entry = store.get("r", 0)
    entry.wait()
    k = [torch.zeros(2 * n, hkv, d, dtype=dtype, device=device) for _ in range(layers)]
    v = [torch.zeros(2 * n, hkv, d, dtype=dtype, device=device) for _ in range(layers)]
    pool = SimpleNamespace(get_key_buffer=k.__getitem__, get_value_buffer=v.__getitem__)
    req_to_token = torch.zeros(1, n, dtype=torch.int32, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {"check": "reload_staging", "tokens": n, "layers": layers, "bytes": entry.nbytes(), "ok": True}
    layouts = {"contiguous": torch.arange(n // 2, n // 2 + n, device=device),
               "scattered": torch.randperm(2 * n, generator=g, device=device)[:n]}
    with ThreadPoolExecutor(1) as executor:
        for name, slots in layouts.items():
            best = float("inf")
            for _ in range(repeats):
                sync()
                t0 = time.perf_counter()
                rl = LayerwiseReload(executor, {0: entry}, {0: slots}, pool, req_to_token, list(range(layers)),
                                     device, depth=layers, copy_stream=stream)
                for lid in range(layers):
                    rl.layer(lid)
                sync()
                best = min(best, time.perf_counter() - t0)
                rl.close()
                out["ok"] &= all(torch.equal(k[lid][slots].cpu(), entry.k[lid]) and
                                 torch.equal(v[lid][slots].cpu(), entry.v[lid]) for lid in range(layers))
            out[f"{name}_gb_per_s"] = entry.nbytes() / best / 1e9
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_vc.bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmark/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from sglang_vc.bench import gpu_step, kernels

    check = drafter_matches_cpu()
    check["device"] = torch.cuda.get_device_name()
    (out / "gpu_check.json").write_text(json.dumps(check, indent=2))
    print(f"[gpu_check] {check}", file=sys.stderr, flush=True)
    failed = not check["ok"]
    staging = reload_staging()
    (out / "reload_staging.json").write_text(json.dumps(staging, indent=2))
    print(f"[gpu_check] {staging}", file=sys.stderr, flush=True)
    failed |= not staging["ok"]
    for name, fn, extra in (("kernels.json", kernels.main, []), ("gpu_step.json", gpu_step.main, []),
                            ("gpu_step_b32.json", gpu_step.main, ["--batch", "32", "--budget", "512"])):
        try:
            fn(["--json", str(out / name), *extra])
        except SystemExit as exc:  # bench.kernels exits non-zero when a kernel is off its torch path
            failed |= bool(exc.code)
    # last: a capture that breaks the CUDA context cannot cost the figures above
    from sglang_vc.bench import draft_graph

    try:
        graph = draft_graph.main_check()
    except Exception as exc:  # noqa: BLE001 (a failure is this check's finding, written like its figures)
        graph = {"check": "draft_graph", "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    (out / "draft_graph.json").write_text(json.dumps(graph, indent=2))
    print(f"[gpu_check] {graph}", file=sys.stderr, flush=True)
    failed |= not graph["ok"]
    from sglang_vc.bench import view_step

    try:
        view = view_step.main(["--json", str(out / "view_step.json")])
    except Exception as exc:  # noqa: BLE001 (as above)
        view = {"check": "view_step", "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        (out / "view_step.json").write_text(json.dumps(view, indent=2))
    failed |= not view["ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
