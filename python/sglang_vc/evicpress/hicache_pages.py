"""A context's full KV on the storage tier is HiCache's own pages, not a second copy.

HiCache writes a prefix's rows through to the storage backend as pages, one object per
page under SGLang's hash chain (``get_storage_hash_str``: each page's hash seeded by the
one before, the first by the request's ``extra_key`` / ``cache_salt``), and prefetches
them back for any server of the model. A context's full rows are such a prefix. So
EvicPress's full placement on the storage tier reads those pages (:meth:`HiCachePages.get`)
and, when HiCache has not written them (the context reached storage before its backup
did, or the backend evicted some), writes the missing pages itself under the same keys
(:meth:`HiCachePages.put`): one copy, which SGLang's prefetch and EvicPress both read.

The pages are HiCache's cache, which the backend may evict (``evicpress_file`` marks them
evictable). While EvicPress places a context on them they are pinned (:meth:`HiCachePages.keep`:
``evicpress_file`` then evicts other pages first) and released when it moves the context
away. A page gone all the same (another backend's eviction, damage) is a lost placement:
the manager drops the context and the prefill recomputes it, never a wrong row.

Pages hold whole pages only: a context's tail shorter than a page is not on storage, and
a read returns the page-aligned rows (a load onto the device uses no more).

The page format is what SGLang's controller writes, which depends on the backend's
interface: through the generic page calls (``evicpress_file``, ``file``) a page is the host
pool's ``get_data_page`` (MHA ``layer_first``, ``page_first``, ``page_first_direct``);
through the zero-copy calls (``seaweedfs``, ``mooncake``, ...) it is the host buffers
``get_page_buffer_meta`` lists, one after the other (MHA ``layer_first``: each layer's K,
then its V). Another pool, layout or interface has no :class:`HiCachePages`
(:func:`for_pool` returns None, says why), and the full placement stays an EvicPress blob.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from . import codec, tenant
from .codec import FullKV
from .config import FULL
from .context import Context

logger = logging.getLogger(__name__)

__all__ = ["HiCachePages", "for_pool"]

ZERO_COPY = "zero_copy:"  # prefix of the zero-copy interface's formats

# format -> the page object's shape, from (page_size, layers, heads, head_dim)
_PAGE_SHAPES = {
    "layer_first": lambda p, L, H, D: (2, L, p, H, D),
    "page_first": lambda p, L, H, D: (2, p, L, H, D),
    "page_first_direct": lambda p, L, H, D: (2, 1, L, p, H, D),
    ZERO_COPY + "layer_first": lambda p, L, H, D: (L, 2, p, H, D),
}


def _to_lpHD(page: torch.Tensor, layout: str) -> torch.Tensor:
    """A page as ``[2, L, p, H, D]``."""
    if layout == "page_first":
        return page.permute(0, 2, 1, 3, 4)
    if layout == "page_first_direct":
        return page[:, 0]
    if layout == ZERO_COPY + "layer_first":
        return page.transpose(0, 1)
    return page


def _from_lpHD(page: torch.Tensor, layout: str) -> torch.Tensor:
    """``[2, L, p, H, D]`` in the page object's format."""
    if layout == "page_first":
        return page.permute(0, 2, 1, 3, 4)
    if layout == "page_first_direct":
        return page.unsqueeze(1)
    if layout == ZERO_COPY + "layer_first":
        return page.transpose(0, 1)
    return page


