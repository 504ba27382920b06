"""The plan of one VERICACHE forward travels on the forward (its verify input), not on the
attention backend: what the worker attaches is what the backend reads, a forward without
one reads the empty plan, and neither the worker nor the backend parks a plan on the
backend (:mod:`sglang_vc.vericache.forward_plan`)."""

from __future__ import annotations

import inspect
import types

import torch

from sglang.srt.speculative.ngram_info import NgramVerifyInput

from sglang_vc.vericache import attention, forward_layout, lockstep, staggered_round, worker
from sglang_vc.vericache.attention import InPoolDrafts
from sglang_vc.vericache.forward_plan import NO_PLAN, ForwardPlan, attach, plan_of


def test_the_backend_reads_the_plan_the_worker_attached():
    staging = types.SimpleNamespace(requests={2: "staged"})
    plan = ForwardPlan(staging=staging, in_pool=InPoolDrafts({0: 64, 3: 64}))
    spec_info = NgramVerifyInput(draft_token_num=2, new_seq_lens=torch.zeros(1))
    attach(spec_info, plan)
    forward_batch = types.SimpleNamespace(spec_info=spec_info)
    assert plan_of(forward_batch) is plan
    assert plan.staged == {2: "staged"} and plan.in_pool_set == frozenset({0, 3})
    # a forward the worker planned nothing for (SGLang's own, a decode)
    assert plan_of(types.SimpleNamespace(spec_info=None)) is NO_PLAN
    assert plan_of(types.SimpleNamespace(spec_info=NgramVerifyInput(draft_token_num=2, new_seq_lens=torch.zeros(1)))) is NO_PLAN
    assert NO_PLAN.staged == {} and NO_PLAN.in_pool_set == frozenset()


def test_nothing_is_parked_on_the_attention_backend_per_forward():
    """The backend declares no per-forward slot for the plan, and no worker code assigns
    one to it (the source of every module that drives a VERICACHE forward)."""
    backend = attention.VeriCacheAttnBackend
    for name in ("staging", "in_pool", "selections", "shared_selections"):
        assert not hasattr(backend, name), name  # the selection stores travel on the plan too
    for module in (worker, staggered_round, lockstep, forward_layout):
        source = inspect.getsource(module)
        for name in ("staging", "in_pool", "selections", "shared_selections"):
            assert f"attn_backend.{name} =" not in source, (module.__name__, name)
