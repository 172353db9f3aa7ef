"""Variable elimination as one compiled loop (numba) over a program made once per schedule.

:func:`autopar.solver.elimination.eliminate` runs thousands of times per plan on the tables
of one graph (the axis sweep's steps, each at a few Lagrange multipliers). In numpy each
bucket costs a dozen array operations, and the minimum over the eliminated node's axis (its
first) is a strided reduction. Here the schedule (which factors meet in which bucket, laid
out how) becomes flat integer arrays once, and one compiled call per elimination does the
arithmetic: 1.5 times numpy's speed in CPU time on the eliminations of the encoder-decoder
of ``benchmarks/solver.py`` (tables of 0.6 to 6.7 million entries), where the work is
memory-bound (about 4 ns an entry).

A bucket's factors over a subset of another's nodes are first added into that one (in the
buffer: each factor is read by one bucket only), so each entry adds fewer numbers (4.5 an
entry became 2.1 there). Sums change in order only: exact on integers, within rounding
otherwise; the minimum over the node is taken in order with the first kept (``argmin``'s
tie rule).

The program, for a buffer laid out as ``[unary costs | edge matrices | messages]``:

- per step ``s`` (a node eliminated): ``st_x`` the node, ``st_dx`` its domain size,
  ``st_rest`` (``st_rest_ptr``) the domain sizes of the nodes left in its bucket, in scope
  order, ``st_rest_nodes`` which nodes those are, ``st_msg`` where its message (the minimum
  per assignment of the rest, C order) goes in the buffer (-1: none), ``st_arg`` where its
  best choices go in the choices array, ``st_op_ptr`` its additions of small factors into
  larger ones (``op_*``: destination, source, and the destination's index space with both
  strides), ``st_part_ptr`` the factors its loop reads;
- per factor read: ``pt_base`` its first entry in the buffer, ``pt_sx`` its stride along the
  node's axis, ``pt_strides`` (from ``pt_stride_ptr``, one per rest axis, 0 where the
  factor does not depend on that node) its strides along the rest.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

_INT = np.int64
# the kinds of factor in a bucket of a schedule (``elimination._schedule``): a node's own
# costs, an edge's matrix, the diagonal of a self-edge's, the message left by eliminating a node
UNARY, EDGE, DIAGONAL, MESSAGE = range(4)


class Program:
    """A schedule lowered to flat arrays (see the module docstring), with the buffer's
    layout: where each node's unary costs and each edge's matrix start, and its length."""

    __slots__ = ("n", "steps", "unary_off", "edge_off", "size", "n_args")

    def __init__(self, dom: list[int], edges: list[tuple[int, int]], schedule: list) -> None:
        self.n = len(dom)
        self.unary_off, self.edge_off = unary_off, edge_off = layout(dom, edges)
        cursor = int(edge_off[-1])
        messages: dict[int, tuple[int, tuple[int, ...], tuple[int, ...]]] = {}
        arg_cursor = 0
        st_x, st_dx, st_msg, st_arg = [], [], [], []
        st_rest_ptr, st_rest, st_rest_nodes, st_part_ptr = [0], [], [], [0]
        pt_base, pt_sx, pt_stride_ptr, pt_strides = [], [], [], []
        st_op_ptr, op_dst, op_src, op_dim_ptr, op_dims, op_dst_st, op_src_st = (
            [0], [], [], [0], [], [], [])
        for x, rest, parts, shape in schedule:
            st_x.append(x)
            st_dx.append(shape[0])
            st_rest.extend(shape[1:])
            st_rest_nodes.extend(rest)
            st_rest_ptr.append(len(st_rest))
            placed = []  # (first entry, {node: stride}) per factor, in the bucket's order
            for kind, k in parts:
                if kind == MESSAGE:
                    base, own_scope, own_strides = messages.pop(k)
                else:
                    base, own_scope, own_strides = self._source(kind, k, dom, edges)
                placed.append((base, dict(zip(own_scope, own_strides))))
            kept, into = _absorb(placed, dom)
            for j, q in enumerate(into):
                if q is None:
                    continue
                # factor j added into factor q's entries (each factor is read by one bucket
                # only, so its entries in this call's buffer are free to change)
                (src, src_of), (dst, dst_of) = placed[j], placed[q]
                op_dst.append(dst)
                op_src.append(src)
                for y, stride in dst_of.items():
                    op_dims.append(dom[y])
                    op_dst_st.append(stride)
                    op_src_st.append(src_of.get(y, 0))
                op_dim_ptr.append(len(op_dims))
            st_op_ptr.append(len(op_dst))
            for j in kept:
                base, stride_of = placed[j]
                pt_base.append(base)
                pt_sx.append(stride_of.get(x, 0))
                pt_stride_ptr.append(len(pt_strides))
                pt_strides.extend(stride_of.get(y, 0) for y in rest)
            st_part_ptr.append(len(pt_base))
            size = int(np.prod(shape[1:], dtype=_INT))
            if rest:
                messages[x] = (cursor, rest, _c_strides(shape[1:]))
                st_msg.append(cursor)
                cursor += size
            else:
                st_msg.append(-1)
            st_arg.append(arg_cursor)
            arg_cursor += size
        self.size = cursor
        self.n_args = arg_cursor
        self.steps = tuple(np.asarray(a, dtype=_INT) for a in (
            st_x, st_dx, st_msg, st_arg, st_rest_ptr, st_rest, st_rest_nodes, st_part_ptr,
            pt_base, pt_sx, pt_stride_ptr, pt_strides, st_op_ptr, op_dst, op_src, op_dim_ptr,
            op_dims, op_dst_st, op_src_st))

    def _source(self, kind: int, k: int, dom: list[int], edges: list[tuple[int, int]]
                ) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(first entry in the buffer, the nodes it spans, its strides along them) of a
        factor given to the call: unary costs, an edge's matrix (C order), the diagonal of a
        self-edge's."""
        if kind == UNARY:
            return int(self.unary_off[k]), (k,), (1,)
        u, v = edges[k]
        if kind == EDGE:
            return int(self.edge_off[k]), (u, v), (dom[v], 1)
        assert kind == DIAGONAL
        return int(self.edge_off[k]), (u,), (dom[u] + 1,)

    def run(self, unary: list[np.ndarray], edge_costs: list[np.ndarray]) -> np.ndarray:
        """The assignment minimising ``unary`` plus the edge costs."""
        buf = np.empty(self.size)
        pack(buf, self.unary_off, self.edge_off, unary, edge_costs)
        return _run(buf, np.empty(self.n_args, dtype=_INT), self.n, *self.steps)

    def run_flat(self, unary: np.ndarray, edges: np.ndarray) -> np.ndarray:
        """:meth:`run` on the unary costs and the edge matrices each laid out flat, in
        :func:`layout`'s order (as :func:`pack` writes them): a Lagrangian walk solves one
        graph at several multipliers, its edge matrices the same at each, so they are
        flattened once, not per call."""
        buf = np.empty(self.size)
        split = int(self.unary_off[-1])
        buf[:split] = unary
        buf[split:split + len(edges)] = edges
        return _run(buf, np.empty(self.n_args, dtype=_INT), self.n, *self.steps)


