"""Lossless tiering inside one server (``VERICACHE_REMOTE --vc-remote-path tiering``): a
context whose full KV is only in this server's storage and whose compressed copy it
loaded drafts from that copy while the full copy loads, then verifies the drafts
against it; the output is the full-KV server's, token for token.

The reference server computes the context (its storage copies go to the store) and
answers every prompt with full KV. The tiering server loads the KIVI 4-bit copy over an
emulated slow link (the full copy takes about 9 s on it; the 16 draft forwards of two
requests took 2.8 s here, so the drafts are all made before the copy arrives), answers a batch that mixes requests on the context with one that has
no stored prefix, and commits tokens verified at the prefill in rounds with no forward.
Its verify forwards each request's tokens in pieces (small here, so that several run).
"""

from __future__ import annotations

import threading

import pytest
import requests

import sglang_vc.testing.evicpress as epx
from sglang_vc.testing.server import ServerProcess

from test_vericache_remote import CTX, _common

N_NEW = 24
DRAFTS = 16


def test_a_request_drafts_from_the_compressed_copy_while_the_full_copy_loads_and_stays_exact(tmp_path, tokenizer):
    from conftest import real_text_passages

    store = tmp_path / "store"
    passages = real_text_passages(6, words=500)
    ctx_ids = tokenizer(passages[0])["input_ids"][:CTX]
    questions = ["\n\nQuestion: What is this text about?\nAnswer:", "\n\nSummarize the text above in one line:"]
    prompts = [ctx_ids + tokenizer(q, add_special_tokens=False)["input_ids"] for q in questions]
    prompts.append(tokenizer(passages[3][:300])["input_ids"])  # no stored prefix: exact
    doc2 = tokenizer(passages[1])["input_ids"][:CTX]
    last_q = tokenizer("\n\nThe most important word in this text is", add_special_tokens=False)["input_ids"]
    alone, later = doc2 + last_q, ctx_ids + last_q

    ref_server = ServerProcess(_common(store), log_path=tmp_path / "reference.log", timeout=420)
    try:
        for name, ids in (("doc", ctx_ids), ("doc2", doc2)):
            epx.api(ref_server, "POST", "/evicpress/contexts", {"id": name, "token_ids": ids})
            ref_server.generate(input_ids=ids + [13], max_new_tokens=1)  # computes it: copies go to the store
        ref = [ref_server.generate(input_ids=p, max_new_tokens=N_NEW) for p in prompts + [alone, later]]
    finally:
        ref_server.stop()

    args = _common(store) + [
        "--speculative-algorithm", "VERICACHE_REMOTE", "--speculative-num-draft-tokens", "4",
        "--vc-remote-path", "tiering", "--vc-tiering-drafts", str(DRAFTS),
        "--vc-storage-read-gbps", "0.002",  # emulated, GB/s: 18.4 MB of full copy, about 9 s
        "--evicpress-load-copy", "kivi@4b", "--evicpress-storage-copies", "none"]
    # each verify in pieces of 4 tokens before its tail (the default is 512)
    with ServerProcess(args, log_path=tmp_path / "tiering.log", timeout=420,
                       env={"SGLANG_VC_TIERING_VERIFY_PIECE": "4"}) as server:
        for name, ids in (("doc", ctx_ids), ("doc2", doc2)):
            epx.api(server, "POST", "/evicpress/contexts", {"id": name, "token_ids": ids})
        outs: dict[int, dict] = {}

        def ask(i):
            outs[i] = requests.post(server.url + "/generate", json={"input_ids": prompts[i], "sampling_params": {
                "temperature": 0, "max_new_tokens": N_NEW}}, timeout=300).json()

        threads = [threading.Thread(target=ask, args=(i,)) for i in (2, 0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(3):
            assert outs[i]["output_ids"] == ref[i]["output_ids"], (i, outs[i], ref[i]["output_ids"])
            assert outs[i]["meta_info"]["finish_reason"] == ref[i]["meta_info"]["finish_reason"], i
        counters = server.server_info()["sglang_vc"]["counters"]
        rv, ep = counters["vericache_remote"], counters["evicpress"]
        # the 4-bit copy first (what the drafts read), then the full copy, once
        assert ep["storage_copies_read"] == 1 and ep["bytes_read_storage_copies"] > 0.9 * CTX * 46080, ep
        assert 0 < ep["bytes_loaded_disk"] < 0.4 * CTX * 46080, ep
        assert rv["full_copies_streamed"] == 1 and rv["full_copies_installed"] == 1, rv
        # the requests on the context matched before the install drafted (how many: up to
        # the scheduler; one matched after it is exact from the start)
        n = rv["tiering_requests"]
        assert 1 <= n <= 2 and rv["tiering_drafted"] == n * DRAFTS, rv  # all made while the copy loaded
        assert 0 < rv["held_tokens_committed"] == rv["tiering_accepted"] <= rv["tiering_drafted"], rv
        assert not rv.get("verify_rounds"), rv  # no verifier elsewhere
        metas = [m[0] for i in range(2) if (m := outs[i]["meta_info"].get("sglang_vc_vericache")) and m[0]]
        assert len(metas) == n and all(m["path"] == "TIERING" and m["drafted"] == DRAFTS for m in metas), metas

        # alone on another context whose 4-bit copy EvicPress placed on the host tier (its
        # full KV only in storage): its verified drafts are committed in rounds that run
        # no forward at all
        placed = epx.api(server, "POST", "/evicpress/contexts/doc2/placement", {"tier": "host", "config": "kivi@4b"})
        assert placed["ok"] and placed["placement"]["tier"] == "host" and placed["placement"]["config"] == "kivi@4b", placed
        got = server.generate(input_ids=alone, max_new_tokens=N_NEW)
        assert got["output_ids"] == ref[3]["output_ids"] and \
            got["meta_info"]["finish_reason"] == ref[3]["meta_info"]["finish_reason"]
        rv2 = server.server_info()["sglang_vc"]["counters"]["vericache_remote"]
        meta = got["meta_info"]["sglang_vc_vericache"][0]
        assert meta["path"] == "TIERING" and meta["drafted"] == DRAFTS and meta["accepted"] >= 1, meta
        assert rv2["tiering_requests"] == n + 1 and rv2["full_copies_installed"] == 2, rv2
        assert rv2["rounds_without_forward"] >= 1, rv2
        ep2 = server.server_info()["sglang_vc"]["counters"]["evicpress"]
        assert ep2["hits_host"] == 1 and ep2["storage_copies_read"] == 2, ep2  # the 4-bit copy from the host
        # the compressed path was taken: some drafts were rejected
        assert rv2["tiering_accepted"] < rv2["tiering_drafted"], rv2

        # the first context is exact on the device now: a new request on it drafts nothing
        got = server.generate(input_ids=later, max_new_tokens=N_NEW)
        assert got["output_ids"] == ref[4]["output_ids"] and \
            got["meta_info"]["finish_reason"] == ref[4]["meta_info"]["finish_reason"]
        after = server.server_info()["sglang_vc"]["counters"]["vericache_remote"]
        assert after["tiering_requests"] == n + 1 and after["full_copies_streamed"] == 2, after


def test_tiering_takes_no_verifier_and_refuses_negative_drafts(model_dir, capsys):
    from sglang_vc.config import ConfigError
    from sglang_vc.launch_server import parse_args
    from sglang_vc.vericache.remote import spec as remote_spec

    base = ["--speculative-algorithm", "VERICACHE_REMOTE", "--radix-cache-backend", "evicpress",
            "--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--evicpress-load-copy", "kivi@4b"]
    _, sa = parse_args(base + ["--vc-remote-path", "tiering"])
    remote_spec.validate_server_args(sa)  # no --vc-remote-verifier needed
    _, sa = parse_args(base + ["--vc-remote-path", "tiering", "--vc-remote-verifier", "http://h:1"])
    with pytest.raises(ConfigError, match="drop --vc-remote-verifier"):
        remote_spec.validate_server_args(sa)
    with pytest.raises(SystemExit) as exc:
        parse_args(base + ["--vc-remote-path", "tiering", "--vc-tiering-drafts", "-1"])
    assert exc.value.code == 2 and "--vc-tiering-drafts" in capsys.readouterr().err


def test_a_chain_verify_forward_is_a_causal_extend_after_each_prefix():
    """vc_chain's view of a ragged TARGET_VERIFY batch: prefix = each request's committed
    length, extend = its verify tokens, the sequence = both (what torch_native extends)."""
    from types import SimpleNamespace

    import torch

    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_vc.vericache.chain_attention import extend_view, verify_lens

    layout = SimpleNamespace(verify_lens_cpu=[5, 1, 3])
    fb = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, seq_lens=torch.tensor([400, 12, 7]),
                         seq_lens_cpu=torch.tensor([400, 12, 7]),
                         spec_info=SimpleNamespace(ragged_verify_layout=layout, draft_token_num=5))
    view = extend_view(fb)
    assert view.forward_mode == ForwardMode.EXTEND and view.spec_info is None
    assert view.extend_prefix_lens_cpu == [400, 12, 7] and view.extend_seq_lens_cpu == [5, 1, 3]
    assert view.seq_lens.tolist() == [405, 13, 10] and view.extend_prefix_lens.tolist() == [400, 12, 7]
    assert fb.forward_mode == ForwardMode.TARGET_VERIFY and fb.seq_lens.tolist() == [400, 12, 7]  # a copy
    # a uniform chain (no ragged layout): every request forwards the draft width
    assert verify_lens(SimpleNamespace(draft_token_num=4), 2) == [4, 4]


def test_held_tokens_are_committed_x_a_round_with_their_kv_moved_in():
    """Tiering.drain: a request holding 5 verified tokens commits 4 (X) in the first round
    and 1 in the next, each token's predecessor KV moved from its scratch slot into the
    round's slot, and the scratch slots freed once drained; a holder not where it was left
    commits nothing and its slots are freed; a request holding nothing is left alone."""
    from types import SimpleNamespace

    import torch

    from sglang_vc.vericache.remote.tiering import Held, Tiering

    moves, freed = [], []
    pool = SimpleNamespace(move_kv_cache=lambda dst, src: moves.append((dst.tolist(), src.tolist())))
    alloc = SimpleNamespace(get_kvcache=lambda: pool, free=lambda s: freed.append(s.tolist()))
    t = Tiering(SimpleNamespace(token_to_kv_pool_allocator=alloc, device="cpu"), lambda: None, 8)
    t.held["a"] = Held(100, [11, 12, 13, 14, 15], torch.tensor([50, 51, 52, 53, 54]))
    t.held["stale"] = Held(100, [7, 8], torch.tensor([60, 61]))
    batch = SimpleNamespace(reqs=[SimpleNamespace(rid="a"), SimpleNamespace(rid="b"), SimpleNamespace(rid="stale")])
    x = 4
    slots = torch.tensor([[200, 201, 202, 203], [300, 301, 302, 303], [400, 401, 402, 403]])
    tokens, lens = torch.zeros(3, x + 1, dtype=torch.int64), torch.full((3,), x, dtype=torch.int64)
    assert t.drain(batch, torch.tensor([100, 37, 90]), slots, tokens, lens, x) == 1
    assert tokens[0, :4].tolist() == [11, 12, 13, 14] and lens.tolist() == [4, 4, 0]
    assert moves == [([200, 201, 202, 203], [50, 51, 52, 53])] and freed == [[60, 61]]
    assert t.holding("a") and not t.holding("stale")
    slots2 = torch.tensor([[210, 211, 212, 213], [310, 311, 312, 313], [410, 411, 412, 413]])
    tokens, lens = torch.zeros(3, x + 1, dtype=torch.int64), torch.full((3,), x, dtype=torch.int64)
    assert t.drain(batch, torch.tensor([104, 41, 90]), slots2, tokens, lens, x) == 1
    assert tokens[0, 0] == 15 and lens[0] == 1 and moves[-1] == ([210], [54])
    assert freed[-1] == [50, 51, 52, 53, 54] and not t.holding("a")
