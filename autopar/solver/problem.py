"""The abstract sharding problem (IOPDDL contest form) and its evaluation.

A problem has nodes ``i`` with one cost and one memory usage per strategy ``s``, a live
interval ``[start, end)`` per node, and edges ``(u, v)`` with a cost matrix indexed
``[s_u, s_v]``. A solution picks one strategy per node; its cost is the sum of the chosen
node costs and edge costs, and it is feasible when at every time ``t`` the usages of the
nodes live at ``t`` sum to at most ``usage_limit``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Status = Literal["optimal", "feasible", "infeasible", "timeout-no-solution"]

# Usages are compared against the limit with this relative slack so that a float round-off in
# a running sum never turns a feasible plan infeasible; integer instances are exact anyway.
_USAGE_RTOL = 1e-12


class ProblemError(ValueError):
    """A problem that is malformed (wrong sizes, negative usage, bad node index...)."""


@dataclass(frozen=True, slots=True)
class _Index:
    """Flat numpy views of a problem, built once, so evaluation is a few vector ops."""

    n_strat: np.ndarray  # [n] int64
    node_off: np.ndarray  # [n] offset of node i's strategies in the flat arrays
    cost_flat: np.ndarray
    usage_flat: np.ndarray
    start: np.ndarray
    end: np.ndarray
    edge_u: np.ndarray
    edge_v: np.ndarray
    edge_nv: np.ndarray
    edge_off: np.ndarray
    edge_flat: np.ndarray
    horizon: int  # one past the last time step any node is live


@dataclass(frozen=True, slots=True, eq=False)
class Problem:
    """Nodes with per-strategy costs/usages and live intervals, edges with cost matrices."""

    costs: list[np.ndarray]
    usages: list[np.ndarray]
    intervals: list[tuple[int, int]]
    edges: list[tuple[int, int]]
    edge_costs: list[np.ndarray]
    usage_limit: float | None = None
    names: list[str] | None = None
    name: str | None = None
    _index: _Index = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", _build_index(self))

    @property
    def num_nodes(self) -> int:
        return len(self.costs)

    @property
    def num_edges(self) -> int:
        return len(self.edges)

    @property
    def index(self) -> _Index:
        return self._index

    def __repr__(self) -> str:
        limit = "None" if self.usage_limit is None else f"{self.usage_limit:g}"
        return (
            f"Problem(name={self.name!r}, nodes={self.num_nodes}, edges={self.num_edges}, "
            f"strategies={int(self._index.n_strat.sum())}, usage_limit={limit})"
        )


@dataclass(frozen=True, slots=True)
class Solution:
    """One strategy index per node, its true (float) cost and how it was obtained."""

    assignment: tuple[int, ...]
    cost: float
    feasible: bool
    status: Status
    time_s: float
    method: str
    lower_bound: float | None = None
    peak_usage: float | None = None


def _build_index(p: Problem) -> _Index:
    n = len(p.costs)
    if len(p.usages) != n or len(p.intervals) != n:
        raise ProblemError(
            f"node lists disagree in length: {n} costs, {len(p.usages)} usages, "
            f"{len(p.intervals)} intervals"
        )
    if p.names is not None and len(p.names) != n:
        raise ProblemError(f"{len(p.names)} names for {n} nodes")
    if len(p.edges) != len(p.edge_costs):
        raise ProblemError(f"{len(p.edges)} edges but {len(p.edge_costs)} edge cost matrices")
    n_strat = np.array([len(c) for c in p.costs], dtype=np.int64)
    for i in range(n):
        c, u = p.costs[i], p.usages[i]
        if c.ndim != 1 or len(c) == 0:
            raise ProblemError(f"node {i}: needs at least one strategy (got costs shape {c.shape})")
        if u.shape != c.shape:
            raise ProblemError(f"node {i}: {len(c)} costs but {len(u)} usages")
    cost_flat = np.concatenate(p.costs).astype(np.float64, copy=False) if n else np.zeros(0)
    usage_flat = np.concatenate(p.usages).astype(np.float64, copy=False) if n else np.zeros(0)
    if not np.all(np.isfinite(cost_flat)) or not np.all(np.isfinite(usage_flat)):
        raise ProblemError("node costs and usages must be finite numbers")
    if np.any(usage_flat < 0):
        bad = int(np.searchsorted(np.cumsum(n_strat), int(np.argmax(usage_flat < 0)), "right"))
        raise ProblemError(f"node {bad}: negative memory usage")
    iv = np.array(p.intervals, dtype=np.int64).reshape(n, 2)
    m = len(p.edges)
    ed = np.array(p.edges, dtype=np.int64).reshape(m, 2)
    if m and (ed.min() < 0 or ed.max() >= n):
        e = int(np.argmax((ed < 0).any(1) | (ed >= n).any(1)))
        raise ProblemError(f"edge {e}: node index {tuple(ed[e])} out of range for {n} nodes")
    for e, mat in enumerate(p.edge_costs):
        want = (n_strat[ed[e, 0]], n_strat[ed[e, 1]])
        if mat.shape != want:
            raise ProblemError(
                f"edge {e} {tuple(ed[e])}: cost matrix shape {mat.shape}, expected {want}"
            )
    edge_flat = (
        np.concatenate([mat.ravel() for mat in p.edge_costs]).astype(np.float64, copy=False)
        if m
        else np.zeros(0)
    )
    if not np.all(np.isfinite(edge_flat)):
        raise ProblemError("edge costs must be finite numbers")
    sizes = n_strat[ed[:, 0]] * n_strat[ed[:, 1]] if m else np.zeros(0, np.int64)
    live = iv[:, 1] > iv[:, 0]
    return _Index(
        n_strat=n_strat,
        node_off=np.concatenate([[0], np.cumsum(n_strat)[:-1]]).astype(np.int64),
        cost_flat=cost_flat,
        usage_flat=usage_flat,
        start=iv[:, 0].copy(),
        end=iv[:, 1].copy(),
        edge_u=ed[:, 0].copy(),
        edge_v=ed[:, 1].copy(),
        edge_nv=n_strat[ed[:, 1]] if m else np.zeros(0, np.int64),
        edge_off=np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64),
        edge_flat=edge_flat,
        horizon=int(iv[live, 1].max()) if live.any() else 0,
    )


def check_assignment(problem: Problem, assignment: object) -> np.ndarray:
    """The assignment as an int64 array; raises ProblemError if it is not a valid one."""
    idx = problem.index
    a = np.asarray(assignment, dtype=np.int64).reshape(-1)
    if len(a) != problem.num_nodes:
        raise ProblemError(f"assignment has {len(a)} entries for {problem.num_nodes} nodes")
    bad = (a < 0) | (a >= idx.n_strat)
    if bad.any():
        i = int(np.argmax(bad))
        raise ProblemError(f"node {i}: strategy {a[i]} out of range [0, {idx.n_strat[i]})")
    return a


def usage_profile(problem: Problem, a: np.ndarray) -> np.ndarray:
    """Total usage at every time step 0..horizon-1 under assignment ``a``."""
    idx = problem.index
    use = idx.usage_flat[idx.node_off + a]
    live = idx.end > idx.start
    h = idx.horizon
    delta = np.bincount(idx.start[live], weights=use[live], minlength=h + 1)
    delta -= np.bincount(idx.end[live], weights=use[live], minlength=h + 1)
    return np.cumsum(delta[:h])


def fits(peak: float, limit: float | None) -> bool:
    return limit is None or peak <= limit + _USAGE_RTOL * max(1.0, abs(limit))


def least_load(problem: Problem, usages: list[np.ndarray] | None = None) -> np.ndarray:
    """At every time step, the sum of the live nodes' smallest usages (``usages``: the
    problem's, or the presolve's narrowed ones): no assignment uses less at that step."""
    usages = problem.usages if usages is None else usages
    idx = problem.index
    live = idx.end > idx.start
    umin = np.array([float(u.min()) if len(u) else 0.0 for u in usages])
    h = idx.horizon
    delta = np.bincount(idx.start[live], weights=umin[live], minlength=h + 1)
    delta -= np.bincount(idx.end[live], weights=umin[live], minlength=h + 1)
    return np.cumsum(delta[:h])


def least_peak_usage(problem: Problem) -> float:
    """The least peak usage of any assignment (:func:`least_load`'s highest step)."""
    load = least_load(problem)
    return float(load.max()) if len(load) else 0.0


def cannot_fit(problem: Problem) -> bool:
    """Whether no assignment fits the usage limit (:func:`least_peak_usage` over it), as
    the presolve proves it (:mod:`autopar.solver.reduce`): a search that can only return
    "no solution" then need not run. A planner's memory fit tightens a problem's limit round
    after round, and a search of an over-tight one spent its whole time limit finding
    nothing."""
    return problem.usage_limit is not None and not fits(least_peak_usage(problem),
                                                        problem.usage_limit)


def restrict(p: Problem, allowed: dict[int, list[int]]) -> tuple[Problem, list[np.ndarray]]:
    """The problem with some variables limited to given strategies; ``maps[v][k]`` is the
    original index of the restricted problem's strategy ``k``."""
    maps = [np.asarray(allowed.get(v, range(len(c)))) for v, c in enumerate(p.costs)]
    costs = [c[m] for c, m in zip(p.costs, maps)]
    usages = [u[m] for u, m in zip(p.usages, maps)]
    ecosts = [m_[np.ix_(maps[u], maps[v])] for (u, v), m_ in zip(p.edges, p.edge_costs)]
    return Problem(costs, usages, p.intervals, p.edges, ecosts, p.usage_limit, p.names, p.name), maps


def evaluate(problem: Problem, assignment: object) -> tuple[float, bool, float]:
    """``(cost, feasible, peak_usage)`` of an assignment, vectorised over all nodes/edges."""
    idx = problem.index
    a = check_assignment(problem, assignment)
    cost = float(idx.cost_flat[idx.node_off + a].sum())
    if len(idx.edge_u):
        cost += float(
            idx.edge_flat[idx.edge_off + a[idx.edge_u] * idx.edge_nv + a[idx.edge_v]].sum()
        )
    prof = usage_profile(problem, a)
    peak = float(prof.max()) if len(prof) else 0.0
    return cost, fits(peak, problem.usage_limit), peak


def make_problem(
    costs: list,
    usages: list,
    intervals: list,
    edges: list,
    edge_costs: list,
    usage_limit: float | None = None,
    names: list[str] | None = None,
    name: str | None = None,
) -> Problem:
    """Build a Problem from plain lists; edge costs may be flat (contest form) or 2-D."""
    cs = [np.asarray(c, dtype=np.float64).reshape(-1) for c in costs]
    us = [np.asarray(u, dtype=np.float64).reshape(-1) for u in usages]
    mats = []
    for e, ((u, v), m) in enumerate(zip(edges, edge_costs)):
        arr = np.asarray(m, dtype=np.float64)
        if not (0 <= u < len(cs) and 0 <= v < len(cs)):
            raise ProblemError(f"edge {e}: node index ({u}, {v}) out of range for {len(cs)} nodes")
        shape = (len(cs[u]), len(cs[v]))
        if arr.size != shape[0] * shape[1]:
            raise ProblemError(
                f"edge {e} ({u}, {v}): {arr.size} costs, expected {shape[0]}*{shape[1]}"
            )
        mats.append(arr.reshape(shape))
    ivs = [(int(s), int(t)) for s, t in intervals]
    eds = [(int(u), int(v)) for u, v in edges]
    limit = None if usage_limit is None else float(usage_limit)
    return Problem(cs, us, ivs, eds, mats, limit, names, name)
