"""The seam between a speculative worker and SGLang's scheduler.

SGLang's scheduler sizes each decode's KV allocation, holds pool room back from
admission and chooses the next batch without asking the spec worker; :mod:`sglang_vc.hooks`
asks the worker through this one object instead, which the worker registers once on the
runtime (``runtime.side``). Nothing on it is set per forward: the worker's answers are
callables and objects it owns, and the scheduler's answer (its waiting queue after each
batch choice) is kept by the hook in :class:`Waiting`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional


@dataclasses.dataclass
class Waiting:
    """The scheduler's waiting queue after its last batch choice (not in that batch):
    prompt rows, requests and the prompts themselves (references, no copy)."""

    demand: int = 0
    requests: int = 0
    prompts: list = dataclasses.field(default_factory=list)

    def see(self, queue) -> None:
        self.demand = sum(len(req.origin_input_ids) for req in queue)
        self.requests = len(queue)
        self.prompts = [req.origin_input_ids for req in queue]


@dataclasses.dataclass
class SchedulerSide:
    """What the worker answers the scheduler (each None: SGLang's own behaviour).

    ``slots_ahead(req) -> int``: KV slots the request's next decode writes past its
    committed length (VERICACHE's staggered schedule; None: SGLang's uniform speculative
    reserve). ``held_back``: pool slots held back from admission while compressed
    requests live (VERICACHE's verify headroom: ``size``, ``fit(n)``,
    ``yield_to_decode(n)``, ``starved_shortfall``). ``compress_gate(rid, own_rows, spec)
    -> reason or None``: whether a request whose prefill ends is compressed (None) or
    keeps its full KV (the reason), reading ``waiting``. ``full_kv_for_tree(req, up_to)``:
    a compressed request finished; put its full KV back in its row (True) so that the
    radix tree keeps it, as it keeps a plain server's finished requests, or return a host
    copy of it (``HeldRows``) where the pool has no room. ``lossless``:
    the worker verifies every token against the full KV (VERICACHE): a request borrows the
    tree's whole match, and one whose own rows cannot hold its compressed rows keeps its
    full KV (compressing a prompt the tree holds frees nothing)."""

    slots_ahead: Optional[Callable] = None
    held_back: Optional[object] = None
    compress_gate: Optional[Callable] = None
    full_kv_for_tree: Optional[Callable] = None
    lossless: bool = False
    waiting: Waiting = dataclasses.field(default_factory=Waiting)
