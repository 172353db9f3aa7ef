import numpy as np
import pytest

from autopar.capture import capture
from autopar.mesh import Mesh
from autopar.models import get_preset
from autopar.passes import sharding_problem
from autopar.passes.axis_search import solve_axiswise
from autopar.solver import evaluate
from autopar.solver.elimination import solve_by_elimination


def _sp(mesh, name="gpt2-tiny"):
    preset = get_preset(name)
    return sharding_problem.build(capture(preset.build("meta"), preset.example_inputs(4, 32)), mesh)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama3-tiny"])
def test_on_a_1d_mesh_the_sweep_is_the_global_optimum(name):
    sp = _sp(Mesh((4,), ("tp",)), name)
    sol = solve_axiswise(sp, sp.problem, timeout_s=30)
    exact = solve_by_elimination(sp.problem, max_entries=5e7)
    assert sol.status == "optimal"
    assert exact is not None and sol.cost == pytest.approx(exact.cost, rel=1e-12)


def test_on_a_2d_mesh_it_improves_on_every_start():
    sp = _sp(Mesh((2, 2), ("dp", "tp")))
    p = sp.problem
    rng = np.random.default_rng(3)
    hint = [int(rng.integers(len(c))) for c in p.costs]
    sol = solve_axiswise(sp, p, timeout_s=30, hints=[hint], restarts=0)
    assert sol.feasible
    assert sol.cost <= evaluate(p, hint)[0]
    assert sol.cost <= evaluate(p, [0] * p.num_nodes)[0]
    assert evaluate(p, sol.assignment)[0] == pytest.approx(sol.cost)
