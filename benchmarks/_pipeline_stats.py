"""The pure functions of ``benchmarks/pipeline.py``: the measured bubble (defined as the
schedule model defines its prediction), the textbook bubble as a share of the step, ranks and
Spearman's rank correlation with a bootstrap interval. No torch, no processes."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

COMPUTE_KINDS = ("F", "B", "I", "W")  # a stage's actions; "sync" (the gradient sync) is not one


def schedule_bubble(events: Sequence[tuple], ranks: int) -> tuple[float, float]:
    """(bubble, span) of one step from ``(rank, kind, start, end, ...)`` actions on a common
    clock: idle over ``ranks x span``, the span from the first compute action's start to the
    last one's end on any rank, as ``passes/pipeline/schedule.simulate`` defines its
    ``bubble_fraction`` (a ``kind`` not in F/B/I/W, such as the gradient sync, is left out).
    A rank with no action counts as idle throughout."""
    acts = [e for e in events if e[1] in COMPUTE_KINDS]
    if not acts:
        return 0.0, 0.0
    start = min(e[2] for e in acts)
    span = max(e[3] for e in acts) - start
    if span <= 0:
        return 0.0, 0.0
    busy = sum(e[3] - e[2] for e in acts)
    return max(0.0, 1.0 - busy / (ranks * span)), span


def textbook_share(p: int, m: int, v: int = 1) -> float:
    """The textbook bubble ``(p-1)/(v*m)`` (idle over ideal time) as a share of the step."""
    x = (p - 1) / (v * m)
    return x / (1 + x)


def rank_of(xs: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's over the (tie-averaged) ranks."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("spearman needs two sequences of the same length, at least 2")
    rx, ry = rank_of(xs), rank_of(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else 0.0


def bootstrap_rho(predicted: Sequence[float], rounds: Sequence[Sequence[float]],
                  n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of Spearman's rho of ``predicted`` against per-plan medians, the rounds
    (``rounds[plan][round]``, measured in the same rounds for every plan) drawn again."""
    rng = random.Random(seed)
    k = len(rounds[0])
    rhos = []
    for _ in range(n):
        pick = [rng.randrange(k) for _ in range(k)]
        rhos.append(spearman(predicted, [statistics.median([r[i] for i in pick])
                                         for r in rounds]))
    rhos.sort()
    return rhos[int(0.025 * n)], rhos[int(0.975 * n) - 1]
