"""What the selectors' signals are (issue #76): hand-built cases where the tokens that
should win are known, and on the small model, that the served ``speccache`` signal is
eq. 1 on HF's hidden states and the lab oracle's layer 1 is CacheBlend's deviation."""

from __future__ import annotations

import json

import torch

from conftest import real_text_passages
from sglang_vc.speccache import align as al
from sglang_vc.speccache import signals as sg
from sglang_vc.speccache import spans as sp
from sglang_vc.speccache.selectors import Chunks, SelectionInput
from sglang_vc.speccache.selectors.base import top_chunk_tokens
from sglang_vc.speccache.selectors.speccache import SpecCacheSelector


def _kv(layers: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g)) for _ in range(layers)]


def test_kv_deviation_ranks_the_tokens_that_deviate_at_each_depth():
    """Tokens 2 and 7 deviate in the deep layers only, token 4 in layer 1 only: the
    deep oracle picks {2, 7}, the first-layer one (CacheBlend's) picks 4."""
    full = _kv(6, 10)
    reused = [(k.clone(), v.clone()) for k, v in full]
    for layer in (4, 5):  # deep: the last third of 6 layers
        reused[layer][0][0, :, 2] += 3.0
        reused[layer][1][0, :, 7] -= 2.0
    reused[1][1][0, :, 4] += 1.0
    reused[3][0][0, :, 9] += 0.5  # a middle-layer deviation, outside the deep set
    dev = sg.kv_deviation(full, reused)
    assert dev.shape == (6, 10)
    assert torch.allclose(dev[4, 2], torch.tensor(3.0 * (2 * 4) ** 0.5))  # |dK| over 2 heads x 4 channels
    assert float(dev[0].abs().max()) == 0.0
    chunks = Chunks((0,), (10,), 10)
    layers = sg.depths(6)
    assert layers["deep"] == [4, 5] and layers["first"] == [1] and layers["middle"] == [3]
    deep = top_chunk_tokens(sg.layer_mean(dev, layers["deep"], chunks.mask()), chunks, 2)
    assert deep.nonzero().flatten().tolist() == [2, 7]
    first = top_chunk_tokens(sg.layer_mean(dev, layers["first"], chunks.mask()), chunks, 1)
    assert first.nonzero().flatten().tolist() == [4]


def test_layer_mean_scales_each_layer_to_its_own_mean():
    """A layer 100x larger does not decide the ranking alone; a zero layer adds 0."""
    per_layer = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [300.0, 200.0, 100.0]])
    out = sg.layer_mean(per_layer, [0, 1, 2])
    assert torch.allclose(out, torch.tensor([1 / 2 + 3 / 2, 1.0 + 1.0, 3 / 2 + 1 / 2]) / 3)


def test_speccache_selector_picks_the_largest_deep_layer_hidden_norms():
    """The served ``speccache`` ranks by eq. 1, the mean norm over the last third of the
    layers: tokens 3 and 8 (large in the deep layers) win over token 1 (large in the
    shallow layers only, larger overall); the query token is never a candidate."""
    layers, n = 9, 12
    hidden = [torch.ones(n, 4) for _ in range(layers)]
    for i in range(0, 6):
        hidden[i][1] = 50.0
    for i in range(6, 9):
        hidden[i][3] = 10.0
        hidden[i][8] = 8.0
        hidden[i][11] = 40.0  # the query token: the largest, but not a chunk token
    scores = sp.importance(hidden)
    chunks = Chunks((0,), (11,), n)
    inp = SelectionInput(chunks, spec_scores=lambda: (scores, al.identity(n)))
    got = SpecCacheSelector().select(inp, 2 / 11)
    assert got.nonzero().flatten().tolist() == [3, 8]


