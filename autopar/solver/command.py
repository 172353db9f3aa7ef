"""``autopar solve PROBLEM.json[.gz] --timeout S [--out SOLUTION.json] [--method ...]``."""

from __future__ import annotations

import argparse
import sys

from autopar.solver.iopddl import read_problem, write_solution
from autopar.solver.problem import ProblemError
from autopar.solver.solve import METHODS, solve


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("problem", help="problem file in IOPDDL contest JSON form (.json or .json.gz)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds, presolve included")
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


def run(args: argparse.Namespace) -> int:
    try:
        problem = read_problem(args.problem)
    except FileNotFoundError:
        print(f"autopar solve: no such file: {args.problem}", file=sys.stderr)
        return 2
    except (ProblemError, OSError) as e:
        print(f"autopar solve: bad problem file: {e}", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print("autopar solve: --timeout must be positive", file=sys.stderr)
        return 2
    n_strat = int(problem.index.n_strat.sum())
    limit = "none" if problem.usage_limit is None else f"{problem.usage_limit:.6g}"
    print(
        f"problem {problem.name or args.problem}: {problem.num_nodes} nodes, "
        f"{problem.num_edges} edges, {n_strat} strategies, usage limit {limit}"
    )
    sol = solve(problem, args.timeout, args.method, workers=args.workers, seed=args.seed)
    cost = f"{sol.cost:.12g}" if sol.assignment else "-"
    print(f"cost      {cost}")
    print(f"feasible  {'yes' if sol.feasible else 'no'}")
    print(f"status    {sol.status}")
    print(f"time      {sol.time_s:.2f} s  ({sol.method})")
    if sol.peak_usage is not None:
        print(f"peak use  {sol.peak_usage:.6g}")
    if args.out:
        try:
            write_solution(sol, args.out, problem)
        except OSError as e:
            print(f"autopar solve: cannot write {args.out}: {e}", file=sys.stderr)
            return 2
        print(f"wrote     {args.out}")
    return 0 if sol.feasible else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autopar")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
