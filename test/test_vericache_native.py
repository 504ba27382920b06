"""VERICACHE's in-pool drafts as SGLang's own forwards (:mod:`sglang_vc.vericache.view_rows`).

In process: a forward's views written into rows of SGLang's own ``ReqToTokenPool`` (the
window view's slots, rows given back, a table without free rows leaves drafters on their
full rows). One server: a batch that mixes in-pool drafters, a full-KV request and an
opted-out one, in both orders, gives the plain server's tokens, lengths and finish reasons;
its drafting iterations are SGLang ``DECODE`` forwards over view rows, and no forward
runs the project's attention (counted by the server); drafts were rejected somewhere.
"""

from __future__ import annotations

import pytest
import torch

from conftest import real_text_passages
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang_vc import stats
from sglang_vc.kvruntime.launches import LaunchCounter
from sglang_vc.testing.client import concurrently, generate
from sglang_vc.testing.reference import compare, finish_type, greedy_reference
from sglang_vc.testing.server import ServerProcess
from sglang_vc.vericache import draft_view
from sglang_vc.vericache.view_rows import ViewRows

META = "sglang_vc_vericache"
NEW = 24
BUDGET = 128


def _pool(rows: int, width: int = 64) -> ReqToTokenPool:
    pool = ReqToTokenPool(size=rows, max_context_len=width, device="cpu", enable_memory_saver=False)
    pool.req_to_token.copy_(torch.arange(pool.req_to_token.numel(), dtype=torch.int32).view_as(pool.req_to_token))
    return pool


def test_views_are_written_into_rows_of_sglangs_table_and_given_back():
    """Two drafters (lengths 40 and 10, budget 16): each view row holds its view's slots
    (sinks and the sliding window; the short one its whole row) in its first ``view
    length`` entries, and the rows go back to SGLang's table after the forward."""
    pool = _pool(6)
    own = pool.alloc_rows(2)
    free = pool.available_size()
    views = ViewRows(pool)
    out = views.write({0: 16, 1: 16}, own, [40, 10])
    assert out.lengths == {0: 16, 1: 10} and pool.available_size() == free - 2
    r2t = pool.req_to_token
    slots, valid = draft_view.view_slots(r2t, torch.tensor(own), torch.tensor([40, 10]), torch.tensor([16, 16]), 16)
    for k in (0, 1):
        n = out.lengths[k]
        assert r2t[out.rows[k], :n].tolist() == slots[k, :n].tolist()
    assert r2t[out.rows[0], :4].tolist() == r2t[own[0], :4].tolist()  # the sinks
    assert r2t[out.rows[0], 4:16].tolist() == r2t[own[0], 28:40].tolist()  # the last 12 positions
    assert r2t[out.rows[1], :10].tolist() == r2t[own[1], :10].tolist()  # short: all of it
    with pytest.raises(RuntimeError):
        views.write({0: 16}, own, [40, 10])  # the earlier forward's rows are still held
    views.give_back()
    assert pool.available_size() == free


def test_drafters_without_a_free_row_draft_over_their_full_rows():
    """A table with one free row and two drafters: one gets a view, the other none (it
    drafts over its own full row: a draft is a guess, the output is the verifier's); the
    shortfall is counted."""
    pool = _pool(3)
    own = pool.alloc_rows(2)
    before = stats.snapshot().get("vericache", {}).get("in_pool_view_rows_short", 0)
    views = ViewRows(pool)
    out = views.write({0: 8, 1: 8}, own, [20, 20])
    assert list(out.rows) == [0] and pool.available_size() == 0
    assert stats.snapshot()["vericache"]["in_pool_view_rows_short"] == before + 1
    views.give_back()
    assert pool.available_size() == 1
    assert ViewRows(pool).write({}, own, []) is None


def test_the_shared_view_is_sinks_its_selection_and_recent_rows_in_one_row():
    """The shared view after a verify selected positions 9, 5, 7 (of a 40-token request,
    4 recent rows): its view row holds the sinks, those positions and the last 4
    positions, 11 entries; a request not verified yet gets the window view of its budget;
    a short one all of its row."""
    from sglang_vc.vericache.view_rows import SharedSelections

    pool = _pool(8)
    own = pool.alloc_rows(3)
    sel = SharedSelections()
    sel.score(0, torch.zeros(30).index_fill_(0, torch.tensor([5, 1, 3]), 1.0))  # candidates at positions 4 ..
    sel.select(0, "a", own[0], 4, 3, pool.req_to_token.shape[0])
    views = ViewRows(pool)
    out = views.write({0: 11, 1: 11, 2: 11}, own, [40, 40, 6], (sel, {0: ("a", 4), 1: ("b", 4), 2: ("c", 4)}))
    r2t = pool.req_to_token
    mine = r2t[own[0]].tolist()
    assert out.lengths == {0: 11, 1: 11, 2: 6}
    row = r2t[out.rows[0], :11].tolist()
    assert row[:4] == mine[:4] and sorted(row[4:7]) == [mine[5], mine[7], mine[9]] and row[7:] == mine[36:40]
    other = r2t[own[1]].tolist()
    assert r2t[out.rows[1], :11].tolist() == other[:4] + other[33:40]  # no selection yet: the window
    assert r2t[out.rows[2], :6].tolist() == r2t[own[2], :6].tolist()
    views.give_back()
    sel.forget({"b"})
    assert sel.count("a", own[0]) == 0


