"""The prefill's host-copy buffer (``StagingArena``): one buffer, blocks handed out and
given back once the GPU is past them; the worker allocates it when the first request is
compressed, never at start-up, and caps reloads started ahead by ``--vc-staging-fraction``
without setting anything aside (no server)."""

from __future__ import annotations

import types

import torch

from sglang_vc.kvruntime import CopyStream
from sglang_vc.testing.streams import StandInStreams
from sglang_vc.vericache.reload import HostKVStore
from sglang_vc.vericache.staging_arena import ALIGN, StagingArena

def _inside(t: torch.Tensor, arena: StagingArena) -> bool:
    start = arena.buffer.data_ptr()
    return start <= t.data_ptr() < start + arena.capacity


class _Event:
    """A GPU event that has not passed until ``passed`` is set (a host wait sets it)."""

    def __init__(self):
        self.passed = False
        self.waited = 0

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.waited += 1
        self.passed = True


def test_blocks_are_aligned_first_fit_and_coalesce_when_given_back():
    arena = StagingArena(10 * ALIGN + 17, "cpu")
    assert arena.capacity == 10 * ALIGN  # whole aligned units only
    a, b, c = arena.alloc(1), arena.alloc(3 * ALIGN), arena.alloc(2 * ALIGN + 1)
    assert (a.start, a.size) == (0, ALIGN) and (b.start, b.size) == (ALIGN, 3 * ALIGN)
    assert (c.start, c.size) == (4 * ALIGN, 3 * ALIGN)
    assert arena.alloc(4 * ALIGN) is None  # 3 units left
    assert arena.in_use == 7 * ALIGN and arena.peak == 7 * ALIGN
    arena.release(a)
    arena.release(b)  # coalesces with a's run: 4 units from 0
    assert arena.alloc(4 * ALIGN).start == 0
    arena.release(c)  # coalesces with the free run after it: 6 units from 4
    assert arena.stats()["free_runs"] == 1 and arena.alloc(6 * ALIGN).start == 4 * ALIGN
    assert arena.alloc(11 * ALIGN) is None  # more than the arena
    assert arena.peak == 10 * ALIGN


def test_a_block_comes_back_only_once_the_gpu_passed_its_events():
    arena = StagingArena(8 * ALIGN, "cpu")
    first = arena.alloc(4 * ALIGN)
    copied, read = _Event(), _Event()
    arena.release(first, [copied, read])
    assert arena.in_use == 4 * ALIGN  # the GPU may still copy into it or read it
    second = arena.alloc(4 * ALIGN)
    assert second.start == 4 * ALIGN and read.waited == 0  # the free half: no wait
    copied.passed = True  # the reads have not passed: the first block is not free yet
    # nothing else fits: the arena waits for the pending block's events (a rare host wait)
    again = arena.alloc(ALIGN)
    assert again.start == 0 and read.waited == 1
    done = _Event()
    done.passed = True
    arena.release(second, [done])
    assert arena.in_use == ALIGN and done.waited == 0  # passed: back at once


def test_the_arena_waits_oldest_first_and_only_while_waiting_can_make_room():
    arena = StagingArena(6 * ALIGN, "cpu")
    blocks = [arena.alloc(2 * ALIGN) for _ in range(3)]
    events = [_Event() for _ in blocks]
    for block, event in zip(blocks, events):
        arena.release(block, [event])
    assert arena.alloc(2 * ALIGN).start == 0  # the oldest pending block, waited for
    assert [e.waited for e in events] == [1, 0, 0]
    assert arena.alloc(7 * ALIGN) is None and [e.waited for e in events] == [1, 0, 0]  # larger than the arena
    held = arena.alloc(4 * ALIGN)  # both others waited for: they coalesce
    assert held.start == 2 * ALIGN and [e.waited for e in events] == [1, 1, 1]
    assert arena.alloc(ALIGN) is None  # nothing pending, nothing free: no wait, no room


def test_views_are_typed_slices_of_the_block():
    arena = StagingArena(8 * ALIGN, "cpu")
    block = arena.alloc(2 * ALIGN)
    f = arena.view(block, 0, (4, 2, 4), torch.float32)
    i = arena.view(block, ALIGN, (2, 3), torch.int64)
    f.fill_(1.5)
    i.fill_(7)
    assert f.shape == (4, 2, 4) and i.dtype == torch.int64 and float(f.sum()) == 48.0
    assert i.data_ptr() - f.data_ptr() == ALIGN and _inside(i, arena)
    for bad in ((1, (4,), torch.float32), (ALIGN, (100,), torch.float32)):  # misaligned, too long
        try:
            arena.view(block, *bad)
        except ValueError:
            continue
        raise AssertionError(bad)


def test_the_worker_sets_nothing_aside_until_a_request_is_compressed():
    """The host-copy buffer is allocated at the first request the host store admits (the
    first compressed one), once; reloads started ahead take pool slots up to
    ``--vc-staging-fraction`` of the pool's bytes (a cap: nothing is allocated for it)."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from sglang_vc.vericache.host_copy import HOST_COPY_BYTES
    from sglang_vc.vericache.worker import VeriCacheWorker

    worker = object.__new__(VeriCacheWorker)
    worker.device = "cpu"
    worker.copy_stream = CopyStream("cpu", module=StandInStreams())  # an accelerator's copy stream
    worker.host = HostKVStore(copy_stream=worker.copy_stream, pin=False)
    worker.server_args = types.SimpleNamespace()
    allocator = TokenToKVPoolAllocator(100, torch.float32, "cpu", None, need_sort=False)
    k0 = torch.zeros(101, 2, 4)
    worker._runtime = types.SimpleNamespace(bytes_per_slot=64, allocator=allocator, start_layer=0,
                                            kv_pool=types.SimpleNamespace(get_key_buffer=lambda l: k0))
    assert worker.host.copy_out is None
    ahead = worker._ahead_slots()
    from sglang_vc.vericache import flags
    assert ahead.cap_bytes == int(flags.DEFAULT_STAGING_FRACTION * 64 * 101) and ahead.held == 0
    assert allocator.available_size() == 100  # a cap, not a reservation
    assert worker._ahead_slots() is ahead
    assert worker._admit_host("r", 0, 0, 10)
    out = worker.host.copy_out
    assert out is not None and out.arena.capacity == HOST_COPY_BYTES
    assert worker._admit_host("s", 1, 0, 10) and worker.host.copy_out is out  # once


def test_the_gpu_checks_reload_staging_runs_the_servers_reload_on_the_cpu():
    """``bench.gpu_check``'s reload check (what a lent GPU runs first) on small CPU shapes:
    the rows land in contiguous and scattered pool slots equal to the host copy."""
    from sglang_vc.bench.gpu_check import reload_staging

    out = reload_staging(device="cpu", n=64, layers=3, hkv=2, d=8, dtype=torch.float32, repeats=1)
    assert out["ok"] and out["contiguous_gb_per_s"] > 0 and out["scattered_gb_per_s"] > 0, out
