r"""Exact min-sum by variable elimination, for problems of small treewidth.

The planner's problems are pairwise: a cost per node strategy and a cost matrix per edge, over
a graph that (once repeated layers share variables) is a transformer block or two. Such graphs
have small treewidth, and on them *bucket elimination* is exact and fast: eliminating node
``x`` replaces every factor that mentions it by one factor over its neighbours,

.. math::

    g(N_x) = \min_{x} \Big( c_x(x) + \sum_{f \ni x} f(x, N_f) \Big),

and remembers the minimising ``x`` for every assignment of ``N_x``; after the last node, the
choices are read back in reverse order. Work and memory are the product of the domain sizes in
the largest factor, so a greedy order (smallest new factor first) is chosen up front and the
solver declines (returns ``None``) when that factor would exceed ``max_entries``.

A memory limit on one instant (the planner's form: every interval equal) is handled by
Lagrangian relaxation: ``lambda * usage`` is added to the node costs and ``lambda`` is
bisected to the smallest value whose optimum fits. The result then fits but is only proven
optimal for ``lambda = 0``.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from autopar.solver.elimination_kernel import DIAGONAL as _DIAGONAL
from autopar.solver.elimination_kernel import EDGE as _EDGE
from autopar.solver.elimination_kernel import MESSAGE as _MESSAGE
from autopar.solver.elimination_kernel import UNARY as _UNARY
from autopar.solver.elimination_kernel import Program, undominated
from autopar.solver.problem import Problem, Solution, evaluate


class _Factor:
    __slots__ = ("scope", "table")

    def __init__(self, scope: tuple[int, ...], table: np.ndarray) -> None:
        self.scope = scope
        self.table = table


def _order(p: Problem, max_entries: float) -> list[int] | None:
    """Greedy elimination order (smallest resulting factor first), or None if too wide."""
    return greedy_order(p.edges, [len(c) for c in p.costs], max_entries)


def greedy_order(
    edges: list[tuple[int, int]], dom: list[int], max_entries: float
) -> list[int] | None:
    """:func:`_order` on a graph given by its edges and domain sizes: repeatedly the node
    whose neighbours' domains multiply to the least, the lowest-numbered of equals. A heap of
    (size, node), where eliminating a node changes only its neighbours' sizes."""
    n = len(dom)
    nbrs: list[set[int]] = [set() for _ in range(n)]
    for u, v in edges:
        if u != v:
            nbrs[u].add(v)
            nbrs[v].add(u)
    size = [math.prod(dom[y] for y in nbrs[x]) for x in range(n)]
    heap = [(size[x], x) for x in range(n)]
    heapq.heapify(heap)
    alive = [True] * n
    order = []
    while heap:
        sz, best = heapq.heappop(heap)
        if not alive[best] or sz != size[best]:
            continue  # eliminated, or its size changed since this entry
        if sz * dom[best] > max_entries:
            return None
        order.append(best)
        alive[best] = False
        for y in nbrs[best]:
            nbrs[y].discard(best)
            nbrs[y] |= nbrs[best] - {y}
            size[y] = math.prod(dom[z] for z in nbrs[y])
            heapq.heappush(heap, (size[y], y))
        nbrs[best] = set()
    return order


def cheap_order(
    edges: list[tuple[int, int]], dom: list[int], max_entries: float
) -> list[int] | None:
    """An elimination order whose tables hold few entries in all: :func:`greedy_order`'s,
    or, where that one's tables are large, a weighted min-fill order's when it is cheaper
    (None when the chosen order's largest table would exceed ``max_entries``). Smallest
    factor first looks one step ahead only; on the planner's attention models min-fill
    (the node whose elimination joins the fewest, smallest, unconnected neighbours) made
    tables 2 to 3x smaller in all (the encoder of benchmarks/solver.py: 452k entries per
    elimination against 146k, its largest table 257k against 26k)."""
    order = greedy_order(edges, dom, math.inf)
    assert order is not None
    total, largest = order_size(edges, dom, order)
    if total > MIN_FILL_FROM:
        other = _min_fill_order(edges, dom)
        t2, l2 = order_size(edges, dom, other)
        if t2 < total:
            order, total, largest = other, t2, l2
    return order if largest <= max_entries else None


# below this many table entries in all, elimination is quick whatever the order
MIN_FILL_FROM = 20_000


def _neighbours(edges: list[tuple[int, int]], n: int) -> list[set[int]]:
    nbrs: list[set[int]] = [set() for _ in range(n)]
    for u, v in edges:
        if u != v:
            nbrs[u].add(v)
            nbrs[v].add(u)
    return nbrs


