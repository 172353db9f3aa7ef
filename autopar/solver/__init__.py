"""Solver core for the abstract sharding problem (IOPDDL form); needs no torch.

``solve(problem, timeout_s)`` returns the best ``Solution`` found; ``read_problem`` /
``write_problem`` speak the contest JSON; ``evaluate`` scores any assignment.
"""

from autopar.solver.iopddl import read_problem, write_problem, write_solution
from autopar.solver.problem import Problem, ProblemError, Solution, evaluate, make_problem
from autopar.solver.solve import solve

__all__ = [
    "Problem",
    "ProblemError",
    "Solution",
    "evaluate",
    "make_problem",
    "read_problem",
    "solve",
    "write_problem",
    "write_solution",
]
