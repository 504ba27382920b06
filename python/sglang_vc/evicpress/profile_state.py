"""EvicPress's profiling state on the manager: which contexts need (re-)profiling and why,
the profiler's work list and results, the online query log, sampled observations of
served answers and the drift that triggers a re-profile (paper section 6.3), and the
server's idle time the profiler runs in (:mod:`.service` drives it)."""

from __future__ import annotations

import collections
import itertools
import logging
from typing import Optional, Sequence

from .config import FULL, CompressionConfig
from .context import Context

logger = logging.getLogger(__name__)


class ProfileState:
    """:class:`~.manager.EvicPressManager`'s profiling (``manager.profiling``): the sampled
    observations and the server's activity are its own; it uses the manager's lock,
    contexts, settings, query log and quality tracker (``self.m``)."""

    MAX_PROFILE_FAILURES = 3

    def __init__(self, manager):
        self.m = manager
        self.observations: collections.deque = collections.deque(maxlen=256)
        self._obs_counter = itertools.count()
        self.active_requests: dict[str, float] = {}
        self.last_user_activity = manager.clock()

    def observe_served(self, ctx: Context, config: CompressionConfig, prompt_ids, output_ids,
                       max_new_tokens: int) -> bool:
        """Maybe keep a served answer of a lossy config for a shadow quality check."""
        with self.m.lock:
            if config.is_full or not len(output_ids) or self.m.settings.observe_rate <= 0:
                return False
            n = next(self._obs_counter)
            every = max(1, round(1 / self.m.settings.observe_rate))
            if n % every:
                return False
            self.observations.append({
                "obs_id": f"{ctx.ctx_id}-{n}",
                "ctx_id": ctx.ctx_id,
                "config": config.label,
                "prompt_ids": [int(t) for t in prompt_ids],
                "output_ids": [int(t) for t in output_ids],
                "max_new_tokens": int(max_new_tokens),
            })
            self.m.count(observations_queued=1)
            return True

    def record_observation(self, ctx_id: str, config: str, quality: float) -> bool:
        """An observed quality of a served answer (vs. the full-KV answer); True when
        it flags the context for re-profiling (section 4.3)."""
        with self.m.lock:
            ctx = self.m.contexts.get(str(ctx_id))
            if ctx is None:
                return False
            self.m.count(observations=1)
            fired = self.m.tracker.observe(ctx.ctx_id, float(quality), CompressionConfig.parse(config))
            if fired:
                self.m.count(drift_flags=1)
                ctx.profile_reason = "drift"
            return fired

    def note_activity(self, rid: str, active: bool) -> None:
        with self.m.lock:
            if active:
                self.active_requests[rid] = self.m.clock()
            else:
                self.active_requests.pop(rid, None)
            self.last_user_activity = self.m.clock()

    def idle_for(self) -> float:
        with self.m.lock:
            now = self.m.clock()
            # a request we never saw finish (aborted early) stops counting after 10 min
            for rid, t in list(self.active_requests.items()):
                if now - t > 600:
                    self.active_requests.pop(rid, None)
            if self.active_requests:
                return 0.0
            return now - self.last_user_activity

    def note_prefill(self, tokens: int, seconds: float) -> None:
        if not self.m.settings.prefill_measured or tokens < 64 or seconds <= 0:
            return
        with self.m.lock:
            rate = tokens / seconds
            s = self.m.settings
            s.prefill_tokens_per_s = 0.8 * s.prefill_tokens_per_s + 0.2 * rate

    # ------------------------------------------------------------------ profiling
    def profile_work(self, limit: int = 4) -> list[dict]:
        """Contexts that need (re-)profiling, with the queries to profile them on."""
        with self.m.lock:
            jobs = []
            if self.m.settings.policy != "evicpress" or not self.m.settings.candidates:
                return jobs
            for ctx in self.m.contexts.values():
                if ctx.profile_reason is None or ctx.profile_in_flight:
                    continue
                online = self.m.querylog.latest(ctx.ctx_id)
                queries = []
                if ctx.profile_reason == "drift":
                    queries = [ctx.token_ids[:p].tolist() + s for p, s in online]
                queries += [ctx.token_ids.tolist() + q for q in ctx.queries]
                if ctx.profile_reason != "drift":
                    queries += [ctx.token_ids[:p].tolist() + s for p, s in online]
                queries = queries[: self.m.settings.profile_queries]
                job = {
                    "ctx_id": ctx.ctx_id,
                    "reason": ctx.profile_reason,
                    "token_ids": ctx.token_ids.tolist(),
                    "prompts": queries,
                    "candidates": [c.label for c in self.m.settings.candidates],
                    "generate_queries": self.m.settings.generate_queries if not queries else 0,
                    "profile_source": self.m.settings.profile_source.value,
                    "profile_metric": self.m.settings.profile_metric.value,
                    "likelihood_scale": self.m.settings.likelihood_scale,
                    "max_new_tokens": self.m.settings.profile_max_new_tokens,
                }
                if not queries and not job["generate_queries"]:
                    continue
                ctx.profile_in_flight = True
                jobs.append(job)
                if len(jobs) >= limit:
                    break
            return jobs

    def add_queries(self, ctx_id: str, suffixes: Sequence[Sequence[int]], texts: Sequence[str] = ()) -> None:
        with self.m.lock:
            ctx = self.m.contexts.get(str(ctx_id))
            if ctx is not None:
                self.m.registry.extend_queries(ctx, suffixes, texts)

    def set_profile(self, ctx_id: str, quality: dict, reason: Optional[str] = None) -> bool:
        """Profile results (label -> quality); the placement is re-balanced with them."""
        with self.m.lock:
            ctx = self.m.contexts.get(str(ctx_id))
            if ctx is None:
                return False
            prof = {FULL: 1.0}
            for label, q in quality.items():
                cfg = CompressionConfig.parse(label)
                if not cfg.is_full:
                    prof[cfg] = min(1.0, max(0.0, float(q)))
            cur = ctx.placement.config
            if ctx.stored and cur not in prof:
                prof[cur] = ctx.quality.get(cur, 0.0)
            was_profiled = ctx.profiled
            ctx.quality = prof
            ctx.profiled = True
            ctx.profile_in_flight = False
            ctx.profile_reason = None
            ctx.profile_failures = 0
            self.m.count(profiles=1)
            if was_profiled or reason == "drift":
                self.m.count(reprofilings=1)
            if ctx.stored and not cur.is_full:
                self.m.tracker.set_profile(ctx.ctx_id, cur, prof[cur])
            self.m.rebalance_pending = True
            return True

    def release_profile(self, ctx_id: str) -> None:
        """A profile attempt failed; retried, up to :attr:`MAX_PROFILE_FAILURES` times."""
        with self.m.lock:
            ctx = self.m.contexts.get(str(ctx_id))
            if ctx is not None:
                ctx.profile_in_flight = False
                ctx.profile_failures += 1
                if ctx.profile_failures >= self.MAX_PROFILE_FAILURES:
                    logger.warning("EvicPress: giving up profiling context %s", ctx.ctx_id)
                    ctx.profile_reason = None

    def request_profile(self, ctx_id: str) -> bool:
        with self.m.lock:
            ctx = self.m.contexts.get(str(ctx_id))
            if ctx is None:
                return False
            ctx.profile_reason = ctx.profile_reason or "api"
            return True

    def take_observations(self, limit: int = 16) -> list[dict]:
        with self.m.lock:
            out = []
            while self.observations and len(out) < limit:
                out.append(self.observations.popleft())
            return out
