"""Host synchronisations of VERICACHE's decode iterations (``pytest -k sync``).

On a GPU every value read on the host waits for the queued kernels; the staggered
iteration may make a fixed number of such reads, never one per request or per layer.
Servers started with ``SGLANG_VC_COUNT_SYNCS=1`` count them per iteration
(:mod:`sglang_vc.kvruntime.syncs`: ``tolist``, ``item``, ``cpu``, ``numpy``, ``.to("cpu")``
and ``int``/``float``/``bool``/``index`` of a tensor, on the scheduler thread) and write
the count into the schedule trace. Two model depths (the embedded model cut to 2 and 4
layers), batches of 2 and 8 requests, SnapKV, KIVI 2-bit and SpeCache 2-bit (the default
drafter) drafters in one batch: the count per iteration (drafting only, verifying only,
both) is the same everywhere.

Blocking host-to-device copies count too (``torch.tensor(list, device=...)``, a ``.to``
of a device without ``non_blocking``). Two code paths: the CPU's (torch), where SpeCache
drafts per request over a host copy that is on the device already (no copy), and the
GPU's (``SGL_KERNEL_EXT_BACKEND=triton``, a stand-in CUDA platform: the Triton kernels
in Triton's interpreter, slow), where every drafter of the batch drafts together and
per-forward index lists go up by pinned, non-blocking copies.
"""

from __future__ import annotations

import json

import pytest

from conftest import real_text_passages
from sglang_vc.testing.client import concurrently, generate
from sglang_vc.testing.server import ServerProcess, start_servers

KIVI = {"vc_compressor": "kivi", "vc_kv_bits": 2}
SPECACHE = {"vc_compressor": "specache", "vc_kv_bits": 2}


DEPTHS = (2, 4)


def _servers(tmp_path, backend: str) -> list[ServerProcess]:
    """One server per depth, started together (the starts overlap on two cores)."""
    return start_servers([dict(
        args=["--dtype", "float32", "--max-total-tokens", "12000", "--speculative-algorithm", "VERICACHE",
              "--vc-compress-when", "always", "--speculative-num-draft-tokens", "4", "--vc-compressor", "snapkv",
              "--vc-compression-ratio", "0.25", "--vc-schedule-trace", str(tmp_path / f"trace{depth}.jsonl"),
              "--json-model-override-args", json.dumps({"num_hidden_layers": depth}), "--skip-server-warmup"],
        log_path=tmp_path / f"server{depth}.log",
        env={"SGLANG_VC_COUNT_SYNCS": "sites", "SGL_KERNEL_EXT_BACKEND": backend}) for depth in DEPTHS])


def _iterations(server: ServerProcess, trace, tokenizer) -> dict[int, list[dict]]:
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    out = {}
    for bs in (2, 8):
        seen = len(trace.read_text().splitlines()) if trace.exists() else 0
        jobs = [(stream[i * 300 : i * 300 + 240], (SPECACHE, KIVI, None)[i % 3]) for i in range(bs)]
        concurrently(lambda ids, custom: generate(server, ids, 12, custom), jobs)
        out[bs] = [json.loads(line) for line in trace.read_text().splitlines()[seen:]]
    # the default drafter really drafted: SpeCache fetched its top-k rows
    counters = server.server_info()["sglang_vc"]["counters"]["vericache"]
    assert counters.get("specache_rows_fetched", 0) > 0, counters
    return out


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_host_syncs_per_iteration_do_not_grow_with_batch_or_depth(tokenizer, tmp_path, backend):
    by_roles: dict[frozenset, dict] = {}  # the roles in an iteration -> (depth, bs) -> counts
    sites: dict[frozenset, dict] = {}  # the roles -> "kind file:line" -> the calls seen there
    servers = _servers(tmp_path, backend)
    try:
        runs = {depth: _iterations(server, tmp_path / f"trace{depth}.jsonl", tokenizer)
                for depth, server in zip(DEPTHS, servers)}
    finally:
        for server in servers:
            server.stop()
    for depth, run in runs.items():
        for bs, records in run.items():
            busy = [r for r in records if r["requests"]]
            assert busy and all("host_syncs" in r["phases"] for r in busy)
            # the batch really was that large, and verifies happened beside drafts
            assert max(len(r["requests"]) for r in busy) >= bs - 1
            assert any({"draft", "verify"} <= {q["role"] for q in r["requests"]} for r in busy)
            if backend == "triton":  # the GPU's path uploads only by pinned, non-blocking copies
                assert not [r["phases"]["host_sync_sites"] for r in busy if r["phases"].get("host_syncs_h2d")]
            for r in busy:
                roles = frozenset(q["role"] for q in r["requests"]) & {"draft", "verify"}
                by_roles.setdefault(roles, {}).setdefault((depth, bs), set()).add(r["phases"]["host_syncs"])
                for site, n in r["phases"]["host_sync_sites"].items():
                    sites.setdefault(roles, {}).setdefault(site, set()).add(n)
    assert frozenset({"draft", "verify"}) in by_roles
    # the committed lengths come from SGLang's host copy (seq_lens_cpu), not a device read
    import inspect

    from sglang_vc import spec_worker

    src, first = inspect.getsourcelines(spec_worker.committed_lens)
    fallback = first + next(i for i, line in enumerate(src) if "seq_lens.to(" in line)
    seen = {site for per in sites.values() for site in per}
    assert seen and not [site for site in seen if site.endswith(f"spec_worker.py:{fallback}")], seen
    # one count per kind of iteration (drafting only, verifying only, both), the same
    # at every depth and batch size: nothing per request, nothing per layer
    for roles, counts in by_roles.items():
        growing = {site: n for site, n in sites.get(roles, {}).items() if len(n) > 1}
        assert len(set.union(*counts.values())) == 1, f"{sorted(roles)} {counts} grows at {growing}"
