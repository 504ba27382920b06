"""SpecCache in the server's front end (SGLang's tokenizer manager, main process).

For a prompt marked with the separator (text, or token ids whose text has it: the
OpenAI chat API tokenizes its template), before SGLang tokenizes it:

1. the prompt is split and tokenized piece by piece (:mod:`.layout`);
2. its chunks this front end has not fetched before are *fetched* onto the device
   (:mod:`.fetch`): one prefill-only request per chunk (its ids alone, from position 0),
   which SGLang serves from the device tree, loads back from HiCache's host pool or
   storage backend, or computes the first time (so a chunk's KV is cached under its
   token ids like any prefix, in every tier);
3. at the same time, the selector picks the chunk tokens to recompute; ``speccache``
   runs the speculative model over the text in a worker thread (the event loop keeps
   serving, and the fetches run in the scheduler meanwhile);
4. the request goes on with the joined token ids and the plan (chunk spans, recomputed
   positions, where each chunk came from) in ``custom_params``, where the scheduler's
   radix cache and attention backend read it.

Bad input is a ``ValueError`` here, which SGLang answers with HTTP 400: a malformed chunk
layout, an unknown selector, a ratio outside [0, 1], a ``speccache_overlap`` that is not
a boolean, a client-sent plan, or input log-probabilities (the reused tokens have no
logits). A chunk no longer (wholly) on the device when the request's prefill looks it up
(the tree evicted it) is recomputed by that prefill (counted as ``chunks_lost``: slower,
never wrong); the response reports it, and the front end forgets it
(:meth:`Frontend.forget`) so that the next request fetches it again (from the host or
storage tier where HiCache kept it). A cache flush makes it forget every chunk at once
(:meth:`Frontend.forget_all`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, Optional, Sequence

import torch

from sglang_vc import stats
from sglang_vc.request_checks import check_token_ids

from . import layout
from .align import align
from .fetch import ChunkSource, Namespace, fetch_chunks
from .flags import SpecCacheSettings, check_ratio, check_selector
from .names import FETCH_RID_PREFIX, GROUP, PLAN_KEY, REQUEST_KEYS
from .selectors import Need, SelectionInput, get_selector
from .spec_model import SpecModel

logger = logging.getLogger(__name__)

MAX_KNOWN_CHUNKS = 4096  # chunks this front end fetched (LRU)


class Frontend:
    def __init__(self, tokenizer_manager, settings: SpecCacheSettings):
        self.tm = tokenizer_manager
        self.settings = settings
        self.known: OrderedDict[tuple, None] = OrderedDict()  # (namespace, chunk ids)
        self._spec: Optional[SpecModel] = None
        self._spec_error: Optional[BaseException] = None
        self._spec_lock = threading.Lock()  # one load; requests needing it wait for it
        if settings.selector == "speccache":  # load at start-up, not in the first request
            threading.Thread(target=self._try_load, daemon=True, name="speccache-spec-model").start()

    # ------------------------------------------------------------------ spec model

    def _try_load(self) -> None:
        try:
            self.spec_model()
        except RuntimeError:
            pass  # logged; each request that needs it gets the error

    def spec_model(self) -> SpecModel:
        """The speculative model, loaded once (a failed load is not retried)."""
        with self._spec_lock:
            if self._spec is None and self._spec_error is None:
                try:
                    t = time.perf_counter()
                    device = "cuda" if torch.cuda.is_available() else "cpu"
                    self._spec = SpecModel(self.settings.spec_model, device)
                    logger.info("SpecCache: speculative model %s loaded on %s in %.1f s",
                                self.settings.spec_model, device, time.perf_counter() - t)
                except Exception as exc:
                    self._spec_error = exc
                    logger.error("SpecCache: speculative model %s failed to load: %s", self.settings.spec_model, exc)
        if self._spec is None:
            raise RuntimeError(f"the speculative model {self.settings.spec_model} is not available: {self._spec_error}")
        return self._spec

    # ------------------------------------------------------------------ requests

    def request_options(self, custom: dict) -> tuple[str, float, bool]:
        """(selector, ratio, overlap) of a request: the server's, or its ``custom_params``'."""
        if PLAN_KEY in custom:
            raise ValueError(f"custom_params.{PLAN_KEY} is set by the server, not by a client")
        unknown = sorted(k for k in custom if k.startswith("speccache") and k not in REQUEST_KEYS)
        if unknown:
            raise ValueError(f"unknown SpecCache request keys {unknown}; known: {list(REQUEST_KEYS)}")
        selector = check_selector(custom.get("speccache_selector", self.settings.selector))
        ratio = check_ratio(custom.get("speccache_ratio", self.settings.ratio))
        overlap = custom.get("speccache_overlap", True)
        if not isinstance(overlap, bool):
            raise ValueError(f"speccache_overlap must be true or false, got {overlap!r}")
        return selector, ratio, overlap

    def prompt_text(self, obj) -> Optional[str]:
        if isinstance(obj.text, str):
            return obj.text
        if obj.input_ids is not None and self.tm.tokenizer is not None and obj.input_embeds is None:
            # ids are decoded to find the chunk marks: refuse what is not a token first
            check_token_ids(obj.input_ids, self.tm.model_config.vocab_size)
            return self.tm.tokenizer.decode(obj.input_ids)
        return None

    async def prepare(self, obj) -> None:
        """Turn ``obj`` (one ``GenerateReqInput``) into a SpecCache request when its prompt
        carries chunks; leave it alone otherwise."""
        if isinstance(obj.rid, str) and obj.rid.startswith(FETCH_RID_PREFIX):
            return  # the front end's own chunk fetch
        params = obj.sampling_params if isinstance(obj.sampling_params, dict) else {}
        custom = params.get("custom_params") or {}
        if not isinstance(custom, dict):
            return  # SGLang's own validation answers
        text = self.prompt_text(obj)
        if text is None or self.settings.separator not in text:
            if any(k in custom for k in (*REQUEST_KEYS, PLAN_KEY)):
                raise ValueError(f"speccache_* options need a prompt whose chunks are marked with "
                                 f"{self.settings.separator!r}")
            return
        started = time.perf_counter()
        selector, ratio, overlap = self.request_options(custom)
        if obj.return_logprob:
            raise ValueError("SpecCache requests cannot return log-probabilities: the reused prompt tokens have "
                             "no logits of their own")
        prefix, chunks, query = layout.split(text, self.settings.separator)
        t = time.perf_counter()
        prompt = layout.tokenize(self.tm.tokenizer, prefix, chunks, query)
        tokenize_s = time.perf_counter() - t
        seed = int(params.get("sampling_seed") or 0)

        async def fetch() -> tuple[list[ChunkSource], float]:
            t0 = time.perf_counter()
            sources = await self.fetch(prompt.chunk_ids, Namespace.of(obj))
            return sources, time.perf_counter() - t0

        def select():  # the small model's forward runs in a thread: the event loop keeps serving
            return asyncio.to_thread(self.select, prompt, selector, ratio, seed)

        if overlap:
            # the selection overlaps the chunks' fetch (loads and prefills in the
            # scheduler): neither needs the other
            (recompute, times), (sources, fetch_s) = await asyncio.gather(select(), fetch())
        else:  # one after the other: what the overlap buys is the difference
            sources, fetch_s = await fetch()
            recompute, times = await select()
        times.update(tokenize_s=tokenize_s, fetch_s=fetch_s, front_end_s=time.perf_counter() - started)
        stats.add(GROUP, requests=1, **times)
        obj.input_ids = prompt.ids
        obj.text = prompt.text
        params = dict(params)
        params["custom_params"] = {**custom, PLAN_KEY: {
            "starts": list(prompt.chunks.starts), "ends": list(prompt.chunks.ends),
            "recompute": recompute, "selector": selector, "ratio": ratio,
            "return_selection": bool(custom.get("speccache_return_selection", False)),
            "times": {k: round(v, 6) for k, v in times.items()},
            "sources": [s.value for s in sources],
        }}
        obj.sampling_params = params

    def select(self, prompt: layout.Prompt, selector: str, ratio: float, seed: int) -> tuple[list[int], dict]:
        """The chunk positions to recompute, and the time it took by part. A selector
        that needs the target's own first layer (``cacheblend``) selects in the prefill
        (:mod:`.attention`): none here."""
        sel = get_selector(selector)
        inp = SelectionInput(prompt.chunks, seed=seed)
        times: dict[str, float] = {}
        if sel.needs is Need.FIRST_LAYER_DEVIATION:
            return [], times
        if sel.needs is Need.SPEC_SCORES:
            def spec_scores():
                t = time.perf_counter()
                scores = self.spec_model().score(prompt.text)
                times["score_s"] = time.perf_counter() - t
                t = time.perf_counter()
                alignment = align(scores.offsets, prompt.offsets)
                times["align_s"] = time.perf_counter() - t
                return scores.importance, alignment

            inp.spec_scores = spec_scores
        t = time.perf_counter()
        mask = sel.select(inp, ratio)
        times["select_s"] = time.perf_counter() - t - times.get("score_s", 0.0) - times.get("align_s", 0.0)
        return mask.nonzero().flatten().tolist(), times

    # ------------------------------------------------------------------ chunks

    async def fetch(self, chunk_ids: Sequence[Sequence[int]], namespace: Namespace = Namespace(),
                    force: bool = False) -> list[ChunkSource]:
        """Bring the chunks this front end has not fetched before (all, ``force``) onto
        the device (:func:`.fetch.fetch_chunks`); the source of each chunk, ``KNOWN``
        for those not fetched. Counts where the fetched ones came from."""
        keys = [(namespace, tuple(int(t) for t in ids)) for ids in chunk_ids]
        todo = [k for k in dict.fromkeys(keys) if force or k not in self.known]
        fetched = dict(zip(todo, await fetch_chunks(self.tm, [ids for _, ids in todo], namespace)))
        for k in keys:
            self.known[k] = None
            self.known.move_to_end(k)
        while len(self.known) > MAX_KNOWN_CHUNKS:
            self.known.popitem(last=False)
        found = Counter(fetched.values())
        stats.add(GROUP, chunks_fetched=len(todo), chunk_hits_host=found[ChunkSource.HOST],
                  chunk_hits_storage=found[ChunkSource.STORAGE], chunk_misses=found[ChunkSource.COMPUTED])
        return [fetched.get(k, ChunkSource.KNOWN) for k in keys]

    def forget_all(self) -> None:
        """After a cache flush: no chunk is on the device any more, so the next request
        that brings one fetches it (from storage, where HiCache keeps it, or computed)."""
        self.known.clear()

    def forget(self, obj, meta: dict) -> None:
        """A finished SpecCache request's report: chunks its prefill did not find (wholly)
        on the device are fetched again by the next request that brings them."""
        plan = ((obj.sampling_params or {}).get("custom_params") or {}).get(PLAN_KEY)
        if not plan or not meta.get("lost_chunks") or obj.input_ids is None:
            return
        namespace = Namespace.of(obj)
        for i in meta["lost_chunks"]:
            self.known.pop((namespace, tuple(obj.input_ids[plan["starts"][i]:plan["ends"][i]])), None)

    def chunk_ids_of(self, texts: Sequence[Any]) -> list[list[int]]:
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
            raise ValueError("'chunks' must be a non-empty list of non-empty strings")
        if len(texts) > layout.MAX_CHUNKS:
            raise ValueError(f"at most {layout.MAX_CHUNKS} chunks a call (each is a prefill of its own), "
                             f"got {len(texts)}")
        marked = [i for i, t in enumerate(texts) if self.settings.separator in t]
        if marked:  # a prompt could not carry it: the separator would split it
            raise ValueError(f"chunk {marked[0]} contains the chunk separator {self.settings.separator!r}")
        return [list(self.tm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


_frontends: dict[int, Frontend] = {}


def frontend_for(tokenizer_manager) -> Optional[Frontend]:
    """The front end of a tokenizer manager whose server runs SpecCache (else None)."""
    key = id(tokenizer_manager)
    if key not in _frontends:
        from sglang_vc.config import get_vc_config

        from .flags import settings_of

        settings = settings_of(get_vc_config(tokenizer_manager.server_args).group(GROUP))
        _frontends[key] = None if settings is None else Frontend(tokenizer_manager, settings)
    return _frontends[key]