class HiCachePages:
    """Full contexts as HiCache pages on ``backend`` (the ``HiCacheStorage`` SGLang built)."""

    def __init__(self, backend, layout: str, page_size: int, layers: int, heads: int,
                 head_dim: int, dtype: torch.dtype) -> None:
        if layout not in _PAGE_SHAPES:
            raise ValueError(f"HiCache pages: layout {layout!r} not supported")
        self.backend = backend
        self.layout = layout
        self.page_size = int(page_size)
        self.shape = _PAGE_SHAPES[layout](self.page_size, layers, heads, head_dim)
        self.dtype = dtype

    def keys(self, token_ids: Sequence[int], namespace: Optional[str]) -> list[str]:
        """SGLang's storage keys of the whole pages of ``token_ids`` in ``namespace``:
        the keys HiCache writes the same prefix under."""
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        n = len(token_ids) // self.page_size * self.page_size
        if n == 0:
            return []
        extra_key, cache_salt = tenant.tree_key(namespace)
        key = RadixKey([int(t) for t in token_ids[:n]], extra_key=extra_key, cache_salt=cache_salt)
        return list(get_storage_hash_str(key, None, page_size=self.page_size))

    def probe(self, token_ids: Sequence[int], namespace: Optional[str]) -> bool:
        """Whether every whole page of the context is on the backend."""
        keys = self.keys(token_ids, namespace)
        return bool(keys) and self._present(keys) == len(keys)

    def _present(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, the backend holds."""
        batch_exists = getattr(self.backend, "batch_exists", None)
        if batch_exists is not None:
            try:
                return int(batch_exists(keys))
            except NotImplementedError:
                pass
        n = 0
        for k in keys:
            if not self.backend.exists(k):
                break
            n += 1
        return n

    def keep(self, token_ids: Sequence[int], namespace: Optional[str], keep: bool = True) -> None:
        """Pin the context's pages against the backend's own eviction while EvicPress
        places the context on them (``evicpress_file``'s ``keep``; ``keep=False``
        releases them to HiCache's cache). Other backends have no page eviction of
        their own, or none this can stop: a page they drop is a lost placement."""
        fn = getattr(self.backend, "keep" if keep else "release", None)
        if fn is not None:
            fn(self.keys(token_ids, namespace))

    def corrupted(self) -> int:
        """Damaged objects the backend has detected (``evicpress_file``; 0 for backends
        that do not check)."""
        return int(getattr(getattr(getattr(self.backend, "store", None), "stats", None), "corrupted", 0) or 0)

    def files(self, token_ids: Sequence[int], namespace: Optional[str]) -> list[str]:
        """The local files of the context's pages, where the backend keeps files (tests)."""
        path_of = getattr(self.backend, "entry_path", None)
        return [] if path_of is None else [str(path_of(k)) for k in self.keys(token_ids, namespace)]

    def read(self, token_ids: Sequence[int], namespace: Optional[str]) -> Optional[FullKV]:
        """The context's page-aligned full KV read from the pages; None when a page is
        missing or short (evicted or damaged: never served)."""
        keys = self.keys(token_ids, namespace)
        if not keys:
            return None
        targets = [torch.empty(self.shape, dtype=self.dtype).flatten() for _ in keys]
        got = self.backend.batch_get(keys, targets)
        if got is None or len(got) != len(keys) or any(g is None for g in got):
            return None
        pages = [_to_lpHD(g.view(self.dtype).reshape(self.shape), self.layout) for g in got]
        kv = torch.cat(pages, dim=2)  # [2, L, N, H, D]
        return FullKV(kv[0].contiguous(), kv[1].contiguous())

    def write(self, token_ids: Sequence[int], namespace: Optional[str], kv: FullKV,
              keep: bool = False) -> tuple[bool, int]:
        """Write the pages of ``kv`` the backend lacks (whole pages only); (every page
        now there, bytes written). ``keep``: the pages stay pinned (:meth:`keep`), for
        a placement on them; else they are HiCache's cache once written. They are
        pinned while they are written either way: a context's first pages are the
        oldest, the first the backend would evict to make room for its last ones."""
        keys = self.keys(token_ids, namespace)
        n = len(keys) * self.page_size
        if not keys or kv.num_tokens < n:
            return False, 0
        self.keep(token_ids, namespace)
        ok, nbytes = True, 0
        have = self._present(keys)
        if have < len(keys):
            both = torch.stack([kv.k[:, :n], kv.v[:, :n]]).to(self.dtype)  # [2, L, N, H, D]
            p = self.page_size
            pages = [_from_lpHD(both[:, :, i * p:(i + 1) * p], self.layout).contiguous().flatten()
                     for i in range(have, len(keys))]
            ok = bool(self.backend.batch_set(keys[have:], pages))
            nbytes = sum(t.numel() * t.element_size() for t in pages) if ok else 0
        if not (ok and keep):
            self.keep(token_ids, namespace, keep=False)
        return ok, nbytes

    def get_blob(self, token_ids: Sequence[int], namespace: Optional[str]) -> Optional[bytes]:
        """:meth:`read` as the full blob the tiers move (:mod:`.codec`)."""
        kv = self.read(token_ids, namespace)
        return None if kv is None else codec.encode(kv, FULL)

    # -- the manager's full placement on the storage tier ----------------------------------
    def load(self, ctx: Context, count: Callable[..., None]) -> Optional[bytes]:
        """``ctx``'s full blob from its pages; None when one is gone or damaged (its
        pages left are released: HiCache's cache)."""
        before = self.corrupted()
        blob = self.get_blob(ctx.token_ids, ctx.namespace)
        if blob is not None:
            count(full_pages_read=1)
            return blob
        self.keep(ctx.token_ids, ctx.namespace, keep=False)
        if self.corrupted() > before:
            count(disk_corrupted=1)
            logger.warning("EvicPress: a storage page of context %s is corrupted; it will be recomputed", ctx.ctx_id)
        else:
            count(full_pages_missing=1)
            logger.info("EvicPress: storage pages of context %s are gone (evicted); it will be recomputed", ctx.ctx_id)
        return None

    def place(self, ctx: Context, blob: bytes, count: Callable[..., None]) -> bool:
        """Put ``ctx``'s full KV on storage as its pages, pinned (those HiCache has not
        written are written); whether they are all there."""
        ok, written = self.write(ctx.token_ids, ctx.namespace, codec.decode(blob)[1], keep=True)
        if ok:
            count(**({"full_pages_written": 1, "bytes_written_disk": written} if written
                     else {"full_pages_found": 1}))
        return ok


def for_pool(backend, host_pool, page_size: int, dims, zero_copy: bool) -> Optional[HiCachePages]:
    """:class:`HiCachePages` for SGLang's host ``host_pool`` (its layout and dtype) on a
    backend the controller drives through the zero-copy calls or not, or None when its
    pages are not MHA pages in a format this module reads (said in the log)."""
    layout = (ZERO_COPY if zero_copy else "") + str(getattr(host_pool, "layout", None))
    heads, head_dim = getattr(host_pool, "head_num", None), getattr(host_pool, "head_dim", None)
    why = None
    if layout not in _PAGE_SHAPES:
        why = f"page format {layout!r}"
    elif (heads, head_dim) != (dims.heads, dims.head_dim) or (dims.v_heads, dims.v_head_dim) != (dims.heads, dims.head_dim):
        why = "K and V of other shapes than the host pool's MHA pages"
    elif not callable(getattr(backend, "batch_get", None)) or not callable(getattr(backend, "batch_set", None)):
        why = f"{type(backend).__name__} has no page interface"
    if why is not None:
        logger.warning("EvicPress: full contexts on storage stay EvicPress blobs, a second copy beside "
                       "HiCache's pages (%s)", why)
        return None
    return HiCachePages(backend, layout, page_size, dims.layers, dims.heads, dims.head_dim, host_pool.dtype)
