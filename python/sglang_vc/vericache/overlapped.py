"""VERICACHE under SGLang's overlap scheduler: the iterations in which every request
decodes from its full KV, and those in which requests draft in the pool, run overlapped;
the others synchronously.

SGLang's ``event_loop_overlap`` launches iteration ``k`` and only then processes the
result of ``k - 1``, unless ``Scheduler.is_disable_overlap_for_batch`` says otherwise
(then ``k - 1`` is processed first). The project's hook (``hooks.py``) asks the worker's
``needs_sync``, which asks :func:`overlap_of`, for each decode batch:

- **full-only** (every request decodes its next token from its full KV, resident in the
  pool: nothing compressed, nothing drafted, admitted or reloading, full-KV decoding
  chosen by the mode policy): the forward reads the batch's committed lengths and last
  tokens from SGLang's future map, on the device (:func:`full_only_iteration`), and
  nothing is read back to the host. A grammar does not stop it: as SGLang's EAGLE v2
  worker does, the iteration calls the scheduler's grammar barrier after launching its
  forward (the grammars accept the previous iteration's tokens while the device runs),
  then masks the logits. Nor does a penalty, where the previous iteration left at most
  one token of the request unprocessed: that token is the one relayed on the device, and
  the penalty's history takes it there (:func:`_penalised`);
- **drafting** (requests draft over views of their resident rows, beside full-KV ones;
  no grammar, penalty or logprobs): the staggered iteration is launched with its accept
  rule on the device and settled before the next reads its tokens (:mod:`.deferred`);
- **synchronous** otherwise: the worker's staggered or lock-step iteration, over the
  requests still running (:mod:`sglang_vc.overlap`).

The mode policy decides in :func:`overlap_of` (once per iteration): a decision taken at
the forward could otherwise turn a request to drafting in an iteration already
overlapped as full-only.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections import deque
from typing import Optional

import torch
from sgl_kernel_ext.payload_batch import to_device

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_vc import stats
from sglang_vc.grammar_masks import apply_grammars
from sglang_vc.kvruntime import syncs
from sglang_vc.kvruntime.launches import LaunchCounter
from sglang_vc.penalties import apply_penalties, has_penalties, penalty_rows
from sglang_vc.spec_worker import committed_lens

from . import flags
from .policy import IterationRows, Mode
from .staggered_schedule import Outcome, Role


class Overlap(enum.Enum):
    """How SGLang's overlap loop runs a decode batch (:func:`overlap_of`)."""

    SYNC = "sync"  # the previous result processed first; the worker's iteration reads it
    FULL_ONLY = "full-only"  # overlapped: every request decodes a token from full KV (:func:`full_only_iteration`)
    DRAFTING = "drafting"  # overlapped: requests draft in the pool, settled later (:mod:`.deferred`)


def overlap_of(worker, batch) -> Overlap:
    """How decode ``batch`` runs under SGLang's overlap loop: synchronously where a
    request is offloaded, admitted for a reload, or reloading, where the batch has a
    grammar, logprobs or a penalty with drafts (their commit reads host state; a penalised
    full-KV request misses at most the one token the device relays), or under the
    lock-step schedule. Decides the mode of every request at a cycle boundary, with the
    lengths the worker committed."""
    if worker.schedule is not flags.Schedule.STAGGERED:
        return Overlap.SYNC
    runtime, tracks = worker.runtime, worker.staggered.schedule.tracks
    rows, lengths, drafting = [], [], False
    for req in batch.reqs:
        row = req.kv.req_pool_idx
        if row is None or req.finished() or runtime.entry_for_row(row) is not None \
                or worker.host.get(req.rid, row) is not None:
            return Overlap.SYNC
        track = tracks.get(req.rid)
        if track is not None and (track.reload is not None or
                                  (track.admission is not None and track.admission.kv_bytes != 0)):
            return Overlap.SYNC
        drafting |= track is not None and (bool(track.drafts) or track.admission is not None)
        rows.append(row)
        # (SGLang's own count lags by the queued result's token; the worker's does not)
        lengths.append(track.committed if track is not None and track.row == row else req.kv.kv_committed_len)
        if has_penalties(req.sampling_params) and unseen(req, lengths[-1]) > 1:
            return Overlap.SYNC  # (a penalty counts the output so far: the device holds only the last token)
    worker.staggered.modes.decide(batch, rows, lengths)
    modes = [worker.modes[req.rid].mode for req in batch.reqs]
    if not drafting and all(m is Mode.FULL for m in modes):
        return Overlap.FULL_ONLY
    if any(m is Mode.OFFLOAD for m in modes) or batch.has_grammar or batch.return_logprob or \
            any(has_penalties(req.sampling_params) for req in batch.reqs):
        return Overlap.SYNC
    # the plan reads each request's last token on the host: from its output_ids, or from
    # the settled overlapped iteration whose result SGLang has not processed yet (not from
    # a prefill's or an overlapped full-KV decode's, which only the device holds)
    unprocessed = worker.staggered.unprocessed
    for req, n in zip(batch.reqs, lengths):
        track = tracks.get(req.rid)
        if track is None or track.row != req.kv.req_pool_idx or \
                (unseen(req, n) > 0 and req.rid not in unprocessed):
            return Overlap.SYNC
    return Overlap.DRAFTING


