"""The planner's solve memo: the same problem content from the same starts is solved once per
planning call, and nothing else is answered from it."""

from __future__ import annotations

from harness.limited_problems import random_problem

from autopar.planning import solve_memo
from autopar.solver import Problem, solve


def _copy(p: Problem, limit: float | None = None) -> Problem:
    """The same content in new objects (as a mode's own build makes it)."""
    return Problem([c.copy() for c in p.costs], [u.copy() for u in p.usages],
                   list(p.intervals), list(p.edges), [m.copy() for m in p.edge_costs],
                   p.usage_limit if limit is None else limit, None, "another mode")


def test_the_same_content_is_solved_once_per_call() -> None:
    p = random_problem(3, 12)
    calls: list[Problem] = []

    def solver(q: Problem):
        return lambda: calls.append(q) or solve(q, timeout_s=1.0)

    with solve_memo.remembering():
        first = solve_memo.solved(p, [], ("how",), 1.0, solver(p))
        again = solve_memo.solved(_copy(p), [], ("how",), 1.0, solver(p))
        assert again is first and len(calls) == 1  # equal content, other objects: remembered
        # another limit, other starts, other settings, much more time: each solved
        assert p.usage_limit is not None
        solve_memo.solved(_copy(p, p.usage_limit + 1), [], ("how",), 1.0, solver(p))
        solve_memo.solved(p, [tuple(first.assignment)], ("how",), 1.0, solver(p))
        solve_memo.solved(p, [], ("other",), 1.0, solver(p))
        solve_memo.solved(p, [], ("how",), 2.5, solver(p))
        assert len(calls) == 5
        with solve_memo.remembering():  # a nested call shares the outer call's memo
            solve_memo.solved(p, [], ("how",), 1.0, solver(p))
        assert len(calls) == 5
    solve_memo.solved(p, [], ("how",), 1.0, solver(p))  # the call ended: forgotten
    assert len(calls) == 6


def test_the_key_reads_every_part_of_the_problem() -> None:
    p = random_problem(4, 10)
    key = solve_memo.content_key(p)
    assert solve_memo.content_key(_copy(p)) == key
    for change in ("costs", "usages", "edge_costs"):
        q = _copy(p)
        getattr(q, change)[0][0] += 1.0
        assert solve_memo.content_key(_copy(q)) != key, change
    moved = _copy(p)
    moved.intervals[0] = (moved.intervals[0][0], moved.intervals[0][1] + 1)
    assert solve_memo.content_key(_copy(moved)) != key

