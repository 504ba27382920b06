"""Quality profiling and the re-profiling trigger (paper sections 4.1 and 4.3).

Profiling: for each context and its query set, answer every query with the full KV
(the reference) and with each candidate config; a config's quality is the mean
agreement ``score(compressed answer, full answer)`` (section 4.3; the evaluation's
quality score is the MiniLM-L6-v2 cosine of the two answers, section 6.1 -- see
:mod:`.quality`). The profiler is abstract over how answers are produced: the runtime
passes ``answer(context, query, config) -> str``.

A measured profile is then made monotone (:func:`monotone_profile`): within one method,
keeping more of the KV never lowers quality. A few short answers make each score noisy
(a lucky 8-token match scores 1.0 at a ratio whose neighbours score 0.3); pooling the
violators of that order is the least-squares fit that respects it, and removes the noise
that most misleads the knapsack: an aggressive config that looks better than a milder
one.

Re-profiling: "triggered whenever the quality achieved on the online testing dataset
is below the quality achieved on the profiling dataset by a threshold of X%, and when
the system has free GPU cycles" (section 4.3); the microbenchmark uses a discrepancy of
0.3 (section 6.3). :class:`QualityTracker` keeps a moving average of the observed
quality of each context under its *current* config and flags the context when that
average falls below the profiled quality by the threshold; the runtime re-profiles
flagged contexts when it has spare cycles, using the newest queries kept by
:class:`QueryLog` ("records new incoming queries for each context", section 1).
"""

from __future__ import annotations

import collections
import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Iterable, Optional, Sequence

from .config import FULL, CompressionConfig

__all__ = ["ProfileMetric", "likelihood_quality", "profile_quality", "monotone_profile", "reprofile",
           "QualityTracker", "QueryLog"]


class ProfileMetric(str, enum.Enum):
    """How the profiler scores a config on a question."""

    ANSWER = "answer"  # the config's own answer against the full-KV answer (MiniLM cosine)
    LIKELIHOOD = "likelihood"  # how much less likely the full-KV answer is under the config's KV


def likelihood_quality(ref_logprobs: Sequence[float], cfg_logprobs: Sequence[float], scale: float) -> float:
    """The cheaper proxy: ``exp(-gap / scale)`` where ``gap`` is the mean per-token drop
    in log-probability of the full-KV answer's first tokens when read over the
    compressed KV instead (a one-sample estimate of the KL between the two next-token
    distributions along the full-KV answer). It needs one forward of the answer per
    config, no decoding of the config's own answer and no embedding model; ``scale``
    maps it onto the answer metric's range (calibrated against served quality by
    ``bench.evicpress --profile-methods ...,context-likelihood``)."""
    k = min(len(ref_logprobs), len(cfg_logprobs))
    if k == 0:
        return 1.0
    gap = sum(r - c for r, c in zip(ref_logprobs[:k], cfg_logprobs[:k])) / k
    return math.exp(-max(0.0, gap) / scale)

AnswerFn = Callable[[Any, Any, CompressionConfig], str]
ScoreFn = Callable[[str, str], float]


