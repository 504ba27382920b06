"""The ``VERICACHE_REMOTE`` worker: draft from a lossy copy of a stored prefix, verify
on the local server (VeriCache remote prefix caching, paths P1 and P2).

A request is *lossy* when EvicPress served its prefix from a compressed copy
(:func:`sglang_vc.evicpress.radix.served_config`: the server's ``--evicpress-load-copy``,
read from the shared store over this server's slow link); the KV of that prefix in the
pool is the copy dequantized, so the drafts are ordinary decode forwards of the target
model over it. Every other request has exact KV and decodes as usual.

One iteration (lock-step; ``L`` = committed KV length, ``t0`` = last output token):

1. **Draft** ``X`` tokens greedily, ``X`` decode forwards of the whole batch; the drafts'
   KV goes to ``row[L .. L+X-1]``.
2. **Verify** the lossy requests' drafts on the local server, the round's calls as one
   batched ``/generate`` (:mod:`.verify`): its full-KV greedy token at each draft
   position and after the last.
3. **Commit**: an exact request its ``X`` drafts (greedy decoding over exact KV); a lossy
   one the matching drafts plus the verifier's token after them (at most ``X`` tokens:
   when all ``X`` match, the bonus token is not committed, since its predecessor's KV at
   ``L+X`` was never computed here). A lossy request's first token, from its prefill over
   the copy, is the verifier's too (a verify with no drafts, sent before the prefill
   forward so that both overlap).

The KV a lossy request keeps for its committed tokens is the drafts' (computed over the
lossy prefix): it only feeds later drafts; every committed token is the verifier's
full-KV argmax. Such KV never enters the radix tree (nor does the lossy copy
share tree nodes with exact requests: :mod:`sglang_vc.evicpress.radix`). Greedy
only (sampling is refused with HTTP 400, :mod:`.requests`).

Path P2 and the fallback (:mod:`.stream`): the context's full copy streams here
while the request drafts (P2, chosen per request by ``--vc-remote-path``), or is read at
once when a verify fails (the local server is down or slower than
``--vc-remote-timeout``: the round commits nothing). Once it is here it is written over
the context's device rows and the requests on it are retracted (SGLang's retraction,
:func:`retract_switched`, called by the scheduler between iterations): requeued, each
prefills its tokens after the context over the exact prefix and decodes by itself. A
request whose full copy cannot be read either ends with HTTP 503, never an unverified
token.

Lossless tiering (``--vc-remote-path tiering``, :mod:`.tiering`): no verifier elsewhere;
a lossy request drafts at its prefill while the full copy loads here, is verified against
it before its first token, and commits its accepted drafts in the following rounds
without forwarding them.

Not built: the staggered schedule (a round waits for its verify; drafting does not
overlap it); CUDA graphs for the draft forwards.
"""

from __future__ import annotations

import logging
import time
from http import HTTPStatus
from typing import Optional

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_vc import stats
from sglang_vc.evicpress import radix as evicpress_radix
from sglang_vc.evicpress.config import FULL
from sglang_vc.spec_worker import ChainSpecWorker

from .. import flags
from ..names import META_INFO_KEY
from ..sampling import greedy_verify_ids
from .stream import FullCopies, PathInputs, RemotePath, choose_path
from .tiering import Lossy, Tiering
from .verify import STATS, RemoteVerifier, RemoteVerifyError, VerifyCall

logger = logging.getLogger(__name__)

_ACTIVE: Optional["RemoteVerifyWorker"] = None  # this scheduler's worker (one TP rank)
_EMA = 0.2  # weight of the newest measurement in the worker's running means


def _abort(req, error) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.to_finish = FINISH_ABORT(f"remote verify failed: {error}", HTTPStatus.SERVICE_UNAVAILABLE)