def order_size(edges: list[tuple[int, int]], dom: list[int], order: list[int]
               ) -> tuple[int, int]:
    """(entries of all tables, of the largest) that eliminating in ``order`` builds."""
    nbrs = _neighbours(edges, len(dom))
    total = largest = 0
    for x in order:
        size = dom[x] * math.prod(dom[y] for y in nbrs[x])
        total += size
        largest = max(largest, size)
        for y in nbrs[x]:
            nbrs[y].discard(x)
            nbrs[y] |= nbrs[x] - {y}
        nbrs[x] = set()
    return total, largest


def _min_fill_order(edges: list[tuple[int, int]], dom: list[int]) -> list[int]:
    """Weighted min-fill: repeatedly the node whose elimination adds the least new table
    (the domain products of its neighbour pairs not yet joined), then the smallest factor,
    then the lowest-numbered. Eliminating a node joins its neighbours: their own scores
    change, and the fill of a node beyond them only where two of its neighbours are among
    them (no other node's neighbours or their links change), so only those are scored again;
    the least score is kept in a heap (entries gone stale skipped as they come up)."""
    n = len(dom)
    nbrs = _neighbours(edges, n)

    def score(x: int) -> tuple[int, int, int]:
        ys = sorted(nbrs[x])
        fill = sum(dom[a] * dom[b] for i, a in enumerate(ys) for b in ys[i + 1:]
                   if b not in nbrs[a])
        return fill, dom[x] * math.prod(dom[y] for y in ys), x

    scores = [score(x) for x in range(n)]
    heap = list(scores)
    heapq.heapify(heap)
    alive = [True] * n
    order = []
    while heap:
        entry = heapq.heappop(heap)
        best = entry[2]
        if not alive[best] or entry != scores[best]:
            continue
        order.append(best)
        alive[best] = False
        joined = nbrs[best]
        for y in joined:
            nbrs[y].discard(best)
            nbrs[y] |= joined - {y}
        nbrs[best] = set()
        beyond = {z for y in joined for z in nbrs[y]} - joined
        for y in (*joined, *(z for z in beyond if len(nbrs[z] & joined) >= 2)):
            scores[y] = score(y)
            heapq.heappush(heap, scores[y])
    return order


def _broadcast(f: _Factor, scope: tuple[int, ...]) -> np.ndarray:
    """``f``'s table laid out along ``scope``'s axes (size 1 where f does not depend)."""
    perm = sorted(range(len(f.scope)), key=lambda k: scope.index(f.scope[k]))
    t = f.table.transpose(perm)
    shape = [1] * len(scope)
    for k in perm:
        shape[scope.index(f.scope[k])] = f.table.shape[k]
    return t.reshape(shape)


def _eliminate(p: Problem, order: list[int], unary: list[np.ndarray]) -> np.ndarray:
    return eliminate([len(c) for c in p.costs], p.edges, p.edge_costs, order, unary)


def eliminate(
    dom: list[int], edges: list[tuple[int, int]], edge_costs: list[np.ndarray],
    order: list[int], unary: list[np.ndarray],
) -> np.ndarray:
    """The assignment minimising ``unary`` plus the edge costs, eliminating in ``order``.

    The axis sweep runs this thousands of times on small tables of one graph, so what does
    not depend on the numbers (each bucket's factors, their scopes and layouts) is worked
    out once per graph and order (:func:`_schedule`), lowered to flat arrays, and only the
    arithmetic runs per call, compiled (:mod:`autopar.solver.elimination_kernel`): exact on
    integer costs (the numpy reference :func:`_eliminate_plain` gives the same assignment,
    ties included), within rounding otherwise (a bucket's factors are summed in another
    order)."""
    return _program(dom, edges, order).run(unary, edge_costs)


def _program(dom: list[int], edges: list[tuple[int, int]], order: list[int]) -> Program:
    key = (tuple(dom), tuple(map(tuple, edges)), tuple(order))
    got = _PROGRAMS.get(key)
    if got is None:
        if len(_PROGRAMS) >= _MAX_PROGRAMS:
            _PROGRAMS.popitem(last=False)  # the least recently used
        got = _PROGRAMS[key] = Program(dom, edges, _schedule(dom, edges, order))
    else:
        _PROGRAMS.move_to_end(key)
    return got


_PROGRAMS: OrderedDict[tuple, Program] = OrderedDict()


