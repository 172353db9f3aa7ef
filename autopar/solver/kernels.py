"""Compiled inner loops (numba) of the unit local search of ``unitsearch.py``.

Every function works on the flat arrays of a ``UnitArrays`` tuple ``D`` (its fields are
unpacked by position; see ``unitsearch.UnitArrays``): units with choices, their members'
usages over time, and cost matrices between units. ``ch`` is the current choice per unit,
``pc`` the per-choice unit costs in use (true costs, or priced by Lagrange multipliers),
``load`` the usage profile. Compiled once per machine (``cache=True`` keeps the machine code
beside this file), each loop runs about two orders of magnitude faster than its Python form.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_INF = np.inf


@njit(cache=True, nogil=True)
def local_cost(D, u, ch, pc, out):
    """out[k] = cost of unit u's choice k given its neighbours' current choices."""
    k_off, adj_ptr, adj_e, adj_side, e_a, e_b, e_off, e_nb, e_flat = (
        D[0], D[6], D[7], D[8], D[9], D[10], D[11], D[12], D[13])
    o = k_off[u]
    kk = k_off[u + 1] - o
    for k in range(kk):
        out[k] = pc[o + k]
    for p in range(adj_ptr[u], adj_ptr[u + 1]):
        e = adj_e[p]
        nb = e_nb[e]
        if adj_side[p] == 0:
            base = e_off[e] + ch[e_b[e]]
            for k in range(kk):
                out[k] += e_flat[base + k * nb]
        else:
            base = e_off[e] + ch[e_a[e]] * nb
            for k in range(kk):
                out[k] += e_flat[base + k]
    return kk


@njit(cache=True, nogil=True)
def total_cost(D, ch, pc):
    k_off, e_a, e_b, e_off, e_nb, e_flat = D[0], D[9], D[10], D[11], D[12], D[13]
    s = 0.0
    for u in range(len(ch)):
        s += pc[k_off[u] + ch[u]]
    for e in range(len(e_a)):
        s += e_flat[e_off[e] + ch[e_a[e]] * e_nb[e] + ch[e_b[e]]]
    return s


@njit(cache=True, nogil=True)
def profile(D, ch, base):
    """Usage at every time step: the fixed nodes' ``base`` plus every unit's members."""
    m_ptr, m_st, m_en, m_uoff, m_use = D[1], D[2], D[3], D[4], D[5]
    h = len(base)
    delta = np.zeros(h + 1)
    for u in range(len(ch)):
        for m in range(m_ptr[u], m_ptr[u + 1]):
            x = m_use[m_uoff[m] + ch[u]]
            delta[m_st[m]] += x
            delta[m_en[m]] -= x
    load = base.copy()
    acc = 0.0
    for t in range(h):
        acc += delta[t]
        load[t] += acc
    return load


@njit(cache=True, nogil=True)
def priced(D, ucost, lam):
    """Unit costs plus each member's usage times the multipliers summed over its life."""
    k_off, m_ptr, m_st, m_en, m_uoff, m_use = D[0], D[1], D[2], D[3], D[4], D[5]
    cum = np.zeros(len(lam) + 1)
    for t in range(len(lam)):
        cum[t + 1] = cum[t] + lam[t]
    pc = ucost.copy()
    for u in range(len(k_off) - 1):
        o = k_off[u]
        kk = k_off[u + 1] - o
        for m in range(m_ptr[u], m_ptr[u + 1]):
            pi = cum[m_en[m]] - cum[m_st[m]]
            if pi != 0.0:
                for k in range(kk):
                    pc[o + k] += pi * m_use[m_uoff[m] + k]
    return pc


@njit(cache=True, nogil=True)
def _shift(D, u, k0, k1, load):
    m_ptr, m_st, m_en, m_uoff, m_use = D[1], D[2], D[3], D[4], D[5]
    for m in range(m_ptr[u], m_ptr[u + 1]):
        d = m_use[m_uoff[m] + k1] - m_use[m_uoff[m] + k0]
        if d != 0.0:
            for t in range(m_st[m], m_en[m]):
                load[t] += d


