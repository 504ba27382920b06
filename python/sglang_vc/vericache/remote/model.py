"""Throughput model of VeriCache's remote prefix caching (paper appendix B.2).

A storage node holds precomputed KV caches. ``G_L`` local GPUs reach it over a fast link
(``BW_h``), ``G_R`` remote GPUs over a slow one (``BW_l``). Every request reuses one stored
KV (``KV_full`` bytes, ``c * KV_full`` compressed) and generates ``K`` tokens. Six ways
to serve a request (:class:`Route`), each with per-request costs in seconds on six
resources (:class:`RouteCost`): each pool's network link, GPU compute and memory slots
(memory-time, Little's law). Throughput is the best mix of routes (eq. 19), a linear
program in the routes' request rates, with ``T_tok`` evaluated at the batch occupancy the
mix implies (a fixed point). Six variables and six constraints: solved exactly by
enumerating the vertices of the feasible polytope (no solver dependency).

One deviation, on purpose: B.2 writes a slot's memory-time as the transfer plus ``K
T_tok``, ``T_tok`` being a request's *share* of a decode step (eq. 12). A slot is held
for ``K`` whole steps, ``K B T_tok(B)`` of wall clock; with the share, Little's law puts
the occupancy of a compute-bound GPU at one request, whatever ``B_max``. Here
memory-time counts whole steps, and then a compute-bound pool runs at ``B_max``.

``gamma`` in the paper is committed tokens per drafted token: a drafter that commits
``A`` tokens per round of ``x`` drafts has ``gamma = A / x`` (``A`` counts the correction
token; ``x`` drafts commit ``A``).
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

import numpy as np


class Route(str, enum.Enum):
    B1 = "B1"  # pure local: full KV to a local GPU, decode there
    B2 = "B2"  # pure remote: full KV over the slow link, decode there
    P1_CACHED = "P1-cached"  # remote drafts from the compressed copy; local verifies, KV kept between rounds
    P1_STATELESS = "P1-stateless"  # ... local re-reads the full KV for every verify round
    P2_CACHED = "P2-cached"  # P1 while the rest of the full KV streams to the remote; then remote decodes alone
    P2_STATELESS = "P2-stateless"

    @property
    def speculative(self) -> bool:
        return self not in (Route.B1, Route.B2)


@dataclass(frozen=True)
class Cluster:
    weights_bytes: float  # M
    kv_full_bytes: float  # KV_full per request
    compression: float  # c: the compressed copy is c * KV_full bytes
    hbm_bw: float  # BW_hbm
    gpu_mem_bytes: float  # GPU_mem (both pools)
    local_gpus: int  # G_L
    remote_gpus: int  # G_R
    bw_high: float  # BW_h: storage -> a local GPU
    bw_low: float  # BW_l: storage -> a remote GPU
    output_tokens: int  # K

    @property
    def max_batch(self) -> int:
        """B_max: full-KV requests a GPU holds beside the weights."""
        return max(0, math.floor((self.gpu_mem_bytes - self.weights_bytes) / self.kv_full_bytes + 1e-9))

    def t_tok(self, batch: float) -> float:
        """Eq. 12: one request's share of a decode step at batch occupancy ``batch``."""
        return (self.weights_bytes / max(1.0, batch) + self.kv_full_bytes) / self.hbm_bw


@dataclass(frozen=True)
class RouteCost:
    """Seconds of each resource one request on a route holds."""

    local_net: float = 0.0
    local_gpu: float = 0.0
    local_mem: float = 0.0
    remote_net: float = 0.0
    remote_gpu: float = 0.0
    remote_mem: float = 0.0

    def vector(self) -> tuple[float, ...]:
        return (self.local_net, self.local_gpu, self.local_mem, self.remote_net, self.remote_gpu, self.remote_mem)


RESOURCES = ("local_net", "local_gpu", "local_mem", "remote_net", "remote_gpu", "remote_mem")


