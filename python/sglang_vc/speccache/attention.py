"""Attention backend ``vc_speccache``: ``vc_torch`` plus SpecCache's selective-recompute
prefill. Before an extend forward, :meth:`.store.ChunkStore.prepare_extend` fills each
SpecCache request's reused chunk rows and leaves only its recomputed tokens in the
batch; in each layer those tokens' K/V are written into their slots (overwriting the
reused rows) and each of them attends over the request's whole row, causally by
position. A batch without SpecCache requests runs exactly as ``vc_torch``.

A selector that needs the target's own first layer (``cacheblend``) chooses in a first
pass over the whole batch: the reused rows of layer 1 are put in place, the model runs
until layer 1's attention receives its K/V (layer 0 fully recomputed over every token,
as CacheBlend does), and the pass stops there; the tokens whose K/V deviate most from
the reused ones are the recomputed ones of the real forward that follows. The pass goes
through the model's own forward and stops in this backend, so it needs no model-specific
code.
"""

from __future__ import annotations

import time

from sglang_vc.kvruntime.backend import VCTorchAttnBackend

from . import rope
from .radix import store_of
from .store import PROBE_LAYER, ExtendPlan


class _ProbeDone(Exception):
    """Raised at :data:`.store.PROBE_LAYER`'s attention to end the first pass."""


class SpecCacheAttnBackend(VCTorchAttnBackend):
    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.model = model_runner.model
        self.store = store_of(model_runner)
        self.rotary = rope.sglang_cos_sin(model_runner.model)
        self.num_layers = model_runner.model_config.num_hidden_layers
        self.extend_plan: ExtendPlan | None = None
        self._probed = None  # (k, v) of PROBE_LAYER while a first pass runs, else None

    def init_forward_metadata(self, forward_batch):
        self.extend_plan = None
        mode = forward_batch.forward_mode
        if mode.is_extend() and not mode.is_target_verify() and self.store.plans:
            pool = self.token_to_kv_pool
            ranges = self.store.probe_ranges(forward_batch)
            if ranges:
                self._select_in_prefill(forward_batch, ranges)
            tree = self.store.tree
            self.extend_plan = self.store.prepare_extend(
                forward_batch, pool.get_key_buffer, pool.get_value_buffer, self.num_layers,
                self.req_to_token_pool.req_to_token, self.rotary, tree.unlock)
        super().init_forward_metadata(forward_batch)

    def _select_in_prefill(self, fb, ranges) -> None:
        t = time.perf_counter()
        pool = self.token_to_kv_pool
        req_to_token = self.req_to_token_pool.req_to_token
        self.store.fill_probe_layer(fb, ranges, pool.get_key_buffer, pool.get_value_buffer, req_to_token,
                                    self.rotary)
        super().init_forward_metadata(fb)  # every token of the batch, attending causally
        self._probed = ()
        try:
            self.model.forward(fb.input_ids, fb.positions, fb)
        except _ProbeDone:
            pass
        finally:
            k_new, v_new = self._probed or (None, None)
            self._probed = None
        if k_new is None:
            raise RuntimeError("SpecCache: the first pass ended before layer 1's attention")
        self.store.select_from_probe(fb, ranges, k_new, v_new, pool.get_key_buffer(PROBE_LAYER),
                                     pool.get_value_buffer(PROBE_LAYER), req_to_token, time.perf_counter() - t)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if self._probed is not None and layer.layer_id == PROBE_LAYER:
            self._probed = (k, v)
            raise _ProbeDone
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def extend_per_request(self) -> bool:
        # Always: SGLang's torch-native extend attends with every cached prefix token as a
        # (discarded) query, so a chunk fetch that finds its chunk cached (one new token
        # after hundreds) would pay the whole chunk's attention again; the per-request
        # path attends with the new tokens only.
        return True

    def query_positions(self, i: int):
        return None if self.extend_plan is None else self.extend_plan.q_positions.get(i)