@njit(cache=True, nogil=True)
def _try_move(D, u, k0, k1, load, lim):
    """Move unit u from k0 to k1 if the profile stays under ``lim``; True if moved."""
    m_ptr, m_st, m_en, m_uoff, m_use = D[1], D[2], D[3], D[4], D[5]
    _shift(D, u, k0, k1, load)
    for m in range(m_ptr[u], m_ptr[u + 1]):
        if m_use[m_uoff[m] + k1] > m_use[m_uoff[m] + k0]:
            for t in range(m_st[m], m_en[m]):
                if load[t] > lim:
                    _shift(D, u, k1, k0, load)
                    return False
    return True


@njit(cache=True, nogil=True)
def sweep(D, order, ch, pc, load, lim, buf):
    """Best single-unit moves in ``order``; with a finite ``lim`` only moves that keep the
    profile under it (trying the three best improving choices). Returns how many moved."""
    k_off = D[0]
    moved = 0
    for u in order:
        if k_off[u + 1] - k_off[u] == 1:
            continue
        kk = local_cost(D, u, ch, pc, buf)
        cur = ch[u]
        thr = buf[cur] - 1e-9 * max(1.0, abs(buf[cur]))
        for _ in range(3):
            best = -1
            bv = thr
            for k in range(kk):
                if buf[k] < bv:
                    bv = buf[k]
                    best = k
            if best < 0:
                break
            if lim == _INF:
                ch[u] = best
                moved += 1
                break
            if _try_move(D, u, cur, best, load, lim):
                ch[u] = best
                moved += 1
                break
            buf[best] = _INF
    return moved


@njit(cache=True, nogil=True)
def pair_moves(D, edges, ch, pc, load, lim, buf, buf2, max_pairs):
    """Both ends of each listed unit edge re-chosen jointly (the best of all pairs, then
    the best that fits); returns the number of improving moves taken."""
    k_off, e_a, e_b, e_off, e_nb, e_flat = D[0], D[9], D[10], D[11], D[12], D[13]
    moved = 0
    for e in edges:
        a, b = e_a[e], e_b[e]
        ka = k_off[a + 1] - k_off[a]
        kb = k_off[b + 1] - k_off[b]
        if ka * kb > max_pairs or ka * kb == 1:
            continue
        ca, cb = ch[a], ch[b]
        # each side's local cost without this edge, the other end free
        local_cost(D, a, ch, pc, buf)
        local_cost(D, b, ch, pc, buf2)
        nb = e_nb[e]
        o = e_off[e]
        for k in range(ka):
            buf[k] -= e_flat[o + k * nb + cb]
        for k in range(kb):
            buf2[k] -= e_flat[o + ca * nb + k]
        cur = buf[ca] + buf2[cb] + e_flat[o + ca * nb + cb]
        thr = cur - 1e-9 * max(1.0, abs(cur))
        best_i, best_j, bv = -1, -1, thr
        for i in range(ka):
            if buf[i] >= bv:
                continue
            for j in range(kb):
                v = buf[i] + buf2[j] + e_flat[o + i * nb + j]
                if v < bv:
                    bv, best_i, best_j = v, i, j
        if best_i < 0:
            continue
        if lim == _INF:
            ch[a], ch[b] = best_i, best_j
            moved += 1
            continue
        if _try_move(D, a, ca, best_i, load, lim):
            if _try_move(D, b, cb, best_j, load, lim):
                ch[a], ch[b] = best_i, best_j
                moved += 1
            else:
                _shift(D, a, best_i, ca, load)
    return moved


