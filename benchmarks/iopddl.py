"""Solve the four public IOPDDL contest instances as a contest runner would, and compare with
the contest's best scores.

    python benchmarks/iopddl.py [--instances A G M S] [--timeout-scale 1.0] [--perturb SEED]
    python benchmarks/iopddl.py --perturb 1 --instances M S --baseline /tmp/a8f5b1c
    python benchmarks/iopddl.py --ab 0.0 0.75 --time 120 --perturb 1 [--instances S M]

Default mode: each instance runs as ``autopar solve FILE --time-limit T --out SOL`` in a
fresh process, T its contest timeout (times ``--timeout-scale``); the wall column is that
process's whole life (interpreter start, imports, reading the file, solving, writing), and
the cost is re-scored here from the written solution; the cpu column is the CPU time that
process got (user + system, all threads): on a shared machine far less than wall x cores. ``--perturb SEED`` solves unseen
variants instead (``perturb``): the same graphs with every node and edge cost scaled by its
own random factor and a different usage limit; they have no known best, so the gap column is
empty.

``--baseline DIR``: each instance also runs the source tree in DIR (another commit, e.g.
``git archive a8f5b1c | tar -x -C /tmp/a8f5b1c``) at the same time, both rows printed: one
load for both, so their costs compare as a ratio on a shared machine.

``--ab X Y``: the solver's unit-search share (``solve.UNIT_SHARE``) X against Y, both
in-process on the same instance at the same time (two processes side by side, so a loaded
machine slows both alike), ``--time`` seconds each; prints both costs and their ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autopar.solver import Problem, evaluate, read_problem, write_problem  # noqa: E402
from autopar.solver.problem import usage_profile  # noqa: E402

# instance: (contest timeout s, best score in the contest), from ../shared/bench/iopddl/README.md
CONTEST = {
    "A": (60, 6_548_641_531),
    "G": (120, 217_039),
    "M": (180, 49_928_460_991),
    "S": (240, 1_534_613_444),
}
FORBIDDEN = 1e17


def default_dir() -> Path:
    for d in (ROOT.parent / "shared" / "bench" / "iopddl", ROOT / "shared" / "bench" / "iopddl"):
        if d.is_dir():
            return d
    return ROOT.parent / "shared" / "bench" / "iopddl"


def perturb(p: Problem, seed: int) -> Problem:
    """An unseen instance of the same shape: every node's and edge's costs scaled by a factor
    of its own (log-normal, sigma 0.5; forbidden costs stay forbidden), and the usage limit
    moved to 80-130% of its headroom over the smallest possible peak. Usages are kept: a
    rigid group's members change size together, which scaling them one by one would break
    (perturbed A then needed forbidden pairs to fit at all)."""
    rng = np.random.default_rng(seed)

    def scale(a: np.ndarray, f: float) -> np.ndarray:
        return np.where(a >= FORBIDDEN, a, np.round(a * f))

    costs = [scale(c, f) for c, f in zip(p.costs, rng.lognormal(0, 0.5, p.num_nodes))]
    ecosts = [scale(m, f) for m, f in zip(p.edge_costs, rng.lognormal(0, 0.5, p.num_edges))]
    usages = p.usages
    limit = p.usage_limit
    if limit is not None:
        q = Problem(costs, usages, p.intervals, p.edges, ecosts, None)
        floor = float(usage_profile(q, np.array([int(np.argmin(u)) for u in usages])).max())
        limit = float(np.floor(floor + rng.uniform(0.8, 1.3) * max(limit - floor, 0.0)))
    name = f"{p.name or 'problem'}-perturbed-{seed}"
    return Problem(costs, usages, p.intervals, p.edges, ecosts, limit, None, name)


def instance_file(args: argparse.Namespace, name: str, tmp: Path) -> Path:
    path = args.dir / f"{name}.json.gz"
    if not args.perturb:
        return path
    out = tmp / f"{name}-p{args.perturb}.json.gz"
    write_problem(perturb(read_problem(path), args.perturb), out)
    return out


def solve_once(args: argparse.Namespace, name: str, path: Path, out: Path,
               baseline: Path | None = None) -> str:
    """One ``autopar solve`` process on ``path``, as a table row; ``baseline``: the source
    tree of another commit to run instead of this one (put first on PYTHONPATH)."""
    timeout, best = CONTEST[name]
    limit = timeout * args.timeout_scale
    cmd = [sys.executable, "-m", "autopar.cli", "solve", str(path),
           "--time-limit", f"{limit:g}", "--workers", str(args.workers),
           "--seed", str(args.seed), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(baseline)) if baseline else None
    log = out.with_suffix(".log")
    t = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=baseline or ROOT,
                                env=env)
        _, _, ru = os.wait4(proc.pid, 0)  # reaps it with its own CPU time (user + system)
        proc.returncode = 0
    wall = time.monotonic() - t
    cpu = ru.ru_utime + ru.ru_stime
    err = log.read_text()
    p = read_problem(path)
    if not out.exists():
        return f"| {name} | failed: {err.strip()[-200:]} |"
    sol = json.loads(out.read_text())
    cost, ok, _ = evaluate(p, sol["solution"]) if sol["solution"] else (0, False, 0)
    gap = f"{100.0 * (cost - best) / best:+.2f}" if ok and not args.perturb else ""
    lb = sol.get("lower_bound")
    bgap = f"{100.0 * (cost - lb) / cost:.1f}" if ok and lb is not None else ""
    shown_best = f"{best:,}" if not args.perturb else "-"
    label = (p.name or name) + (f" ({baseline.name})" if baseline else "")
    return (f"| {label} | {p.num_nodes:,} | {p.num_edges:,} | {limit:g} "
            f"| {wall:.1f} | {cpu:.0f} | {'yes' if wall <= limit else 'NO'} | {cost:,.0f} "
            f"| {'yes' if ok else 'no'} | {shown_best} | {gap} | {bgap} | {sol['status']} |")


def run_cli(args: argparse.Namespace) -> int:
    print("| instance | nodes | edges | limit s | wall s | cpu s | within | our cost | feasible "
          "| contest best | gap % | bound gap % | status |")
    print("|---" * 13 + "|")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name in args.instances:
            path = instance_file(args, name, tmp)
            trees = [None] + ([args.baseline] if args.baseline else [])
            with ThreadPoolExecutor(len(trees)) as pool:  # side by side: one load for both
                rows = list(pool.map(
                    lambda b, n=name, f=path: solve_once(args, n, f, tmp / f"{n}-{bool(b)}.sol.json", b),
                    trees))
            for row in rows:
                print(row, flush=True)
    return 0


def _solve_with_share(path: str, share: float, limit: float, seed: int, out: mp.Queue) -> None:
    import autopar.solver.solve  # noqa: F401  (the module, not the function it exports)

    module = sys.modules["autopar.solver.solve"]
    module.UNIT_SHARE = share
    p = read_problem(path)
    sol = module.solve(p, limit, seed=seed)
    out.put((share, sol.cost if sol.feasible else float("inf")))


def run_ab(args: argparse.Namespace) -> int:
    x, y = args.ab
    print(f"| instance | time s | share {x:g} cost | share {y:g} cost | ratio {y:g}/{x:g} |")
    print("|---" * 5 + "|")
    with tempfile.TemporaryDirectory() as d:
        for name in args.instances:
            path = str(instance_file(args, name, Path(d)))
            q: mp.Queue = mp.Queue()
            procs = [mp.Process(target=_solve_with_share, args=(path, s, args.time, args.seed, q))
                     for s in (x, y)]
            for pr in procs:
                pr.start()
            got = dict(q.get() for _ in procs)
            for pr in procs:
                pr.join()
            label = f"{name}" + (f" perturbed {args.perturb}" if args.perturb else "")
            print(f"| {label} | {args.time:g} | {got[x]:,.0f} | {got[y]:,.0f} "
                  f"| {got[y] / got[x]:.3f} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout-scale", type=float, default=1.0)
    ap.add_argument("--instances", nargs="+", default=list(CONTEST), choices=list(CONTEST))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--perturb", type=int, default=0, metavar="SEED",
                    help="solve an unseen variant of each instance (0: the published ones)")
    ap.add_argument("--ab", type=float, nargs=2, metavar=("X", "Y"),
                    help="compare unit-search shares X and Y side by side, in-process")
    ap.add_argument("--time", type=float, default=60.0, help="seconds per solve with --ab")
    ap.add_argument("--baseline", type=Path, metavar="DIR",
                    help="also run the source tree in DIR (another commit: git archive C | tar "
                         "-x -C DIR) on each instance, at the same time, for a side-by-side ratio")
    ap.add_argument("--dir", type=Path, default=default_dir(), help="folder with X.json.gz")
    args = ap.parse_args(argv)
    return run_ab(args) if args.ab else run_cli(args)


if __name__ == "__main__":
    sys.exit(main())
