"""A drafting iteration under SGLang's overlap loop: launched now, settled when its
tokens reach the host.

SGLang's overlap loop launches decode batch ``k`` and only then processes the result of
``k - 1`` (:mod:`.overlapped`). A drafting iteration used to read its tokens back inside
its own forward (the drafts and the verifiers' accepted counts feed the next plan), so it
ran synchronously: SGLang's processing of ``k - 1`` and its building of batch ``k + 1``
waited for the device. A batch in which requests draft in the pool now:

- **launches** (:meth:`.staggered_round.StaggeredRound.run` with ``deferred``): plan,
  forward, and the accept rule on the device (:func:`accept_on_device`: the greedy rule
  of :func:`.sampling.greedy_verify_ids` over the verifiers' drafts, which the plan
  knows). SGLang's result is device tensors; one non-blocking copy brings the committed
  tokens, the new drafts and the accepted counts to the host (:class:`Launched`);
- **settles** (:meth:`~.staggered_round.StaggeredRound.settle`) before anything reads
  the worker's bookkeeping: at the next decode batch's ``needs_sync``, or when SGLang
  processes its result (a prefill or nothing followed), whichever comes first. The drafters keep their draft,
  the verifiers commit their run, the schedule and the policy record the iteration, as a
  synchronous iteration's commit does, in the same order.

What is known at launch is set at launch: which requests verify (SGLang's counts read
it) and which commit nothing (SGLang's overlap loop keeps them in its next batch). The
slots SGLang allocates for the next batch count one more per request of an unsettled
iteration (:meth:`~.staggered_round.StaggeredRound.slots_ahead`).

Not overlapped: batches with a grammar, a penalty or logprobs, or with an offloaded,
admitted or reloading request (their commit reads host state: ``needs_sync``). And the
plan of iteration ``k + 1`` still waits for ``k``'s tokens, as SGLang's own NGRAM spec-v2
worker waits at ``resolve_seq_lens_cpu``; a plan built on the device (EAGLE v2's) is not
built.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch
from sgl_kernel_ext.payload_batch import to_device

from .iteration import Iteration
from .sampling import greedy_verify_ids
from .staggered_schedule import Role


@dataclasses.dataclass
class Accepted:
    """What a launched iteration commits, on the device: per request of the batch its
    ``tokens [bs, stride]`` and ``lens [bs]``; the drafters' new drafts (in ``part``
    order) and the verifiers' accepted draft counts."""

    tokens: torch.Tensor
    lens: torch.Tensor
    drafts: torch.Tensor
    accepted: torch.Tensor

    def packed(self) -> torch.Tensor:
        """All four in one int64 vector (one copy to the host)."""
        return torch.cat([self.tokens.flatten(), self.lens, self.drafts, self.accepted])


@dataclasses.dataclass
class Launched:
    """A launched iteration waiting to settle: its plan, the host copy of what it
    commits (complete once ``ready`` has fired; None on the CPU, where the copy is), how
    many drafts each verifier verified, and its clock."""

    it: Iteration
    host: torch.Tensor
    ready: Optional[object]
    n_drafts: list[int]
    phases: dict
    forward_marks: tuple
    rids: frozenset  # the requests of the batch (their next decode writes one more slot)
    result: object = None  # SGLang's result of the iteration (the scheduler processes it later)

    def unpack(self, stride: int) -> tuple[torch.Tensor, torch.Tensor, list, list, list, list]:
        """``tokens [bs, stride]`` and ``lens [bs]`` (host tensors), and as lists: the
        tokens per request, the lens, the drafts, the accepted counts. Waits for the copy
        first, then reads it once (the iteration's one host synchronisation)."""
        if self.ready is not None:
            self.ready.synchronize()
        bs = len(self.it.reqs)
        values = self.host.tolist()
        n_draft = sum(1 for s in self.it.part if s.role is Role.DRAFT)
        rows = [values[i * stride: (i + 1) * stride] for i in range(bs)]
        lens, tail = values[bs * stride: bs * stride + bs], values[bs * stride + bs:]
        return (self.host[: bs * stride].view(bs, stride), self.host[bs * stride: bs * stride + bs], rows, lens,
                tail[:n_draft], tail[n_draft:])


