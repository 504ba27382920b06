"""Bringing a request's chunk KV onto the device, through SGLang's own request path.

A chunk's KV is cached like any prefix, under the chunk's own token ids (computed alone
from position 0), so it lives wherever SGLang's tree keeps cached KV: the device pool,
HiCache's host pool, or HiCache's storage backend. Before a SpecCache request is
queued, the front end sends one prefill-only request per chunk (the chunk's ids alone,
``max_new_tokens = 0``). SGLang's scheduler serves it as any request: a device hit, a
host hit that its HiCache controller loads back, a storage hit it prefetches, or a miss
it computes (a chunk seen for the first time: this is how chunks are registered). Its
``cached_tokens`` and ``cached_tokens_details`` tell which (:func:`source_of`). The
SpecCache request then finds the chunk on the device.

A prefill-only request computes at least the chunk's last token (SGLang's match leaves
one token to compute), so a fetch costs a forward even when the chunk is on the device
(on a CPU, with a 1.5B model, most of a second: the weights are read once per forward).
The front end therefore fetches only chunks it has not fetched before (its ``known``
set, cleared by a cache flush); the prefill's lookup checks the others, and a chunk the
tree evicted is recomputed by that prefill, reported, and fetched again by the next
request.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from dataclasses import dataclass
from typing import Optional, Sequence

from .names import FETCH_RID_PREFIX


class ChunkSource(str, enum.Enum):
    """Where a fetched chunk's KV came from (the slowest tier that served part of it)."""

    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"
    COMPUTED = "computed"  # no tier had it whole: prefilled (a miss)
    KNOWN = "known"  # not fetched: an earlier request did; the prefill's lookup finds it or not


def source_of(meta_info: dict, num_tokens: int) -> ChunkSource:
    """The source of the fetch of a ``num_tokens`` chunk, from its response's
    ``meta_info``. A hit is the whole chunk but its last token (which SGLang always
    computes) found in the tiers; a cached part only (another chunk sharing its first
    tokens) is a miss, computed."""
    if int(meta_info.get("cached_tokens") or 0) < max(num_tokens - 1, 1):
        return ChunkSource.COMPUTED
    details = meta_info.get("cached_tokens_details") or {}
    if int(details.get("storage") or 0) > 0:
        return ChunkSource.STORAGE
    if int(details.get("host") or 0) > 0:
        return ChunkSource.HOST
    return ChunkSource.DEVICE


@dataclass(frozen=True)
class Namespace:
    """The tree namespace of the request whose chunks are fetched (its LoRA adapter and
    cache salt key its KV in SGLang's tree): fetches share it."""

    lora_path: Optional[str] = None
    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None

    @classmethod
    def of(cls, obj) -> "Namespace":
        def one(name):
            value = getattr(obj, name, None)
            return value if isinstance(value, str) else None

        return cls(one("lora_path"), one("extra_key"), one("cache_salt"))


async def fetch_chunks(tokenizer_manager, chunk_ids: Sequence[Sequence[int]],
                       namespace: Namespace = Namespace()) -> list[ChunkSource]:
    """Bring each chunk onto the device (one prefill-only request each, concurrently);
    the source of each, in order. Repeated chunks are fetched once."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    keys = [tuple(int(t) for t in ids) for ids in chunk_ids]
    unique = list(dict.fromkeys(keys))

    async def one(key) -> ChunkSource:
        # a fetch is never itself a SpecCache prompt, whatever its tokens decode to
        req = GenerateReqInput(rid=f"{FETCH_RID_PREFIX}{uuid.uuid4().hex}",
                               input_ids=list(key), sampling_params={"max_new_tokens": 0},
                               lora_path=namespace.lora_path, extra_key=namespace.extra_key,
                               cache_salt=namespace.cache_salt)
        meta: dict = {}
        async for out in tokenizer_manager.generate_request(req, None):
            meta = out.get("meta_info") or meta
        return source_of(meta, len(key))

    sources = dict(zip(unique, await asyncio.gather(*(one(k) for k in unique))))
    return [sources[k] for k in keys]
