"""Read and write problems and solutions in the IOPDDL contest JSON form (plain or gzipped).

Layout: ``{"problem": {"name", "nodes": {"intervals", "costs", "usages"},
"edges": {"nodes", "costs"}, "usage_limit"?}}`` with edge costs flattened row-major
(``costs[e][s_u * len(costs[v]) + s_v]``).
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
from pathlib import Path

import numpy as np

from autopar.solver.problem import Problem, ProblemError, Solution, make_problem


def _open_text(path: Path) -> str:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
        raw = gzip.decompress(raw)
    return raw.decode("utf-8")


def _field(d: object, key: str, where: str) -> object:
    if not isinstance(d, dict) or key not in d:
        raise ProblemError(f"{where}: missing key {key!r}")
    return d[key]


def _arrays(lists: object) -> object:
    """A list of number lists as float64 views of one array: one conversion for millions of
    numbers instead of one per list (a contest file holds 5M edge costs in 40k lists).
    Anything else is returned as it is, for make_problem to name what is wrong."""
    try:
        lens = np.fromiter(map(len, lists), dtype=np.int64)
        flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.float64,
                           count=int(lens.sum()))
    except (TypeError, ValueError):
        return lists
    ends = np.cumsum(lens).tolist()
    return [flat[e - k : e] for e, k in zip(ends, lens.tolist())]


def problem_from_json(doc: object, source: str = "<json>") -> Problem:
    """Build a Problem from the parsed contest JSON document."""
    p = _field(doc, "problem", source)
    nodes = _field(p, "nodes", f"{source}: problem")
    edges = _field(p, "edges", f"{source}: problem")
    try:
        return make_problem(
            costs=_arrays(_field(nodes, "costs", f"{source}: nodes")),
            usages=_arrays(_field(nodes, "usages", f"{source}: nodes")),
            intervals=_field(nodes, "intervals", f"{source}: nodes"),
            edges=_field(edges, "nodes", f"{source}: edges"),
            edge_costs=_arrays(_field(edges, "costs", f"{source}: edges")),
            usage_limit=p.get("usage_limit"),
            names=nodes.get("names"),
            name=p.get("name"),
        )
    except ProblemError as e:
        raise ProblemError(f"{source}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ProblemError(f"{source}: malformed problem ({e})") from None


def read_problem(path: str | os.PathLike) -> Problem:
    """Read a contest problem file (``.json`` or ``.json.gz``).

    Raises FileNotFoundError for a missing file and ProblemError (a ValueError) naming the
    cause for anything malformed.
    """
    path = Path(path)
    try:
        text = _open_text(path)
    except (OSError, EOFError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ProblemError(f"{path}: cannot read ({e})") from None
    except UnicodeDecodeError:
        raise ProblemError(f"{path}: not a UTF-8 JSON file") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProblemError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    return problem_from_json(doc, str(path))


def _num(x: float) -> int | float:
    # Contest files hold integers; writing them back as ints keeps the round trip byte-faithful.
    return int(x) if float(x).is_integer() and abs(x) < 2**53 else float(x)


def _nums(a: np.ndarray) -> list:
    if np.all(np.mod(a, 1) == 0) and (len(a) == 0 or np.abs(a).max() < 2**53):
        return a.astype(np.int64).tolist()
    return [_num(x) for x in a.tolist()]


def problem_to_json(problem: Problem) -> dict:
    nodes: dict = {
        "intervals": [list(iv) for iv in problem.intervals],
        "costs": [_nums(c) for c in problem.costs],
        "usages": [_nums(u) for u in problem.usages],
    }
    if problem.names is not None:
        nodes["names"] = list(problem.names)
    p: dict = {}
    if problem.name is not None:
        p["name"] = problem.name
    p["nodes"] = nodes
    p["edges"] = {
        "nodes": [list(e) for e in problem.edges],
        "costs": [_nums(m.ravel()) for m in problem.edge_costs],
    }
    if problem.usage_limit is not None:
        p["usage_limit"] = _num(problem.usage_limit)
    return {"problem": p}


def write_problem(problem: Problem, path: str | os.PathLike) -> None:
    """Write a problem in contest form; gzipped when the name ends in ``.gz``."""
    path = Path(path)
    data = json.dumps(problem_to_json(problem), separators=(",", ":")).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def write_solution(
    solution: Solution, path: str | os.PathLike, problem: Problem | None = None
) -> None:
    """Write a solution as JSON: the strategy list under ``"solution"`` plus how it scored."""
    doc = {
        "problem": problem.name if problem is not None else None,
        "solution": list(solution.assignment),
        "cost": _num(solution.cost) if solution.assignment else None,
        "feasible": solution.feasible,
        "status": solution.status,
        "method": solution.method,
        "time_s": round(solution.time_s, 3),
        "lower_bound": solution.lower_bound,
    }
    Path(path).write_text(json.dumps(doc) + "\n")
