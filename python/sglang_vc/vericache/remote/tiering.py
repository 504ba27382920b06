"""Lossless tiering inside one server: draft from a context's compressed copy while its
full KV loads from this server's own slow tier, then verify the drafts against it
(``VERICACHE_REMOTE`` with ``--vc-remote-path tiering``: no verifier elsewhere).

EvicPress served the request's prefix from a lossy copy (``--evicpress-load-copy``, or a
lossy placement); the context's full copy sits in storage (``--evicpress-storage-copies``).
At the request's prefill (:meth:`Tiering.prefill`, inside the worker's prefill):

1. the prefill forward runs over the lossy rows, and the full copy's read starts on the
   reader thread (:class:`~.stream.FullCopies`);
2. **draft** while the read is in flight: greedy decode forwards of the lossy requests
   over the lossy copy, up to ``--vc-tiering-drafts`` tokens, their KV in scratch slots
   of SGLang's KV pool;
3. the full copy has arrived: it is written over the context's rows
   (``EvicPressRadixCache.install_full``), and ONE ragged ``TARGET_VERIFY`` forward
   recomputes each request's own tokens after the context and its drafts over the exact
   prefix: the exact KV replaces what the lossy copy produced, and its logits give the
   full-KV greedy token at the prompt's end and after each draft;
4. **commit** the first token (the prefill's one), and keep the accepted drafts and the
   correction after them (:func:`~.sampling.greedy_verify_ids`) *held*, with their exact
   KV in the scratch slots: the following decode rounds commit up to ``X`` held tokens
   each, moving their KV into the round's slots (:meth:`Tiering.drain`), with no forward
   when every request in the batch has held tokens.

What drafting buys over loading the full copy first is the decode forwards of the
accepted drafts, run while the link was busy anyway. The prefill waits for the read (the
scheduler does not run other batches meanwhile), as EvicPress's own loads in
``match_prefix`` do. A read that fails ends the request with HTTP 503, never an
unverified token.

Not built: drafting with a page size above 1 (the scratch slots are single tokens; the
prefill then only waits); overlapping the wait with other requests' decoding.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_vc import stats

from ..sampling import greedy_verify_ids
from .verify import STATS


@dataclass
class Held:
    """A request's verified tokens not yet committed. ``tokens[j]`` is the exact token at
    position ``pos + j + 1``; ``slots[j]`` holds the exact KV of the token at ``pos + j``
    (the one before it), so a round starting at committed length ``L`` commits
    ``tokens[L - pos ..]`` with the KV in ``slots[L - pos ..]``."""

    pos: int
    tokens: list[int]
    slots: torch.Tensor  # [len(tokens)] pool slots, owned until drained or dropped


# tokens a chain forwards per verify forward before its tail (the logits are tokens x
# vocabulary); the environment variable lets a test run a verify in several pieces
VERIFY_PIECE = int(os.environ.get("SGLANG_VC_TIERING_VERIFY_PIECE", "512"))


@dataclass
class _Chain:
    """One request's verify: ``tokens`` (its own after the context, then its drafts) at
    positions ``start ..``, their KV into ``slots``; the logits of the last ``tail``
    tokens are the ones that matter."""

    index: int  # in the lossy sub-batch
    tokens: list[int]
    start: int
    slots: torch.Tensor
    tail: int


@dataclass
class Lossy:
    """One lossy request of a prefill batch: its index, the context it was served, and
    the first row its own computed KV starts at (recomputed exactly after the install)."""

    index: int
    ctx: object
    start: int


class Tiering:
    def __init__(self, worker, copies: Callable[[], object], max_drafts: int):
        self.worker = worker
        self._copies = copies
        self.max_drafts = max(0, int(max_drafts))
        self.held: dict[str, Held] = {}

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, batch, lossy: list[Lossy], predict: torch.Tensor, install) -> torch.Tensor:
        """After the prefill forward (``predict``: its sampled tokens): draft, wait for the
        full copies, install them (``install(ctx, kv) -> rows`` or 0), verify; returns the
        tokens to commit (the exact first token of each lossy request)."""
        w = self.worker
        copies = self._copies()
        started = time.perf_counter()
        fixed = predict.clone()
        sub = w.sub_batch(batch, [x.index for x in lossy])
        reqs = sub.reqs
        n, dev = len(reqs), sub.seq_lens.device
        seq_lens = sub.seq_lens.to("cpu", torch.int64)  # L: prompt length (its KV computed)
        rows = sub.req_pool_indices.to("cpu", torch.int64)
        budget = [min(self.max_drafts, max(0, int(r.sampling_params.max_new_tokens or 0) - 1)) for r in reqs]
        k_max = max(budget) if w.page_size == 1 else 0
        scratch = w.token_to_kv_pool_allocator.alloc(n * k_max) if k_max else None
        if scratch is None:
            k_max = 0
        scratch = (scratch.view(n, k_max).to("cpu", torch.int64) if k_max
                   else torch.zeros(n, 0, dtype=torch.int64))
        req_to_token = w.req_to_token_pool.req_to_token

        # 2. draft while the full copies load (greedy: the requests are greedy)
        drafts, cur = [], predict[torch.tensor([x.index for x in lossy], device=predict.device)]
        cap = torch.tensor(budget, dtype=torch.int64)
        while len(drafts) < k_max and not all(copies.ready(x.ctx.ctx_id) for x in lossy):
            j = len(drafts)
            # a request past its own budget drafts in place (within its max_new_tokens:
            # inside its row); those drafts are not verified
            pos = seq_lens + torch.clamp(cap, max=j)
            req_to_token[rows.to(req_to_token.device), pos.to(req_to_token.device)] = scratch[:, j].to(
                req_to_token.device, req_to_token.dtype)
            w.set_batch(sub, ForwardMode.DECODE, cur, pos + 1, scratch[:, j], None, sub.seq_lens.dtype, dev)
            res = w.target_worker.forward_batch_generation(sub, is_verify=True)
            drafts.append(cur)
            cur = res.logits_output.next_token_logits.argmax(-1)
        k = len(drafts)
        drafted_s = time.perf_counter() - started

        # 3. the full copies (one read and one install per context), then verify
        # everything computed over the lossy rows
        ok, exact_rows = [], {}
        for i, x in enumerate(lossy):
            cid = x.ctx.ctx_id
            if cid not in exact_rows:
                kv = copies.read_now(x.ctx)
                exact_rows[cid] = install(x.ctx, kv) if kv is not None else 0
            if exact_rows[cid] <= 0:
                w.fail(reqs[i], "the context's full copy could not be read or installed")
                continue
            ok.append(i)
            x.start = min(x.start, exact_rows[cid])
        waited_s = time.perf_counter() - started - drafted_s
        if not ok:
            self._free(scratch)
            return fixed
        draft_ids = torch.stack(drafts, 1).to("cpu", torch.int64) if k else torch.zeros(n, 0, dtype=torch.int64)
        # the prompts' own slots after each start, read on the host in one copy
        spans = [(lossy[i].start, int(seq_lens[i])) for i in ok]
        own_rows = torch.cat([rows[i].repeat(b - a) for i, (a, b) in zip(ok, spans)])
        own_pos = torch.cat([torch.arange(a, b) for a, b in spans])
        own = req_to_token[own_rows.to(req_to_token.device), own_pos.to(req_to_token.device)].to("cpu", torch.int64)
        own = own.split([b - a for a, b in spans])
        chains = []
        for j, i in enumerate(ok):
            r, (s, length) = reqs[i], spans[j]
            kb = min(k, budget[i])
            slots = torch.cat([own[j], scratch[i, :kb]])
            chains.append(_Chain(i, (list(r.origin_input_ids) + list(r.output_ids))[s:length] + draft_ids[i, :kb].tolist(),
                                 s, slots, kb + 1))
        exact = self._verify(sub, chains, dev)

        # 4. commit the first token; hold the accepted drafts and the correction
        n_acc_total, n_drafted = 0, 0
        for j, i in enumerate(ok):
            r = reqs[i]
            kb = min(k, budget[i])
            targets = exact[j][None, :]  # [1, kb + 1]: after the prompt's last token and each draft
            verdict = greedy_verify_ids(draft_ids[i: i + 1, :kb], targets)
            a = int(verdict.num_accepted[0])
            fixed[lossy[i].index] = int(targets[0, 0])
            tokens = targets[0, 1: a + 1].tolist()  # after the first: accepted drafts' successors
            if tokens:
                self.held[r.rid] = Held(int(seq_lens[i]), tokens, scratch[i, :a].clone())
            self._free(scratch[i, a:])  # the rejected drafts' slots
            n_acc_total += a
            n_drafted += kb
            info = w.info_of(r)
            info.update(path="TIERING", drafted=kb, accepted=a, committed=1 + len(tokens))
        for i in range(n):
            if i not in ok:
                self._free(scratch[i])
        stats.add(STATS, tiering_requests=len(ok), tiering_drafted=n_drafted, tiering_accepted=n_acc_total,
                  tiering_draft_forwards=k, tiering_draft_seconds=drafted_s, tiering_wait_seconds=waited_s)
        return fixed

    def _verify(self, sub, chains: list["_Chain"], dev) -> list[torch.Tensor]:
        """Forward each chain's tokens over the exact prefix (chain ``TARGET_VERIFY``
        forwards; the KV goes to the chain's slots) and return, per chain, the full-KV
        greedy token after each of its last ``tail`` tokens. A long chain goes in pieces of
        at most ``VERIFY_PIECE`` tokens before its tail: the forward's logits are tokens x
        vocabulary."""
        w = self.worker
        done = [0] * len(chains)
        while True:
            part = [j for j, c in enumerate(chains) if len(c.tokens) - done[j] > c.tail]
            last = not part
            if last:
                part = list(range(len(chains)))
            lens = [chains[j].tail if last else min(VERIFY_PIECE, len(chains[j].tokens) - done[j] - chains[j].tail)
                    for j in part]
            ids, pos, slots, starts = [], [], [], []
            for j, n in zip(part, lens):
                c, a = chains[j], done[j]
                ids += c.tokens[a: a + n]
                pos += range(c.start + a, c.start + a + n)
                slots.append(c.slots[a: a + n])
                starts.append(c.start + a)
                done[j] += n
            rows = [chains[j].index for j in part]
            fsub = sub if len(rows) == len(sub.reqs) else w.sub_batch(sub, rows)
            ids_t, pos_t = torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64)
            logits = w.forward_sub(fsub, ForwardMode.TARGET_VERIFY, ids_t, torch.tensor(starts), torch.cat(slots),
                                   w.ragged_verify_input(ids_t, pos_t, starts, lens, dev))
            if last:
                return list(logits.argmax(-1).to("cpu", torch.int64).split(lens))

    def _free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.worker.token_to_kv_pool_allocator.free(slots.flatten().to(self.worker.device))

    # ------------------------------------------------------------------ decode rounds
    def holding(self, rid: str) -> bool:
        return rid in self.held

    def drain(self, batch, committed: torch.Tensor, slots: torch.Tensor, accept_tokens: torch.Tensor,
              accept_lens: torch.Tensor, x: int) -> int:
        """Commit up to ``x`` held tokens of each holding request of the round (``slots``:
        the round's slots ``[bs, x]``); their KV moves in from the scratch slots. Returns
        how many requests it served."""
        pool = self.worker.token_to_kv_pool_allocator.get_kvcache()
        served, committed_tokens, src, dst, done = 0, 0, [], [], []
        for i, req in enumerate(batch.reqs):
            h = self.held.get(req.rid)
            if h is None:
                continue
            o = int(committed[i]) - h.pos
            m = min(x, len(h.tokens) - o)
            if o < 0 or m <= 0:  # not where it was left: drop, commit nothing this round
                self.drop(req.rid)  # (the round drafted nothing for it); it drafts from the next
                accept_lens[i] = 0
                continue
            accept_tokens[i, :m] = torch.tensor(h.tokens[o: o + m])
            accept_lens[i] = m
            src.append(h.slots[o: o + m])
            dst.append(slots[i, :m])
            served += 1
            committed_tokens += m
            if o + m >= len(h.tokens):
                done.append(req.rid)
        if src:
            dev = self.worker.device
            pool.move_kv_cache(torch.cat(dst).to(dev), torch.cat(src).to(dev))
        for rid in done:  # after the move: their scratch slots are free again
            self.drop(rid)
        stats.add(STATS, held_tokens_committed=committed_tokens)
        return served

    def drop(self, rid: str) -> None:
        h = self.held.pop(rid, None)
        if h is not None:
            self._free(h.slots)

    def retain(self, live: set[str]) -> None:
        for rid in [r for r in self.held if r not in live]:
            self.drop(rid)
