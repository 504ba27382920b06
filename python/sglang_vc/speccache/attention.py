"""Attention backend ``vc_speccache``: ``vc_torch`` plus SpecCache's selective-recompute
prefill. Before an extend forward, :meth:`.store.ChunkStore.prepare_extend` fills each
SpecCache request's reused chunk rows and leaves only its recomputed tokens in the
batch; in each layer those tokens' K/V are written into their slots (overwriting the
reused rows) and each of them attends over the request's whole row, causally by
position. A batch without SpecCache requests runs exactly as ``vc_torch``."""

from __future__ import annotations

from sglang_vc.kvruntime.backend import VCTorchAttnBackend

from . import rope
from .radix import store_of
from .store import ExtendPlan


class SpecCacheAttnBackend(VCTorchAttnBackend):
    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.store = store_of(model_runner)
        self.rotary = rope.sglang_cos_sin(model_runner.model)
        self.num_layers = model_runner.model_config.num_hidden_layers
        self.extend_plan: ExtendPlan | None = None

    def init_forward_metadata(self, forward_batch):
        self.extend_plan = None
        mode = forward_batch.forward_mode
        if mode.is_extend() and not mode.is_target_verify() and self.store.plans:
            pool = self.token_to_kv_pool
            tree = self.store.tree
            self.extend_plan = self.store.prepare_extend(
                forward_batch, pool.get_key_buffer, pool.get_value_buffer, self.num_layers,
                self.req_to_token_pool.req_to_token, self.rotary, tree.dec_lock_ref)
        super().init_forward_metadata(forward_batch)

    def extend_per_request(self) -> bool:
        return self.extend_plan is not None

    def query_positions(self, i: int):
        return None if self.extend_plan is None else self.extend_plan.q_positions.get(i)
