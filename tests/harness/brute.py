"""The reference the solver tests compare with: every assignment tried."""

import itertools
import math

from autopar.solver import Problem, evaluate


def brute_force(p: Problem) -> float:
    """Cost of the cheapest feasible assignment (inf if none fits)."""
    best = math.inf
    for a in itertools.product(*[range(len(c)) for c in p.costs]):
        cost, ok, _ = evaluate(p, a)
        if ok:
            best = min(best, cost)
    return best