def test_served_signal_is_eq1_on_hf_hidden_states_whose_last_is_after_the_final_norm(model_dir):
    """:class:`SpecModel` scores with HF ``hidden_states[1:]``: every layer's output,
    except the last, which HF replaces with the final norm's output (so eq. 1's last
    deep layer is a normalized state, not the residual stream)."""
    from sglang_vc import models
    from sglang_vc.speccache.spec_model import SpecModel

    spec = SpecModel(models.DEFAULT_MODEL)
    text = real_text_passages(1, words=40)[0]
    decoder = spec.model.get_decoder()
    raw = []
    hooks = [layer.register_forward_hook(lambda m, i, o: raw.append(o[0] if isinstance(o, tuple) else o))
             for layer in decoder.layers]
    try:
        got = spec.score(text)
    finally:
        for h in hooks:
            h.remove()
    raw = [r[0] for r in raw]
    last = decoder.norm(raw[-1][None])[0]
    expected = sp.importance(raw[:-1] + [last])
    assert torch.allclose(got.importance, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(sp.importance(raw), expected, rtol=1e-3)


def test_oracle_first_layer_is_cacheblends_deviation(model_dir, tokenizer):
    """The lab oracle (:func:`signals.kv_deviation` of reuse vs full prefill) at layer 1
    equals the lab's CacheBlend signal, and layer 0 does not deviate on chunk tokens
    (the keys' re-rotation is exact)."""
    from sglang_vc.bench import speccache_hf as sc
    from sglang_vc.bench.lossy_hf import Session, cache_kv, load_model
    from sglang_vc.speccache import layout, rope

    sess = Session(load_model(model_dir))
    passages = real_text_passages(4, words=60)[:2]
    prompt = layout.tokenize(tokenizer, "Answer from the passages.\n", ["\n" + p for p in passages],
                             "\nQuestion: what is it about? Answer:")
    kvs = [sc.chunk_kv(sess, ids) for ids in prompt.chunk_ids]
    reused = sc.assemble(len(prompt.ids), prompt.chunks.starts, kvs, rope.hf_cos_sin(sess.model))
    cache, _, _, _ = sess.prefill(prompt.ids)
    dev = sg.kv_deviation(cache_kv(cache), list(zip(reused.k, reused.v)))
    mask = prompt.chunks.mask()
    blend = sc.first_layer_deviation(sess, prompt.ids, reused)
    assert torch.allclose(dev[1][mask], blend[mask], rtol=1e-3, atol=1e-3)
    assert float(dev[0][mask].max()) < 1e-3 * float(dev[1][mask].mean())
    assert float(dev[-1][mask].mean()) > 0



def test_served_selections_are_scored_against_the_oracle_on_the_same_items(tmp_path):
    """``bench.speccache_oracle --served`` rebuilds a served run's items and scores the
    positions the server recorded: the oracle's own top tokens have recall 1 at every
    depth they came from, their complement 0; full reuse (ratio 0) is not scored."""
    from sglang_vc import models
    from sglang_vc.bench import speccache_oracle as so
    from sglang_vc.bench.speccache import _load
    from sglang_vc.bench.workloads import load_workload

    target = _load(models.DEFAULT_MODEL)
    item = load_workload("rag_multihop", tokenizer=target.tokenizer, n=2, chunks=4, chunk_tokens=96, hop="near")[1]
    t = so.prepare_target(target, item, {})
    chunks = t.prompt.chunks
    deep = top_chunk_tokens(sg.layer_mean(t.deviation, sg.depths(t.deviation.shape[0])["deep"], chunks.mask()),
                            chunks, chunks.budget(0.15))
    other = chunks.mask() & ~deep
    facts = {"bridge": 0.5, "answer": 1.0, "lure": 0.0}

    def row(selector, ratio, mask):
        return {"item": item["id"], "target": models.DEFAULT_MODEL, "spec_model": models.DEFAULT_MODEL,
                "selector": selector, "ratio": ratio, "exact_match": 1.0,
                "selection": {"positions": mask.nonzero().flatten().tolist(), "fact_recomputed": facts}}

    served = {"benchmark": "speccache_serve", "workload": "rag_multihop", "hop": "near", "chunks": 4,
              "chunk_tokens": 96, "pairs": [[models.DEFAULT_MODEL, models.DEFAULT_MODEL]],
              "rows": [row("epic", 0.15, deep), row("random", 0.15, other), row("full-reuse", 0.0, deep[:0])]}
    rows = so.served_rows(served, target, {})
    by = {r["selector"]: r for r in rows}
    assert set(by) == {"epic", "random", "oracle:deep"}
    assert by["epic"]["recall"]["deep"] == 1.0 and by["random"]["recall"]["deep"] == 0.0
    assert by["oracle:deep"]["recall"]["deep"] == 1.0
    assert by["epic"]["fact_recomputed"] == facts and by["epic"]["selected"] == int(deep.sum())
    out = tmp_path / "oracle.json"
    (tmp_path / "served.json").write_text(json.dumps(served))
    assert so.main(["--json", str(out), "--served", str(tmp_path / "served.json")]) == 0
    summary = {e["selector"]: e for e in json.loads(out.read_text())["results"]}
    assert summary["epic"]["recall"]["deep"] == 1.0 and summary["epic"]["exact_match"] == 1.0
    (tmp_path / "bad.json").write_text('{"benchmark": "speccache"}')
    assert so.main(["--json", str(out), "--served", str(tmp_path / "bad.json")]) == 2