def accept_on_device(worker, it: Iteration, logits: torch.Tensor) -> tuple[Accepted, list[int]]:
    """What the iteration commits, computed where its logits are: a full-KV request its
    token, a drafter its greedy draft (with the request's ``logit_bias``), a verifier its
    accepted drafts and the correction or bonus token (:func:`greedy_verify_ids` on the
    verifier's tokens at its ``len(drafts) + 1`` positions). Index tensors come from the
    plan (host) with non-blocking copies; nothing is read back. Also returns each
    verifier's draft count."""
    fp, part, bs, dev = it.forward, it.part, len(it.reqs), logits.device
    q_req = it.query_owner()
    exact = worker.targets_flat(logits, it.sub, q_req, fp.positions).to(torch.int64)
    offsets = fp.offsets
    tokens = torch.zeros(bs, worker.stride, dtype=torch.int64, device=dev)
    lens = torch.zeros(bs, dtype=torch.int64, device=dev)

    def index(values: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.int64), dev)

    full = [(s.index, offsets[k]) for k, s in enumerate(part) if s.role is Role.FULL]
    if full:
        at, row = (index(list(v)) for v in zip(*full))
        tokens[at, 0] = exact[row]
        lens[at] = 1
    draft_rows = [offsets[k] for k, s in enumerate(part) if s.role is Role.DRAFT]
    drafts = exact.new_zeros(0)
    if draft_rows:
        bias = None if it.sub.sampling_info is None else it.sub.sampling_info.logit_bias
        rows = index(draft_rows)
        picked = logits[rows].float()
        if bias is not None:  # drafts are greedy, with the request's logit_bias (fewer rejections)
            picked = picked + bias[:, : logits.shape[-1]].to(dev)[to_device(q_req, dev)[rows]]
        drafts = picked.argmax(-1)
    verifiers = [(k, s) for k, s in enumerate(part) if s.role is Role.VERIFY]
    n_drafts = [len(s.track.drafts) for _, s in verifiers]
    accepted = exact.new_zeros(0)
    if verifiers:
        width = max(n_drafts) + 1
        own = torch.full((len(verifiers), width - 1), -1, dtype=torch.int64)
        own[[j for j, n in enumerate(n_drafts) for _ in range(n)], [c for n in n_drafts for c in range(n)]] = \
            torch.tensor([d for _, s in verifiers for d in s.track.drafts], dtype=torch.int64)
        # each verifier's rows; positions past its own run repeat its last row (never read)
        at = torch.minimum(torch.arange(width)[None], torch.tensor(n_drafts)[:, None]) + \
            torch.tensor([offsets[k] for k, _ in verifiers])[:, None]
        verdict = greedy_verify_ids(to_device(own, dev), exact[to_device(at, dev)],
                                    draft_lens=index(n_drafts), pad_id=0)
        rows = index([s.index for _, s in verifiers])
        tokens[rows, :width] = verdict.tokens
        lens[rows] = verdict.num_tokens
        accepted = verdict.num_accepted
    return Accepted(tokens, lens, drafts, accepted), n_drafts


def copy_to_host(accepted: Accepted) -> tuple[torch.Tensor, Optional[object]]:
    """The committed values' host copy and the event that fires when it is complete:
    a non-blocking copy (into pinned memory on CUDA) behind the forward."""
    packed = accepted.packed()
    host = packed.to("cpu", non_blocking=True)  # (on the CPU: the tensor itself)
    if packed.device.type != "cuda":
        return host, None
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def mark(device):
    """A point in the device's stream: a recorded event on CUDA, the time on the CPU."""
    if torch.device(device).type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(start, end) -> float:
    """The device time between two :func:`mark` points, once ``end`` has completed."""
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3