# programs kept, least recently used dropped first. A program is a few flat index arrays (its
# schedule, not its tables: kilobytes), its key the graph's edges (tens of kilobytes). A
# planning call's sweeps run a few hundred graphs and domain sizes, and a mesh-shape search
# plans many such calls in one process: with 256 kept and the whole cache cleared when full,
# llama3-405b's 25 shapes lowered 3064 programs for 9248 eliminations (31 s of 530 s under
# cProfile). Each key holds the graph's edges, so the cache is kept to 1024
_MAX_PROGRAMS = 1024


def _schedule(dom: list[int], edges: list[tuple[int, int]], order: list[int]) -> list:
    """Per node eliminated, in order: ``(node, rest, parts, shape)``: the nodes left in its
    bucket (in elimination order), each factor of the bucket as ``(source kind, index)``
    (``elimination_kernel``'s kinds: a node's costs, an edge's matrix, a self-edge's
    diagonal, a message by the node that left it) in the order they are added, and the
    domain sizes of its scope ``(node, *rest)``."""
    n = len(dom)
    pos = [0] * n
    for k, x in enumerate(order):
        pos[x] = k
    buckets: list[list[tuple[int, int, tuple[int, ...]]]] = [[(_UNARY, i, (i,))]
                                                            for i in range(n)]
    for k, (u, v) in enumerate(edges):
        if u == v:
            buckets[u].append((_DIAGONAL, k, (u,)))
        else:
            buckets[u if pos[u] < pos[v] else v].append((_EDGE, k, (u, v)))
    steps = []
    for x in order:
        fs = buckets[x]
        buckets[x] = []
        others = {y for _, _, sc in fs for y in sc}
        others.discard(x)
        rest = tuple(sorted(others, key=pos.__getitem__))
        steps.append((x, rest, tuple((kind, k) for kind, k, _ in fs),
                      tuple(dom[y] for y in (x, *rest))))
        if rest:
            buckets[rest[0]].append((_MESSAGE, x, rest))
    return steps


def _eliminate_plain(
    dom: list[int], edges: list[tuple[int, int]], edge_costs: list[np.ndarray],
    order: list[int], unary: list[np.ndarray],
) -> np.ndarray:
    """:func:`eliminate` in numpy, its bookkeeping done on every call (what the compiled
    program holds), kept as the reference the tests hold it to."""
    n = len(dom)
    buckets: list[list[_Factor]] = [[] for _ in range(n)]
    pos = [0] * n
    for k, x in enumerate(order):
        pos[x] = k
    for i in range(n):
        buckets[i].append(_Factor((i,), unary[i]))
    for (u, v), m in zip(edges, edge_costs):
        if u == v:
            buckets[u].append(_Factor((u,), np.diagonal(m).copy()))
        else:
            buckets[u if pos[u] < pos[v] else v].append(
                _Factor((u, v), np.asarray(m, dtype=float)))
    argmins: list[tuple[tuple[int, ...], np.ndarray | None]] = [((), None)] * n
    for x in order:
        fs = buckets[x]
        buckets[x] = []
        others = {y for f in fs for y in f.scope}
        others.discard(x)
        rest = tuple(sorted(others, key=pos.__getitem__))
        scope = (x, *rest)
        where = {y: k for k, y in enumerate(scope)}
        shape = [dom[y] for y in scope]
        # 0 + a == a exactly, so starting from the first factor adds what zeros would
        total = None
        for f in fs:
            b = _laid_out(f, where, len(scope))
            total = b if total is None else total + b
        assert total is not None
        if total.shape != tuple(shape):
            total = np.broadcast_to(total, shape)
        if dom[x] == 1:
            argmins[x] = (rest, None)  # the only choice
            low = total[0]
        else:
            argmins[x] = (rest, np.argmin(total, axis=0))
            low = np.min(total, axis=0)
        if rest:
            buckets[rest[0]].append(_Factor(rest, low))
    return _back_substitute(n, order, argmins)


def _back_substitute(n: int, order: list[int],
                     argmins: list[tuple[tuple[int, ...], np.ndarray | None]]) -> np.ndarray:
    """Each node's choice, last eliminated first, from its table of best choices given the
    nodes left in its bucket (None: its one choice)."""
    assign = np.zeros(n, dtype=np.int64)
    for x in reversed(order):
        rest, table = argmins[x]
        if table is not None:
            assign[x] = table[tuple(assign[y] for y in rest)] if rest else int(table)
    return assign