@pytest.mark.parametrize("view", ["window", "shared"])
def test_writing_the_views_launches_alike_for_2_and_8_drafters_and_reads_nothing_back(view):
    """The stand-in for CUDA launches and syncs (every aten operator is a kernel on a GPU;
    :class:`~sglang_vc.kvruntime.syncs.SyncCounter` counts host reads): writing a
    forward's views runs the same operators for 2 drafters as for 8, with no per-request
    loop over tensors and nothing read back on the host. The draft forward itself is
    SGLang's decode over those rows, its backend's own launches."""
    from sglang_vc.kvruntime.syncs import SyncCounter
    from sglang_vc.vericache.view_rows import SharedSelections

    counts = {}
    for n in (2, 8):
        pool = _pool(2 * n + 1, width=512)
        own = pool.alloc_rows(n)
        shared = None
        if view == "shared":
            sel = SharedSelections()
            for k in range(n):  # every drafter verified once: a selection of 24 positions
                sel.score(k, torch.arange(300, dtype=torch.float32).flip(0))
                sel.select(k, f"r{k}", own[k], 4, 24, pool.req_to_token.shape[0])
            shared = (sel, {k: (f"r{k}", 36) for k in range(n)})
        views = ViewRows(pool)
        with SyncCounter() as syncs, LaunchCounter() as ops:
            out = views.write({k: 64 for k in range(n)}, own, [400 + 7 * k for k in range(n)], shared)
        views.give_back()
        assert len(out.rows) == n and syncs.total == 0, syncs.by_kind
        counts[n] = ops.total
    assert counts[2] == counts[8], counts


# ----------------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """``--vc-in-pool always``: a resident request longer than the budget drafts over its
    window view whatever the cost fit says (the fit's choice is test_vericache_in_pool's)."""
    log = tmp_path_factory.mktemp("vericache_native") / "server.log"
    proc = ServerProcess(["--dtype", "float32", "--max-total-tokens", "8000", "--speculative-algorithm", "VERICACHE",
                          "--speculative-num-draft-tokens", "4", "--vc-in-pool", "always",
                          "--vc-draft-budget", str(BUDGET), "--skip-server-warmup"], log_path=log)
    yield proc
    proc.stop()


def _counters(proc) -> dict:
    return proc.server_info()["sglang_vc"]["counters"]


def _grew(before: dict, after: dict, group: str) -> dict:
    b, a = before.get(group, {}), after.get(group, {})
    return {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}


def _identical_to_the_plain_server(proc, server, model_dir, prompts, custom, order_ix) -> list[dict]:
    """``prompts`` sent to ``proc`` together in the order ``order_ix`` give the plain
    server's tokens (or, at a float32 near-tie between the two, the greedy reference's),
    lengths and finish reasons; each reply's last VERICACHE record, in prompt order."""
    outs = dict(zip(order_ix, concurrently(lambda k: generate(proc, prompts[k], NEW, custom[k]),
                                           [(k,) for k in order_ix])))
    refs = concurrently(lambda ids: generate(server, ids, NEW), [(p,) for p in prompts])
    for k, ref in enumerate(refs):
        out = outs[k]
        assert finish_type(out) == finish_type(ref) == "length" and len(out["output_ids"]) == len(ref["output_ids"])
        if out["output_ids"] != ref["output_ids"]:  # a float32 near-tie between two servers, or a bug
            result = compare(greedy_reference(model_dir, prompts[k], NEW), out["output_ids"], finish_type(out))
            assert result.identical, (k, result)
    return [(outs[k]["meta_info"].get(META) or [{}])[-1] for k in range(len(prompts))]


