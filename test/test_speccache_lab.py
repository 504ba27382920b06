"""SpecCache's selective-recompute prefill in the HF lab: recomputing every chunk token
is a full prefill (same answer tokens), recomputing none is full reuse, and in between
the answer moves from one to the other."""

from __future__ import annotations

import pytest
import torch

from conftest import real_text_passages
from sglang_vc.bench import speccache_hf as sc
from sglang_vc.bench.lossy_hf import Session, load_model
from sglang_vc.speccache import rope
from sglang_vc.speccache.selectors import Chunks, SelectionInput, get_selector


@pytest.fixture(scope="module")
def lab(model_dir, tokenizer):
    sess = Session(load_model(model_dir))
    passages = real_text_passages(6, words=120)[:3]
    prefix = tokenizer("Answer from the passages.\n")["input_ids"]
    chunk_ids = [tokenizer("\n" + p, add_special_tokens=False)["input_ids"] for p in passages]
    query = tokenizer("\nQuestion: what is the first passage about? Answer:", add_special_tokens=False)["input_ids"]
    ids, starts, ends = list(prefix), [], []
    for c in chunk_ids:
        starts.append(len(ids))
        ids += c
        ends.append(len(ids))
    ids += query
    kvs = [sc.chunk_kv(sess, c) for c in chunk_ids]
    reused = sc.assemble(len(ids), starts, kvs, rope.hf_cos_sin(sess.model))
    chunks = Chunks(tuple(starts), tuple(ends), len(ids))
    cache, logits, _, _ = sess.prefill(ids)
    eos = {tokenizer.eos_token_id}
    full = sc.greedy(sess, logits, cache, 12, eos)
    return sess, ids, chunks, reused, full, eos


def _answer(lab, mask):
    sess, ids, chunks, reused, full, eos = lab
    recompute = mask | ~chunks.mask()
    logits, fused = sc.selective_prefill(sess, ids, reused, recompute)
    return sc.greedy(sess, logits, fused.cache(), 12, eos), logits


def test_recomputing_every_chunk_token_is_a_full_prefill(lab):
    sess, ids, chunks, reused, full, eos = lab
    mask = get_selector("full-recompute").select(SelectionInput(chunks), 1.0)
    answer, _ = _answer(lab, mask)
    assert answer == full


def test_first_chunk_reused_at_position_zero_is_its_own_prefill(lab):
    """The first chunk after a prefix is at its offset; a chunk at 0 needs no rotation:
    its reused rows are the chunk prefill's bytes."""
    sess, ids, chunks, reused, full, eos = lab
    kv = sc.chunk_kv(sess, ids[: chunks.ends[0]])
    at0 = sc.assemble(chunks.ends[0], [0], [kv], rope.hf_cos_sin(sess.model))
    for layer in range(len(kv)):
        assert torch.equal(at0.k[layer], kv[layer][0]) and torch.equal(at0.v[layer], kv[layer][1])


def test_full_reuse_differs_and_selection_recovers(lab):
    """Reusing every chunk token ignores cross-chunk attention: the first answer token's
    logits move away from the full prefill's; recomputing 50% of them (CacheBlend's
    deviation) brings them closer."""
    sess, ids, chunks, reused, full, eos = lab
    _, ref = _answer(lab, chunks.mask())
    _, none = _answer(lab, torch.zeros_like(chunks.mask()))
    dev = sc.first_layer_deviation(sess, ids, reused)
    assert float(dev[chunks.mask()].max()) > 0
    half = get_selector("cacheblend").select(SelectionInput(chunks, first_layer_deviation=dev), 0.5)
    _, mid = _answer(lab, half)
    d_none, d_mid = (none - ref).abs().max(), (mid - ref).abs().max()
    assert d_none > 1e-3 and d_mid < d_none, (float(d_none), float(d_mid))
