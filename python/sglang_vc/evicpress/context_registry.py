"""The context registry of :class:`~.manager.EvicPressManager`: registering a context
(through the API, or a long prompt seen as an automatic one), matching a request's
tokens to the context it starts with, and forgetting one.

Composed into the manager (``manager.registry``), as :class:`~.storage_copies.StorageCopies`
is: it keeps the index by first tokens and works on the manager's ``contexts``, lock and
counters (``self.m``).
"""

from __future__ import annotations

import collections
import uuid
from typing import Optional, Sequence

import numpy as np

from .context import MIN_CONTEXT_TOKENS, Context, as_token_array, common_prefix_len


class ContextRegistry:
    """Contexts by id, and an index by namespace and first ``INDEX_TOKENS`` tokens."""

    INDEX_TOKENS = 8

    def __init__(self, manager):
        self.m = manager
        self._index: dict[tuple, list[str]] = collections.defaultdict(list)

    def register(
        self,
        token_ids,
        *,
        ctx_id: Optional[str] = None,
        namespace: Optional[str] = None,
        queries: Sequence[Sequence[int]] = (),
        query_texts: Sequence[str] = (),
        source: str = "api",
    ) -> Context:
        ids = as_token_array(token_ids).copy()
        if len(ids) < MIN_CONTEXT_TOKENS:
            raise ValueError(f"a context needs at least {MIN_CONTEXT_TOKENS} tokens, got {len(ids)}")
        with self.m.lock:
            if ctx_id is None:
                ctx_id = uuid.uuid4().hex[:12]
            ctx_id = str(ctx_id)
            old = self.m.contexts.get(ctx_id)
            if old is not None:
                if old.namespace == namespace and np.array_equal(old.token_ids, ids):
                    self.extend_queries(old, queries, query_texts)
                    return old
                raise ValueError(f"context {ctx_id!r} exists with other tokens; delete it first")
            if len(self.m.contexts) >= self.m.settings.max_contexts:
                # an automatic context makes room by forgetting the least recently used
                # automatic one (scheduler thread); registered contexts are never forgotten
                autos = [c for c in self.m.contexts.values() if c.source == "auto"]
                if source != "auto" or not autos:
                    raise ValueError(f"too many contexts (max {self.m.settings.max_contexts})")
                self.forget(min(autos, key=lambda c: (c.stored, c.last_access)).ctx_id)
            ctx = Context(ctx_id, ids, namespace=namespace, source=source, last_access=self.m.clock())
            self.extend_queries(ctx, queries, query_texts)
            self.m.contexts[ctx_id] = ctx
            self._index[self._key(ids, namespace)].append(ctx_id)
            self.m.count(contexts_registered=1)
            if self.m.settings.policy == "evicpress" and self.m.settings.candidates:
                ctx.profile_reason = "new"
            return ctx

    def extend_queries(self, ctx: Context, queries, texts) -> None:
        for q in queries:
            q = [int(t) for t in q]
            if q and q not in ctx.queries:
                ctx.queries.append(q)
        for t in texts:
            if t not in ctx.query_texts:
                ctx.query_texts.append(t)

    def _key(self, ids: np.ndarray, namespace) -> tuple:
        return (namespace, tuple(int(x) for x in ids[: self.INDEX_TOKENS]))

    def get(self, ctx_id: str) -> Optional[Context]:
        return self.m.contexts.get(str(ctx_id))

    def forget(self, ctx_id: str) -> bool:
        """Remove a context and its stored copies (scheduler thread)."""
        with self.m.lock:
            ctx = self.m.contexts.pop(str(ctx_id), None)
            if ctx is None:
                return False
            self.m._delete_blob(ctx, ctx.placement)
            lst = self._index.get(self._key(ctx.token_ids, ctx.namespace), [])
            if ctx.ctx_id in lst:
                lst.remove(ctx.ctx_id)
            self.m.tracker.forget(ctx.ctx_id)
            self.m.querylog.forget(ctx.ctx_id)
            return True

    @staticmethod
    def _shares_enough(ctx: Context, n: int) -> bool:
        """Whether a request sharing its first ``n`` tokens with ``ctx`` is ``ctx``'s."""
        return n >= max(MIN_CONTEXT_TOKENS, ctx.num_tokens // 2)

    def match_id(self, ctx_id: str, token_ids) -> Optional[tuple[Context, int]]:
        """Context ``ctx_id`` and the prefix ``token_ids`` share with it, as :meth:`match`
        gives them (None unless it covers at least half of the context); for the
        profiler's requests, which name the context they profile."""
        ids = as_token_array(token_ids)
        with self.m.lock:
            ctx = self.m.contexts.get(str(ctx_id))
            if ctx is None:
                return None
            n = common_prefix_len(ids, ctx.token_ids)
            return (ctx, n) if self._shares_enough(ctx, n) else None

    def match(self, token_ids, namespace=None) -> Optional[tuple[Context, int]]:
        """The registered context sharing the longest prefix with ``token_ids``, and
        that prefix length; None unless it covers at least half of the context."""
        ids = as_token_array(token_ids)
        if len(ids) < MIN_CONTEXT_TOKENS:
            return None
        with self.m.lock:
            best = None
            for cid in self._index.get(self._key(ids, namespace), ()):
                ctx = self.m.contexts[cid]
                n = common_prefix_len(ids, ctx.token_ids)
                if self._shares_enough(ctx, n) and (best is None or n > best[1]):
                    best = (ctx, n)
            return best