@pytest.mark.parametrize("order", ["as-listed", "reversed"])
def test_in_pool_drafts_are_sglang_decode_forwards_and_identical(server, native, model_dir, tokenizer, order):
    """Two 600-token requests draft over their views, a 40-token one decodes full KV (it
    fits the budget) and a 600-token one opts out (``vc_compressor: none``), together:
    every output is the plain server's, token for token, with its length and finish
    reason. Iterations where no request verifies are DECODE forwards over view rows, and
    no forward ran the project's attention."""
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    prompts = [stream[i * 700 : i * 700 + n] for i, n in enumerate((600, 40, 600, 600))]
    custom = [None, None, {"vc_compressor": "none"}, None]
    order_ix = list(range(4)) if order == "as-listed" else list(range(3, -1, -1))
    before = _counters(native)
    infos = _identical_to_the_plain_server(native, server, model_dir, prompts, custom, order_ix)
    after = _counters(native)
    assert [i.get("mode") for i in infos] == ["in-pool", "full", "full", "in-pool"], infos
    assert infos[2]["mode_reason"].startswith("the request opted out") and infos[2].get("drafted", 0) == 0
    drafters = [infos[0], infos[3]]
    accepted, drafted = sum(i["accepted"] for i in drafters), sum(i["drafted"] for i in drafters)
    assert 0 < accepted < drafted, drafters  # rejected somewhere
    # the drafts run at their true positions: 0.9 of them accepted here; at the view's own
    # positions (SGLang's default for a DECODE forward, seq_len - 1) 0.24 were
    assert accepted / drafted > 0.6, drafters
    vc, attention = _grew(before, after, "vericache"), _grew(before, after, "attention")
    assert vc["view_decode_forwards"] > 0 and vc["in_pool_view_rows"] > 0, vc
    assert vc["verify_forwards"] > 0 and vc.get("in_pool_view_rows_short", 0) == 0, vc
    assert attention.get("project_attention_forwards", 0) == 0, attention


@pytest.fixture(scope="module")
def uniform(tmp_path_factory):
    """``native``'s server with ``--vc-in-pool-verify uniform`` (on a GPU the default,
    where verify graphs were captured): in-pool drafters draft in the same iterations and
    verify together."""
    log = tmp_path_factory.mktemp("vericache_uniform") / "server.log"
    proc = ServerProcess(["--dtype", "float32", "--max-total-tokens", "8000", "--speculative-algorithm", "VERICACHE",
                          "--speculative-num-draft-tokens", "4", "--vc-in-pool", "always", "--vc-in-pool-verify",
                          "uniform", "--vc-draft-budget", str(BUDGET), "--skip-server-warmup"], log_path=log)
    yield proc
    proc.stop()


@pytest.mark.parametrize("batch", ["in-pool only", "mixed"])
def test_uniform_in_pool_verifies_are_one_target_verify_and_identical(server, uniform, model_dir, tokenizer, batch):
    """Three in-pool drafters alone verify together in uniform ``TARGET_VERIFY`` forwards
    (one width for every request: what SGLang's verify graph replays), and draft in
    ``DECODE`` forwards over view rows; mixed with a full-KV request and an opted-out one,
    in reverse order, the verifies are ragged. Either way every output is the plain
    server's, token for token, with its length and finish reason, and drafts were
    rejected somewhere."""
    stream = [t for text in real_text_passages(12, words=400) for t in tokenizer(text)["input_ids"]]
    if batch == "in-pool only":
        lengths, custom, modes = (600, 600, 600), [None, None, None], ["in-pool"] * 3
    else:
        lengths, custom = (600, 40, 600, 600), [None, None, {"vc_compressor": "none"}, None]
        modes = ["in-pool", "full", "full", "in-pool"]
    prompts = [stream[i * 700 + 50 : i * 700 + 50 + n] for i, n in enumerate(lengths)]
    order_ix = list(range(len(prompts)))[::-1]
    before = _counters(uniform)
    infos = _identical_to_the_plain_server(uniform, server, model_dir, prompts, custom, order_ix)
    after = _counters(uniform)
    assert [i.get("mode") for i in infos] == modes, infos
    drafters = [i for i, m in zip(infos, modes) if m == "in-pool"]
    accepted, drafted = sum(i["accepted"] for i in drafters), sum(i["drafted"] for i in drafters)
    assert 0 < accepted < drafted, drafters  # rejected somewhere
    vc, attention = _grew(before, after, "vericache"), _grew(before, after, "attention")
    assert vc["view_decode_forwards"] > 0 and attention.get("project_attention_forwards", 0) == 0, (vc, attention)
    print(batch, {k: vc.get(k, 0) for k in ("verify_forwards", "uniform_verify_forwards", "view_decode_forwards",
                                            "decode_forwards", "iterations")})
    if batch == "in-pool only":
        assert vc["uniform_verify_forwards"] > 0, vc
    else:  # a full-KV request decodes beside every verify: ragged
        assert vc["verify_forwards"] > 0, vc
