"""What the planner says when no plan fits: a need no mode's constrained instant can go
below, and "raise the time limit" only where the limit stopped the search."""

from __future__ import annotations

import pytest

from autopar.capture.joint import capture
from autopar.ir.mesh import Mesh
from autopar.models import get_preset
from autopar.passes.problem import sharding_problem
from autopar.planning.memory_fit import _proven_need, leanest, no_fit_message
from autopar.planning.modes import Mode, mode_graph
from autopar.solver.problem import least_peak_usage

MESH = Mesh((2, 2), ("dp", "tp"), "cpu")


@pytest.fixture(scope="module")
def graph():
    preset = get_preset("gpt2-tiny").replace(n_layer=1, n_positions=32)
    return capture(preset.build("meta"), preset.example_inputs(4, 32))


def test_the_need_is_at_least_the_constrained_instants(graph):
    sp = sharding_problem.build(mode_graph(graph, Mode("none")), MESH, 1.0)
    need, state = _proven_need(sp)
    assert need >= leanest(sp)[0] and need >= least_peak_usage(sp.problem)
    assert state == leanest(sp)[1]


@pytest.mark.parametrize("cut", [True, False])
def test_more_time_is_advised_only_where_the_limit_cut_the_search(graph, cut):
    full = sharding_problem.build(mode_graph(graph, Mode("full", regather=True)), MESH, None)
    need = _proven_need(full)[0]
    # a limit above what the leanest layouts of single tensors need: nothing was proven
    text = no_fit_message(graph, MESH, need * 1.01, "given", {}, 7.0, cut=cut)
    assert ("raise --time-limit" in text) == cut
    assert "--time-limit 7 s" in text if cut else "before its time limit" in text
    assert "smaller batch or more devices" in text
