"""SpecCache in the server's front end (SGLang's tokenizer manager, main process).

For a prompt marked with the separator (text, or token ids whose text has it: the
OpenAI chat API tokenizes its template), before SGLang tokenizes it:

1. the prompt is split and tokenized piece by piece (:mod:`.layout`);
2. chunks it has not seen are *registered*: each is prefilled alone, at positions
   ``0 ..``, as a prefill-only request (``max_new_tokens = 0``), so its KV enters the
   radix tree under its token ids like any cached prefix;
3. at the same time, the selector picks the chunk tokens to recompute; ``speccache``
   runs the speculative model over the text in a worker thread (the event loop keeps
   serving, and new chunks prefill in the scheduler meanwhile);
4. the request goes on with the joined token ids and the plan (chunk spans, recomputed
   positions) in ``custom_params``, where the scheduler's radix cache and attention
   backend read it.

Bad input is a ``ValueError`` here, which SGLang answers with HTTP 400: a malformed chunk
layout, an unknown selector, a ratio outside [0, 1], a client-sent plan, or input
log-probabilities (the reused tokens have no logits). A chunk the tree evicted after its
registration is recomputed in full by the request that finds it missing (counted, and
reported back here so that the next request registers it again).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch

from sglang_vc import stats

from . import layout
from .align import align
from .flags import SpecCacheSettings, check_ratio, check_selector
from .names import GROUP, PLAN_KEY, REQUEST_KEYS
from .selectors import Need, SelectionInput, get_selector
from .spec_model import SpecModel

logger = logging.getLogger(__name__)

MAX_REMEMBERED_CHUNKS = 4096  # chunk keys this front end registered (LRU)


class Frontend:
    def __init__(self, tokenizer_manager, settings: SpecCacheSettings):
        self.tm = tokenizer_manager
        self.settings = settings
        self.known: OrderedDict[tuple[int, ...], None] = OrderedDict()
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

    def request_options(self, custom: dict) -> tuple[str, float]:
        """(selector, ratio) of a request: the server's, or its ``custom_params``'."""
        if PLAN_KEY in custom:
            raise ValueError(f"custom_params.{PLAN_KEY} is set by the server, not by a client")
        unknown = sorted(k for k in custom if k.startswith("speccache") and k not in REQUEST_KEYS)
        if unknown:
            raise ValueError(f"unknown SpecCache request keys {unknown}; known: {list(REQUEST_KEYS)}")
        selector = check_selector(custom.get("speccache_selector", self.settings.selector))
        ratio = check_ratio(custom.get("speccache_ratio", self.settings.ratio))
        return selector, ratio

    def prompt_text(self, obj) -> Optional[str]:
        if isinstance(obj.text, str):
            return obj.text
        if obj.input_ids is not None and self.tm.tokenizer is not None and obj.input_embeds is None:
            return self.tm.tokenizer.decode(obj.input_ids)
        return None

    async def prepare(self, obj) -> None:
        """Turn ``obj`` (one ``GenerateReqInput``) into a SpecCache request when its prompt
        carries chunks; leave it alone otherwise."""
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
        selector, ratio = self.request_options(custom)
        if obj.return_logprob:
            raise ValueError("SpecCache requests cannot return log-probabilities: the reused prompt tokens have "
                             "no logits of their own")
        prefix, chunks, query = layout.split(text, self.settings.separator)
        t = time.perf_counter()
        prompt = layout.tokenize(self.tm.tokenizer, prefix, chunks, query)
        tokenize_s = time.perf_counter() - t
        seed = int(params.get("sampling_seed") or 0)

        async def register() -> float:
            t0 = time.perf_counter()
            await self.register(prompt.chunk_ids)
            return time.perf_counter() - t0

        # the selection (the small model's forward, in a thread) overlaps the registration
        # of new chunks (their prefill, in the scheduler): neither needs the other
        (recompute, times), register_s = await asyncio.gather(
            asyncio.to_thread(self.select, prompt, selector, ratio, seed), register())
        times.update(tokenize_s=tokenize_s, register_s=register_s)
        stats.add(GROUP, requests=1, **times)
        obj.input_ids = prompt.ids
        obj.text = prompt.text
        params = dict(params)
        params["custom_params"] = {**custom, PLAN_KEY: {
            "starts": list(prompt.chunks.starts), "ends": list(prompt.chunks.ends),
            "recompute": recompute, "selector": selector, "ratio": ratio,
            "times": {k: round(v, 6) for k, v in times.items()},
        }}
        obj.sampling_params = params

    def select(self, prompt: layout.Prompt, selector: str, ratio: float, seed: int) -> tuple[list[int], dict]:
        """The chunk positions to recompute, and the time it took by part."""
        sel = get_selector(selector)
        inp = SelectionInput(prompt.chunks, seed=seed)
        times: dict[str, float] = {}
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

    # ------------------------------------------------------------------ registration

    async def register(self, chunk_ids: Sequence[Sequence[int]], force: bool = False) -> int:
        """Prefill the chunks this front end has not registered (or all, ``force``), each
        alone from position 0, as prefill-only requests: their KV then sits in the radix
        tree. A registered chunk the tree has evicted since is reported back by the
        request that missed it (:meth:`forget`) and registered again by the next one.
        Returns how many were prefilled."""
        keys = list(dict.fromkeys(tuple(int(t) for t in ids) for ids in chunk_ids))
        new = [key for key in keys if force or key not in self.known]
        if new:
            await asyncio.gather(*(self._prefill(list(key)) for key in new))
        for key in keys:
            self.known[key] = None
            self.known.move_to_end(key)
        while len(self.known) > MAX_REMEMBERED_CHUNKS:
            self.known.popitem(last=False)
        stats.add(GROUP, chunks_seen=len(keys), chunks_registered=len(new))
        return len(new)

    def forget(self, obj, meta: dict) -> None:
        """A finished SpecCache request's report: chunks the tree no longer (wholly) had
        are registered again by the next request that brings them."""
        plan = ((obj.sampling_params or {}).get("custom_params") or {}).get(PLAN_KEY)
        if not plan or not meta.get("incomplete_chunks") or obj.input_ids is None:
            return
        for i in meta["incomplete_chunks"]:
            self.known.pop(tuple(obj.input_ids[plan["starts"][i]:plan["ends"][i]]), None)

    async def _prefill(self, ids: list[int]) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        req = GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": 0})
        async for _ in self.tm.generate_request(req, None):
            pass

    def chunk_ids_of(self, texts: Sequence[Any]) -> list[list[int]]:
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
            raise ValueError("'chunks' must be a non-empty list of non-empty strings")
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