def route_costs(cl: Cluster, draft_len: int, accept_len: float, b_local: float,
                b_remote: float) -> dict[Route, RouteCost]:
    """B.2's per-request costs of the six routes with the pools at batch occupancies
    ``b_local`` and ``b_remote`` (GPU time: a request's share of each step, eq. 12;
    memory-time: whole steps)."""
    if not 1 <= accept_len <= draft_len + 1:
        raise ValueError(f"accept_len {accept_len} outside [1, x + 1] at x = {draft_len}")
    k, x, c = cl.output_tokens, draft_len, cl.compression
    gamma = accept_len / x
    t_tok_local, t_tok_remote = cl.t_tok(b_local), cl.t_tok(b_remote)
    step_local, step_remote = max(1.0, b_local) * t_tok_local, max(1.0, b_remote) * t_tok_remote
    t_h = cl.kv_full_bytes / cl.bw_high
    t_l = cl.kv_full_bytes / cl.bw_low
    t_lc = c * cl.kv_full_bytes / cl.bw_low
    t_lrem = (1 - c) * cl.kv_full_bytes / cl.bw_low
    drafts = k / gamma  # drafted tokens for K committed
    n1 = math.ceil(k / (gamma * x))
    remote_p1 = dict(remote_net=t_lc, remote_gpu=drafts * t_tok_remote, remote_mem=t_lc + drafts * step_remote)
    n_draft = min(t_lrem / step_remote, drafts)  # drafts made while the rest of the full KV streams
    n2 = math.ceil(n_draft / x)
    k2 = max(0.0, k - gamma * n_draft)
    remote_p2 = dict(remote_net=t_lc + t_lrem, remote_gpu=(n_draft + k2) * t_tok_remote,
                     remote_mem=t_lc + max(n_draft * step_remote, t_lrem) + k2 * step_remote)
    return {
        Route.B1: RouteCost(local_net=t_h, local_gpu=k * t_tok_local, local_mem=t_h + k * step_local),
        Route.B2: RouteCost(remote_net=t_l, remote_gpu=k * t_tok_remote, remote_mem=t_l + k * step_remote),
        # the verifier's slot is held while the remote drafts (cached) or per round (stateless)
        Route.P1_CACHED: RouteCost(local_net=t_h, local_gpu=n1 * t_tok_local, local_mem=t_h + drafts * step_remote,
                                   **remote_p1),
        Route.P1_STATELESS: RouteCost(local_net=n1 * t_h, local_gpu=n1 * t_tok_local,
                                      local_mem=n1 * (t_h + step_local), **remote_p1),
        Route.P2_CACHED: RouteCost(local_net=t_h, local_gpu=n2 * t_tok_local,
                                   local_mem=t_h + n_draft * step_remote, **remote_p2),
        Route.P2_STATELESS: RouteCost(local_net=n2 * t_h, local_gpu=n2 * t_tok_local,
                                      local_mem=n2 * (t_h + step_local), **remote_p2),
    }


def _max_rate(costs: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """max sum(n) s.t. costs.T @ n <= capacity, n >= 0 (``costs`` is routes x resources):
    the best vertex of the polytope."""
    routes = costs.shape[0]
    a = np.vstack([costs.T, -np.eye(routes)])
    b = np.concatenate([capacity, np.zeros(routes)])
    best, best_n = -1.0, np.zeros(routes)
    for rows in itertools.combinations(range(a.shape[0]), routes):
        sub = a[list(rows)]
        if abs(np.linalg.det(sub)) < 1e-12:
            continue
        n = np.linalg.solve(sub, b[list(rows)])
        if np.all(a @ n <= b + 1e-9 * (1 + np.abs(b))) and n.sum() > best + 1e-15:
            best, best_n = n.sum(), n
    return np.clip(best_n, 0.0, None)


@dataclass
class Mix:
    """The best mix of routes: requests per second on each, and what binds."""

    rates: dict[Route, float]
    tokens_per_s: float
    t_tok_local: float
    t_tok_remote: float
    binding: list[str] = field(default_factory=list)

    def share(self, route: Route) -> float:
        total = sum(self.rates.values())
        return self.rates[route] / total if total else 0.0


def best_mix(cl: Cluster, draft_len: int, accept_len: float, routes: tuple[Route, ...] = tuple(Route),
             iterations: int = 50) -> Mix:
    """Eq. 19 over ``routes``, with each pool's ``T_tok`` at the occupancy the mix implies
    (memory-time per second per GPU, at least 1 and at most ``B_max``)."""
    if cl.max_batch < 1:
        raise ValueError("remote_model: no request fits beside the weights")
    if not 0 < cl.compression < 1:
        raise ValueError("remote_model: the compression fraction c must be in (0, 1)")
    capacity = np.array([cl.local_gpus, cl.local_gpus, cl.local_gpus * cl.max_batch,
                         cl.remote_gpus, cl.remote_gpus, cl.remote_gpus * cl.max_batch], dtype=float)
    b_local = b_remote = float(cl.max_batch)
    for _ in range(iterations):
        at = (b_local, b_remote)  # the occupancies these costs are priced at
        costs = route_costs(cl, draft_len, accept_len, *at)
        matrix = np.array([costs[r].vector() for r in routes])
        rates = _max_rate(matrix, capacity)
        used = matrix.T @ rates
        new_local = min(cl.max_batch, max(1.0, used[2] / max(cl.local_gpus, 1)))
        new_remote = min(cl.max_batch, max(1.0, used[5] / max(cl.remote_gpus, 1)))
        if abs(new_local - b_local) < 1e-6 and abs(new_remote - b_remote) < 1e-6:
            break
        b_local, b_remote = new_local, new_remote
    binding = [name for name, u, cap in zip(RESOURCES, used, capacity) if cap > 0 and u >= cap * (1 - 1e-6)]
    return Mix({r: float(n) for r, n in zip(routes, rates)}, cl.output_tokens * float(rates.sum()),
               cl.t_tok(at[0]), cl.t_tok(at[1]), binding)


def choose_route(cl: Cluster, draft_len: int, accept_len: float) -> Route:
    """The speculative route for a request with ``K`` output tokens: the one of P1 and P2
    (cached) whose mix alone serves more tokens per second (P1 for short outputs, P2 for
    long ones, where streaming the rest of the full KV pays for itself)."""
    p1 = best_mix(cl, draft_len, accept_len, (Route.P1_CACHED,))
    p2 = best_mix(cl, draft_len, accept_len, (Route.P2_CACHED,))
    return Route.P1_CACHED if p1.tokens_per_s >= p2.tokens_per_s else Route.P2_CACHED
