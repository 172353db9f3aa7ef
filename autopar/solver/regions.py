"""Exact moves on connected regions of units (a large-neighbourhood search for the unit
search of ``unitsearch.py``).

The forest moves there re-choose whole induced forests exactly, but a plan can only change
along a cycle of units one unit at a time, and on M (its cost all resharding, about one
independent cycle per unit) those moves settle 4-5% above the contest's best. Here a ball of
units grown breadth-first from a costly edge is re-chosen exactly with the rest held, cycles
and all, by variable elimination (``elimination.eliminate``: work is the product of the
domains in the largest factor, so the ball's size adapts to what the region's width allows).

Under a usage limit the region's optimum is taken when the whole profile still fits;
otherwise the region is solved again allowing only choices whose usage nowhere rises (which
always fits). A move is taken only when it lowers the true cost, so the incumbent never gets
worse and never leaves the limit.
"""

from __future__ import annotations

import math
import time

import numpy as np

from autopar.solver import kernels
from autopar.solver.elimination import eliminate, greedy_order

# the largest elimination factor a region may need (entries): a few milliseconds of numpy
_MAX_ENTRIES = 2e5
# region sizes (units): start, floor and ceiling of the adaptive size
_SIZE0, _SIZE_MIN, _SIZE_MAX = 16, 4, 400


def grow(D, seed: int, size: int, rng: np.random.Generator) -> list[int]:
    """About ``size`` units connected to ``seed``, breadth-first, neighbours shuffled."""
    adj_ptr, adj_e, adj_side, e_a, e_b = D[6], D[7], D[8], D[9], D[10]
    seen = {seed}
    out = [seed]
    head = 0
    while head < len(out) and len(out) < size:
        u = out[head]
        head += 1
        nb = [int(e_b[adj_e[p]] if adj_side[p] == 0 else e_a[adj_e[p]])
              for p in range(adj_ptr[u], adj_ptr[u + 1])]
        for p in rng.permutation(len(nb)).tolist():
            v = nb[p]
            if v not in seen:
                seen.add(v)
                out.append(v)
                if len(out) >= size:
                    break
    return out


def _region_problem(D, units: list[int], ch: np.ndarray, pc: np.ndarray):
    """The region's own problem: each unit's costs plus its edges to the held units, and
    the edges inside. Returns (dom, edges, matrices, unary)."""
    k_off, adj_ptr, adj_e, adj_side, e_a, e_b, e_off, e_nb, e_flat = (
        D[0], D[6], D[7], D[8], D[9], D[10], D[11], D[12], D[13])
    pos = {u: i for i, u in enumerate(units)}
    dom = [int(k_off[u + 1] - k_off[u]) for u in units]
    unary = [pc[k_off[u]:k_off[u + 1]].copy() for u in units]
    edges: list[tuple[int, int]] = []
    mats: list[np.ndarray] = []
    for i, u in enumerate(units):
        for p in range(adj_ptr[u], adj_ptr[u + 1]):
            e = adj_e[p]
            a, b = int(e_a[e]), int(e_b[e])
            nb = int(e_nb[e])
            m = e_flat[e_off[e]:e_off[e] + (k_off[a + 1] - k_off[a]) * nb].reshape(-1, nb)
            if adj_side[p] == 0:  # u is the edge's first end: its rows
                j = pos.get(b, -1)
                if j >= 0:
                    edges.append((i, j))
                    mats.append(m)
                else:
                    unary[i] += m[:, ch[b]]
            elif a not in pos:  # an edge inside is taken once, from its first end
                unary[i] += m[ch[a], :]
    return dom, edges, mats, unary


def _no_rise(D, units: list[int], ch: np.ndarray, unary: list[np.ndarray]) -> None:
    """Forbid (cost inf) every choice where some member's usage rises above the current."""
    m_ptr, m_uoff, m_use = D[1], D[4], D[5]
    for i, u in enumerate(units):
        for m in range(m_ptr[u], m_ptr[u + 1]):
            use = m_use[m_uoff[m]:m_uoff[m] + len(unary[i])]
            unary[i][use > use[ch[u]]] = math.inf


def region_move(D, units: list[int], ch: np.ndarray, cost: np.ndarray, base: np.ndarray,
                lim: float) -> tuple[bool, float]:
    """Re-choose ``units`` exactly with the rest of ``ch`` held; ``ch`` changes only when
    the plan's true ``cost`` falls and its profile stays under ``lim``. Returns (whether
    the region was narrow enough to solve, the cost saved)."""
    dom, edges, mats, unary = _region_problem(D, units, ch, cost)
    order = greedy_order(edges, dom, _MAX_ENTRIES)
    if order is None:
        return False, 0.0
    before = kernels.total_cost(D, ch, cost)
    idx = np.array(units, dtype=np.int64)
    old = ch[idx].copy()
    for attempt in range(2 if math.isfinite(lim) else 1):
        if attempt == 1:
            _no_rise(D, units, ch, unary)
        a = eliminate(dom, edges, mats, order, unary)
        if np.array_equal(a, old):
            return True, 0.0
        ch[idx] = a
        after = kernels.total_cost(D, ch, cost)
        if after < before - 1e-9 * abs(before) and (
                not math.isfinite(lim) or kernels.profile(D, ch, base).max() <= lim):
            return True, before - after
        ch[idx] = old
    return True, 0.0


def region_search(D, ch: np.ndarray, cost: np.ndarray, base: np.ndarray, lim: float,
                  deadline: float, rng: np.random.Generator) -> float:
    """Region moves on ``ch`` (in place) until ``deadline``, seeded at costly edges, the
    size growing while regions solve and shrinking when they are too wide. Returns the
    cost saved."""
    if len(D[9]) == 0:
        return 0.0
    size, saved = _SIZE0, 0.0
    # units of whole components solved exactly with no gain since the plan last changed: a
    # small problem is soon all settled, and moving it again would repeat the same solves
    settled: set[int] = set()
    n_linked = len(np.unique(np.concatenate([D[9], D[10]])))
    while time.monotonic() < deadline and len(settled) < n_linked:
        ec = kernels.edge_costs_now(D, ch)
        w = np.minimum(ec, np.median(ec[ec > 0]) * 1e3 if (ec > 0).any() else 1.0) + 1e-12
        for e in rng.choice(len(ec), size=32, p=w / w.sum()).tolist():
            if time.monotonic() >= deadline:
                break
            seed = int(D[9][e] if rng.random() < 0.5 else D[10][e])
            units = grow(D, seed, size, rng)
            ok, gain = region_move(D, units, ch, cost, base, lim)
            saved += gain
            if gain > 0:
                settled.clear()
            elif ok and len(units) < size:  # the seed's whole component, nothing to gain
                settled.update(units)
            size = min(_SIZE_MAX, int(size * 1.1) + 1) if ok else max(_SIZE_MIN,
                                                                       int(size * 0.8))
    return saved
