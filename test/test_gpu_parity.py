"""``bench.gpu_parity``: the GPU parity prediction reads its terms from the code and gives
plain SGLang's throughput exactly where VERICACHE would cost nothing."""

from __future__ import annotations

import json

import pytest

from sglang_vc.bench import gpu_parity as gp

KW = dict(contexts=[8192, 32768], batch=32, mem_fraction=0.88, host_ms=5.0, link_gb_s=50.0)


def test_terms_are_the_codes():
    from sglang_vc.vericache.decode_graphs import MAX_VERIFY_GRAPH_WIDTH

    terms = gp.code_terms()
    assert terms["pool_share"] == 1.0  # payloads and reloads take pool slots when a request is compressed
    assert terms["overlap"] is True  # VERICACHE keeps SGLang's overlap scheduler (test_vericache_overlap.py)
    assert terms["grammar_overlap"] is True  # and SGLang does not sync its grammar batches
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


def _trace(path, reads: int, launches: list[int]):
    """Overlapped iterations of batches 1, 2, 3.. whose host time is 1 ms + 1 ms a request."""
    site = {"to sglang_vc/vericache/x.py:1": reads} if reads else {}
    lines = [{"requests": [{}] * (b + 1), "phases": {"overlapped": True, "launches_outside_forward": n,
                                                   "host_s": (2 + b) / 1e3,
                                                   "host_sync_sites": {"tolist sglang/srt/managers/y.py:9": 2, **site}}}
             for b, n in enumerate(launches)]
    lines.append({"requests": 4, "phases": {"host_syncs": 7}})  # a synchronous iteration: not read
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return path


def test_a_traces_launches_are_hidden_under_the_step_and_a_device_read_loses_the_overlap(tmp_path):
    """From a server's trace: the worker's launches around SGLang's forward are host work
    the device step hides while no device value is read at the project's code; past the
    step, or once a read makes the iteration wait, it is added to the iteration."""
    code = {"pool_share": 1.0, "overlap": True, "verify_graph_widths": [2]}
    clean = gp.trace_terms(_trace(tmp_path / "a.jsonl", 0, [30, 40, 50]))
    assert clean == {"overlapped_iterations": 3, "batch_sizes": [1, 2, 3], "device_reads_per_iteration": 0,
                     "launches_outside_forward": 40, "worker_host_ms_fixed": 1.0, "worker_host_ms_per_request": 1.0}
    rows = gp.predict({**code, **clean}, **KW, launch_us=5.0)
    # at 8k 32 resident: 1 + 32 ms + 40 launches of 5 us, past the 15 ms step; at 32k 12: 13.2 ms, under it
    assert rows[0].host_ms == pytest.approx(33.2) and rows[0].host_exposed_ms == pytest.approx(33.2 - 15.0, abs=0.1)
    assert rows[0].nothing_drafts < 1
    assert rows[1].host_ms == pytest.approx(13.2) and rows[1].host_exposed_ms == 0 and rows[1].nothing_drafts == 1
    slow = gp.predict({**code, **clean}, **KW, launch_us=1e6)  # 40 s of launches: past any step
    assert all(r.host_exposed_ms > 0 and r.nothing_drafts < 1 for r in slow)
    read = gp.trace_terms(_trace(tmp_path / "b.jsonl", 1, [40]))
    assert read["device_reads_per_iteration"] == 1
    rows = gp.predict({**code, **read}, **KW, launch_us=5.0)
    assert all(r.host_exposed_ms == r.host_ms > 0 and r.nothing_drafts < 1 for r in rows)


def test_a_trace_without_sync_sites_is_a_usage_error(tmp_path, capsys):
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"requests": [{}], "phases": {"overlapped": True}}))
    with pytest.raises(SystemExit, match="SGLANG_VC_COUNT_SYNCS=sites"):
        gp.main(["--json", str(tmp_path / "o.json"), "--trace", str(bare)])
    with pytest.raises(SystemExit) as exc:
        gp.main(["--json", str(tmp_path / "o.json"), "--trace", str(tmp_path / "missing.jsonl")])
    assert exc.value.code == 2 and "no such file" in capsys.readouterr().err
