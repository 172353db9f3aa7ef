"""``autopar solve PROBLEM.json[.gz] --time-limit S [--out SOLUTION.json] [--method ...]``.

The limit is wall time for the whole command, as a contest runner measures it: the time the
process has been alive when the problem is read (interpreter start, imports, reading and
parsing the file) comes off the solver's budget, and a margin is kept for writing the answer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from autopar.solver.iopddl import read_problem, write_solution
from autopar.solver.problem import ProblemError
from autopar.solver.solve import METHODS, solve


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("problem", help="problem file in IOPDDL contest JSON form (.json or .json.gz)")
    p.add_argument("--time-limit", "--timeout", dest="time_limit", type=float, default=60.0,
                   help="wall seconds for the whole command, reading the file included")
    p.add_argument("--clock", choices=("process", "command"), default="process",
                   help="what the limit counts from: the process start (default, as a contest "
                   "runner measures) or this command's start (a call from a running Python)")
    p.add_argument("--out", help="write the solution JSON here")
    p.add_argument("--method", choices=METHODS, default="auto")
    p.add_argument("--workers", type=int, default=2, help="CP-SAT worker threads")
    p.add_argument("--seed", type=int, default=0)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``solve`` subcommand; its handler is ``run``."""
    p = subparsers.add_parser(
        "solve",
        help="solve a sharding problem in IOPDDL contest form",
        description="Pick one strategy per node minimising cost under the memory limit.",
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


# Kept back from the solver for scoring, printing and writing the answer, plus a share of
# the limit for CP-SAT finishing late on a loaded machine (0.9 s late at 15 s measured; A
# ended 2.0 s past 60 s at load 10-15 with margins of 0.5 s + 2%, so 1 s + 3%).
_EXIT_MARGIN_S = 1.0
_EXIT_MARGIN_SHARE = 0.03
_STARTED = time.monotonic()  # fallback where the process start time cannot be read


def process_age_s() -> float:
    """Seconds since this process started (Linux: from /proc), else since this import."""
    try:
        with open("/proc/self/stat") as f:
            # the command name (field 2) may hold spaces: count fields after its ")"
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _STARTED


def run(args: argparse.Namespace) -> int:
    if args.time_limit <= 0:
        print("autopar solve: --time-limit must be positive", file=sys.stderr)
        return 2
    t_read = time.monotonic()
    age0 = process_age_s() if args.clock == "process" else 0.0
    try:
        problem = read_problem(args.problem)
    except FileNotFoundError:
        print(f"autopar solve: no such file: {args.problem}", file=sys.stderr)
        return 2
    except (ProblemError, OSError) as e:
        print(f"autopar solve: bad problem file: {e}", file=sys.stderr)
        return 2
    read_s = time.monotonic() - t_read
    margin = _EXIT_MARGIN_S + _EXIT_MARGIN_SHARE * args.time_limit
    budget = args.time_limit - age0 - read_s - margin
    n_strat = int(problem.index.n_strat.sum())
    limit = "none" if problem.usage_limit is None else f"{problem.usage_limit:.6g}"
    print(
        f"problem {problem.name or args.problem}: {problem.num_nodes} nodes, "
        f"{problem.num_edges} edges, {n_strat} strategies, usage limit {limit}"
    )
    print(f"read      {read_s:.2f} s; {max(budget, 0.0):.1f} s of the limit left to solve",
          flush=True)
    if budget < 0.1:
        print(f"autopar solve: no time left to solve within --time-limit {args.time_limit:g} "
              f"(reading took {read_s:.1f} s); give a longer limit", file=sys.stderr)
        return 2
    sol = solve(problem, budget, args.method, workers=args.workers, seed=args.seed)
    cost = f"{sol.cost:.12g}" if sol.assignment else "-"
    print(f"cost      {cost}")
    print(f"feasible  {'yes' if sol.feasible else 'no'}")
    print(f"status    {sol.status}")
    if sol.lower_bound is not None and sol.feasible and sol.status != "optimal":
        gap = (sol.cost - sol.lower_bound) / max(abs(sol.cost), 1e-300)
        print(f"bound     {sol.lower_bound:.12g}  (gap at most {100 * gap:.2f}%)")
    print(f"time      {sol.time_s:.2f} s solving ({sol.method}); "
          f"{age0 + time.monotonic() - t_read:.2f} s since the process started")
    if sol.peak_usage is not None:
        print(f"peak use  {sol.peak_usage:.6g}")
    if args.out:
        try:
            write_solution(sol, args.out, problem)
        except OSError as e:
            print(f"autopar solve: cannot write {args.out}: {e}", file=sys.stderr)
            return 2
        print(f"wrote     {args.out}")
    rc = 0 if sol.feasible else 1
    if args.clock == "process" and _launched_as_cli():
        # tearing down torch, OR-Tools and the problem's arrays takes 1-3 s that the limit
        # would pay for nothing: everything is written, so the process ends here
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _launched_as_cli() -> bool:
    """Whether this process is the ``autopar`` command (script or ``python -m``), not a
    Python program that called ``main`` and must keep running."""
    prog = os.path.basename(sys.argv[0]) if sys.argv else ""
    return prog in ("autopar", "__main__.py", "command.py") and "solve" in sys.argv[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autopar")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
