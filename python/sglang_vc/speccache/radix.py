"""Radix-cache backend ``speccache``: SGLang's default cache (``UnifiedRadixCache``, with
HiCache's host and storage tiers when ``--enable-hierarchical-cache`` is given) plus
SpecCache's chunk lookups.

* A chunk's KV is cached like any prefix: under the chunk's own token ids, computed
  alone from position 0. The front end brings it onto the device before the request
  that uses it (:meth:`.frontend.Frontend.fetch`), through SGLang's own request path,
  so SGLang's tree and HiCache controller find it on the device, load it back from the
  host pool, or prefetch it from the storage backend.
* When SGLang matches a SpecCache request's prompt, each of its chunks is also matched
  from the root and locked until the request's prefill has copied its rows
  (:class:`.store.ChunkStore`). The prompt's own match is SGLang's: a cached prefix of it
  is exact KV and is reused as is.
* A SpecCache request's KV is fused (reused chunk rows re-rotated, plus recomputed
  tokens), not what a full prefill gives: it never enters the tree
  (``skip_radix_cache_insert``, SGLang's own flag for KV that token ids do not determine).
"""

from __future__ import annotations

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from .store import ChunkStore

_stores: dict[int, ChunkStore] = {}


def store_of(model_runner) -> ChunkStore:
    """The scheduler's chunk store (shared by its radix cache and attention backend)."""
    return _stores.setdefault(id(model_runner), ChunkStore())


def create_chunk_radix_cache(ctx) -> "ChunkRadixCache":
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.disable_radix_cache:
        raise ValueError("--radix-cache-backend speccache supports full-attention models with the radix cache on")
    if ctx.params.page_size != 1:
        raise ValueError("--radix-cache-backend speccache needs --page-size 1")
    cache = create_unified_radix_cache(ctx, cache_class=ChunkRadixCache)
    cache.store = store_of(ctx.tp_worker.model_runner)
    cache.store.tree = cache
    return cache


class ChunkRadixCache(UnifiedRadixCache):
    store: ChunkStore

    def _chunk_matcher(self, prompt_key: RadixKey):
        """Matches a chunk from the root, in the prompt's namespace (its ``extra_key``:
        LoRA adapter, and ``cache_salt``): (tokens on the device, last device node, their
        device slots)."""
        def match(token_ids):
            key = RadixKey(token_ids, prompt_key.extra_key, cache_salt=prompt_key.cache_salt)
            r = self._match_tree(MatchPrefixParams(key=key))
            n = int(r.device_prefix_len)
            if n == 0:
                return 0, None, None
            root = self.root_node_handle(prompt_key.extra_key)
            return n, r.last_device_node, self.tree_core.collect_full_device_indices(r.last_device_node, root)[:n]

        return match

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        if req is not None:
            plan = self.store.plan_for(req)
            if plan is not None:
                req.skip_radix_cache_insert = True
                if plan.hits is None:
                    self.store.look_up(plan, req.origin_input_ids, self._chunk_matcher(params.key), self.lock)
        return super().match_prefix(params)

    def on_release(self, req, *, checkpointed: bool) -> None:
        self.store.forget(req.rid, self.unlock)
        super().on_release(req, checkpointed=checkpointed)

    def finish(self, handle, outcome) -> None:
        if outcome != CacheRequestOutcome.SUCCESS:
            self.store.forget(handle.rid, self.unlock)
        super().finish(handle, outcome)
