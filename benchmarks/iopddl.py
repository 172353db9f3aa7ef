"""Solve the four public IOPDDL contest instances and compare with the contest's best scores.

    python benchmarks/iopddl.py [--timeout-scale 1.0] [--instances A G M S] [--workers 2]

Prints a markdown table: instance, nodes, edges, timeout, our cost, feasible, contest best,
gap %, time. Each instance gets its contest timeout (times ``--timeout-scale``); the time
column is the wall clock of ``solve`` (presolve included, reading the file not).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autopar.solver import read_problem, solve  # noqa: E402

# instance: (contest timeout s, best score in the contest), from ../shared/bench/iopddl/README.md
CONTEST = {
    "A": (60, 6_548_641_531),
    "G": (120, 217_039),
    "M": (180, 49_928_460_991),
    "S": (240, 1_534_613_444),
}


def default_dir() -> Path:
    for d in (ROOT.parent / "shared" / "bench" / "iopddl", ROOT / "shared" / "bench" / "iopddl"):
        if d.is_dir():
            return d
    return ROOT.parent / "shared" / "bench" / "iopddl"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout-scale", type=float, default=1.0)
    ap.add_argument("--instances", nargs="+", default=list(CONTEST), choices=list(CONTEST))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=default_dir(), help="folder with X.json.gz")
    args = ap.parse_args(argv)
    header = (
        "| instance | nodes | edges | timeout s | our cost | feasible | contest best "
        "| gap % | time s | status |"
    )
    print(header)
    print("|---" * 10 + "|")
    for name in args.instances:
        timeout, best = CONTEST[name]
        timeout *= args.timeout_scale
        p = read_problem(args.dir / f"{name}.json.gz")
        t = time.monotonic()
        sol = solve(p, timeout_s=timeout, workers=args.workers, seed=args.seed)
        dt = time.monotonic() - t
        gap = 100.0 * (sol.cost - best) / best if sol.feasible else float("nan")
        cost = f"{sol.cost:,.0f}" if sol.assignment else "-"
        print(
            f"| {name} | {p.num_nodes:,} | {p.num_edges:,} | {timeout:g} | {cost} | "
            f"{'yes' if sol.feasible else 'no'} | {best:,} | {gap:+.2f} | {dt:.1f} | "
            f"{sol.status} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