@njit(cache=True, nogil=True)
def repair(D, ch, pc, load, lim, buf, freed, max_steps):
    """Lower the profile's peak to ``lim``: at the worst step, the unit move with the least
    cost increase per unit of memory freed there, among choices where no member's usage
    rises (so the peak never moves up and the loop ends). True when it fits."""
    k_off, m_ptr, m_st, m_en, m_uoff, m_use = D[0], D[1], D[2], D[3], D[4], D[5]
    n = len(ch)
    for _ in range(max_steps):
        t = int(np.argmax(load))
        over = load[t] - lim
        if over <= 0.0:
            return True
        best_r, best_u, best_k = _INF, -1, -1
        for u in range(n):
            live = False
            for m in range(m_ptr[u], m_ptr[u + 1]):
                if m_st[m] <= t < m_en[m]:
                    live = True
                    break
            o = k_off[u]
            kk = k_off[u + 1] - o
            if not live or kk == 1:
                continue
            cur = ch[u]
            for k in range(kk):
                freed[k] = 0.0
            ok_any = False
            for k in range(kk):
                f = 0.0
                ok = True
                for m in range(m_ptr[u], m_ptr[u + 1]):
                    d = m_use[m_uoff[m] + cur] - m_use[m_uoff[m] + k]
                    if d < 0.0:
                        ok = False
                        break
                    if m_st[m] <= t < m_en[m]:
                        f += d
                freed[k] = f if ok else 0.0
                ok_any = ok_any or (ok and f > 0.0)
            if not ok_any:
                continue
            local_cost(D, u, ch, pc, buf)
            for k in range(kk):
                if freed[k] > 0.0:
                    r = (buf[k] - buf[cur]) / min(freed[k], over)
                    if r < best_r:
                        best_r, best_u, best_k = r, u, k
        if best_u < 0:
            return False
        _shift(D, best_u, ch[best_u], best_k, load)
        ch[best_u] = best_k
    return load.max() <= lim


@njit(cache=True, nogil=True)
def edge_costs_now(D, ch):
    e_a, e_b, e_off, e_nb, e_flat = D[9], D[10], D[11], D[12], D[13]
    out = np.empty(len(e_a))
    for e in range(len(e_a)):
        out[e] = e_flat[e_off[e] + ch[e_a[e]] * e_nb[e] + ch[e_b[e]]]
    return out


@njit(cache=True, nogil=True)
def _find(par, x):
    while par[x] != x:
        par[x] = par[par[x]]
        x = par[x]
    return x


