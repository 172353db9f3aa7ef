"""IOPDDL contest JSON: exact round trip, clear errors, evaluation, the ``solve`` command."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from autopar.solver import ProblemError, evaluate, make_problem, read_problem, write_problem
from autopar.solver.command import main
from autopar.solver.iopddl import problem_to_json

BENCH = Path(__file__).resolve().parents[3] / "shared" / "bench" / "iopddl"
G = BENCH / "G.json.gz"


def random_problem(seed: int, n: int = 30):
    rng = np.random.default_rng(seed)
    k = rng.integers(1, 5, n)
    edges = [(int(rng.integers(n)), int(rng.integers(n))) for _ in range(2 * n)]
    return make_problem(
        costs=[rng.integers(0, 1000, ki) for ki in k],
        usages=[rng.integers(0, 50, ki) for ki in k],
        intervals=[(int(s), int(s + rng.integers(0, 10))) for s in rng.integers(0, 40, n)],
        edges=edges,
        edge_costs=[rng.random(k[u] * k[v]) * 100 for u, v in edges],  # fractional on purpose
        usage_limit=500,
        names=[f"op{i}" for i in range(n)],
        name="random",
    )


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_round_trip_is_exact(tmp_path: Path, suffix: str) -> None:
    p = random_problem(0)
    path = tmp_path / f"p{suffix}"
    write_problem(p, path)
    q = read_problem(path)
    assert problem_to_json(q) == problem_to_json(p)
    assert q.names == p.names and q.name == "random" and q.usage_limit == 500
    for a, b in zip(p.edge_costs, q.edge_costs):
        assert a.shape == b.shape and np.array_equal(a, b)  # floats survive bit-exactly
    a = np.zeros(p.num_nodes, dtype=int)
    assert evaluate(p, a) == evaluate(q, a)


@pytest.mark.skipif(not G.exists(), reason="contest instances not present")
def test_contest_file_round_trips_to_the_same_json(tmp_path: Path) -> None:
    original = json.loads(gzip.decompress(G.read_bytes()))
    p = read_problem(G)
    assert p.num_nodes == 816 and p.num_edges == 1023
    assert problem_to_json(p) == original
    write_problem(p, tmp_path / "g.json")
    assert json.loads((tmp_path / "g.json").read_text()) == original


def test_evaluate_matches_a_plain_loop() -> None:
    p = random_problem(3, n=60)
    rng = np.random.default_rng(4)
    for _ in range(5):
        a = [int(rng.integers(len(c))) for c in p.costs]
        cost = sum(p.costs[i][a[i]] for i in range(p.num_nodes))
        cost += sum(m[a[u], a[v]] for (u, v), m in zip(p.edges, p.edge_costs))
        peak = max(
            sum(p.usages[i][a[i]] for i, (s, e) in enumerate(p.intervals) if s <= t < e)
            for t in range(60)
        )
        got = evaluate(p, a)
        assert got[0] == pytest.approx(cost, rel=1e-12)
        assert got[2] == peak and got[1] == (peak <= 500)


def test_evaluate_rejects_bad_assignments() -> None:
    p = random_problem(5)
    with pytest.raises(ProblemError, match="entries for 30 nodes"):
        evaluate(p, [0, 0])
    with pytest.raises(ProblemError, match="out of range"):
        evaluate(p, [99] * 30)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({}, "missing key 'problem'"),
        ({"problem": {"nodes": {}, "edges": {}}}, "missing key 'costs'"),
        (
            {"problem": {"nodes": {"intervals": [[0, 1]], "costs": [[1, 2]], "usages": [[1]]},
                         "edges": {"nodes": [], "costs": []}}},
            "2 costs but 1 usages",
        ),
        (
            {"problem": {"nodes": {"intervals": [[0, 1]], "costs": [[1, 2]], "usages": [[1, 1]]},
                         "edges": {"nodes": [[0, 0]], "costs": [[1, 2, 3]]}}},
            "3 costs, expected 2\\*2",
        ),
        (
            {"problem": {"nodes": {"intervals": [[0, 1]], "costs": [[1]], "usages": [[-1]]},
                         "edges": {"nodes": [], "costs": []}}},
            "negative memory usage",
        ),
    ],
)  # fmt: skip
def test_malformed_problems_name_the_cause(tmp_path: Path, doc: dict, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProblemError, match=message):
        read_problem(path)


def test_command_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["solve", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and err.count("\n") == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["solve", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "invalid JSON" in err and err.count("\n") == 1


def test_command_solves_and_writes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    p = random_problem(7, n=12)
    write_problem(p, tmp_path / "p.json.gz")
    out = tmp_path / "sol.json"
    rc = main(["solve", str(tmp_path / "p.json.gz"), "--time-limit", "10", "--clock", "command", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "12 nodes" in text and "status    optimal" in text
    sol = json.loads(out.read_text())
    assert len(sol["solution"]) == 12
    assert evaluate(p, sol["solution"])[0] == pytest.approx(sol["cost"])


def test_command_counts_reading_and_start_up_against_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """By default the limit is the process's wall time: a process older than the limit has
    nothing left to solve with and says so in one line, instead of overrunning."""
    from autopar.solver.command import process_age_s

    age = process_age_s()
    assert age > 0
    p = random_problem(3, n=6)
    write_problem(p, tmp_path / "p.json")
    rc = main(["solve", str(tmp_path / "p.json"), "--time-limit", f"{age / 2:.3f}"])
    captured = capsys.readouterr()
    assert rc == 2 and "no time left" in captured.err and captured.err.count("\n") == 1
    # 5 s beyond the process's age, whatever the share of the limit kept back for exiting
    # (2% of it: 12 s for a test process minutes old, as in the whole suite)
    rc = main(["solve", str(tmp_path / "p.json"), "--time-limit", f"{(age + 5) / 0.9:.3f}"])
    assert rc == 0 and "s of the limit left to solve" in capsys.readouterr().out


def test_the_autopar_command_solves_without_importing_torch(tmp_path: Path) -> None:
    """``autopar solve`` (the command's entry point, with the real ``autopar`` package) never
    imports torch: its limit counts from the process start, and torch's import is seconds of
    it. The rest of the command line still loads as before."""
    import subprocess
    import sys

    write_problem(random_problem(4, n=8), tmp_path / "p.json")
    code = (
        "import sys\n"
        "from autopar.cli import main\n"
        f"rc = main(['solve', {str(tmp_path / 'p.json')!r}, '--time-limit', '30',"
        " '--clock', 'command'])\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert rc == 0 and not loaded, (rc, loaded[:5])\n"
        "import autopar\n"
        "assert autopar.Options.__name__ == 'Options' and 'torch' in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
