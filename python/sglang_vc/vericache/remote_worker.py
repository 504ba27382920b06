"""The ``VERICACHE_REMOTE`` worker: draft from a lossy copy of a stored prefix, verify
every round on the local server (VeriCache remote prefix caching, path P1).

A request is *lossy* when EvicPress served its prefix from a compressed copy
(:func:`sglang_vc.evicpress.radix.served_config`: the server's ``--evicpress-load-copy``,
read from the shared store over this server's slow link); the KV of that prefix in the
pool is the copy dequantized, so the drafts are ordinary decode forwards of the target
model over it. Every other request has exact KV and decodes as usual.

One iteration (lock-step; ``L`` = committed KV length, ``t0`` = last output token):

1. **Draft** ``X`` tokens greedily, ``X`` decode forwards of the whole batch; the drafts'
   KV goes to ``row[L .. L+X-1]``.
2. **Verify** the lossy requests' drafts on the local server, one ``/generate`` call per
   request, concurrently (:mod:`.remote_verify`): its full-KV greedy token at each draft
   position and after the last.
3. **Commit**: an exact request its ``X`` drafts (greedy decoding over exact KV); a lossy
   one the matching drafts plus the verifier's token after them (at most ``X`` tokens:
   when all ``X`` match, the bonus token is not committed, since its predecessor's KV at
   ``L+X`` was never computed here). A lossy request's first token, from its prefill over
   the copy, is the verifier's too (a verify with no drafts, sent before the prefill
   forward so that both overlap).

The KV a lossy request keeps for its committed tokens is the drafts' (computed over the
lossy prefix): it only feeds later drafts; every committed token is the verifier's
full-KV argmax. Greedy only (sampling is refused with HTTP 400, :mod:`.requests`). A
verify that fails (the local server is down or times out, ``--vc-remote-timeout``)
finishes its request with HTTP 503 and commits nothing unverified to it.

Not built: path P2 (stream the rest of the full KV here and verify locally once it has
arrived), falling back to loading the full copy when the verifier fails, the staggered
schedule (a round waits for its verify; drafting does not overlap it).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_vc import stats
from sglang_vc.evicpress.radix import served_config
from sglang_vc.spec_worker import ChainSpecWorker

from . import flags
from .names import META_INFO_KEY
from .remote_verify import STATS, RemoteVerifier, RemoteVerifyError, VerifyCall
from .sampling import greedy_verify_ids

logger = logging.getLogger(__name__)


def _lossy(req) -> bool:
    cfg = served_config(req.rid)
    return cfg is not None and not cfg.is_full


def _abort(req, error: RemoteVerifyError) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.to_finish = FINISH_ABORT(f"remote verify failed: {error}", HTTPStatus.SERVICE_UNAVAILABLE)


class RemoteVerifyWorker(ChainSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        from sglang.srt.runtime_context import get_spec

        x = int(get_spec().speculative_num_draft_tokens)
        super().__init__(target_worker, stride=x + 1)
        self.num_drafts = x
        settings = flags.settings_of(server_args)
        url = flags.remote_verifier(settings)
        self.verifier = RemoteVerifier(url, flags.remote_timeout(settings))
        self.per_request: dict[str, dict] = {}
        logger.info("VERICACHE_REMOTE: X=%d, verifier %s", x, url)

    # ------------------------------------------------------------------ entry point
    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        if batch.forward_mode.is_decode() and len(batch.reqs) > 0:
            live = {r.rid for r in batch.reqs}  # a decode batch is every running request
            for rid in [r for r in self.per_request if r not in live]:
                del self.per_request[rid]
            return self._round(batch)
        return self._prefill(batch, pp_proxy_tensors)

    def _prefill(self, batch, pp_proxy_tensors):
        lossy = [i for i, req in enumerate(batch.reqs)
                 if getattr(req, "inflight_middle_chunks", 0) == 0 and _lossy(req)]
        if not lossy:
            return self.prefill_result(batch, pp_proxy_tensors)
        # the first token of a lossy request is the verifier's; asked before the forward
        pending = self.verifier.submit([VerifyCall(batch.reqs[i].origin_input_ids, ()) for i in lossy])

        def override(predict: torch.Tensor) -> torch.Tensor:
            answers = pending()
            fixed = predict.clone()
            ok = [(i, a[0]) for i, a in zip(lossy, answers) if not isinstance(a, RemoteVerifyError)]
            for i, a in zip(lossy, answers):
                if isinstance(a, RemoteVerifyError):
                    _abort(batch.reqs[i], a)
            if ok:
                idx = torch.tensor([i for i, _ in ok], device=fixed.device)
                fixed[idx] = torch.tensor([t for _, t in ok], device=fixed.device, dtype=fixed.dtype)
            stats.add(STATS, first_tokens_verified=len(ok), verify_failures=len(lossy) - len(ok))
            for i, _ in ok:
                self._record(batch.reqs[i], 0, 0, 1)
            return fixed

        return self.prefill_result(batch, pp_proxy_tensors, override=override)

    # ------------------------------------------------------------------ one round
    @torch.inference_mode()
    def _round(self, batch):
        bs, x = len(batch.reqs), self.num_drafts
        dev, seq_dtype = batch.seq_lens.device, batch.seq_lens.dtype
        committed = batch.seq_lens.to("cpu", torch.int64)
        rows = batch.req_pool_indices.to("cpu", torch.int64)
        req_to_token = self.req_to_token_pool.req_to_token
        positions = committed[:, None] + torch.arange(x)[None, :]
        slots = req_to_token[rows[:, None].to(req_to_token.device), positions.to(req_to_token.device)].to(torch.int64)
        t0 = torch.tensor([req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1]
                           for req in batch.reqs], dtype=torch.int64)

        # 1. draft X tokens, the whole batch; the drafts stay on the device until the
        # round needs them on the host (one synchronisation, not one per forward)
        drafted = []
        cur = t0
        for j in range(x):
            self.set_batch(batch, ForwardMode.DECODE, cur, committed + j + 1, slots[:, j], None, seq_dtype, dev)
            res = self.target_worker.forward_batch_generation(batch, is_verify=True)
            cur = res.logits_output.next_token_logits.argmax(-1)
            drafted.append(cur)
        drafts = torch.stack(drafted, 1).to("cpu", torch.int64)
        # the batch leaves the round at its committed lengths: SGLang adds the accepted
        # tokens to what the worker left there
        self.set_batch(batch, ForwardMode.DECODE, t0, committed, slots[:, 0], None, seq_dtype, dev)

        # 2. verify the lossy requests' drafts on the local server
        accept_tokens = torch.zeros(bs, x + 1, dtype=torch.int64)
        accept_tokens[:, :x] = drafts
        accept_lens = torch.full((bs,), x, dtype=torch.int64)
        lossy = [i for i, req in enumerate(batch.reqs) if _lossy(req)]
        if lossy:
            draft_rows = drafts[lossy].tolist()
            answers = self.verifier.submit([
                VerifyCall(list(batch.reqs[i].origin_input_ids) + list(batch.reqs[i].output_ids), d)
                for i, d in zip(lossy, draft_rows)])()
            good = [(k, i) for k, (i, a) in enumerate(zip(lossy, answers)) if not isinstance(a, RemoteVerifyError)]
            for i, a in zip(lossy, answers):
                if isinstance(a, RemoteVerifyError):
                    _abort(batch.reqs[i], a)  # finishes with 503; its one token below is never served
                    accept_lens[i] = 1
            if good:
                idx = torch.tensor([i for _, i in good])
                targets = torch.tensor([answers[k] for k, _ in good], dtype=torch.int64)
                # 3. commit: the matching drafts and the verifier's token after them,
                # at most X (the bonus after X matches has no KV for its predecessor)
                verdict = greedy_verify_ids(drafts[idx], targets, pad_id=0)
                accept_tokens[idx] = verdict.tokens.to(torch.int64)
                accept_lens[idx] = verdict.num_tokens.to(torch.int64).clamp(max=x)
                accepted = verdict.num_accepted
                stats.add(STATS, verify_rounds=len(good), drafted=len(good) * x, accepted=int(accepted.sum()),
                          committed=int(accept_lens[idx].sum()), verify_failures=len(lossy) - len(good))
                for (k, i), a in zip(good, accepted.tolist()):
                    self._record(batch.reqs[i], x, a, int(accept_lens[i]))
        stats.add(STATS, rounds=1, exact_rows=bs - len(lossy))
        return self.result(batch, accept_tokens, accept_lens)

    def _record(self, req, drafted: int, accepted: int, committed: int) -> None:
        """Per-request counters, returned in the request's ``meta_info``."""
        info = self.per_request.setdefault(req.rid, {"remote_verifier": self.verifier.url, "verify_rounds": 0,
                                                    "drafted": 0, "accepted": 0, "committed": 0,
                                                    "draft_tokens": self.num_drafts})
        if drafted:
            info["verify_rounds"] += 1
        info["drafted"] += drafted
        info["accepted"] += accepted
        info["committed"] += committed
        if req.customized_info is None:
            req.customized_info = {}
        req.customized_info[META_INFO_KEY] = [info]
