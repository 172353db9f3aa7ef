r"""Alpa's intra-operator ILP, solved with OR-Tools CP-SAT.

Variables, for every free node ``i`` (more than one strategy left after presolve) and every
edge ``e = (u, v)`` between free nodes:

.. math::

    x_{i,s} \in \{0, 1\}, \qquad y_{e,s,t} \in \{0, 1\} \text{ for each allowed pair }
    (s, t),\ C_e[s, t] < F

where ``F`` is the forbidden-cost sentinel (``reduce.FORBIDDEN``; the contest writes 1e18).

.. math::

    \min\ & \sum_i \sum_s \hat c_{i,s} x_{i,s} + \sum_e \sum_{(s,t)} C_e[s,t]\, y_{e,s,t} \\
    \text{s.t. }
      & \sum_s x_{i,s} = 1 \quad \forall i
        && \text{(one strategy; ``_add_nodes``)} \\
      & \sum_t y_{e,s,t} = x_{u,s} \ \ \forall e, s, \qquad
        \sum_s y_{e,s,t} = x_{v,t} \ \ \forall e, t
        && \text{(pair marginals; ``_add_edges``)} \\
      & \sum_{i \in L_k} \sum_s (m_{i,s} - \underline m_i)\, x_{i,s} \le \mathrm{cap}_k
        \quad \forall k
        && \text{(memory; ``_add_memory``)}

``\hat c_{i,s}`` is the node cost plus the edge costs to neighbours that are not free (their
strategy is fixed: single-strategy nodes, or nodes outside a neighbourhood being
re-optimised). The marginal form is as tight as Alpa's product linearisation and makes a
forbidden pair impossible simply by having no ``y`` for it. The memory rows come from
``memory_rows``: the timeline is cut at every start/end of a free node into segments
``k`` on which the live free set ``L_k`` is constant; ``cap_k`` is the limit minus the
largest load of everything else (fixed nodes, free nodes at their smallest usage
``\underline m_i``) within the segment. Segments whose row is implied by a neighbour's
(a subset live set with no less capacity) or that can never overflow are dropped.

Rigid groups are contracted first (``contract.py``): nodes tied by edges whose allowed pairs
form a permutation share one set of ``x`` variables, indexed by their root's strategy, so a
group of thousands of nodes costs the model a handful of variables; costs inside a group
become one cost per choice, edges between two groups are summed into one matrix, and a
memory row sums the usages of a group's members live in its segment (the rows are built
incrementally in time order, so their cost is the number of changes, not of entries).

Costs are scaled by a power of two and rounded to integers so that the objective stays
below 2^48; for integer costs of moderate size the scale is 1 and the model is exact. The
true float cost of the answer is always recomputed with ``evaluate``. Usages are scaled the
same way but rounded conservatively (coefficients up, capacities down).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from autopar.solver.contract import contract
from autopar.solver.problem import Problem, Solution, evaluate, usage_profile
from autopar.solver.reduce import FORBIDDEN, presolve, reduce_problem

if TYPE_CHECKING:
    from ortools.sat.python import cp_model


class _LazyCpModel:
    """``ortools.sat.python.cp_model``, imported on first use: it imports pandas too (half a
    second), which a plan that never calls CP-SAT (a 1-D mesh, where the axis sweep is exact)
    does not need."""

    def __getattr__(self, name: str) -> object:
        from ortools.sat.python import cp_model as module

        globals()["cp_model"] = module
        return getattr(module, name)


if not TYPE_CHECKING:
    cp_model = _LazyCpModel()

_OBJ_MAX = 2.0**48


class OutOfTime(Exception):
    """``build`` passed its deadline (a whole contest model takes tens of seconds to build
    on a loaded machine); the caller keeps the answer it has."""


def _check(deadline: float | None, k: int) -> None:
    if deadline is not None and k % 128 == 0 and time.monotonic() > deadline:
        raise OutOfTime


def memory_rows(q: Problem, free: np.ndarray, cap: np.ndarray) -> list[tuple[np.ndarray, float]]:
    """Memory rows ``(free nodes live in segment, extra capacity)`` for ``free`` nodes.

    ``cap[t]`` is the usage limit minus the load at ``t`` of everything except the free
    nodes' extras over their smallest usage. Returns ``[(nodes, -1.0)]`` when even the
    smallest usages do not fit (the model is then infeasible).
    """
    idx = q.index
    if len(cap) and cap.min() < 0:
        return [(np.zeros(0, np.int64), -1.0)]
    ext = np.array([q.usages[i].max() - q.usages[i].min() for i in free])
    st, en = idx.start[free], idx.end[free]
    use = (ext > 0) & (en > st)
    f, st, en, ext = free[use], st[use], en[use], ext[use]
    if len(f) == 0:
        return []
    ev = np.unique(np.concatenate([st, en]))
    # reduceat's last segment runs to the end of the array, so cut the profile at ev[-1]
    seg_cap = np.minimum.reduceat(cap[: ev[-1]], ev[:-1])
    n_seg = len(ev) - 1
    starts_at = np.isin(ev, st)
    ends_at = np.isin(ev, en)
    keep = np.ones(n_seg, dtype=bool)
    for k in range(n_seg):
        # boundary k has only ends -> segment k's set is a subset of segment k-1's
        if k > 0 and not starts_at[k] and seg_cap[k] >= seg_cap[k - 1]:
            keep[k] = False
        elif k + 1 < n_seg and not ends_at[k + 1] and seg_cap[k] >= seg_cap[k + 1]:
            keep[k] = False
    rows = []
    order = np.argsort(st, kind="stable")
    st_sorted = st[order]
    for k in np.nonzero(keep)[0]:
        t = ev[k]
        cand = order[: np.searchsorted(st_sorted, t, "right")]
        live = cand[en[cand] > t]
        if len(live) == 0 or ext[live].sum() <= seg_cap[k]:
            continue
        rows.append((f[live], float(seg_cap[k])))
    return rows


def _scale_for(upper: float, values: list[np.ndarray], top: float) -> float:
    """Power of two that maps costs to integers with the whole objective below ``top``."""
    integral = all(np.all(np.mod(v, 1) == 0) for v in values if len(v))
    if integral and upper <= top:
        return 1.0
    if upper <= 0:
        return 1.0
    return 2.0 ** math.floor(math.log2(top / upper))


@dataclass
class SubModel:
    """A CP-SAT model over ``free`` nodes, everything else fixed at ``assign``."""

    model: cp_model.CpModel
    free: np.ndarray
    xs: list[list[cp_model.IntVar]]
    scale: float
    offset: float  # objective = offset + scaled-integer objective / scale
    # every pair variable with the two choice variables it is the AND of, for a complete
    # hint (``solve_sub(whole=True)``)
    pairs: list[tuple[cp_model.IntVar, cp_model.IntVar, cp_model.IntVar]] = field(
        default_factory=list)


def build(
    q: Problem,
    free: np.ndarray,
    assign: np.ndarray,
    cap: np.ndarray | None,
    edges_of: list[list[tuple[int, int]]] | None = None,
    forbid: float = FORBIDDEN,
    lex: bool = False,
    deadline: float | None = None,
) -> SubModel:
    """Build the model; ``cap`` is the capacity profile (see ``memory_rows``) or None.

    ``edges_of[i]`` lists ``(edge, side)`` incident to node i, to avoid scanning all edges.
    Costs >= ``forbid`` are excluded from the model, or with ``lex`` kept at a weight larger
    than every other term together (so the model minimises forbidden choices first; LNS needs
    this while its incumbent still uses some).
    """
    m = cp_model.CpModel()
    free = np.asarray(free, dtype=np.int64)
    pos = {int(i): k for k, i in enumerate(free)}
    node_c = [q.costs[i].copy() for i in free]
    inner: list[tuple[int, int, np.ndarray]] = []
    if edges_of is None:
        eids: list[int] | range = range(q.num_edges)
    else:
        eids = sorted({e for i in free.tolist() for e, _ in edges_of[i]})
    for e in eids:
        u, v = q.edges[e]
        fu, fv = u in pos, v in pos
        mat = q.edge_costs[e]
        if fu and fv:
            inner.append((pos[u], pos[v], mat))
        elif fu:
            node_c[pos[u]] = node_c[pos[u]] + mat[:, assign[v]]
        elif fv:
            node_c[pos[v]] = node_c[pos[v]] + mat[assign[u], :]
    # rigid groups (nodes tied by permutation edges) become one set of variables each; with
    # ``lex`` forbidden pairs are allowed at a weight, so nothing is tied
    units = contract(node_c, inner, forbid, enabled=not lex)
    unit_c, unit_e = units.costs, units.edges
    los = []
    upper = 0.0
    for c in unit_c:
        ok = c < forbid
        if not ok.any():
            ok = np.ones_like(ok)
        los.append(float(c[ok].min()))
        upper += float(c[ok].max()) - los[-1]
    offset = float(sum(los))
    for _, _, mat in unit_e:
        ok = mat < forbid
        upper += float(mat[ok].max()) if ok.any() else 0.0
    finite = [c[c < forbid] for c in unit_c] + [mt[mt < forbid] for _, _, mt in unit_e]
    scale = _scale_for(upper, finite, 2.0**30 if lex else _OBJ_MAX)
    big = int(upper * scale) + 1

    def weight(val: float, lo: float) -> int:
        if val >= forbid:
            return big * max(1, int(val // forbid))
        return int(round((val - lo) * scale))

    xu = _add_nodes(m, unit_c, forbid, lex)
    obj: list = [m.NewConstant(0)]
    coefs: list[int] = [0]
    for k, c in enumerate(unit_c):
        for s, x in enumerate(xu[k]):
            if x is not None:
                w = weight(c[s], los[k])
                if w:
                    obj.append(x)
                    coefs.append(w)
    _check(deadline, 0)
    pairs = _add_edges(m, xu, unit_e, weight, obj, coefs, forbid, lex, deadline)
    xs: list[list] = []
    for k, c in enumerate(node_c):
        row: list = [None] * len(c)
        for t, x in enumerate(xu[int(units.unit_of[k])]):
            if x is not None:
                row[int(units.maps[k][t])] = x
        xs.append(row)
    if cap is not None:
        _check(deadline, 0)
        _add_memory(m, q, free, xs, memory_rows(q, free, cap), deadline)
    m.Minimize(cp_model.LinearExpr.WeightedSum(obj, coefs))
    return SubModel(m, free, xs, scale, offset, pairs)


def _add_nodes(m: cp_model.CpModel, node_c: list[np.ndarray], forbid: float, lex: bool) -> list:
    xs = []
    for k, c in enumerate(node_c):
        ok = c < forbid
        if lex or not ok.any():
            ok[:] = True  # every strategy is forbidden-expensive: keep them all
        row = [m.NewBoolVar(f"x{k}_{s}") if ok[s] else None for s in range(len(c))]
        m.AddExactlyOne([x for x in row if x is not None])
        xs.append(row)
    return xs


def _add_edges(m, xs, inner, weight, obj, coefs, forbid, lex, deadline=None) -> list[tuple]:
    pairs_out: list[tuple] = []
    for k, (a, b, mat) in enumerate(inner):
        _check(deadline, k)
        xa, xb = xs[a], xs[b]
        ok = mat < forbid
        if lex or not ok.any():
            ok = np.ones_like(ok)
        by_row: list[list] = [[] for _ in range(mat.shape[0])]
        by_col: list[list] = [[] for _ in range(mat.shape[1])]
        for s, t in zip(*np.nonzero(ok)):
            if xa[s] is None or xb[t] is None:
                continue
            y = m.NewBoolVar("")
            w = weight(mat[s, t], 0.0)
            if w:
                obj.append(y)
                coefs.append(w)
            by_row[s].append(y)
            by_col[t].append(y)
            pairs_out.append((y, xa[s], xb[t]))
        # each side's choice equals the sum of its pair variables (0 when it has none)
        for side, pairs in ((xa, by_row), (xb, by_col)):
            for x, ys in zip(side, pairs):
                if x is not None:
                    m.Add(sum(ys) == x if ys else x == 0)
    return pairs_out


def _add_memory(m, q: Problem, free, xs, rows, deadline=None) -> None:
    if not rows:
        return
    allu = np.concatenate([q.usages[i] - q.usages[i].min() for i in free])
    integral = bool(np.all(np.mod(allu, 1) == 0)) and all(c == math.floor(c) for _, c in rows)
    big = float(allu.max()) if len(allu) else 1.0
    # Integer usages stay exact; others are scaled to ~2^30 and rounded on the safe side.
    us = 1.0 if integral and big < 2**53 else 2.0 ** math.floor(math.log2(2**30 / max(big, 1e-300)))
    # tied nodes share variables, so a row sums their coefficients; rows come in time order
    # and differ by a few nodes, so each is the previous one's vector plus/minus those
    vid: dict[int, int] = {}
    flat: list = []
    per: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for k, i in enumerate(free.tolist()):
        ext = q.usages[i] - q.usages[i].min()
        ids, ws = [], []
        for s, x in enumerate(xs[k]):
            if x is not None and ext[s] > 0:
                j = vid.setdefault(x.Index(), len(flat))
                if j == len(flat):
                    flat.append(x)
                ids.append(j)
                ws.append(int(math.ceil(ext[s] * us)))
        per[i] = (np.array(ids, dtype=np.int64), np.array(ws, dtype=np.int64))
    vec = np.zeros(len(flat), dtype=np.int64)
    prev = np.zeros(0, dtype=np.int64)
    on = np.zeros(q.num_nodes, dtype=bool)  # the previous row's nodes
    for k, (nodes, capk) in enumerate(rows):
        _check(deadline, k)
        if capk < 0:
            m.AddBoolOr([])  # nothing fits: infeasible
            return
        add = nodes[~on[nodes]]
        on[prev] = False
        on[nodes] = True
        for i in add.tolist():
            vec[per[i][0]] += per[i][1]
        for i in prev[~on[prev]].tolist():
            vec[per[i][0]] -= per[i][1]
        prev = nodes
        nz = np.flatnonzero(vec)
        terms = [flat[j] for j in nz.tolist()]
        m.Add(cp_model.LinearExpr.WeightedSum(terms, vec[nz].tolist()) <= math.floor(capk * us))


def capacity_profile(q: Problem, free: np.ndarray, assign: np.ndarray) -> np.ndarray | None:
    """Limit minus the load of fixed nodes and of free nodes at their smallest usage."""
    if q.usage_limit is None:
        return None
    a = assign.copy()
    for i in free:
        a[i] = int(np.argmin(q.usages[i]))
    return q.usage_limit - usage_profile(q, a)


def solve_sub(
    sm: SubModel, time_limit: float, workers: int, seed: int, hint: np.ndarray | None,
    whole: bool = False,
) -> tuple[int, np.ndarray | None, float | None]:
    """Solve; returns (cp status, chosen strategy per free node or None, objective bound).

    ``whole``: the model is the whole problem (``solve._exact``), tens of thousands of pair
    variables. The hint then sets the pair variables too, so CP-SAT starts from a complete
    solution, and CP-SAT's probing presolve is off: it took most of a second there and fixed
    nothing. Before, autopar train's problem (gpt2-tiny on 2x2) ran out of its 1.4 s with no
    solution at all (UNKNOWN); now it is proven optimal in about 0.5 s. The small models of
    the heuristic's neighbourhoods keep the defaults (hinting every pair there cost more than
    it saved)."""
    if hint is not None:
        on: dict[int, int] = {}  # tied nodes share variables: hint each once
        for k, i in enumerate(sm.free):
            for s, x in enumerate(sm.xs[k]):
                if x is not None and x.Index() not in on:
                    on[x.Index()] = int(s == hint[i])
                    sm.model.AddHint(x, on[x.Index()])
        if whole:
            for y, xa, xb in sm.pairs:
                sm.model.AddHint(y, on.get(xa.Index(), 0) & on.get(xb.Index(), 0))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit))
    solver.parameters.num_workers = max(1, int(workers))
    solver.parameters.random_seed = int(seed)
    if whole:
        solver.parameters.cp_model_probing_level = 0
    st = solver.Solve(sm.model)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return st, None, None
    out = np.empty(len(sm.free), dtype=np.int64)
    for k, row in enumerate(sm.xs):
        out[k] = next(s for s, x in enumerate(row) if x is not None and solver.Value(x))
    bound = sm.offset + solver.BestObjectiveBound() / sm.scale
    return st, out, bound


def solve_ilp(
    problem: Problem,
    timeout_s: float = 60.0,
    hint: np.ndarray | None = None,
    workers: int = 2,
    seed: int = 0,
) -> Solution:
    """Presolve, then solve the whole problem with CP-SAT within ``timeout_s``."""
    t0 = time.monotonic()
    red, soft = presolve(problem)
    n = problem.num_nodes
    if red.infeasible:
        return Solution((), math.inf, False, "infeasible", time.monotonic() - t0, "ilp")
    q = red.problem
    free = np.nonzero(q.index.n_strat > 1)[0]
    base = np.zeros(n, dtype=np.int64)
    sm = build(
        q, free, base, capacity_profile(q, free, base), forbid=math.inf if soft else FORBIDDEN
    )
    h = red.restrict(np.asarray(hint)) if hint is not None else None
    left = timeout_s - (time.monotonic() - t0)
    st, sub, bound = solve_sub(sm, left, workers, seed, h)
    dt = time.monotonic() - t0
    if sub is None:
        if st == cp_model.INFEASIBLE and not soft:
            # forbidden costs may be what memory forces: retry exactly, without hard forbids
            red2 = reduce_problem(problem, hard_forbid=False)
            q2 = red2.problem
            free2 = np.nonzero(q2.index.n_strat > 1)[0]
            sm2 = build(q2, free2, base, capacity_profile(q2, free2, base), forbid=math.inf)
            soft = True
            st, sub, bound = solve_sub(sm2, timeout_s - dt, workers, seed, None)
            red, free, dt = red2, free2, time.monotonic() - t0
        if sub is None:
            status = "infeasible" if st == cp_model.INFEASIBLE else "timeout-no-solution"
            return Solution((), math.inf, False, status, dt, "ilp")
    a = base.copy()
    a[free] = sub
    orig = red.expand(a)
    cost, feas, peak = evaluate(problem, orig)
    # with hard forbids an optimum is proven only among plans that avoid forbidden costs
    status = "optimal" if st == cp_model.OPTIMAL and cost < FORBIDDEN else "feasible"
    return Solution(tuple(orig.tolist()), cost, feas, status, dt, "ilp", bound, peak)
