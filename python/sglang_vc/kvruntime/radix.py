"""Radix-cache backend ``vc``: SGLang's Python ``RadixCache`` made safe for compressed
requests.

* A lossy request's KV never enters the tree (``checkpoint`` is a no-op for it), so no
  request is ever handed a compressed prefix.
* It may still *reuse* a full-KV prefix cached by an earlier full request. The match is
  capped so that it owns at least the rows its compressed KV needs; the compressed rows go
  into its own slots only, the shared prefix nodes are never written. Under VERICACHE
  (lossless) the match is whole, and a request whose own rows cannot hold its compressed
  rows keeps its full KV instead.
* ``free_kv_row`` frees exactly the slots a compressed request still owns (the live
  slots of its own row positions); the slots it gave back at compression time are null in
  its row and not freed twice.
* Full-KV requests (no compressor, or ``custom_params.vc_compressor = "none"``) use the
  tree exactly like SGLang's ``RadixCache``.
* A VERICACHE request offloaded with its full KV on the host enters the tree when it
  finishes: the worker puts its full KV back in its row first (``KVRuntime.full_again``),
  where the pool has room; where it has none, its full KV waits on the host and enters
  the tree when a release frees slots (:mod:`.held_rows`).
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from .held_rows import HeldForTree, HeldRows
from .names import META_INFO_KEY
from .runtime import get_runtime

logger = logging.getLogger(__name__)


def check_plain_tree(ctx, name: str) -> None:
    """``ValueError`` unless the tree is a plain full-attention one with page size 1."""
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError(f"--radix-cache-backend {name} supports plain full-attention models without HiCache")
    if ctx.params.page_size != 1:
        raise ValueError(f"--radix-cache-backend {name} needs --page-size 1")


def create_lossy_radix_cache(ctx) -> "LossyRadixCache":
    check_plain_tree(ctx, "vc")
    runtime = get_runtime(ctx.tp_worker.model_runner)
    return LossyRadixCache(ctx.params, runtime)


class LossyRadixCache(RadixCache):
    def __init__(self, params, runtime):
        self.runtime = runtime
        runtime.tree_cache = self
        # finished requests' full KV that found no pool room (at most a pool's worth)
        self.held = HeldForTree(limit=runtime.allocator.size)
        super().__init__(params)

    def reset(self):
        super().reset()  # (a flush of the cache: what is held goes too)
        self.held.clear()

    # ------------------------------------------------------------------ admission

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        if req is None or self.runtime.default_spec is None and not _has_override(req):
            return super().match_prefix(params)
        prefill_len = len(req.full_untruncated_fill_ids)
        plan = self.runtime.plan(req.rid, getattr(req.sampling_params, "custom_params", None), prefill_len)
        cap = prefill_len - plan.min_own_rows()
        key = params.key
        if plan.spec is not None and len(key) > cap and not self.runtime.side.lossless:
            # The compressed rows go into the request's own slots: borrow at most `cap`
            # (VERICACHE borrows the whole match instead: KVRuntime._own_rows_hold_it).
            params.key = RadixKey(key.token_ids, key.extra_key, is_bigram=key.is_bigram,
                                  limit=max(cap, 0), cache_salt=key.cache_salt)
        return super().match_prefix(params)

    # ------------------------------------------------------------------ insertion

    def checkpoint(self, req, *, up_to: int, **kwargs):
        # report what compression did (or why the request kept its full KV)
        meta = self.runtime.meta.get(req.rid)
        if meta is not None:
            if req.customized_info is None:
                req.customized_info = {}
            req.customized_info[META_INFO_KEY] = [meta]
        if not self.runtime.is_lossy(req):
            return super().checkpoint(req, up_to=up_to, **kwargs)
        if req.finished():
            kept = self.runtime.full_again(req, up_to)
            if kept is True:
                # VERICACHE put its full KV back in its row: the next request with this
                # prefix (a second turn, a shared document) finds its prompt and its answer
                return super().checkpoint(req, up_to=up_to, **kwargs)
            if isinstance(kept, HeldRows):  # no room now: the tree takes it after a release
                key = RadixKey(req.full_untruncated_fill_ids[:up_to], req.extra_key, is_bigram=self.is_eagle,
                               cache_salt=req.cache_salt)
                self.held.add(key, kept)
        # never insert a lossy request's KV

    # ------------------------------------------------------------------ release

    def free_kv_row(self, kv, ranges):
        entry = self.runtime.index.get(kv.req_pool_idx)
        if entry is None:
            return super().free_kv_row(kv, ranges)
        for start, end in ranges:
            slots = self.runtime.owned_slots(entry, start, end)
            if slots.numel():
                self.token_to_kv_pool_allocator.free(slots)

    def on_release(self, req, *, checkpointed: bool) -> None:
        self.runtime.release(req.rid, req.kv.req_pool_idx)
        super().on_release(req, checkpointed=checkpointed)
        if self.held:  # its slots are free: held full KV may fit now
            self.held.insert_into(self, self.runtime.kv_pool)

    def finish(self, handle, outcome) -> None:
        # An aborted request that never got compressed (e.g. still waiting) has only a
        # plan to forget; a compressed one is cleaned up when its row is released.
        if outcome != CacheRequestOutcome.SUCCESS and not self.runtime.has_entry(handle.rid):
            self.runtime.release(handle.rid, None)
        super().finish(handle, outcome)


def _has_override(req) -> bool:
    params = getattr(req.sampling_params, "custom_params", None)
    return isinstance(params, dict) and "vc_compressor" in params
