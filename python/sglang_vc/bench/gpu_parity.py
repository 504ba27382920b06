"""``python -m sglang_vc.bench.gpu_parity --json OUT``: what turning VERICACHE on costs a
plain SGLang user on a GPU before anything drafts, priced from the code as it stands.

A PREDICTION, not a measurement: nothing here runs on a GPU. The terms that decide it are
read from the project's own code, so the figures move when the code does:

* **the pool**: the share of SGLang's KV budget the pool keeps under VERICACHE's default
  flags (:func:`pool_share`: the project's hooks on SGLang's pool sizing, applied to a
  budget; none today), and so how many requests of the context are resident beside plain
  SGLang's;
* **overlap**: whether VERICACHE's flag resolution leaves SGLang's overlap scheduler on
  (``speculative.resolve_flags``); where it is off, the iteration's host work
  (``--host-ms``, an assumption: the issue priced it at 4-6 ms for 32 requests) is added
  to every iteration instead of hidden behind the device; and whether SGLang leaves its
  grammar batches overlapped (``supports_grammar_overlap``);
* **verify graphs**: the widths a uniform in-pool verify replays from a graph
  (``vericache.decode_graphs.verify_graph_widths``), reported (nothing drafts here, so
  they do not enter the ratio);
* **bytes per verify** under offload: the request's whole full KV (copied layer by layer
  into the verify's own pool slots), over a ``--link-gb-s`` link;
* **syncs and launches** of an overlapped iteration, read from a VERICACHE server's
  schedule trace (``--trace``, written under ``SGLANG_VC_COUNT_SYNCS=sites``,
  :func:`trace_terms`): a read of a device value at the project's own code waits for the
  forward, so the iteration's host work is no longer hidden; the worker's own host time
  (timed on the machine that wrote the trace) and the operators it launches around
  SGLang's forward (``--launch-us`` each) are host work the device step must cover, and
  what it does not cover is added.

The device iteration is the memory-bound decode step: the weights and every resident
request's KV read once from HBM. Printed beside the figures a code read gave at d332b8c
(``OLD``), which the issue that asked for this tool (#74) quotes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

GB = 1e9
# one H100 SXM, an 8B model (Llama-3-8B shapes) in bfloat16
H100 = {"gpu_mem_bytes": 80 * GB, "hbm_bw": 3.35e12}
MODEL_8B = {"weights_bytes": 16 * GB, "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}
# the code read at d332b8c (the table): VERICACHE on, nothing drafts; in-pool
# drafting at default flags; offload engaged (32 requests of 32k on an H100, 8B)
OLD = {"nothing_drafts": 0.76, "in_pool": 0.84, "offload": 0.7}


def kv_bytes_per_token(model: dict) -> int:
    return 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * model["dtype_bytes"]


POOL_SIZING = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"


def pool_share(argv: tuple = ("--speculative-algorithm", "VERICACHE"), budget: int = 10 << 30) -> float:
    """The share of SGLang's KV budget the pool keeps for a server launched with ``argv``:
    every hook the project registers on SGLang's pool sizing (:data:`POOL_SIZING`; recorded
    from ``hooks.install``, not applied to SGLang), run on a budget of ``budget`` bytes."""
    from unittest import mock

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_vc import hooks
    from sglang_vc.launch_server import parse_args

    recorded = []

    def record(target, hook, hook_type=HookType.AFTER, **_):
        recorded.append((target, hook, hook_type))

    with mock.patch.object(HookRegistry, "register", staticmethod(record)):
        hooks.install()
    _, server_args = parse_args(list(argv))
    configurator = SimpleNamespace(server_args=server_args, is_draft_worker=False)
    pool = budget
    for target, hook, hook_type in recorded:
        if target == POOL_SIZING:
            if hook_type is not HookType.AFTER:
                raise NotImplementedError(f"a {hook_type} hook on SGLang's pool sizing")
            out = hook(pool, configurator)
            pool = pool if out is None else out
    return pool / budget


def code_terms(draft_tokens: int = 32) -> dict:
    """What the code does under VERICACHE's default flags (X chosen from data up to
    ``draft_tokens``): the pool's share of the KV budget, whether SGLang's overlap
    scheduler stays on, the verify widths graphs capture."""
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_vc.speculative import resolve_flags
    from sglang_vc.vericache.decode_graphs import verify_graph_widths
    from sglang_vc.vericache.names import ATTENTION_BACKEND
    from sglang_vc.vericache.worker_spec import register

    share = pool_share()
    register()
    args = SimpleNamespace(speculative_algorithm="VERICACHE", disable_overlap_schedule=False,
                           enable_mixed_chunk=False)
    # as VERICACHE's handler resolves it: overlap stays on where its worker keeps the contract
    resolve_flags(args, ATTENTION_BACKEND, overlap=get_spec("VERICACHE").supports_overlap)
    return {"pool_share": share, "overlap": not args.disable_overlap_schedule,
            # whether SGLang leaves a grammar batch overlapped (it syncs those of algorithms
            # that do not take its grammar barrier); penalised batches: test_vericache_serving
            "grammar_overlap": get_spec("VERICACHE").supports_grammar_overlap(),
            "verify_graph_widths": verify_graph_widths(draft_tokens + 1)}


PROJECT_SITES = ("sglang_vc/", "vericache/", "kvruntime/")  # (SGLang's own sites are a plain server's too)
DEVICE_READS = ("to", "item", "cpu", "numpy", "h2d")


def trace_terms(path: Path) -> dict:
    """From a schedule trace (``--vc-schedule-trace``) of a VERICACHE server run with
    ``SGLANG_VC_COUNT_SYNCS=sites``: its overlapped iterations, the most reads of a device
    value any of them made at the project's own code (on the CPU the counter cannot tell a
    host copy's read from a device read: an over-count), the median operators launched
    around SGLang's forward, and the host time of the worker's own work per iteration (the
    mode check and what runs around the forward, timed on the machine that wrote the trace;
    counting itself slows it, so it is an over-estimate) as a line in the batch size."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    overlapped = [dict(r["phases"], batch=len(r["requests"])) for r in records
                  if r.get("phases", {}).get("overlapped")]
    if not overlapped or "host_sync_sites" not in overlapped[0]:
        raise SystemExit(f"{path}: no overlapped iteration with sync sites (run the server with "
                         "SGLANG_VC_COUNT_SYNCS=sites and --vc-schedule-trace)")
    reads = [sum(n for site, n in p["host_sync_sites"].items()
                 if site.split()[0] in DEVICE_READS and site.split()[1].startswith(PROJECT_SITES))
             for p in overlapped]
    launches = sorted(p.get("launches_outside_forward", 0) for p in overlapped)
    fixed, per_request = _line([p["batch"] for p in overlapped], [1e3 * p.get("host_s", 0.0) for p in overlapped])
    return {"overlapped_iterations": len(overlapped), "batch_sizes": sorted({p["batch"] for p in overlapped}),
            "device_reads_per_iteration": max(reads), "launches_outside_forward": launches[len(launches) // 2],
            "worker_host_ms_fixed": round(fixed, 4), "worker_host_ms_per_request": round(per_request, 4)}


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` through the means, ``b >= 0`` (host work does not
    shrink with the batch; a negative slope is noise)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx) if sxx else 0.0
    return my - b * mx, b


@dataclass
class Row:
    context_tokens: int
    plain_batch: int
    vc_batch: int
    plain_iter_ms: float
    vc_iter_ms: float
    nothing_drafts: float  # tokens/s, VERICACHE on / plain SGLang
    offload_verify_bytes: float
    offload_verify_link_ms: float
    host_ms: float  # the worker's host work per overlapped iteration (launches; assumed where no trace)
    host_exposed_ms: float  # the part of it the device step does not hide


def predict(terms: dict, *, contexts: list[int], batch: int, mem_fraction: float, host_ms: float,
            link_gb_s: float, launch_us: float = 5.0, hw: dict = H100, model: dict = MODEL_8B) -> list[Row]:
    """Tokens/s of VERICACHE with nothing drafting over plain SGLang's. With a trace's terms
    the host work is the worker's own host time plus its launches at ``launch_us`` each,
    hidden up to the device step while overlap holds (no device read at the project's
    code); without one it is ``host_ms``, hidden wherever overlap is on."""
    budget = mem_fraction * hw["gpu_mem_bytes"] - model["weights_bytes"]
    weights_ms = 1e3 * model["weights_bytes"] / hw["hbm_bw"]
    traced = "launches_outside_forward" in terms
    overlapped = terms["overlap"] and (not traced or terms["device_reads_per_iteration"] == 0)
    rows = []
    for n in contexts:
        kv = n * kv_bytes_per_token(model)
        plain_b = min(batch, int(budget // kv))
        vc_b = min(batch, int(budget * terms["pool_share"] // kv))
        work_ms = (terms["worker_host_ms_fixed"] + terms["worker_host_ms_per_request"] * vc_b
                   + terms["launches_outside_forward"] * launch_us / 1e3) if traced else host_ms
        step = lambda b: weights_ms + 1e3 * b * kv / hw["hbm_bw"]  # noqa: E731
        plain_ms = step(plain_b)
        exposed = (max(0.0, work_ms - step(vc_b)) if traced else 0.0) if overlapped else work_ms
        vc_ms = step(vc_b) + exposed
        rows.append(Row(n, plain_b, vc_b, plain_ms, vc_ms, (vc_b / vc_ms) / (plain_b / plain_ms),
                        kv, 1e3 * kv / (link_gb_s * GB), work_ms, exposed))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_vc.bench.gpu_parity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch", type=int, default=32, help="requests waiting to decode")
    parser.add_argument("--mem-fraction-static", type=float, default=0.88)
    parser.add_argument("--host-ms", type=float, default=5.0,
                        help="host work per iteration that overlap scheduling would hide (an assumption)")
    parser.add_argument("--link-gb-s", type=float, default=50.0, help="pinned host-to-device copies")
    parser.add_argument("--trace", type=Path, help="a VERICACHE server's schedule trace written under "
                        "SGLANG_VC_COUNT_SYNCS=sites: its overlapped iterations' syncs and launches replace --host-ms")
    parser.add_argument("--launch-us", type=float, default=5.0, help="host time per operator launched (with --trace)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    if not 0 < args.mem_fraction_static < 1 or args.batch < 1 or min(args.contexts) < 1:
        parser.error("--mem-fraction-static in (0, 1), --batch and --contexts >= 1")
    if args.trace is not None and not args.trace.is_file():
        parser.error(f"--trace {args.trace}: no such file")
    terms = code_terms()
    if args.trace is not None:
        terms.update(trace_terms(args.trace))
    rows = predict(terms, contexts=args.contexts, batch=args.batch, mem_fraction=args.mem_fraction_static,
                   host_ms=args.host_ms, link_gb_s=args.link_gb_s, launch_us=args.launch_us)
    out = {"label": "PREDICTION from the code's terms and nominal H100 figures, not a measurement",
           "device": "H100 (nominal)", "model": "8B (Llama-3-8B shapes)", "terms": terms, "old_code_read": OLD,
           "rows": [asdict(r) for r in rows],
           "command": " ".join(["python -m sglang_vc.bench.gpu_parity", *(argv if argv is not None else sys.argv[1:])])}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"[gpu_parity] {out['label']}; pool share {terms['pool_share']:.3f} of the KV budget, overlap "
          f"{'on' if terms['overlap'] else 'off'} (grammar batches "
          f"{'overlapped' if terms['grammar_overlap'] else 'synchronous'}), verify graphs at widths "
          f"{terms['verify_graph_widths']}",
          file=sys.stderr)
    for r in rows:
        print(f"[gpu_parity] {r.context_tokens} tokens: resident {r.vc_batch} vs plain {r.plain_batch}, iteration "
              f"{r.vc_iter_ms:.1f} vs {r.plain_iter_ms:.1f} ms: nothing drafts x{r.nothing_drafts:.2f} (code read "
              f"at d332b8c: x{OLD['nothing_drafts']:.2f} at 32k); offload verify reloads "
              f"{r.offload_verify_bytes / GB:.2f} GB ({r.offload_verify_link_ms:.0f} ms of link); host work "
              f"{r.host_ms:.2f} ms an iteration, {r.host_exposed_ms:.2f} ms of it exposed", file=sys.stderr)
    if "launches_outside_forward" in terms:
        print(f"[gpu_parity] from {args.trace}: {terms['overlapped_iterations']} overlapped iterations, at most "
              f"{terms['device_reads_per_iteration']} device reads at the project's code in one, median "
              f"{terms['launches_outside_forward']} operators launched around SGLang's forward; the worker's "
              f"host time {terms['worker_host_ms_fixed']:.2f} ms + {terms['worker_host_ms_per_request']:.3f} ms a "
              f"request (batches {terms['batch_sizes']})", file=sys.stderr)
    _plot(out, path.with_suffix(".png"))


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["nothing_drafts"] for r in rows], 0.4, label="as the code stands")
    ax.bar([x + 0.2 for x in xs], [OLD["nothing_drafts"] if r["context_tokens"] == 32768 else 0 for r in rows], 0.4,
           label="code read at d332b8c (32k only)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), [f"{r['context_tokens'] // 1024}k" for r in rows])
    ax.set(ylabel="x plain SGLang tokens/s", title="PREDICTION: VERICACHE on, nothing drafts (H100, 8B)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
