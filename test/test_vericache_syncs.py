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
"""

from __future__ import annotations

import json

import pytest

from conftest import real_text_passages
from sglang_vc.testing.client import concurrently, generate
from sglang_vc.testing.server import ServerProcess

KIVI = {"vc_compressor": "kivi", "vc_kv_bits": 2}
SPECACHE = {"vc_compressor": "specache", "vc_kv_bits": 2}


def _iterations(depth: int, tokenizer, tmp_path) -> dict[int, list[dict]]:
    trace = tmp_path / f"trace{depth}.jsonl"
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    server = ServerProcess(
        ["--dtype", "float32", "--max-total-tokens", "12000", "--speculative-algorithm", "VERICACHE",
         "--vc-compress-when", "always",
         "--speculative-num-draft-tokens", "4", "--vc-compressor", "snapkv", "--vc-compression-ratio", "0.25",
         "--vc-schedule-trace", str(trace), "--json-model-override-args", json.dumps({"num_hidden_layers": depth}),
         "--skip-server-warmup"],
        log_path=tmp_path / f"server{depth}.log", env={"SGLANG_VC_COUNT_SYNCS": "1"})
    out = {}
    try:
        for bs in (2, 8):
            seen = len(trace.read_text().splitlines()) if trace.exists() else 0
            jobs = [(stream[i * 300 : i * 300 + 240], (SPECACHE, KIVI, None)[i % 3]) for i in range(bs)]
            concurrently(lambda ids, custom: generate(server, ids, 12, custom), jobs)
            out[bs] = [json.loads(line) for line in trace.read_text().splitlines()[seen:]]
        # the default drafter really drafted: SpeCache fetched its top-k rows
        counters = server.server_info()["sglang_vc"]["counters"]["vericache"]
        assert counters.get("specache_rows_fetched", 0) > 0, counters
    finally:
        server.stop()
    return out


def test_host_syncs_per_iteration_do_not_grow_with_batch_or_depth(tokenizer, tmp_path):
    by_roles: dict[frozenset, dict] = {}  # the roles in an iteration -> (depth, bs) -> counts
    for depth in (2, 4):
        for bs, records in _iterations(depth, tokenizer, tmp_path).items():
            busy = [r for r in records if r["requests"]]
            assert busy and all("host_syncs" in r["phases"] for r in busy)
            # the batch really was that large, and verifies happened beside drafts
            assert max(len(r["requests"]) for r in busy) >= bs - 1
            assert any({"draft", "verify"} <= {q["role"] for q in r["requests"]} for r in busy)
            for r in busy:
                roles = frozenset(q["role"] for q in r["requests"]) & {"draft", "verify"}
                by_roles.setdefault(roles, {}).setdefault((depth, bs), set()).add(r["phases"]["host_syncs"])
    assert frozenset({"draft", "verify"}) in by_roles
    # one count per kind of iteration (drafting only, verifying only, both), the same
    # at every depth and batch size: nothing per request, nothing per layer
    for roles, counts in by_roles.items():
        assert len(set.union(*counts.values())) == 1, (sorted(roles), counts)