def layout(dom: list[int], edges: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Where each node's unary costs and each edge's matrix (C order) start in a buffer
    ``[unary costs | edge matrices | ...]``; the last entry of each is where they end."""
    unary_off = np.zeros(len(dom) + 1, dtype=_INT)
    unary_off[1:] = np.cumsum(dom)
    edge_off = np.zeros(len(edges) + 1, dtype=_INT)
    edge_off[1:] = np.cumsum([dom[u] * dom[v] for u, v in edges])
    edge_off += unary_off[-1]
    return unary_off, edge_off


def pack(buf: np.ndarray, unary_off: np.ndarray, edge_off: np.ndarray,
         unary: list[np.ndarray], edge_costs: list[np.ndarray]) -> None:
    """``unary`` and ``edge_costs`` written into ``buf`` as :func:`layout` places them."""
    split = int(unary_off[-1])
    if unary:
        buf[:split] = np.concatenate(unary)
    if edge_costs:
        buf[split:edge_off[-1]] = np.concatenate(
            [np.asarray(m, dtype=float).reshape(-1) for m in edge_costs])


def undominated(dom: list[int], edges: list[tuple[int, int]], costs: list[np.ndarray],
                usages: list[np.ndarray], edge_costs: list[np.ndarray]) -> np.ndarray:
    """Per choice (flat, node by node), whether it is kept: choice ``b`` of a node is left
    out where a choice ``a`` still kept uses no more memory and costs no more whatever the
    neighbours choose (its own cost plus, per edge, the most its row exceeds ``b``'s, at
    most ``b``'s own cost); a self-edge's diagonal counts as own cost. Choices are looked at
    in order, each against those still kept, so every node keeps one."""
    unary_off, edge_off = layout(dom, edges)
    buf = np.empty(int(edge_off[-1]))
    pack(buf, unary_off, edge_off, costs, edge_costs)
    use = np.concatenate(usages) if usages else np.empty(0)
    ends = np.asarray(edges, dtype=_INT).reshape(-1, 2)
    return _undominated(buf, use, np.asarray(dom, dtype=_INT), ends[:, 0].copy(),
                        ends[:, 1].copy(), unary_off, edge_off)


@njit(cache=True, nogil=True)
def _undominated(buf, use, dom, eu, ev, unary_off, edge_off):
    n = len(dom)
    own = buf[:unary_off[n]].copy()
    # incident edges per node: (edge, which side the node is on)
    deg = np.zeros(n + 1, dtype=np.int64)
    for e in range(len(eu)):
        if eu[e] == ev[e]:
            d = dom[eu[e]]
            for a in range(d):
                own[unary_off[eu[e]] + a] += buf[edge_off[e] + a * (d + 1)]
        else:
            deg[eu[e] + 1] += 1
            deg[ev[e] + 1] += 1
    for x in range(n):
        deg[x + 1] += deg[x]
    inc = np.zeros(deg[n], dtype=np.int64)
    side = np.zeros(deg[n], dtype=np.int64)
    fill = deg[:n].copy()
    for e in range(len(eu)):
        if eu[e] != ev[e]:
            inc[fill[eu[e]]], side[fill[eu[e]]] = e, 0
            fill[eu[e]] += 1
            inc[fill[ev[e]]], side[fill[ev[e]]] = e, 1
            fill[ev[e]] += 1
    alive = np.ones(unary_off[n], dtype=np.bool_)
    for x in range(n):
        d = dom[x]
        o = unary_off[x]
        for b in range(d):
            for a in range(d):
                if a == b or not alive[o + a] or use[o + a] > use[o + b]:
                    continue
                worst = own[o + a] - own[o + b]
                for k in range(deg[x], deg[x + 1]):
                    e = inc[k]
                    base = edge_off[e]
                    if side[k] == 0:  # x is the row: rows a and b of a (d x dv) matrix
                        dv = dom[ev[e]]
                        most = -np.inf
                        for y in range(dv):
                            most = max(most, buf[base + a * dv + y] - buf[base + b * dv + y])
                    else:  # x is the column
                        du = dom[eu[e]]
                        most = -np.inf
                        for y in range(du):
                            most = max(most, buf[base + y * d + a] - buf[base + y * d + b])
                    worst += most
                if worst <= 0.0:
                    alive[o + b] = False
                    break
    return alive


def _absorb(placed: list[tuple[int, dict[int, int]]], dom: list[int]
            ) -> tuple[list[int], list[int | None]]:
    """Which factors of a bucket the main loop reads (``kept``, in order), and for each of
    the others the kept factor it is added into first (``into``, None for a kept one): a
    factor over a subset of another's nodes goes into the smallest such (the first of
    equals), so that each entry of the bucket's table adds fewer numbers (4.5 factors an
    entry became 2.1 on the encoder-decoder of ``benchmarks/solver.py``). The sums are the
    same up to rounding (their order changes)."""
    scopes = [frozenset(of) for _, of in placed]
    sizes = [math.prod(dom[y] for y in sc) for sc in scopes]
    kept = [j for j, sc in enumerate(scopes)
            if not any(sc < t or (sc == t and i < j) for i, t in enumerate(scopes))]
    into: list[int | None] = [None] * len(placed)
    for j, sc in enumerate(scopes):
        if j not in kept:
            into[j] = min((q for q in kept if sc <= scopes[q]), key=lambda q: (sizes[q], q))
    return kept, into


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


@njit(cache=True, nogil=True)
def _run(buf, args, n, st_x, st_dx, st_msg, st_arg, st_rest_ptr, st_rest, st_rest_nodes,
         st_part_ptr, pt_base, pt_sx, pt_stride_ptr, pt_strides, st_op_ptr, op_dst, op_src,
         op_dim_ptr, op_dims, op_dst_st, op_src_st):
    n_steps = len(st_x)
    idx = np.zeros(len(st_rest) + 1, dtype=np.int64)  # the rest's multi-index
    roff = np.zeros(len(pt_base) + 1, dtype=np.int64)  # each part's entry at that index
    for s in range(n_steps):
        for o in range(st_op_ptr[s], st_op_ptr[s + 1]):
            _add_into(buf, op_dst[o], op_src[o], op_dim_ptr[o], op_dim_ptr[o + 1], op_dims,
                      op_dst_st, op_src_st, idx)
        dx = st_dx[s]
        r0, r1 = st_rest_ptr[s], st_rest_ptr[s + 1]
        m = r1 - r0
        p0, p1 = st_part_ptr[s], st_part_ptr[s + 1]
        size = 1
        for j in range(m):
            size *= st_rest[r0 + j]
            idx[j] = 0
        msg, arg = st_msg[s], st_arg[s]
        for p in range(p0, p1):
            roff[p] = pt_base[p]
        # a bucket reads one to three factors nearly always: their strides are held in
        # locals there, and the sums written out (the same additions in the same order as
        # the general loop, so the same numbers), 0.8x the loop's time on the
        # encoder-decoder's eliminations
        k = p1 - p0
        sx0 = pt_sx[p0]
        sx1 = pt_sx[p0 + 1] if k > 1 else 0
        sx2 = pt_sx[p0 + 2] if k > 2 else 0
        # the parts' strides along the last axis of the rest, and its length
        ls0 = pt_strides[pt_stride_ptr[p0] + m - 1] if m > 0 else 0
        ls1 = pt_strides[pt_stride_ptr[p0 + 1] + m - 1] if m > 0 and k > 1 else 0
        ls2 = pt_strides[pt_stride_ptr[p0 + 2] + m - 1] if m > 0 and k > 2 else 0
        last = st_rest[r1 - 1] if m > 0 else 1
        for r in range(size):
            which = 0
            if k == 1:
                o0 = roff[p0]
                best = buf[o0]
                for i in range(1, dx):
                    t = buf[o0 + i * sx0]
                    # the first minimum kept, as argmin; branch-free (the comparisons are
                    # unpredictable)
                    lower = t < best
                    which = i if lower else which
                    best = t if lower else best
            elif k == 2:
                o0, o1 = roff[p0], roff[p0 + 1]
                best = buf[o0] + buf[o1]
                for i in range(1, dx):
                    t = buf[o0 + i * sx0] + buf[o1 + i * sx1]
                    lower = t < best
                    which = i if lower else which
                    best = t if lower else best
            elif k == 3:
                o0, o1, o2 = roff[p0], roff[p0 + 1], roff[p0 + 2]
                best = buf[o0] + buf[o1] + buf[o2]
                for i in range(1, dx):
                    t = buf[o0 + i * sx0] + buf[o1 + i * sx1] + buf[o2 + i * sx2]
                    lower = t < best
                    which = i if lower else which
                    best = t if lower else best
            else:
                best = buf[roff[p0]]
                for p in range(p0 + 1, p1):
                    best = best + buf[roff[p]]
                for i in range(1, dx):
                    t = buf[roff[p0] + i * pt_sx[p0]]
                    for p in range(p0 + 1, p1):
                        t = t + buf[roff[p] + i * pt_sx[p]]
                    lower = t < best
                    which = i if lower else which
                    best = t if lower else best
            if msg >= 0:
                buf[msg + r] = best
            args[arg + r] = which
            # the next index of the rest (C order), each part's entry moved with it: along
            # the last axis by the strides held above, past its end by the general carry
            if m > 0 and k <= 3 and idx[m - 1] + 1 < last:
                idx[m - 1] += 1
                roff[p0] += ls0
                if k > 1:
                    roff[p0 + 1] += ls1
                if k > 2:
                    roff[p0 + 2] += ls2
                continue
            j = m - 1
            while j >= 0:
                idx[j] += 1
                if idx[j] < st_rest[r0 + j]:
                    for p in range(p0, p1):
                        roff[p] += pt_strides[pt_stride_ptr[p] + j]
                    break
                for p in range(p0, p1):
                    roff[p] -= (st_rest[r0 + j] - 1) * pt_strides[pt_stride_ptr[p] + j]
                idx[j] = 0
                j -= 1
    out = np.zeros(n, dtype=np.int64)
    for s in range(n_steps - 1, -1, -1):
        at = 0
        for j in range(st_rest_ptr[s], st_rest_ptr[s + 1]):
            at = at * st_rest[j] + out[st_rest_nodes[j]]
        out[st_x[s]] = args[st_arg[s] + at]
    return out


@njit(cache=True, nogil=True)
def _add_into(buf, dst, src, d0, d1, dims, dst_st, src_st, idx):
    """buf[dst + i . dst_st] += buf[src + i . src_st] for every index i of ``dims[d0:d1]``."""
    size = 1
    for j in range(d0, d1):
        size *= dims[j]
        idx[j - d0] = 0
    m = d1 - d0
    a, b = dst, src
    for _ in range(size):
        buf[a] += buf[b]
        j = m - 1
        while j >= 0:
            idx[j] += 1
            if idx[j] < dims[d0 + j]:
                a += dst_st[d0 + j]
                b += src_st[d0 + j]
                break
            a -= (dims[d0 + j] - 1) * dst_st[d0 + j]
            b -= (dims[d0 + j] - 1) * src_st[d0 + j]
            idx[j] = 0
            j -= 1