def _clip01(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else float(x)


def profile_quality(
    context: Any,
    queries: Sequence[Any],
    candidates: Iterable[CompressionConfig],
    answer: AnswerFn,
    score: ScoreFn,
) -> Dict[CompressionConfig, float]:
    """Quality of each candidate config on ``context`` (section 4.3).

    ``quality[c] = mean_q clip01(score(answer(context, q, c), answer(context, q, FULL)))``
    and ``quality[FULL] = 1.0``. Scores are clipped to [0, 1] because a cosine can be
    negative. The full answer of each query is computed once.
    """
    queries = list(queries)
    if not queries:
        raise ValueError("profiling needs at least one query")
    refs = [answer(context, q, FULL) for q in queries]
    quality: Dict[CompressionConfig, float] = {FULL: 1.0}
    for cfg in candidates:
        if cfg.is_full:
            continue
        agree = [_clip01(score(answer(context, q, cfg), ref)) for q, ref in zip(queries, refs)]
        quality[cfg] = sum(agree) / len(agree)
    return monotone_profile(quality)


def monotone_profile(quality: Dict[CompressionConfig, float]) -> Dict[CompressionConfig, float]:
    """The closest profile (least squares) in which, per method, quality does not fall as
    the kept fraction or the bit width grows: pool-adjacent-violators over each method's
    configs sorted by size. ``FULL`` and methods with one config are unchanged."""
    out = dict(quality)
    families: dict[str, list[CompressionConfig]] = collections.defaultdict(list)
    for cfg in quality:
        if not cfg.is_full:
            families[cfg.method].append(cfg)
    for cfgs in families.values():
        cfgs.sort(key=lambda c: c.size_fraction)
        blocks: list[list] = []  # [mean, count] per pooled block, ascending size
        for c in cfgs:
            blocks.append([float(quality[c]), 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                m2, n2 = blocks.pop()
                m1, n1 = blocks[-1]
                blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
        i = 0
        for mean, n in blocks:
            for c in cfgs[i:i + n]:
                out[c] = mean
            i += n
    return out


@dataclass
class _Track:
    config: CompressionConfig
    profiled: float
    ema: Optional[float] = None
    samples: int = 0
    flagged: bool = False


class QualityTracker:
    """Online quality per context vs. its profile; flags contexts to re-profile.

    ``threshold`` is in quality units (0.3 in the paper's section 6.3) when
    ``relative=False``, or a fraction of the profiled quality (the "X%" of section 4.3)
    when ``relative=True``. ``ema_weight`` is the weight of a new observation in the
    exponential moving average; nothing fires before ``min_samples`` observations.
    Observations are only comparable under one config, so :meth:`set_profile` (called
    after profiling and whenever a context's config changes) restarts the average.
    """

    def __init__(
        self,
        threshold: float = 0.3,
        *,
        relative: bool = False,
        ema_weight: float = 0.2,
        min_samples: int = 3,
    ) -> None:
        if not 0.0 < ema_weight <= 1.0:
            raise ValueError("ema_weight must be in (0, 1]")
        if threshold < 0:
            raise ValueError("threshold must be >= 0")
        self.threshold = threshold
        self.relative = relative
        self.ema_weight = ema_weight
        self.min_samples = max(1, int(min_samples))
        self._tracks: dict[Hashable, _Track] = {}

    def set_profile(self, ctx_id: Hashable, config: CompressionConfig, profiled_quality: float) -> None:
        """(Re)start tracking ``ctx_id`` under ``config`` with its profiled quality."""
        self._tracks[ctx_id] = _Track(config, float(profiled_quality))

    def forget(self, ctx_id: Hashable) -> None:
        self._tracks.pop(ctx_id, None)

    def observe(self, ctx_id: Hashable, quality: float, config: Optional[CompressionConfig] = None) -> bool:
        """Record one observed quality; True when this observation flags the context.

        An observation made under a different ``config`` than the tracked one (a
        request served while a move was in flight) is ignored. Untracked contexts are
        ignored too.
        """
        t = self._tracks.get(ctx_id)
        if t is None or (config is not None and config != t.config):
            return False
        q = _clip01(quality)
        t.ema = q if t.ema is None else (1.0 - self.ema_weight) * t.ema + self.ema_weight * q
        t.samples += 1
        if t.flagged or t.samples < self.min_samples:
            return False
        margin = self.threshold * t.profiled if self.relative else self.threshold
        if t.ema < t.profiled - margin:
            t.flagged = True
            return True
        return False

    def needs_reprofile(self, ctx_id: Hashable) -> bool:
        t = self._tracks.get(ctx_id)
        return bool(t and t.flagged)

    def pending(self) -> list[Hashable]:
        """Flagged contexts, in the order they were first tracked."""
        return [cid for cid, t in self._tracks.items() if t.flagged]

    def observed(self, ctx_id: Hashable) -> Optional[float]:
        """Current moving average (None before the first observation)."""
        t = self._tracks.get(ctx_id)
        return None if t is None else t.ema


class QueryLog:
    """The newest ``maxlen`` queries of each context, the set used to re-profile it."""

    def __init__(self, maxlen: int = 50) -> None:
        # 50: the paper's per-context training query set size (section 6.1).
        self.maxlen = maxlen
        self._q: dict[Hashable, collections.deque] = {}

    def record(self, ctx_id: Hashable, query: Any) -> None:
        self._q.setdefault(ctx_id, collections.deque(maxlen=self.maxlen)).append(query)

    def latest(self, ctx_id: Hashable) -> list[Any]:
        return list(self._q.get(ctx_id, ()))

    def forget(self, ctx_id: Hashable) -> None:
        self._q.pop(ctx_id, None)


def reprofile(
    ctx_id: Hashable,
    context: Any,
    queries: Sequence[Any],
    candidates: Iterable[CompressionConfig],
    answer: AnswerFn,
    score: ScoreFn,
    tracker: QualityTracker,
    current: CompressionConfig,
) -> Dict[CompressionConfig, float]:
    """Re-profile ``context`` on ``queries`` (e.g. ``QueryLog.latest``) and restart its
    tracker under ``current`` with the new profiled quality. Returns the new profile;
    the caller then re-runs placement with it."""
    candidates = list(candidates)
    if not current.is_full and current not in candidates:
        candidates.append(current)  # keep the tracked config comparable
    quality = profile_quality(context, queries, candidates, answer, score)
    tracker.set_profile(ctx_id, current, quality[current])
    return quality
