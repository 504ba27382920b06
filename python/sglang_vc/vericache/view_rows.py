"""In-pool drafts as SGLang's own forwards: each drafting request's view (sinks and a
recent window, :func:`.draft_view.view_slots`) is written into a second row of SGLang's
``req_to_token`` table, and the draft forwards with that row and the view's length as its
``seq_len`` (positions the true ones, ``out_cache_loc`` the request's real next slot).
Every attention backend (``torch_native`` here, FlashInfer, FA3 or Triton on a GPU) then
reads the view with its own kernels, in a ``DECODE`` forward SGLang's decode graph runner
can replay, or as one more request of a ragged verify: no project attention code runs for
the drafters.

The rows come from SGLang's own table, widened for them at start-up
(``hooks._view_rows_for_in_pool_drafts``: SGLang's ``max_running_requests`` is unchanged,
so they never admit a request); they are taken for one forward and given back after it.
Where the table has no row left a drafter drafts over its full row for that step: a draft
is only a guess, so the output is unchanged (``in_pool_view_rows_short`` counts them).

Writing a forward's views is one gather and one scatter on the device for the whole batch,
nothing read back on the host (the views' lengths are the host's own arithmetic).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from sgl_kernel_ext.payload_batch import to_device

from sglang_vc import stats

from . import draft_view

# rows the table is widened by, at most: past that many drafters in one forward the rest
# draft over their full rows (a 32k-token row is 128 KiB of int32 on the device)
MAX_VIEW_ROWS = 256


def extra_rows(max_running_requests: int) -> int:
    """Rows SGLang's ``req_to_token`` table is widened by for the views."""
    return max(1, min(int(max_running_requests), MAX_VIEW_ROWS))


@dataclasses.dataclass(frozen=True)
class Views:
    """One forward's views: for each drafter (by its index in the forward) its view row and
    the view's length (the draft query's own position included)."""

    rows: dict  # index -> view row of req_to_token
    lengths: dict  # index -> attended rows


class ViewRows:
    """Takes view rows from SGLang's ``ReqToTokenPool`` for one forward and writes the
    drafters' views into them."""

    def __init__(self, req_to_token_pool):
        self.pool = req_to_token_pool
        self.held: list[int] = []

    def write(self, drafters: dict, rows: list[int], lengths: list[int],
              shared: Optional[tuple["SharedSelections", dict]] = None) -> Optional[Views]:
        """``drafters``: index -> budget; ``rows`` / ``lengths``: per index, the request's own
        row and its attendable positions (the draft query's included); ``shared``: the
        shared view's selections and, per index, ``(rid, recent rows)``. Returns the views
        of as many drafters as rows are free (the rest draft over their full rows), or
        None when none is."""
        if self.held:
            raise RuntimeError("VERICACHE: view rows of an earlier forward were not given back")
        want = sorted(drafters)
        free = self.pool.available_size()
        if len(want) > free:
            stats.add("vericache", in_pool_view_rows_short=len(want) - free)
            want = want[:free]
        if not want:
            return None
        taken = self.pool.alloc_rows(len(want))  # as many as are free: not None
        self.held = list(taken)
        req_to_token = self.pool.req_to_token
        dev = req_to_token.device
        up = lambda xs: to_device(torch.tensor(xs, dtype=torch.int64), dev)  # noqa: E731
        budgets = [drafters[k] for k in want]
        own = up([rows[k] for k in want])
        if shared is None:  # the window view
            width = max(budgets)
            slots, _ = draft_view.view_slots(req_to_token, own, up([lengths[k] for k in want]), up(budgets), width)
            view_lens = [min(lengths[k], b) for k, b in zip(want, budgets)]
        else:
            slots, view_lens = shared[0].view_slots(req_to_token, own, [rows[k] for k in want],
                                                    [lengths[k] for k in want], budgets,
                                                    [shared[1][k] for k in want])
            width = slots.shape[1]
        # past a view's length the row holds padding no backend reads (it reads seq_len rows)
        req_to_token[up(taken)[:, None], torch.arange(width, device=dev)[None, :]] = slots.to(req_to_token.dtype)
        stats.add("vericache", in_pool_view_rows=len(want), in_pool_draft_rows=sum(view_lens))
        return Views(dict(zip(want, taken)), dict(zip(want, view_lens)))

    def give_back(self) -> None:
        """The forward is done (or failed): its rows go back to SGLang's table."""
        if self.held:
            self.pool.free_rows(self.held)
            self.held = []


class SharedSelections:
    """The shared view's selected positions (one list per request for every layer and KV
    head), scored in each in-pool verify's forward (:func:`.draft_view.pillar_scores`,
    summed over the layers) and read by the request's next drafts: a device table indexed
    by ``req_to_token`` row, the counts on the host (a view's length is host arithmetic)."""

    def __init__(self):
        self.table: Optional[torch.Tensor] = None  # [rows, K] positions
        self.of: dict[str, tuple[int, int]] = {}  # rid -> (its row, positions selected)
        self._scores: dict[int, torch.Tensor] = {}  # verifier index -> scores so far (one forward)

    def score(self, i: int, scores: torch.Tensor) -> None:
        """One layer's scores of verifier ``i``'s candidates (``[m]``)."""
        acc = self._scores.get(i)
        self._scores[i] = scores if acc is None else acc + scores

    def select(self, i: int, rid: str, row: int, first: int, count: int, rows: int) -> None:
        """After the last layer: verifier ``i``'s ``count`` best candidates (positions
        ``first ..``) become its view (``rows``: the table's height, SGLang's row count)."""
        scores = self._scores.pop(i)
        top = scores.topk(count).indices + first
        if self.table is None or self.table.shape[1] < count:
            table = torch.zeros(rows, count, dtype=torch.int64, device=top.device)
            if self.table is not None:
                table[:, : self.table.shape[1]] = self.table
            self.table = table
        self.table[row, :count] = top
        self.of[rid] = (row, count)

    def end_forward(self) -> None:
        self._scores.clear()

    def count(self, rid: str, row: int) -> int:
        got = self.of.get(rid)
        return got[1] if got is not None and got[0] == row else 0

    def forget(self, live) -> None:
        for rid in [r for r in self.of if r not in live]:
            del self.of[rid]

    def view_slots(self, req_to_token: torch.Tensor, own: torch.Tensor, rows: list[int], lengths: list[int],
                   budgets: list[int], requests: list[tuple[str, int]]) -> tuple[torch.Tensor, list[int]]:
        """The drafters' view slots ``[n, width]`` (each view's first, then padding) and
        lengths: sinks, its selection (none before its first verify: then the window view)
        and its recent rows."""
        dev = req_to_token.device
        counts = [self.count(rid, row) for (rid, _), row in zip(requests, rows)]
        recent = [rec if n else b - draft_view.SINKS for (_, rec), n, b in zip(requests, counts, budgets)]
        k = max(counts)
        if k:
            selected = self.table[own, :k]
        else:
            selected = torch.zeros(len(rows), 0, dtype=torch.int64, device=dev)
        up = lambda xs: to_device(torch.tensor(xs, dtype=torch.int64), dev)  # noqa: E731
        pos, valid = draft_view.reselect_positions(up(lengths), selected[:, None, :], up(counts), up(recent),
                                                   max(recent))
        pos = draft_view.compact(pos[:, 0], valid[:, 0])
        slots = req_to_token[own[:, None], pos].to(torch.int64)
        lens = [t if t <= draft_view.SINKS + n + r else draft_view.SINKS + n + r
                for t, n, r in zip(lengths, counts, recent)]
        return slots, lens
