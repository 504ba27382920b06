"""The tree's side of a request's plan (:class:`~.request_plan.ContextRows`): what
:class:`~.radix.EvicPressRadixCache` holds of the context a request is matched on, and
the copy it loads for the request -- exact rows under the request's own key, a lossy
one in the context's private namespace (see :mod:`.radix`)."""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.mem_cache.radix_cache import RadixKey

from .config import CompressionConfig, Tier
from .context import Context, Fetched
from .tree_rows import SAME_NAMESPACE, private_namespace


class MatchRows:
    """:class:`~.request_plan.ContextRows` for one request's match: what the tree holds
    of the request's context, and the copy it loads for the request."""

    def __init__(self, cache, req, key: RadixKey):
        self.cache, self.req, self.key = cache, req, key
        self.ids = key.raw_token_ids()
        self.exact_idx: Optional[torch.Tensor] = None  # the exact rows, when all are there

    def floor(self, n: int) -> int:
        return self.cache.tree_rows.floor(n)

    def exact(self, n: int) -> int:
        have, _, idx = self.cache.tree_rows.device_match(self.cache.tree_rows.key(self.ids[:n], self.key))
        if have >= n:
            self.cache._private.pop(self.req.rid, None)  # matched again (waiting): its exact rows now
            self.exact_idx = idx
        return have

    def serve_lossy(self, ctx: Context, cfg: CompressionConfig, n: int) -> bool:
        namespace = private_namespace(ctx, cfg, n, salt=self.key.cache_salt)
        return self.cache._private_on_device(self.req, ctx, self.ids, namespace, n, cfg)

    def backed_up(self, n: int) -> bool:
        return self.cache.tree_rows.cached_len(self.cache.tree_rows.key(self.ids[:n], self.key)) >= n

    def load(self, ctx: Context, fetched: Fetched, usable: int, have: int) -> bool:
        cache, ids = self.cache, self.ids
        cfg = fetched.config
        if cfg.is_full:  # exact rows: in the request's own namespace, shared by all
            n = cache.tree_rows.floor(min(usable, fetched.kv.num_tokens))
            loaded = n > have and cache.tree_rows.inject(ids, self.key, SAME_NAMESPACE, n, fetched.kv) >= n
            start = have
        else:
            # lossy: a private node only this context's requests are sent to (a token-dropped
            # copy's kept rows stand for exactly num_tokens tokens)
            n = usable if fetched.dropped else cache.tree_rows.floor(min(usable, fetched.kv.num_tokens))
            loaded = (n > 0 and (not fetched.dropped or n == fetched.num_tokens)
                      and cache._load_private(self.req, ctx, ids,
                                              private_namespace(ctx, cfg, n, salt=self.key.cache_salt),
                                              n, cfg, fetched.kv))
            start = 0
        if loaded and fetched.tier is Tier.DISK:
            # SGLang's tier split of the cached prefix (cached_tokens_details, the prefill
            # log's storage hits) reads the span a storage prefetch loaded from these
            self.req.storage_hit_start, self.req.storage_hit_length = start, n - start
        return loaded