def _laid_out(f: _Factor, where: dict[int, int], ndim: int) -> np.ndarray:
    """``f``'s table along a scope's axes (``where[y]``: node y's axis; size 1 elsewhere)."""
    axes = [where[y] for y in f.scope]
    t = f.table
    if len(axes) == 2 and axes[0] > axes[1]:
        t = t.T
        axes = [axes[1], axes[0]]
    elif len(axes) > 2 and axes != sorted(axes):
        perm = sorted(range(len(axes)), key=axes.__getitem__)
        t = t.transpose(perm)
        axes = sorted(axes)
    if axes == list(range(len(axes))):  # leading axes: trailing size-1 axes are implied...
        if len(axes) == ndim:
            return t
        return t.reshape(t.shape + (1,) * (ndim - len(axes)))
    shape = [1] * ndim
    for k, a in enumerate(axes):
        shape[a] = t.shape[k]
    return t.reshape(shape)


def solve_by_elimination(
    p: Problem, timeout_s: float = 30.0, max_entries: float = 4e6
) -> Solution | None:
    """The optimum (or, under a memory limit, a Lagrangian solution that fits), or None when
    the problem is too wide for elimination or has per-node intervals that differ."""
    t0 = time.monotonic()
    if p.usage_limit is not None and len(set(map(tuple, p.intervals))) > 1:
        return None  # a timeline of different live ranges: not the one-instant form
    order = _order(p, max_entries)
    if order is None:
        return None
    a, status = minimise([len(c) for c in p.costs], p.edges, p.edge_costs, p.costs, p.usages,
                         p.usage_limit, order, lambda a: evaluate(p, a)[1], timeout_s)
    if a is None:
        if status == "infeasible":
            return Solution((), math.inf, False, "infeasible", time.monotonic() - t0,
                            "elimination")
        return None
    cost, _, _ = evaluate(p, a)
    if status == "optimal":
        return Solution(tuple(int(x) for x in a), cost, True, "optimal", time.monotonic() - t0,
                        "elimination", cost)
    return Solution(tuple(int(x) for x in a), cost, True, "feasible", time.monotonic() - t0,
                    "elimination+lagrange")


