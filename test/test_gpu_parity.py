"""``bench.gpu_parity``: the GPU parity prediction reads its terms from the code and gives
plain SGLang's throughput exactly where VERICACHE would cost nothing."""

from __future__ import annotations

import json

from sglang_vc.bench import gpu_parity as gp

KW = dict(contexts=[8192, 32768], batch=32, mem_fraction=0.88, host_ms=5.0, link_gb_s=50.0)


def test_terms_are_the_codes():
    from sglang_vc.vericache.decode_graphs import MAX_VERIFY_GRAPH_WIDTH

    terms = gp.code_terms()
    assert terms["pool_share"] == 1.0  # payloads and reloads take pool slots when a request is compressed
    assert terms["overlap"] is True  # VERICACHE keeps SGLang's overlap scheduler (test_vericache_overlap.py)
    assert terms["verify_graph_widths"] == list(range(2, MAX_VERIFY_GRAPH_WIDTH + 1))


def test_parity_where_nothing_is_reserved_and_overlap_stays_on():
    parity = {"pool_share": 1.0, "overlap": True, "verify_graph_widths": [2]}
    for row in gp.predict(parity, **KW):
        assert row.nothing_drafts == 1.0 and row.vc_batch == row.plain_batch
    # each term alone costs: the pool at 32k (fewer resident requests), the host work at both
    pool_only = gp.predict({**parity, "pool_share": 0.727}, **KW)
    host_only = gp.predict({**parity, "overlap": False}, **KW)
    assert pool_only[1].vc_batch < pool_only[1].plain_batch and pool_only[1].nothing_drafts < 1
    assert all(r.nothing_drafts < 1 for r in host_only)
    # an offload verify reloads the request's whole full KV: 4.29 GB at 32k for 8B shapes
    assert abs(host_only[1].offload_verify_bytes - 32768 * 131072) < 1


def test_cli_writes_json_and_plot(tmp_path):
    out = tmp_path / "parity.json"
    gp.main(["--json", str(out)])
    report = json.loads(out.read_text())
    assert report["label"].startswith("PREDICTION") and len(report["rows"]) == 2
    assert report["old_code_read"]["nothing_drafts"] == 0.76
    assert out.with_suffix(".png").stat().st_size > 0