def unseen(req, committed: int) -> int:
    """The output tokens of ``req`` not in its ``output_ids`` yet (SGLang has not processed
    the result that committed them), given its committed KV length: the token after the
    committed rows is the forward's input, so ``committed + 1`` tokens are known."""
    return committed + 1 - len(req.origin_input_ids) - len(req.output_ids)


class LaggedTimer:
    """The device time of forwards nobody waits for: events recorded around each, read
    when a later iteration finds them complete (no host wait), each returned with what
    its own iteration ran. On the CPU a forward is synchronous and its wall time is exact."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.pending: deque = deque()  # (start event, end event, payload), oldest first

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, start, payload) -> list[tuple[float, object]]:
        """``(seconds, payload)`` of every timed forward known now: this one on the CPU;
        on CUDA those whose events have completed, oldest first."""
        if not self.cuda:
            return [(time.perf_counter() - start, payload)]
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((start, end, payload))
        done = []
        while self.pending and self.pending[0][1].query():
            begin, finish, earlier = self.pending.popleft()
            done.append((begin.elapsed_time(finish) / 1e3, earlier))
        return done


def full_only_iteration(worker, batch, grammar_barrier=None):
    """One overlapped iteration: every request decodes one token from its full KV
    (:func:`overlap_of` said so), with the committed lengths SGLang resolved from the
    previous forward's publish and the last tokens it relayed (``spec_info.bonus_tokens``),
    both already on their device; ``grammar_barrier`` (the scheduler's) brings the
    grammars up to those tokens. Returns the spec-V2 result; with ``SGLANG_VC_COUNT_SYNCS``
    set, its host synchronisations go into the trace."""
    counter = syncs.SyncCounter() if syncs.enabled() else None
    # (and the operators launched around SGLang's forward, not inside it: the worker's own
    # launches, which a plain server does not make; ``bench.gpu_parity --trace`` prices them)
    launched, in_forward = (LaunchCounter(), LaunchCounter()) if counter is not None else (None, None)
    with counter if counter is not None else contextlib.nullcontext(), \
            launched if launched is not None else contextlib.nullcontext():
        result, finish = _full_only(worker, batch, in_forward or contextlib.nullcontext(), grammar_barrier)
    if counter is not None:
        finish[-1]["host_syncs"] = counter.total
        finish[-1].update({f"host_syncs_{k.strip('_')}": n for k, n in counter.by_kind.items()})
        finish[-1]["launches_outside_forward"] = launched.total - in_forward.total
        if syncs.with_sites():
            finish[-1]["host_sync_sites"] = dict(counter.by_site)
            finish[-1]["launches_by_op"] = dict(launched.by_op - in_forward.by_op)
    worker.staggered.schedule.finish(*finish)
    return result


def _grammar_masked(logits, batch, grammar_barrier):
    """``logits`` with each live grammar's mask: the grammars first accept the tokens of
    the result SGLang has not processed yet (its barrier, run while this forward is on the
    device), so each stands after its request's last token."""
    if not batch.has_grammar:
        return logits
    if grammar_barrier is None:  # (SGLang passes it to every worker that says it can take it)
        raise RuntimeError("an overlapped iteration with a grammar got no grammar barrier")
    grammar_barrier()
    bs = len(batch.reqs)
    # (one row per request, no drafts: the chain is the last token alone, never accepted)
    return apply_grammars(logits, batch.reqs, [0] * bs, [()] * bs, range(bs), [0] * bs)


def _penalised(logits, batch, committed_list, last_tokens):
    """``logits`` with each penalised request's penalties: its history is its
    ``output_ids`` and, where SGLang has not processed the previous result yet, that
    result's token, which is the forward's input (``last_tokens``, on the device)."""
    reqs = batch.reqs
    if not any(has_penalties(req.sampling_params) for req in reqs):
        return logits
    bs = len(reqs)
    missing = [unseen(req, n) for req, n in zip(reqs, committed_list)]
    if any(m not in (0, 1) for m in missing):  # (overlap_of sends those synchronously)
        raise RuntimeError(f"an overlapped penalised iteration misses {max(missing)} tokens of a request")
    # the unseen token as a one-token run, a placeholder filled on the device below
    pen = penalty_rows(reqs, [[0] * m for m in missing], range(bs), missing, logits.shape[-1], logits.device)
    if pen is None:
        return logits
    penalised = [i for i in range(bs) if has_penalties(reqs[i].sampling_params)]
    at = [(k, len(reqs[i].output_ids), i) for k, i in enumerate(penalised) if missing[i]]
    if at:
        k_idx, col, src = (to_device(torch.tensor(v, dtype=torch.int64), logits.device) for v in zip(*at))
        pen.history[k_idx, col] = last_tokens.to(torch.int64)[src]
    return apply_penalties(logits, pen)


def _full_only(worker, batch, around_forward, grammar_barrier):
    started = time.perf_counter()
    sched = worker.staggered.schedule
    worker.staggered.unprocessed = {}  # (this iteration's tokens are the next unprocessed ones: device only)
    bs = len(batch.reqs)
    committed = committed_lens(batch)
    row_list = [req.kv.req_pool_idx for req in batch.reqs]
    committed_list = committed.tolist()  # (a host copy: SGLang resolved it from the publish)
    plan = sched.plan([r.rid for r in batch.reqs], row_list, committed_list,
                      lambda i: worker.staggered.staging.reload_bytes(batch.reqs[i].rid, row_list[i]))
    if any(s.role is not Role.FULL for s in plan.slots):  # overlap_of and the plan read the same state
        raise RuntimeError("an overlapped iteration was planned with a request that drafts")
    req_to_token = worker.req_to_token_pool.req_to_token
    rows = torch.tensor(row_list, dtype=torch.int64)
    slots = req_to_token[to_device(rows, req_to_token.device), to_device(committed, req_to_token.device)]
    sub = worker.sub_batch(batch, list(range(bs)))
    timer = worker.overlap_timer
    mark = timer.start()
    with around_forward:
        forward_started = time.perf_counter()
        logits = worker.forward_sub(sub, ForwardMode.DECODE, batch.spec_info.bonus_tokens, committed + 1, slots, None)
        forward_wall = time.perf_counter() - forward_started  # SGLang's own work: a plain server's too
    # SGLang's sampler order: penalties, the grammar's mask, then logit_bias
    logits = _grammar_masked(_penalised(logits, batch, committed_list, batch.spec_info.bonus_tokens), batch,
                             grammar_barrier)
    exact = worker.targets_flat(logits, sub, torch.arange(bs), committed)
    accept_tokens = torch.zeros(bs, worker.stride, dtype=torch.int64, device=exact.device)
    accept_tokens[:, 0] = exact
    accept_lens = torch.ones(bs, dtype=torch.int64)
    logits_output = None
    if batch.return_logprob:
        logits_output = worker.committed_logprobs(batch, logits.float() if sub.sampling_info is None or
                                                  sub.sampling_info.logit_bias is None else
                                                  logits.float() + sub.sampling_info.logit_bias[:, : logits.shape[-1]],
                                                  list(range(bs)), accept_tokens, accept_lens)
    rows_read = sum(committed_list) + bs
    timed = timer.stop(mark, (bs, rows_read))
    for s in plan.slots:
        sched.verified(s.track, 1)
    for seconds, (n, rows) in timed:  # each with the rows of its own iteration
        worker.draft_length.record_iteration(seconds, 0, n, 0, 0)
        worker.policy.record(seconds, IterationRows(n, rows, rows, 0), batch=n, full_only=True)
    forward_s = timed[-1][0] if timed else None
    worker.staggered.modes.count(plan)
    stats.add("vericache", iterations=1, forwards=1, full_kv_steps=bs, decode_forwards=1, overlapped_iterations=1)
    # the worker's host work beyond SGLang's forward: the mode check before it and this
    # iteration around it (what an overlapped device step must hide; bench.gpu_parity --trace)
    host_s = worker.sync_check_s + time.perf_counter() - started - forward_wall
    phases = {"plan_s": 0.0, "forward_s": forward_s or 0.0, "forwards": 1, "overlapped": True, "host_s": host_s,
              "tokens": bs, "rows": rows_read, "query_rows": rows_read, "offload_drafts": 0}
    finish = (plan, forward_s if forward_s is not None else time.perf_counter() - started,
              {s.track.rid: Outcome(drafts=0, tokens=1) for s in plan.slots}, {}, phases)
    return worker.result(batch, accept_tokens, accept_lens, logits_output, can_run_cuda_graph=worker.replayed), finish
