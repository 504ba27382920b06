"""The fidelity lab's SpeCache simulation (sglang_vc.bench.specache_hf) on the embedded
model cut to 4 layers: exact when every row is prefetched, lossy and better than 1-bit
KIVI when not, the decode tail quantized as the server does, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from sglang_vc.bench import fidelity_run
from sglang_vc.bench.lossy_hf import Session, build_cache, cache_kv, load_model
from sglang_vc.bench.specache_hf import SpeCacheSim, decode, evaluate
from sglang_vc.specache.config import SpeCacheConfig

from test_fidelity import items, tiny_dir  # noqa: F401  (module fixtures)


@pytest.fixture(scope="module")
def sess(tiny_dir):  # noqa: F811
    return Session(load_model(tiny_dir))


@pytest.fixture(scope="module")
def traj(sess, tiny_dir, items):  # noqa: F811
    """Prompt KV, greedy full-KV trajectory and its log-probs for the needle item."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = fidelity_run.encode(tok, items["needle"]["prompt"], chat=True)
    sess.activate(None)
    cache, logits, _, _ = sess.prefill(ids)
    base = cache_kv(cache)
    y, lps = [int(logits.argmax())], [torch.log_softmax(logits.double(), -1)]
    for _ in range(12):
        logits = sess.step(cache, y[-1])
        lps.append(torch.log_softmax(logits.double(), -1))
        y.append(int(logits.argmax()))
    return tok, ids, base, y, lps


def _kl(lp_full, logits):
    lp = torch.log_softmax(logits.double(), -1)
    return float((lp_full.exp() * (lp_full - lp)).sum())


def test_every_row_prefetched_is_full_kv(sess, traj):
    """top-k >= the quantized rows: eq. 1 puts every row back in full precision, so each
    output token's distribution is the full-KV one (no tail group is quantized within
    these steps)."""
    tok, ids, base, y, lps = traj
    T = len(ids)
    cfg = SpeCacheConfig(bits=1, topk=4096, residual=64, group_size=32)
    sim = SpeCacheSim.from_prompt(cfg, base)
    assert sim.num_quantized == cfg.quantized_len(T) > 0
    run = decode(sess, build_cache(base, T), sim, T, y[0], 8, forced=y)
    for t in range(1, 9):
        assert _kl(lps[t], run.row0_logits[t - 1]) < 1e-8
        assert run.argmax[t - 1] == y[t]
    assert run.num_quantized == sim.num_quantized, "no tail group was due in 8 steps"
    assert run.counters.hit_rate == pytest.approx(1.0)


def test_specache_takes_the_compressed_path_and_beats_one_bit_kivi(sess, traj):
    """At top-64 of a ~200-token prompt the output token reads half the quantized rows
    in 1 bit: its distribution moves (KL > 0, so it did not read the full KV), by far less
    than plain 1-bit KIVI's at a larger residual."""
    tok, ids, base, y, lps = traj
    T = len(ids)
    kls = {}
    for cfg in (SpeCacheConfig(bits=1), SpeCacheConfig(bits=1, topk=0, residual=128)):
        sim = SpeCacheSim.from_prompt(cfg, base)
        run = decode(sess, build_cache(base, T), sim, T, y[0], 8, forced=y)
        kls[cfg.label] = sum(_kl(lps[t], run.row0_logits[t - 1]) for t in range(1, 9))
        if cfg.topk:
            assert run.counters.rows_prefetched > 0 and 0 < run.counters.hit_rate <= 1
    assert kls["specache@1b"] > 1e-6
    assert kls["specache@1b"] < kls["kivi1@1b/r128"]


def test_tail_is_quantized_group_by_group_as_the_server_does(traj):
    tok, ids, base, y, lps = traj
    T = len(ids)
    cfg = SpeCacheConfig(bits=2, topk=8, residual=16, group_size=32)
    sim = SpeCacheSim.from_prompt(cfg, base)
    n_q = sim.num_quantized
    assert n_q == (T - 16) // 32 * 32
    longer = [(torch.cat([k, k], 2), torch.cat([v, v], 2)) for k, v in base]  # positions past T
    sim.stream(longer, n_q + 16 + 31)
    assert sim.num_quantized == n_q, "tail of residual + group - 1: nothing due"
    sim.stream(longer, n_q + 48)
    assert sim.num_quantized == n_q + 32 and sim.kq[0].shape[0] == n_q + 32
    group = [(k[0, :, n_q : n_q + 32].transpose(0, 1), v[0, :, n_q : n_q + 32].transpose(0, 1)) for k, v in longer]
    q = cfg.quantizer(residual=0)
    want_k, _ = q.dequantize(q.compress(0, *group[0], 2))
    assert torch.equal(sim.kq[0][n_q:], want_k)


def test_evaluate_reports_the_labs_fields(sess, traj, items):  # noqa: F811
    tok, ids, base, y, lps = traj
    r = evaluate(sess, tok, SpeCacheConfig(bits=1, topk=16), base, len(ids), y, lps, 8, [2, 4], [],
                 needle_item={"needle": {"value": "48213"}})
    for key in ("compressor", "cumulative_kl", "first_divergence", "acceptance_length", "needle_found",
                "device_kv_fraction", "prefetch_hit", "rows_prefetched"):
        assert key in r
    assert r["compressor"] == "specache@1b/k16" and len(r["kl"]) == 8
    assert set(r["acceptance_length"]) == {"2", "4"}
    assert 1.0 <= r["acceptance_length"]["2"] <= 3.0
    assert 0 < r["device_kv_fraction"] < 1


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sglang_vc.bench.fidelity", *args],
                          capture_output=True, text=True, timeout=600)


def test_cli_refuses_bad_specache_variants(tmp_path):
    p = _cli("--input", str(tmp_path / "x.txt"), "--compressors", "none")
    assert p.returncode == 2 and "--compressors none needs --specache" in p.stderr
    p = _cli("--input", str(tmp_path / "x.txt"), "--specache", "3b")
    assert p.returncode == 2 and "--specache" in p.stderr and "bits" in p.stderr


def test_cli_writes_specache_rows(tmp_path, tiny_dir, items):  # noqa: F811
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps(items["needle"]) + "\n")
    out = tmp_path / "f.json"
    p = _cli("--model", tiny_dir, "--input", str(src), "--compressors", "none", "--specache", "1b,1b/k0/r128",
             "--max-new-tokens", "4", "--draft-lengths", "2", "--json", str(out), "--no-plot")
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [r["compressor"] for r in doc["results"]] == ["specache@1b", "kivi1@1b/r128"]
    assert doc["settings"]["specache"] == ["specache@1b", "kivi1@1b/r128"]
    assert all(len(r["cumulative_kl"]) == 4 for r in doc["results"])