def minimise(
    dom: list[int], edges: list[tuple[int, int]], edge_costs: list[np.ndarray],
    costs: list[np.ndarray], usages: list[np.ndarray], limit: float | None,
    order: list[int], fits: Callable[[np.ndarray], bool], timeout_s: float,
    memo: dict[float, np.ndarray] | None = None, start: np.ndarray | None = None,
    guess: float | None = None, walked: list[float] | None = None,
) -> tuple[np.ndarray | None, str]:
    """:func:`solve_by_elimination` on a problem given by its parts (no :class:`Problem` is
    built: the axis sweep calls this thousands of times) and an elimination ``order``;
    ``fits(a)`` says whether an assignment fits the limit. Returns ``(assignment, status)``:
    ``optimal``, ``feasible`` (Lagrangian, fits), or ``(None, "infeasible")`` /
    ``(None, "timeout")``. ``memo``: the minimiser at each multiplier, kept for these costs
    and usages (whatever the limit): solved again at another limit (a memory fit's retry),
    the walk asks for the same multipliers until the two limits part. ``start``: a point
    known to fit (an axis step's current point); the walk down the hull starts from it
    instead of bracketing the multiplier (see below). ``guess``: a multiplier to try first
    (where its minimiser does not fit, the walk starts there); ``walked``: set to the
    largest multiplier whose minimiser did not fit, where the walk ran."""
    t0 = time.monotonic()
    base = [np.asarray(c, dtype=float) for c in costs]
    usage = [np.asarray(u, dtype=float) for u in usages]
    # the elimination runs on the choices no other choice dominates, at every multiplier
    kept = _without_dominated(dom, edges, edge_costs, base, usage, order)
    if kept is None:
        s_dom, s_order, s_edge_costs, s_base, s_usage = dom, order, edge_costs, base, usage
    else:
        s_dom, s_order, keep = kept
        s_edge_costs = [m.take(keep[u], 0).take(keep[v], 1)
                        for (u, v), m in zip(edges, edge_costs)]
        s_base = [c[k] for c, k in zip(base, keep)]
        s_usage = [w[k] for w, k in zip(usage, keep)]

    # what every multiplier's elimination shares, made once: the program, the edge matrices
    # and the costs and usages laid out flat (c + lam * u per entry, as per node), and where
    # each node's kept choices start (a kept choice's original index by one gather)
    prog = _program(s_dom, edges, s_order)
    flat_edges = _flat(s_edge_costs)
    flat_base, flat_usage = _flat(s_base), _flat(s_usage)
    if kept is not None:
        kept_flat = np.concatenate(kept[2]).astype(np.int64)
        kept_start = np.cumsum([0, *s_dom[:-1]], dtype=np.int64)

    def at(lam: float) -> np.ndarray:
        got = memo.get(lam) if memo is not None else None
        if got is None:
            unary = flat_base if lam == 0.0 else flat_base + lam * flat_usage
            got = prog.run_flat(unary, flat_edges)
            if kept is not None:
                got = kept_flat[kept_start + got]
            if memo is not None:
                memo[lam] = got
        return got

    # a multiplier a step like this one walked to (``guess``): where its minimiser does
    # not fit, neither does the one at 0 (a minimiser's usage only falls as the multiplier
    # grows), so that elimination is saved and the walk starts nearer its end
    lo, a = 0.0, None
    if guess and limit is not None and (memo is None or 0.0 not in memo):
        g = at(guess)
        if not fits(g):
            lo, a = guess, g
    if a is None:
        a = at(0.0)
        if fits(a):
            return a, "optimal"
    assert limit is not None
    if sum(float(u.min()) for u in usage) > limit:
        return None, "infeasible"

    where: list[np.ndarray] = []  # laid out on first use (a walk prices a few points)

    def cost_and_usage(x: np.ndarray) -> tuple[float, float]:
        if not where:
            node_off = np.cumsum([0, *dom[:-1]], dtype=np.int64)
            eu = np.array([u for u, _ in edges], dtype=np.int64)
            ev = np.array([v for _, v in edges], dtype=np.int64)
            dv = np.array([dom[v] for _, v in edges], dtype=np.int64)
            edge_off = np.cumsum([0, *(dom[u] * dom[v] for u, v in edges)][:-1],
                                 dtype=np.int64)
            where.extend((node_off, eu, ev, dv, edge_off, _flat(base), _flat(usage),
                          _flat(edge_costs)))
        node_off, eu, ev, dv, edge_off, costs_flat, usage_flat, edges_flat = where
        x = np.asarray(x, dtype=np.int64)
        picked = node_off + x
        c = float(costs_flat[picked].sum())
        if len(eu):
            c += float(edges_flat[edge_off + x[eu] * dv + x[ev]].sum())
        return c, float(usage_flat[picked].sum())

    below = a  # the minimiser at lo, which does not fit
    # Minimisers known at other multipliers (a memory fit's earlier rounds, at other limits):
    # along the multiplier their usage only falls, so the last that does not fit and the
    # first that does bracket the walk as its own eliminations would have
    known = None
    for lam in sorted(memo or ()):
        if lam > lo:
            if fits(memo[lam]):
                known = lam, memo[lam]
                break
            lo, below = lam, memo[lam]
    fitting_start = start is not None and fits(start)
    if fitting_start and (known is None
                          or cost_and_usage(start)[0] < cost_and_usage(known[1])[0]):
        # A point that fits brackets the walk as a minimiser that fits would (at an infinite
        # multiplier): every point of the problem, this one too, lies on or above the lower
        # hull, so where it is not on the hull the walk's first multiplier finds a point
        # strictly below its line, and from there the walk is the usual one; where it is,
        # it is as good as the hull point the usual walk returns. The bracket's eliminations
        # (one to three) are saved, and an axis step that cannot improve on its current
        # point (a third of them under a memory limit) ends after one or two more.
        best, hi = start, math.inf
    elif known is not None:
        hi, best = known
    else:
        scale = max(max(float(c.max()) for c in base), 1e-30) / max(
            max(float(u.max()) for u in usage), 1e-30)
        hi, best = scale, None
        while hi <= lo:  # past a minimiser known not to fit
            hi *= 10
        while best is None and time.monotonic() - t0 < timeout_s:  # a lambda that fits
            a = at(hi)
            if fits(a):
                best = a
            else:
                lo, hi, below = hi, hi * 10, a
        if best is None:
            return None, "timeout"

    # Down to the smallest lambda that still fits, along the lower hull of (usage, cost): the
    # minimisers at lo (does not fit) and hi (fits) cost the same at the lambda where their
    # lines cross; the minimiser there is either one of them (no plan lies between: ``best``
    # is the cheapest that fits any lambda gives) or a new hull point, which replaces lo's
    # or hi's. Bisecting the multiplier reached the same point in about 20 eliminations a
    # step; the walk takes as many as there are hull points between (a few).
    c_lo, u_lo = cost_and_usage(below)
    c_hi, u_hi = cost_and_usage(best)
    for _ in range(30):
        if time.monotonic() - t0 > timeout_s or u_lo <= u_hi:
            break
        mid = (c_hi - c_lo) / (u_lo - u_hi)
        if not lo < mid < hi:
            break
        a = at(mid)
        c_a, u_a = cost_and_usage(a)
        if c_a + mid * u_a >= (c_hi + mid * u_hi) - 1e-12 * max(abs(c_hi + mid * u_hi), 1e-300):
            break  # a tie: lo's and hi's minimisers are adjacent on the hull
        if fits(a):
            best, hi, c_hi, u_hi = a, mid, c_a, u_a
        else:
            lo, c_lo, u_lo = mid, c_a, u_a
    if walked is not None:
        walked[:] = [lo]
    return best, "feasible"


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays' entries one after another (C order), as float."""
    if not arrays:
        return np.empty(0)
    return np.concatenate([np.asarray(a, dtype=float).reshape(-1) for a in arrays])


