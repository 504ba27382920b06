"""Positional recovery on the real model: a chunk prefilled alone at positions 0.. and
moved by :func:`speccache.rope.shift` has the keys of the same chunk prefilled at the
target offset (every layer), and at offset 0 exactly its own keys."""

from __future__ import annotations

import pytest
import torch

from sglang_vc.speccache import rope


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def _keys(model, ids, start):
    with torch.no_grad():
        out = model(torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None], use_cache=True)
    return [layer.keys[0].transpose(0, 1) for layer in out.past_key_values.layers]  # [n, H, D] per layer


@pytest.mark.parametrize("offset", [0, 1, 517, 3000])
def test_shifted_chunk_keys_equal_a_prefill_at_the_offset(hf_model, tokenizer, offset):
    ids = tokenizer("The river Nile flows north through Egypt into the Mediterranean Sea.")["input_ids"]
    local = _keys(hf_model, ids, 0)
    at = _keys(hf_model, ids, offset)
    cos_sin = rope.hf_cos_sin(hf_model)
    for layer, (k0, ko) in enumerate(zip(local, at)):
        moved = rope.shift(k0, offset, cos_sin)
        if offset == 0:
            assert moved is k0 and torch.equal(k0, ko)
        else:
            assert not torch.allclose(k0, ko, atol=1e-3)  # the offset does change the keys
            err = (moved - ko).abs().max() / ko.abs().max()
            assert err < 1e-4, (layer, float(err))


def test_rotate_gptj_pairs_neighbours():
    k = torch.tensor([[[1.0, 0.0, 0.0, 1.0, 5.0]]])  # rot = 4, one pass-through channel
    out = rope.rotate(k, torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0]), neox=False)
    assert torch.allclose(out, torch.tensor([[[0.0, 1.0, 0.0, 1.0, 5.0]]]))
    out = rope.rotate(k, torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0]), neox=True)
    # pairs (0, 2) rotated by 90 degrees, (1, 3) by 0
    assert torch.allclose(out, torch.tensor([[[0.0, 0.0, 1.0, 1.0, 5.0]]]))
