"""SPECACHE serving: the server's tokens equal the lab's exact simulation token for token
(float32), the compressed path is taken (payload quantized, rows prefetched, a
pre-decode step), the host store's rows are the full KV bytes for bytes, and the
fallbacks (host store full, failed or late prefetch) keep requests going."""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests
import torch

from sglang_vc.specache.core import Rows
from sglang_vc.specache.host import HostKVStore, Prefetcher
from sglang_vc.testing.server import ServerProcess

from conftest import real_text_passages

HOST_GB = 0.03  # holds the full KV of the ~500-token prompt's quantized rows, not the ~1100-token one's


@pytest.fixture(scope="module")
def sc(tmp_path_factory):
    folder = tmp_path_factory.mktemp("specache")
    proc = ServerProcess(["--dtype", "float32", "--max-total-tokens", "12000", "--enable-metrics",
                          "--speculative-algorithm", "SPECACHE", "--specache-kv-bits", "1",
                          "--specache-host-kv-gb", str(HOST_GB)], log_path=folder / "server.log")
    yield proc
    proc.stop()


def _counters(proc) -> dict:
    return requests.get(proc.url + "/get_server_info").json()["sglang_vc"]["counters"]


def _generate(proc, ids, n, **sampling):
    r = requests.post(proc.url + "/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **sampling}})
    return r


_sessions: dict = {}


def _lab(model_dir, ids, n, config):
    from sglang_vc.bench.lossy_hf import Session, cache_kv, load_model
    from sglang_vc.bench.specache_hf import SpeCacheSim, decode

    if model_dir not in _sessions:
        _sessions[model_dir] = Session(load_model(model_dir, "float32"))
    sess = _sessions[model_dir]
    cache, logits, _, _ = sess.prefill(ids)
    y0 = int(logits.argmax())
    if config is None:  # full KV greedy
        out = [y0]
        for _ in range(n - 1):
            out.append(int(sess.step(cache, out[-1]).argmax()))
        return out
    run = decode(sess, cache, SpeCacheSim.from_prompt(config, cache_kv(cache)), len(ids), y0, n - 1)
    return [y0] + run.argmax


def test_serving_matches_the_lab_simulation_token_for_token(sc, model_dir, tokenizer):
    """A ~500-token prompt at 1 bit, top-64, residual 64: the server's greedy tokens are
    the HF simulation's, and the counters show the compressed path: the prompt's payload
    quantized and its slots freed, a pre-decode step, rows prefetched each step."""
    from sglang_vc.specache.config import SpeCacheConfig

    ids = tokenizer(" ".join(real_text_passages(6, words=120)))["input_ids"][:500]
    before = _counters(sc)
    out = _generate(sc, ids, 16).json()
    after = _counters(sc)
    assert out["output_ids"] == _lab(model_dir, ids, 16, SpeCacheConfig(bits=1))
    assert out["meta_info"]["sglang_vc_specache"][0]["steps"] == 15
    delta = {k: after["specache"].get(k, 0) - before.get("specache", {}).get(k, 0) for k in after["specache"]}
    assert delta["predecode_steps"] == 1 and delta["steps"] == 15
    assert delta["rows_prefetched"] == 15 * 30 * 3 * 64  # steps x layers x kv heads x top-k
    assert 0 < delta["prefetch_hit_mass"] <= delta["prefetch_topk_mass"]
    assert after["compression"]["slots_freed"] - before.get("compression", {}).get("slots_freed", 0) >= 400


def test_host_store_full_serves_full_kv(sc, model_dir, tokenizer):
    """A prompt whose quantized rows do not fit the host store keeps its full KV on the
    device: its tokens are full-KV greedy decoding's, and the refusal is counted."""
    ids = tokenizer(" ".join(real_text_passages(12, words=120)))["input_ids"][:1100]
    before = _counters(sc).get("specache", {}).get("host_store_full", 0)
    out = _generate(sc, ids, 8).json()
    assert _counters(sc)["specache"]["host_store_full"] == before + 1
    assert out["output_ids"] == _lab(model_dir, ids, 8, None)


def test_unsupported_sampling_is_refused(sc):
    r = _generate(sc, [1, 2, 3], 4, regex="a+")
    assert r.status_code == 400 and "SPECACHE" in r.text and "regex" in r.text


@pytest.mark.parametrize("argv, message", [
    (["--specache-topk", "16"], "need --speculative-algorithm SPECACHE"),
    (["--speculative-algorithm", "SPECACHE", "--specache-residual", "-1"], "residual must be an integer >= 0"),
    (["--vc-compressor", "specache", "--vc-kv-bits", "1"], "needs --speculative-algorithm VERICACHE"),
    (["--speculative-algorithm", "VERICACHE", "--vc-compressor", "specache", "--vc-kv-bits", "4"],
     "--vc-kv-bits"),
    (["--speculative-algorithm", "VERICACHE", "--vc-compressor", "specache", "--vc-kv-bits", "1",
      "--specache-fetch", "speculative"], "--specache-fetch: not used by VERICACHE's SpeCache drafter"),
    (["--speculative-algorithm", "VERICACHE", "--vc-compressor", "snapkv", "--vc-compression-ratio", "0.5",
      "--specache-topk", "8"], "with --vc-compressor specache"),
], ids=["no-algorithm", "bad-residual", "drafter-without-vericache", "drafter-bits", "drafter-fetch",
        "topk-without-drafter"])
def test_flags_are_refused_without_the_algorithm_or_with_other_widths(argv, message, capsys):
    """The launcher's parsing, in process (``main`` runs it first; exit 2, a usage line)."""
    from sglang_vc.launch_server import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- host + prefetch


def _store():
    host = HostKVStore(capacity=None, pin=False)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(96, 3, 8, generator=g), torch.randn(96, 3, 8, generator=g)
    assert host.admit("r", 0)
    assert host.append("r", 5, 0, k[:64], v[:64]) and host.append("r", 5, 64, k[64:], v[64:])
    assert not host.append("r", 5, 10, k[:4], v[:4]), "rows must continue the copy"
    return host, k, v


def test_prefetched_rows_are_the_host_copy_bytes():
    host, k, v = _store()
    pos = torch.tensor([[0, 70, 95], [3, 4, 5], [90, 1, 64]])
    rows = Prefetcher(host, "cpu").fetch("r", 5, pos, "cpu")
    for h in range(3):
        for j, p in enumerate(pos[h].tolist()):
            assert torch.equal(rows.k[j, h], k[p, h]) and torch.equal(rows.v[j, h], v[p, h])


def test_failed_prefetch_falls_back_to_a_synchronous_fetch(monkeypatch):
    from sglang_vc import stats

    host, k, v = _store()
    seen = []
    monkeypatch.setattr(stats, "add", lambda mech, **kw: seen.append(kw))

    def broken(*args):
        raise OSError("copy failed")

    pre = Prefetcher(host, "cpu", fetch=broken)
    pos = torch.tensor([[1], [2], [3]])
    pre.start("r", 5, pos)
    rows = pre.take("r", 5)
    assert isinstance(rows, Rows) and torch.equal(rows.k[0, 1], k[2, 1])
    assert {"sync_fetches": 1} in seen
    # the host copy itself gone too: the layer attends over the low-bit copy, counted
    pre.start("r", 5, pos)
    host.drop("r")
    assert pre.take("r", 5) is None and {"fetch_failures": 1} in seen
    assert pre.take("r", 6) is None, "nothing started for that layer"


def test_late_prefetch_is_waited_for_and_counted(monkeypatch):
    import threading

    from sglang_vc import stats

    host, k, v = _store()
    seen = []
    gate = threading.Event()

    def add(mech, **kw):
        seen.append(kw)
        if "prefetch_stalls" in kw:
            gate.set()  # the copy lands only once take() has found it not done: no timing

    monkeypatch.setattr(stats, "add", add)

    def slow(*args):
        gate.wait(10)
        return host.gather(*args)

    pre = Prefetcher(host, "cpu", fetch=slow)
    pre.start("r", 5, torch.tensor([[7], [8], [9]]))
    rows = pre.take("r", 5)
    assert torch.equal(rows.v[0, 2], v[9, 2]) and {"prefetch_stalls": 1} in seen


def test_prefetch_copies_on_its_own_stream_and_the_step_waits():
    """On an accelerator a prefetch copies on the copy stream, after the step that picked
    its rows (the copy stream waits on an event recorded on the compute stream), and the
    step that reads the rows waits on the copy's event first; the rows are
    ``record_stream``ed on the reading stream."""
    from sglang_vc.kvruntime import CopyStream
    from sglang_vc.testing.streams import StandInStreams

    host, k, v = _store()
    fake = StandInStreams()
    stream = CopyStream("cpu", module=fake)
    kept = []
    stream.keep_alive = lambda t, s: kept.append(t)
    copied_on = []

    def fetch(*args):
        copied_on.append(fake.inside())
        return host.gather(*args)

    pre = Prefetcher(host, "cpu", fetch=fetch, copy_stream=stream)
    pos = torch.tensor([[7], [8], [9]])
    pre.start("r", 5, pos)
    rows = pre.take("r", 5)
    assert copied_on == ["copy"]
    kinds = [kind for kind, _ in fake.log]
    assert kinds == ["record", "copy-wait", "record", "wait"], fake.log
    (_, mark), (_, waited_by_copy), (_, done), (_, waited_by_step) = fake.log
    assert mark.stream == "compute" and waited_by_copy is mark  # the copy follows the top-k
    assert done.stream == "copy" and waited_by_step is done  # the step follows the copy
    assert any(t is rows.k for t in kept) and any(t is rows.v for t in kept)
    assert torch.equal(rows.v[0, 2], v[9, 2])


def test_per_request_settings(sc, model_dir, tokenizer):
    """A request may take the other bit width and its own top-k (served as the lab
    simulates that configuration), or opt out (full-KV tokens); any other compression,
    or a bad top-k, is refused with HTTP 400."""
    from sglang_vc.specache.config import SpeCacheConfig

    ids = tokenizer(" ".join(real_text_passages(6, words=120)))["input_ids"][:300]
    mine = {"vc_compressor": "kivi", "vc_kv_bits": 2, "specache_topk": 16}
    out = _generate(sc, ids, 8, custom_params=mine).json()
    assert out["output_ids"] == _lab(model_dir, ids, 8, SpeCacheConfig(bits=2, topk=16))
    info = out["meta_info"]["sglang_vc_specache"][0]
    assert info["topk"] == 16 and info["kv_bits"] == 2
    out = _generate(sc, ids, 6, custom_params={"vc_compressor": "none"})
    assert out.status_code == 200 and out.json()["output_ids"] == _lab(model_dir, ids, 6, None)
    for bad in ({"vc_compressor": "snapkv", "vc_compression_ratio": 0.5}, {"vc_compressor": "kivi"},
                {"vc_compressor": "kivi", "vc_kv_bits": 4}, {"specache_topk": -2}):
        r = _generate(sc, [1, 2, 3], 4, custom_params=bad)
        assert r.status_code == 400, bad


def test_host_store_reserves_prompts_at_admission():
    host = HostKVStore(capacity=1000, pin=False)
    assert host.admit("a", 600) and not host.admit("b", 600), "b does not fit beside a's reservation"
    k = torch.zeros(10, 1, 5)  # 400 bytes with v
    assert host.append("a", 0, 0, k, k) and host.used == 600, "within a's reservation"
    assert host.append("a", 0, 10, torch.zeros(20, 1, 5), torch.zeros(20, 1, 5))  # decode tail: not refused
    assert host.used == 400 + 800 and not host.append("c", 0, 0, k, k)
    host.drop("a")
    assert host.used == 0 and host.admit("b", 600)