@njit(cache=True, nogil=True)
def forest_dp(D, order, ch, pc, no_rise):
    """Re-choose, exactly, every unit of an induced forest grown in ``order`` (a unit joins
    when its neighbours already in belong to distinct trees), the others held: (min, +)
    dynamic programming over each tree. With ``no_rise`` a unit may only take choices where
    no member's usage rises, so the profile nowhere goes up. Returns the forest's size."""
    k_off, m_ptr, m_uoff, m_use = D[0], D[1], D[4], D[5]
    adj_ptr, adj_e, adj_side, e_a, e_b, e_off, e_nb, e_flat = (
        D[6], D[7], D[8], D[9], D[10], D[11], D[12], D[13])
    n = len(ch)
    inf_ = np.inf
    in_f = np.zeros(n, dtype=np.bool_)
    par = np.arange(n)
    mark = np.full(n, -1, dtype=np.int64)
    for u in order:
        ok = True
        for p in range(adj_ptr[u], adj_ptr[u + 1]):
            e = adj_e[p]
            v = e_b[e] if adj_side[p] == 0 else e_a[e]
            if in_f[v]:
                r = _find(par, v)
                if mark[r] == u:
                    ok = False
                    break
                mark[r] = u
        if not ok:
            continue
        in_f[u] = True
        for p in range(adj_ptr[u], adj_ptr[u + 1]):
            e = adj_e[p]
            v = e_b[e] if adj_side[p] == 0 else e_a[e]
            if in_f[v] and v != u:
                r = _find(par, v)
                par[r] = u
    # unary costs: own choice plus edges to units outside the forest
    val = pc.copy()
    for u in range(n):
        if not in_f[u]:
            continue
        o = k_off[u]
        kk = k_off[u + 1] - o
        for p in range(adj_ptr[u], adj_ptr[u + 1]):
            e = adj_e[p]
            nb = e_nb[e]
            if adj_side[p] == 0:
                v = e_b[e]
                if not in_f[v]:
                    base = e_off[e] + ch[v]
                    for k in range(kk):
                        val[o + k] += e_flat[base + k * nb]
            else:
                v = e_a[e]
                if not in_f[v]:
                    base = e_off[e] + ch[v] * nb
                    for k in range(kk):
                        val[o + k] += e_flat[base + k]
        if no_rise:
            cur = ch[u]
            for k in range(kk):
                for m in range(m_ptr[u], m_ptr[u + 1]):
                    if m_use[m_uoff[m] + k] > m_use[m_uoff[m] + cur]:
                        val[o + k] = inf_
                        break
    # breadth-first order of each tree, parents first
    seq = np.empty(n, dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    pedge = np.full(n, -1, dtype=np.int64)
    seen = np.zeros(n, dtype=np.bool_)
    size = 0
    for r in range(n):
        if not in_f[r] or seen[r]:
            continue
        seen[r] = True
        seq[size] = r
        size += 1
        head = size - 1
        while head < size:
            u = seq[head]
            head += 1
            for p in range(adj_ptr[u], adj_ptr[u + 1]):
                e = adj_e[p]
                v = e_b[e] if adj_side[p] == 0 else e_a[e]
                if in_f[v] and not seen[v]:
                    seen[v] = True
                    parent[v] = u
                    pedge[v] = e
                    seq[size] = v
                    size += 1
    # children to parents: message[kp] = min over kc of val_c[kc] + edge(kp, kc)
    arg_off = np.zeros(n + 1, dtype=np.int64)
    for i in range(size):
        c = seq[i]
        p = parent[c]
        arg_off[i + 1] = arg_off[i] + (k_off[p + 1] - k_off[p] if p >= 0 else 0)
    argb = np.zeros(arg_off[size], dtype=np.int64)
    for i in range(size - 1, -1, -1):
        c = seq[i]
        p = parent[c]
        if p < 0:
            continue
        e = pedge[c]
        nb = e_nb[e]
        oc, op = k_off[c], k_off[p]
        kc, kp = k_off[c + 1] - oc, k_off[p + 1] - op
        c_is_a = e_a[e] == c
        for j in range(kp):
            best, bk = inf_, 0
            for k in range(kc):
                vc = val[oc + k]
                if vc >= best:
                    continue
                w = e_flat[e_off[e] + k * nb + j] if c_is_a else e_flat[e_off[e] + j * nb + k]
                if vc + w < best:
                    best, bk = vc + w, k
            argb[arg_off[i] + j] = bk
            val[op + j] += best
    for i in range(size):
        u = seq[i]
        p = parent[u]
        if p < 0:
            o = k_off[u]
            kk = k_off[u + 1] - o
            bk, best = ch[u], val[o + ch[u]]
            for k in range(kk):
                if val[o + k] < best:
                    best, bk = val[o + k], k
            ch[u] = bk
        else:
            ch[u] = argb[arg_off[i] + ch[p]]
    return size


@njit(cache=True, nogil=True)
def lower_bound(D, pc):
    """A valid lower bound of the unit objective with costs ``pc``: each unit's cheapest
    choice, counting for the edges it is first end of each edge's cheapest entry on that
    choice's row."""
    k_off, e_a, e_off, e_nb, e_flat = D[0], D[9], D[11], D[12], D[13]
    own = pc.copy()
    for e in range(len(e_a)):
        a = e_a[e]
        o = k_off[a]
        nb = e_nb[e]
        for i in range(k_off[a + 1] - o):
            base = e_off[e] + i * nb
            m = e_flat[base]
            for j in range(1, nb):
                if e_flat[base + j] < m:
                    m = e_flat[base + j]
            own[o + i] += m
    total = 0.0
    for u in range(len(k_off) - 1):
        m = own[k_off[u]]
        for k in range(k_off[u] + 1, k_off[u + 1]):
            if own[k] < m:
                m = own[k]
        total += m
    return total
