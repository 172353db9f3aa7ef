"""The priced unit problem solved by a complete weighted-CSP solver (toulbar2), for the
relaxed plans of the Lagrangian rounds in ``unitsearch.py``.

With the usage limit priced into the unit costs, what is left is a pairwise min-sum problem
(a weighted CSP). The unit search's own moves (forest DP, sweeps, pair and region moves)
settle in the basin they start in: on contest instance M, with no limit at all, they stop at
5.18e10 where toulbar2 (hybrid best-first search under soft arc consistency) finds 4.615e10
in 25 s, and CP-SAT proves the unit search's plan optimal on the 215 units around its 40
costliest edges. A relaxed plan from this solver, repaired by the unit search's tightening,
lands in a different basin (M: 5.016e10 from one such round, against 5.227e10).

toulbar2 runs in a child process: its time limit counts CPU seconds and its state is global
(one solve at a time per process), so the parent holds the wall-clock limit itself, kills
the child at it, and reads the best plan the child printed so far (toulbar2 prints every
better solution, a line at a time). Costs are shifted to be non-negative per function and
scaled to integers (toulbar2's costs are integers); a forbidden entry (``>= forbid``) is a
hard constraint. Nothing here is trusted: the caller re-scores every plan with its own costs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import numpy as np

# the largest finite cost after scaling: sums of ~1e5 functions stay far below 2^63
_SCALE_TO = 1e12
_TOP = 2**62


def available() -> bool:
    """Whether toulbar2's Python package can be imported (it is a dependency; a broken
    install turns this step off rather than the solver)."""
    try:
        import pytoulbar2  # noqa: F401
    except ImportError:
        return False
    return True


def _int_costs(a: np.ndarray, forbid: float, scale: float) -> np.ndarray:
    """Shifted to a zero minimum, scaled and rounded; forbidden entries at ``_TOP``."""
    ok = a < forbid
    if not ok.any():
        return np.full(len(a), _TOP, dtype=np.int64)
    out = np.round((a - a[ok].min()) * scale)
    return np.where(ok, np.minimum(out, _TOP // 4), _TOP).astype(np.int64)


def solve_priced(D, pc: np.ndarray, forbid: float, wall_s: float,
                 hint: np.ndarray | None = None, cpu_s: float | None = None
                 ) -> np.ndarray | None:
    """The best unit choice toulbar2 finds for unit costs ``pc`` and ``D``'s edge matrices
    in ``cpu_s`` seconds of its own CPU time (default: ``wall_s``), and never more than
    ``wall_s`` seconds of wall time (the whole child process), or None. On a shared machine
    the CPU limit is what makes a solve as good as on an idle one, the wall limit what
    keeps the caller's deadline. ``hint``: a
    plan whose values the search tries first (solution-based phase saving); without it
    the first plans of a short search are poor (M: 6.4e10 in 15 s against 4.6e10 in 30)."""
    k_off, e_a, e_b, e_off, e_nb, e_flat = D[0], D[9], D[10], D[11], D[12], D[13]
    fin = np.concatenate([pc[pc < forbid], e_flat[e_flat < forbid]])
    span = float(np.abs(fin).max(initial=0.0))
    scale = _SCALE_TO / span if span > 0 else 1.0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "problem.npz"), os.path.join(d, "solutions.txt")
        np.savez(src, k_off=k_off, e_a=e_a, e_b=e_b, e_off=e_off, e_nb=e_nb,
                 e_flat=e_flat, pc=pc, forbid=np.float64(forbid), scale=np.float64(scale),
                 hint=np.zeros(0, np.int64) if hint is None else hint)
        left = wall_s - (time.monotonic() - t0)
        if left <= 0.5:
            return None
        # toulbar2's own limit counts CPU seconds, whole ones; the parent's kill holds the wall
        cpu = max(1, int(min(left, wall_s if cpu_s is None else cpu_s)))
        with open(out, "w") as f:
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), src, str(cpu)],
                stdout=f, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
            try:
                proc.wait(timeout=max(0.1, wall_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return _last_solution(out, len(k_off) - 1)


def _last_solution(path: str, n: int) -> np.ndarray | None:
    """The last complete solution line the child printed (toulbar2 prints every better
    solution and flushes the line; a line cut by the kill has no newline yet)."""
    try:
        with open(path) as f:
            lines = f.read().split("\n")[:-1]
    except OSError:
        return None
    for line in reversed(lines):
        words = line.split()
        if len(words) == n and all(w.isdigit() for w in words):
            return np.array([int(w) for w in words], dtype=np.int64)
    return None


def _child(src: str, cpu: int) -> None:
    import pytoulbar2

    z = np.load(src)
    k_off, e_a, e_b, e_off, e_nb, e_flat, pc = (z[k] for k in (
        "k_off", "e_a", "e_b", "e_off", "e_nb", "e_flat", "pc"))
    forbid, scale, hint = float(z["forbid"]), float(z["scale"]), z["hint"]
    cfn = pytoulbar2.CFN(_TOP, verbose=-1)
    n = len(k_off) - 1
    for u in range(n):
        cfn.AddVariable(f"u{u}", range(int(k_off[u + 1] - k_off[u])))
    for u in range(n):
        cfn.AddFunction([u], _int_costs(pc[k_off[u]:k_off[u + 1]], forbid, scale).tolist())
    for e in range(len(e_a)):
        a, b = int(e_a[e]), int(e_b[e])
        m = e_flat[e_off[e]:e_off[e] + (k_off[a + 1] - k_off[a]) * e_nb[e]]
        cfn.AddFunction([a, b], _int_costs(m, forbid, scale).tolist())
    for u, v in enumerate(hint.tolist()):
        cfn.CFN.wcsp.setBestValue(u, int(v))
    cfn.Solve(showSolutions=1, timeLimit=cpu)


if __name__ == "__main__":  # the child process: python wcsp.py PROBLEM.npz CPU_S
    _child(sys.argv[1], int(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)
