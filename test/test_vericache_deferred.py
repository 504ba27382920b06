"""A drafting iteration under SGLang's overlap loop (:mod:`sglang_vc.vericache.deferred`):
its accept rule runs where the logits are and reads nothing back; what it commits is the
synchronous commit's, read once from one host copy.

The server side (the iterations really overlapped, outputs identical to the plain
server's, the launch reading no device value) is in ``test_vericache_in_pool`` and
``test_vericache_finish``."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_vc.kvruntime.launches import LaunchCounter
from sglang_vc.kvruntime.syncs import SyncCounter
from sglang_vc.vericache.deferred import Launched, accept_on_device, copy_to_host
from sglang_vc.vericache.forward_plan import ForwardPlan
from sglang_vc.vericache.iteration import Iteration
from sglang_vc.vericache.sampling import greedy_verify_ids
from sglang_vc.vericache.staggered_schedule import IterationPlan, Role, Slot, Track

VOCAB, STRIDE = 50, 6


def _worker():
    def targets_flat(logits, batch, rows, positions):  # greedy, no bias: SGLang's sampler then
        return logits.argmax(-1)

    return SimpleNamespace(stride=STRIDE, targets_flat=targets_flat)


def _iteration(roles_drafts: list[tuple[Role, list[int]]], argmax: list[list[int]]):
    """One request per entry (its role, its drafts so far), forwarding ``argmax[i]``'s
    rows, whose logits pick those tokens."""
    slots = [Slot(i, role, Track(f"r{i}", i, 100 + i, list(drafts))) for i, (role, drafts) in enumerate(roles_drafts)]
    lens = tuple(len(a) for a in argmax)
    logits = torch.zeros(sum(lens), VOCAB)
    for row, token in enumerate(t for a in argmax for t in a):
        logits[row, token] = 1.0
    fp = ForwardPlan(index=tuple(range(len(slots))), roles=tuple(s.role for s in slots), lens=lens,
                     positions=torch.arange(sum(lens)))
    it = Iteration(SimpleNamespace(reqs=[f"req{i}" for i in range(len(slots))]), IterationPlan(0, slots, []), list(range(len(slots))),
                   [0] * len(slots), [s for s in slots if s.role is Role.DRAFT], [s for s in slots if s.role is Role.FULL],
                   [s for s in slots if s.role is Role.VERIFY], staging=None, forward=fp)
    it.sub = SimpleNamespace(sampling_info=None)
    return it, logits


def test_accept_on_device_commits_what_the_greedy_rule_commits_and_reads_nothing_back():
    """A full-KV request commits its token; a drafter keeps its argmax as its next draft
    and commits nothing; a verifier whose drafts all match commits them and the bonus;
    one rejected at its second draft commits the first and the correction; a request that
    waits commits nothing. No host read, and the same operators for 2 verifiers as 4."""
    roles = [(Role.FULL, []), (Role.DRAFT, [7]), (Role.VERIFY, [3, 4, 5]), (Role.VERIFY, [8, 9])]
    argmax = [[11], [12], [3, 4, 5, 6], [8, 1, 2]]
    it, logits = _iteration(roles, argmax)
    with SyncCounter() as syncs:
        with LaunchCounter() as launches:
            accepted, n_drafts = accept_on_device(_worker(), it, logits)
        host, ready = copy_to_host(accepted)
    assert syncs.total == 0, syncs.by_kind  # (on a GPU: one pinned copy behind the forward)
    assert ready is None  # (the CPU's copy is complete; a CUDA one fires an event)
    assert n_drafts == [3, 2]
    assert accepted.lens.tolist() == [1, 0, 4, 2]
    assert accepted.tokens[0, :1].tolist() == [11] and accepted.tokens[2, :4].tolist() == [3, 4, 5, 6]
    assert accepted.tokens[3, :2].tolist() == [8, 1]
    assert accepted.drafts.tolist() == [12] and accepted.accepted.tolist() == [3, 1]
    # the synchronous commit's rule on the same tokens
    verdict = greedy_verify_ids(torch.tensor([[3, 4, 5], [8, 9, -1]]), torch.tensor([[3, 4, 5, 6], [8, 1, 2, 0]]),
                                draft_lens=torch.tensor([3, 2]), pad_id=0)
    assert verdict.num_tokens.tolist() == [4, 2] and verdict.num_accepted.tolist() == [3, 1]

    launched = Launched(it, host, ready, n_drafts, {}, (0.0, 0.0), frozenset())
    # SGLang filters its batch in place (a finished request leaves) before the iteration
    # settles: the settle reads the requests as planned
    it.batch.reqs.pop()
    with SyncCounter() as read:
        _, _, rows, lens, drafts, acc = launched.unpack(STRIDE)
    assert read.total == 1, read.by_kind  # the settle's one read of the copy
    assert lens == [1, 0, 4, 2] and drafts == [12] and acc == [3, 1] and rows[3][:2] == [8, 1]

    wide, wide_logits = _iteration(roles + [(Role.VERIFY, [1]), (Role.VERIFY, [2, 2])], argmax + [[1, 4], [2, 2, 9]])
    with LaunchCounter() as more:
        accept_on_device(_worker(), wide, wide_logits)
    assert more.total == launches.total, (more.by_op, launches.by_op)


def test_a_verifier_whose_first_draft_is_rejected_commits_the_correction_alone():
    it, logits = _iteration([(Role.VERIFY, [5, 6])], [[9, 6, 7]])
    accepted, _ = accept_on_device(_worker(), it, logits)
    assert accepted.lens.tolist() == [1] and accepted.tokens[0, 0].item() == 9 and accepted.accepted.tolist() == [0]


def test_a_launched_iteration_settles_at_its_own_result_not_at_an_earlier_ones():
    """SGLang processes the result of iteration k - 1 right after launching k: settling
    k there would wait for k's forward and undo the overlap. The worker settles k at the
    next decode (no result given) or when SGLang processes k's own result; a fault while
    settling ends k's requests with an error, and the scheduler goes on."""
    from sglang_vc.vericache.worker import VeriCacheWorker

    own, earlier = object(), object()
    settled, failed = [], []
    round_ = SimpleNamespace(launched=SimpleNamespace(result=own, it=SimpleNamespace(reqs=["a"])))

    def settle():
        settled.append(round_.launched.result)
        round_.launched = None

    round_.settle = settle
    worker = SimpleNamespace(staggered=round_, _fail=lambda req, why: failed.append((req, why)))
    VeriCacheWorker.settle(worker, earlier)
    assert settled == [] and round_.launched is not None
    VeriCacheWorker.settle(worker, own)
    assert settled == [own] and round_.launched is None
    VeriCacheWorker.settle(worker)  # nothing launched: nothing to do
    assert settled == [own]

    def broken():
        round_.launched = None
        raise RuntimeError("copy lost")

    round_.launched, round_.settle = SimpleNamespace(result=own, it=SimpleNamespace(reqs=["b"])), \
        broken
    VeriCacheWorker.settle(worker)
    assert failed and failed[0][0] == "b" and "copy lost" in failed[0][1]