def _ema(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


def retract_switched(scheduler) -> int:
    """Between iterations (a scheduler hook, :mod:`sglang_vc.hooks`): install the full
    copies that have arrived, then retract the running requests whose context is exact
    now, with SGLang's own release and requeue of a retracted request. Returns how many
    were retracted."""
    worker = _ACTIVE
    if worker is None:
        return 0
    worker.install_arrived()
    batch = getattr(scheduler, "running_batch", None)
    if not worker.switching or batch is None or batch.is_empty():
        return 0
    out = [i for i, r in enumerate(batch.reqs)
           if r.rid in worker.switching and not r.finished() and r.to_finish is None]
    if not out:
        return 0
    reqs = [batch.reqs[i] for i in out]
    for n, i in enumerate(out):
        batch.release_req(i, len(out) - n)
    gone = set(out)
    batch.filter_batch(keep_indices=[i for i in range(len(batch.reqs)) if i not in gone])
    batch.batch_is_full = False
    for req in reqs:
        worker.switching.discard(req.rid)
        info = worker.per_request.pop(req.rid, None)
        if info is not None:
            info["switched_to_local"] = True
        # SGLang's requeue of a retracted request (its memory-pressure retraction does
        # the same); no public seam takes a request back into the waiting queue
        scheduler._add_request_to_queue(req, is_retracted=True)
    stats.add(STATS, switched_to_local=len(reqs))
    logger.info("VERICACHE_REMOTE: %d request(s) continue on the full KV here", len(reqs))
    return len(reqs)


class RemoteVerifyWorker(ChainSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        from sglang.srt.runtime_context import get_spec

        global _ACTIVE
        x = int(get_spec().speculative_num_draft_tokens)
        super().__init__(target_worker, stride=x + 1)
        self.num_drafts = x
        settings = flags.settings_of(server_args)
        url = flags.remote_verifier(settings)
        self.path = flags.remote_path(settings)
        # lossless tiering (no verifier elsewhere): the full copy from this server's storage
        self.verifier = None if self.path is RemotePath.TIERING else RemoteVerifier(url, flags.remote_timeout(settings))
        self.tiering = (Tiering(self, lambda: self.copies, flags.tiering_drafts(settings))
                        if self.path is RemotePath.TIERING else None)
        self.page_size = int(server_args.page_size or 1)
        self.device = self.model_runner.device
        self.per_request: dict[str, dict] = {}
        self.lossy_ctx: dict[str, str] = {}  # rid -> ctx_id of the lossy copy it drafts from
        self.switching: set[str] = set()  # rids to retract: their context is exact now
        self._copies: Optional[FullCopies] = None  # made with the radix cache (after this worker)
        self.round_s: Optional[float] = None
        self.commits_per_round: Optional[float] = None
        self.step_s: Optional[float] = None
        _ACTIVE = self
        logger.info("VERICACHE_REMOTE: X=%d, verifier %s, path %s", x,
                    url or "this server's own full copies (lossless tiering)", self.path.value)

    # ------------------------------------------------------------------ lossy requests
    def _lossy(self, req) -> bool:
        if req.rid in self.switching:
            return False
        cfg = evicpress_radix.served_config(req.rid)
        return cfg is not None and not cfg.is_full

    @property
    def copies(self) -> FullCopies:
        if self._copies is None:
            mgr = evicpress_radix.active_cache().evicpress
            self._copies = FullCopies(lambda ctx: mgr.storage_copies.read_storage_copy(ctx, FULL))
        return self._copies

    def _choose(self, req, ctx) -> RemotePath:
        if self.path is not RemotePath.AUTO:
            return self.path
        mgr = evicpress_radix.active_cache().evicpress
        c = mgr.counters
        link = c.get("bytes_loaded_disk", 0) / c["load_seconds_disk"] if c.get("load_seconds_disk") else None
        full = (ctx.stored_len or ctx.num_tokens) * mgr.dims.bytes_per_token
        return choose_path(PathInputs(int(req.sampling_params.max_new_tokens or 0), full, link, self.round_s,
                                      self.commits_per_round, self.step_s, self.num_drafts))

    def _start(self, req) -> None:
        """A lossy request's prefill: its path, and its context's full copy on P2."""
        ctx = evicpress_radix.served_context(req.rid)
        if ctx is None:
            return
        self.lossy_ctx[req.rid] = ctx.ctx_id
        path = self._choose(req, ctx)
        stats.add(STATS, **{f"requests_{path.value}": 1})
        self._info(req)["path"] = path.value.upper()
        exact = ctx.device_config is None or ctx.device_config.is_full  # installed; this request ran over lossy rows
        if path in (RemotePath.P2, RemotePath.TIERING) and not exact and self.copies.stream(ctx):
            stats.add(STATS, full_copies_streamed=1)

    def _switch(self, ctx_id: str) -> None:
        """Every request drafting from ``ctx_id`` is exact from here: retract them."""
        rids = [rid for rid, cid in self.lossy_ctx.items() if cid == ctx_id]
        for rid in rids:
            del self.lossy_ctx[rid]
        self.switching.update(rids)

    def _install(self, ctx, kv) -> bool:
        cache = evicpress_radix.active_cache()
        if kv is None or cache is None or cache.install_full(ctx, kv) == 0:
            return False
        self._switch(ctx.ctx_id)
        return True

    def install_arrived(self) -> None:
        if self._copies is None:
            return
        for ctx, kv in self._copies.arrived():
            if self._install(ctx, kv):
                stats.add(STATS, full_copies_installed=1)
            else:
                stats.add(STATS, full_copy_failures=1)

    def _fallback(self, req, error: RemoteVerifyError) -> bool:
        """A failed verify: read the context's full copy now and go exact. False (and the
        request finished with 503) when that fails too."""
        ctx = evicpress_radix.served_context(req.rid)
        if ctx is not None and self._install(ctx, self.copies.read_now(ctx)):
            stats.add(STATS, verify_fallbacks=1)
            logger.warning("VERICACHE_REMOTE: verify failed (%s); request %s continues on the full copy", error, req.rid)
            return True
        _abort(req, error)
        return False

    # ------------------------------------------------------------------ entry point
    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        if batch.forward_mode.is_decode() and len(batch.reqs) > 0:
            live = {r.rid for r in batch.reqs}  # a decode batch is every running request
            for rid in [r for r in self.per_request if r not in live]:
                del self.per_request[rid]
            for rid in [r for r in self.lossy_ctx if r not in live]:
                del self.lossy_ctx[rid]
            self.switching &= live
            if self.tiering is not None:
                self.tiering.retain(live)
            return self._round(batch)
        return self._prefill(batch, pp_proxy_tensors)

    def _exact_since_match(self, req) -> bool:
        """A request matched its context while the copy was lossy, and the full copy was
        installed before its prefill (SGLang matches waiting requests early): its prefill
        computes everything after the context over exact rows, so it is exact."""
        ctx = evicpress_radix.served_context(req.rid)
        if ctx is None or not (ctx.device_config is None or ctx.device_config.is_full):
            return False
        if evicpress_radix.active_cache().mark_exact(req.rid, req.prefix_len):
            stats.add(STATS, exact_after_install=1)
            return True
        return False

    def _prefill(self, batch, pp_proxy_tensors):
        for req in batch.reqs:  # a rid seen again is a new (or requeued) request
            self.switching.discard(req.rid)
            self.lossy_ctx.pop(req.rid, None)
            if self.tiering is not None:
                self.tiering.drop(req.rid)
        lossy = [i for i, req in enumerate(batch.reqs)
                 if getattr(req, "inflight_middle_chunks", 0) == 0 and self._lossy(req)
                 and not self._exact_since_match(req)]
        if not lossy:
            return self.prefill_result(batch, pp_proxy_tensors)
        for i in lossy:
            self._start(batch.reqs[i])
        if self.tiering is not None:
            return self._tiering_prefill(batch, lossy, pp_proxy_tensors)
        # the first token of a lossy request is the verifier's; asked before the forward
        # (after the outputs a retracted request already has)
        pending = self.verifier.submit([VerifyCall(list(batch.reqs[i].origin_input_ids) + list(batch.reqs[i].output_ids), ())
                                        for i in lossy])

        def override(predict: torch.Tensor) -> torch.Tensor:
            answers = pending()
            fixed = predict.clone()
            ok = [(i, a[0]) for i, a in zip(lossy, answers) if not isinstance(a, RemoteVerifyError)]
            for i, a in zip(lossy, answers):
                req = batch.reqs[i]
                if isinstance(a, RemoteVerifyError) and self._fallback(req, a):
                    # SGLang commits nothing of a retracted request's forward; it is
                    # requeued (retract_switched) and prefills again over the full copy
                    req.is_retracted = True
            if ok:
                idx = torch.tensor([i for i, _ in ok], device=fixed.device)
                fixed[idx] = torch.tensor([t for _, t in ok], device=fixed.device, dtype=fixed.dtype)
            stats.add(STATS, first_tokens_verified=len(ok), verify_failures=len(lossy) - len(ok))
            for i, _ in ok:
                self._record(batch.reqs[i], 0, 0, 1)
            return fixed

        return self.prefill_result(batch, pp_proxy_tensors, override=override)

    def _tiering_prefill(self, batch, lossy: list[int], pp_proxy_tensors):
        cache = evicpress_radix.active_cache()
        todo = [Lossy(i, evicpress_radix.served_context(batch.reqs[i].rid),
                      min(batch.reqs[i].prefix_len, cache.context_rows(batch.reqs[i].rid))) for i in lossy]

        def install(ctx, kv) -> int:
            exact = ctx.device_config is None or ctx.device_config.is_full
            rows = cache.install_full(ctx, kv)
            if rows and not exact:
                stats.add(STATS, full_copies_installed=1)
            return rows

        def override(predict: torch.Tensor) -> torch.Tensor:
            fixed = self.tiering.prefill(batch, todo, predict, install)
            for x in todo:  # every row after x.start recomputed over the full copy
                req = batch.reqs[x.index]
                if req.to_finish is None:
                    cache.mark_exact(req.rid, x.start)
                    self.lossy_ctx.pop(req.rid, None)
            return fixed

        return self.prefill_result(batch, pp_proxy_tensors, override=override)

    def fail(self, req, reason: str) -> None:
        _abort(req, reason)

    def info_of(self, req) -> dict:
        return self._info(req)

    # ------------------------------------------------------------------ one round
    @torch.inference_mode()
    def _round(self, batch):
        started = time.perf_counter()
        bs, x = len(batch.reqs), self.num_drafts
        dev, seq_dtype = batch.seq_lens.device, batch.seq_lens.dtype
        committed = batch.seq_lens.to("cpu", torch.int64)
        rows = batch.req_pool_indices.to("cpu", torch.int64)
        req_to_token = self.req_to_token_pool.req_to_token
        positions = committed[:, None] + torch.arange(x)[None, :]
        slots = req_to_token[rows[:, None].to(req_to_token.device), positions.to(req_to_token.device)].to(torch.int64)
        t0 = torch.tensor([req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1]
                           for req in batch.reqs], dtype=torch.int64)

        # 1. draft X tokens; the drafts stay on the device until the round needs them on
        # the host (one synchronisation, not one per forward). Only the rows that need
        # them: a request holding tokens verified at its prefill (lossless tiering)
        # commits those, so a round of holders alone runs no forward
        holders = {i for i, r in enumerate(batch.reqs) if self.tiering is not None and self.tiering.holding(r.rid)}
        drafting = [i for i in range(bs) if i not in holders]
        drafts = torch.zeros(bs, x, dtype=torch.int64)
        if drafting:
            whole = not holders
            sub = batch if whole else self.sub_batch(batch, drafting)
            idx = torch.tensor(drafting)
            cur, drafted = t0[idx], []
            for j in range(x):
                self.set_batch(sub, ForwardMode.DECODE, cur, committed[idx] + j + 1, slots[idx, j], None, seq_dtype, dev)
                res = self.target_worker.forward_batch_generation(sub, is_verify=True)
                cur = res.logits_output.next_token_logits.argmax(-1)
                drafted.append(cur)
            drafts[idx] = torch.stack(drafted, 1).to("cpu", torch.int64)
            if whole:  # the draft step of the whole batch (what choose_path prices)
                self.step_s = _ema(self.step_s, (time.perf_counter() - started) / x)
        # the batch leaves the round at its committed lengths: SGLang adds the accepted
        # tokens to what the worker left there
        self.set_batch(batch, ForwardMode.DECODE, t0, committed, slots[:, 0], None, seq_dtype, dev)

        # 2. verify the lossy requests' drafts on the local server; a request waiting to
        # be retracted (its context is exact now) commits nothing
        accept_tokens = torch.zeros(bs, x + 1, dtype=torch.int64)
        accept_tokens[:, :x] = drafts
        accept_lens = torch.full((bs,), x, dtype=torch.int64)
        for i, req in enumerate(batch.reqs):
            if req.rid in self.switching:
                accept_lens[i] = 0
        if self.tiering is not None:
            # tokens verified at the prefill: committed with their KV, drafts discarded
            self.tiering.drain(batch, committed, slots, accept_tokens, accept_lens, x)
        lossy = [i for i, req in enumerate(batch.reqs) if self._lossy(req)]
        if lossy and self.verifier is None:  # never: a tiering request is exact after its prefill
            for i in lossy:
                _abort(batch.reqs[i], "lossless tiering: a lossy request reached a decode round unverified")
                accept_lens[i] = 1
            lossy = []
        if lossy:
            draft_rows = drafts[lossy].tolist()
            answers = self.verifier.submit([
                VerifyCall(list(batch.reqs[i].origin_input_ids) + list(batch.reqs[i].output_ids), d)
                for i, d in zip(lossy, draft_rows)])()
            good = [(k, i) for k, (i, a) in enumerate(zip(lossy, answers)) if not isinstance(a, RemoteVerifyError)]
            for i, a in zip(lossy, answers):
                if isinstance(a, RemoteVerifyError):
                    # nothing committed this round: the request goes exact (fallback), or
                    # ends with 503 and its one placeholder token is never served
                    accept_lens[i] = 0 if self._fallback(batch.reqs[i], a) else 1
            if good:
                idx = torch.tensor([i for _, i in good])
                targets = torch.tensor([answers[k] for k, _ in good], dtype=torch.int64)
                # 3. commit: the matching drafts and the verifier's token after them,
                # at most X (the bonus after X matches has no KV for its predecessor)
                verdict = greedy_verify_ids(drafts[idx], targets, pad_id=0)
                accept_tokens[idx] = verdict.tokens.to(torch.int64)
                accept_lens[idx] = verdict.num_tokens.to(torch.int64).clamp(max=x)
                accepted = verdict.num_accepted
                commits = int(accept_lens[idx].sum())
                stats.add(STATS, verify_rounds=len(good), drafted=len(good) * x, accepted=int(accepted.sum()),
                          committed=commits, verify_failures=len(lossy) - len(good))
                for (k, i), a in zip(good, accepted.tolist()):
                    self._record(batch.reqs[i], x, a, int(accept_lens[i]))
                self.round_s = _ema(self.round_s, time.perf_counter() - started)
                self.commits_per_round = _ema(self.commits_per_round, commits / len(good))
        stats.add(STATS, rounds=1, exact_rows=bs - len(lossy), rounds_without_forward=int(not drafting))
        return self.result(batch, accept_tokens, accept_lens)

    def _info(self, req) -> dict:
        """The request's counters, returned in its ``meta_info``."""
        info = self.per_request.get(req.rid)
        if info is None:
            info = self.per_request[req.rid] = {"remote_verifier": self.verifier.url if self.verifier else None,
                                                "verify_rounds": 0,
                                                "drafted": 0, "accepted": 0, "committed": 0,
                                                "draft_tokens": self.num_drafts}
            if req.customized_info is None:
                req.customized_info = {}
            req.customized_info[META_INFO_KEY] = [info]
        return info

    def _record(self, req, drafted: int, accepted: int, committed: int) -> None:
        info = self._info(req)
        if drafted:
            info["verify_rounds"] += 1
        info["drafted"] += drafted
        info["accepted"] += accepted
        info["committed"] += committed
