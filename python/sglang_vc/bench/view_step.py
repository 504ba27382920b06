"""``python -m sglang_vc.bench.view_step --json OUT``: VERICACHE's in-pool draft step as the
server runs it since drafts became SGLang decode forwards, against a full-KV decode step,
both replayed from a CUDA graph, at 8B shapes (Llama-3-8B, 32 layers), batch 32, 32k tokens.

Each step is what SGLang's decode graph replays: for every layer the layer's matrix
products and one paged decode attention over rows of ``req_to_token``:

* ``full``: each request's own row, its 32k tokens;
* ``draft``: the view rows the server's :meth:`vericache.view_rows.ViewRows.write` wrote
  into a second row per request (sinks and a recent window of ``--budget`` rows): the
  draft reads the same pool, only fewer of its rows.

The metadata runs eagerly once per step, before the replay, as SGLang's backends prepare
theirs outside the graph: the views (``ViewRows.write``) and the attention's index lists
from the rows. The lent GPU machine has PyTorch and Triton but no SGLang: the attention is
``sgl_kernel_ext.paged_attention`` over index lists built from ``req_to_token``
(``build_kv_indices``), standing in for SGLang's Triton decode, which reads the same rows
through its ``kv_indices``. The KV of 32 layers of 32 x 32k tokens (128 GiB) does not fit
beside the weights, so the layers cycle over :data:`KV_COPIES` pools of one layer each
(4 GiB apiece; a draft layer's 64 MiB of view rows is not in L2 when it comes round again).

Reports each step's time (graph replay, CUDA events), their ratio (#63's check: the draft
step at <= 0.3x the full one), and each replay's output against the same step run eagerly.
On the CPU (``test_view_step``) the same code runs eagerly at small shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_vc.bench.gpu_step import D, HIDDEN, HKV, HQ, LAYERS, MLP, _time_us

KV_COPIES = 4


class _RowPool:
    """SGLang's ``ReqToTokenPool`` as ``ViewRows`` uses it: the table and its free rows."""

    def __init__(self, req_to_token: torch.Tensor, first_free: int):
        self.req_to_token = req_to_token
        self.free = list(range(first_free, req_to_token.shape[0]))

    def available_size(self) -> int:
        return len(self.free)

    def alloc_rows(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def free_rows(self, rows) -> None:
        self.free.extend(rows)


def _steps(n: int, batch: int, budget: int, layers: int, dev: str, dt: torch.dtype, gen: torch.Generator):
    """The two steps' callables (each returns its last layer's attention output), their
    metadata as run once per step, the views written, and the pools and queries read."""
    import sgl_kernel_ext as ext

    from sglang_vc.vericache.view_rows import ViewRows

    scale = D ** -0.5
    w = [{name: torch.randn(a, b, device=dev, dtype=dt, generator=gen) * 0.02 for name, (a, b) in {
        "qkv": (HIDDEN, (HQ + 2 * HKV) * D), "o": (HQ * D, HIDDEN), "gate_up": (HIDDEN, 2 * MLP),
        "down": (MLP, HIDDEN)}.items()} for _ in range(layers)]
    slots = batch * n + 1  # slot 0: SGLang's padding slot
    kv = [(torch.randn(slots, HKV, D, device=dev, dtype=dt, generator=gen),
           torch.randn(slots, HKV, D, device=dev, dtype=dt, generator=gen)) for _ in range(min(KV_COPIES, layers))]
    # each request's tokens at slots of a random permutation (the allocator's order)
    perm = torch.randperm(batch * n, device=dev, generator=gen).to(torch.int32) + 1
    req_to_token = torch.zeros(2 * batch, n + 8, dtype=torch.int32, device=dev)  # a second row per drafter
    req_to_token[:batch, :n] = perm.view(batch, n)
    rows = torch.arange(batch, device=dev)
    h0 = torch.randn(batch, HIDDEN, device=dev, dtype=dt, generator=gen)
    q = torch.randn(batch, HQ, D, device=dev, dtype=dt, generator=gen)
    q_pos = torch.full((batch,), n - 1, device=dev, dtype=torch.int64)

    def index(table_rows: torch.Tensor, lengths: list[int]):
        zero = torch.zeros(batch, dtype=torch.int64, device=dev)
        return ext.build_kv_indices(req_to_token, table_rows, zero, zero + torch.tensor(lengths, device=dev), 0)

    def step(built):
        def run():
            h, out = h0, None
            for lid in range(layers):
                k_buf, v_buf = kv[lid % len(kv)]
                wl = w[lid]
                qkv = h @ wl["qkv"]
                out, _ = ext.paged_attention(q, k_buf, v_buf, rows, q_pos, built.indptr, built.indices,
                                             built.positions, scale)
                h = (qkv[:, : HQ * D] + out.view(batch, -1).to(dt)) @ wl["o"]
                g = h @ wl["gate_up"]
                h = (F.silu(g[:, :MLP]) * g[:, MLP:]) @ wl["down"]
            return out
        return run

    full = index(rows, [n] * batch)
    pool = _RowPool(req_to_token, batch)
    views_of = ViewRows(pool)
    views = views_of.write({i: budget for i in range(batch)}, list(range(batch)), [n] * batch)
    view_rows = torch.tensor([views.rows[i] for i in range(batch)], device=dev)
    draft = index(view_rows, [views.lengths[i] for i in range(batch)])

    def draft_metadata():  # what the server does once per draft step, outside the graph
        views_of.give_back()
        v = views_of.write({i: budget for i in range(batch)}, list(range(batch)), [n] * batch)
        return index(torch.tensor([v.rows[i] for i in range(batch)], device=dev), [v.lengths[i] for i in range(batch)])

    metadata = {"full": lambda: index(rows, [n] * batch), "draft": draft_metadata}
    return {"full": step(full), "draft": step(draft)}, metadata, views, (kv, q)


def _graphed(fn):
    """``fn`` captured in a CUDA graph (warmed up on a side stream first): the replay, and
    the output tensor the replay writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def measure(n: int = 32768, batch: int = 32, budget: int = 512, layers: int = LAYERS, repeats: int = 10,
            dev: str = "cuda") -> dict:
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    steps, metadata, views, _ = _steps(n, batch, budget, layers, dev, dt, gen)
    out = {"tokens": n, "batch": batch, "budget": budget, "layers": layers, "dtype": str(dt).removeprefix("torch."),
           "view_rows": sum(views.lengths.values()), "ok": True}
    for name, fn in steps.items():
        eager = fn().clone()
        if dev == "cuda":
            replay, result = _graphed(fn)
            replay()
            torch.cuda.synchronize()
            err = float((result.float() - eager.float()).abs().max())
            us = _time_us(replay, repeats)
        else:
            err, us = 0.0, _time_us(fn, repeats)
        out[name] = {"us": us, "replayed": dev == "cuda", "max_abs_err_vs_eager": err}
        out["ok"] &= err < 1e-2
    for name, fn in metadata.items():
        out[f"{name}_metadata"] = {"us": _time_us(fn, repeats), "per": "step, eager, before the replay"}
    out["draft_to_full"] = out["draft"]["us"] / out["full"]["us"]
    out["draft_with_metadata_to_full"] = ((out["draft"]["us"] + out["draft_metadata"]["us"])
                                          / (out["full"]["us"] + out["full_metadata"]["us"]))
    out["target"] = {"draft_to_full_at_most": 0.3, "met": out["draft_with_metadata_to_full"] <= 0.3}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = {"full KV step": result["full"]["us"], "its index lists": result["full_metadata"]["us"],
            "draft step (view rows)": result["draft"]["us"], "its views and index lists": result["draft_metadata"]["us"]}
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.barh(list(bars), [us / 1e3 for us in bars.values()])
    ax.set(xlabel="ms per step (graph replay; metadata eager)")
    ax.set_title(f"8B, {result['layers']} layers, batch {result['batch']}, {result['tokens']} tokens, view "
                 f"{result['budget']}: draft {result['draft_with_metadata_to_full']:.2f}x full")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m sglang_vc.bench.view_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    result = measure(args.tokens, args.batch, args.budget, repeats=args.repeats)
    result["device"] = torch.cuda.get_device_name()
    path = Path(args.json)
    path.write_text(json.dumps(result, indent=2))
    plot(result, path.with_suffix(".png"))
    print(f"[view_step] {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


if __name__ == "__main__":
    main()
