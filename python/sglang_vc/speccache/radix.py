"""Radix-cache backend ``speccache``: the ``vc`` radix cache (:mod:`sglang_vc.kvruntime`)
plus SpecCache's chunk lookups.

* When SGLang matches a SpecCache request's prompt, each of its chunks is also matched
  from the root (a chunk's KV is cached under its own token ids, computed alone) and
  locked until the request's prefill has copied it (:class:`.store.ChunkStore`).
* The prompt's own match is SGLang's: a cached prefix of it is exact KV and is reused
  as is.
* A SpecCache request's KV is fused (reused chunk rows re-rotated, plus recomputed
  tokens), not what a full prefill gives: it never enters the tree. Its response's
  ``meta_info["sglang_vc_speccache"]`` says what was reused and recomputed.
"""

from __future__ import annotations

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_vc.kvruntime import get_runtime
from sglang_vc.kvruntime.radix import LossyRadixCache, check_plain_tree

from .names import META_INFO_KEY
from .store import ChunkStore

_stores: dict[int, ChunkStore] = {}


def store_of(model_runner) -> ChunkStore:
    """The scheduler's chunk store (shared by its radix cache and attention backend)."""
    return _stores.setdefault(id(model_runner), ChunkStore())


def create_chunk_radix_cache(ctx) -> "ChunkRadixCache":
    check_plain_tree(ctx, "speccache")
    runner = ctx.tp_worker.model_runner
    return ChunkRadixCache(ctx.params, get_runtime(runner), store_of(runner))


class ChunkRadixCache(LossyRadixCache):
    def __init__(self, params, runtime, store: ChunkStore):
        super().__init__(params, runtime)
        self.store = store
        store.tree = self

    def _match_chunk(self, token_ids):
        r = self.match_prefix(MatchPrefixParams(key=RadixKey(token_ids, None)))  # req None: a plain match
        return int(r.device_prefix_len), r.last_device_node

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        if req is not None:
            plan = self.store.plan_for(req)
            if plan is not None and plan.hits is None:
                self.store.look_up(plan, req.origin_input_ids, self._match_chunk, self.inc_lock_ref,
                                   self.path_device_indices)
        return super().match_prefix(params)

    def checkpoint(self, req, *, up_to: int, **kwargs):
        plan = self.store.plans.get(req.rid)
        if plan is None:
            return super().checkpoint(req, up_to=up_to, **kwargs)
        if req.customized_info is None:
            req.customized_info = {}
        req.customized_info[META_INFO_KEY] = [plan.report()]

    def on_release(self, req, *, checkpointed: bool) -> None:
        self.store.forget(req.rid, self.dec_lock_ref)
        super().on_release(req, checkpointed=checkpointed)

    def finish(self, handle, outcome) -> None:
        if outcome != CacheRequestOutcome.SUCCESS:
            self.store.forget(handle.rid, self.dec_lock_ref)
        super().finish(handle, outcome)