def _without_dominated(
    dom: list[int], edges: list[tuple[int, int]], edge_costs: list[np.ndarray],
    costs: list[np.ndarray], usages: list[np.ndarray], order: list[int],
) -> tuple[list[int], list[int], list[np.ndarray]] | None:
    """``(domain sizes, elimination order, the choices kept per node)`` of the problem
    without its dominated choices, or None where dropping them would not make elimination
    much cheaper. Choice ``b`` of node ``x`` is dominated by ``a`` when ``a`` uses no more
    memory and costs no more whatever its neighbours choose: ``c[a] - c[b]`` plus, for each
    edge, the most ``a``'s row exceeds ``b``'s is at most 0. Then ``c + lam * u`` plus the
    edges is at most as large with ``a`` for every multiplier ``lam >= 0``, so some minimiser
    avoids ``b``: the minimum is the same, only which of equal minimisers is returned can
    change. Dropping is done one choice at a time against the choices still kept, so that
    every node keeps one. On the planner's axis steps a quarter to a third of the choices go,
    and the tables shrink 3 to 15 times (the encoder-decoder of ``benchmarks/solver.py``)."""
    full = _full_size(edges, dom, order)
    if full < _PRUNE_FROM:
        return None
    alive = undominated(dom, edges, costs, usages, edge_costs)
    starts = np.cumsum([0, *dom])
    keep = [np.nonzero(alive[a:b])[0] for a, b in zip(starts[:-1], starts[1:])]
    small = [len(k) for k in keep]
    # the full problem's order: its tables only shrink (an order of its own, min-fill's,
    # cost more to find than it saved)
    if small == dom or order_size(edges, small, order)[0] > _PRUNE_GAIN * full:
        return None
    return small, order, keep


def _full_size(edges: list[tuple[int, int]], dom: list[int], order: list[int]) -> int:
    """:func:`order_size`'s total, kept by graph, domain sizes and order: the sweep's steps
    eliminate the same few graphs thousands of times (14 s of llama3-405b's shape search
    under cProfile went to sizing the same orders again)."""
    key = (tuple(dom), tuple(map(tuple, edges)), tuple(order))
    got = _SIZES.get(key)
    if got is None:
        if len(_SIZES) >= _MAX_PROGRAMS:
            _SIZES.clear()
        got = _SIZES[key] = order_size(edges, dom, order)[0]
    return got


_SIZES: dict[tuple, int] = {}


# below this many table entries an elimination takes well under a millisecond, less than
# looking for dominated choices; a smaller problem is used only where its tables are at most
# this fraction of the full one's
_PRUNE_FROM = 50_000
_PRUNE_GAIN = 0.7
# elimination orders by graph and domain sizes, kept across solves: a planner solves problems
# of one graph many times (the memory fit's retries, repricings, modes that copy nothing)
_ORDERS: dict[tuple, list[int] | None] = {}


def cached_order(edges: list[tuple[int, int]], dom: list[int], max_entries: float
                 ) -> list[int] | None:
    """:func:`cheap_order`, kept by graph, domain sizes and cap."""
    key = (tuple(map(tuple, edges)), tuple(dom), max_entries)
    if key not in _ORDERS:
        if len(_ORDERS) > 4096:
            _ORDERS.clear()
        _ORDERS[key] = cheap_order(edges, dom, max_entries)
    return _ORDERS[key]
