"""Async TP's price (DeviceProfile.async_tp, scoring.hidden_by_async_tp): its share of the
in-line all-gathers and reduce-scatters inside one node comes off the step, and nothing
else does."""

import numpy as np
import pytest

from autopar.capture.joint import capture
from autopar.ir.devices import ASYNC_TP_HIDDEN
from autopar.ir.mesh import Mesh
from autopar.models import get_preset
from autopar.passes.problem import sharding_problem
from autopar.passes.problem.scoring import hidden_by_async_tp, is_param_gather, score_assignment


def _pair(shape):
    preset = get_preset("llama3-tiny")
    pg = capture(preset.build("meta"), preset.example_inputs(8, 64))
    return [sharding_problem.build(pg, Mesh(shape, ("dp", "tp"), d))
            for d in ("h100", "h100+async-tp")]


def _in_line(sp, scored):
    """The in-line collectives of a scored plan, each with the weight of its consumer."""
    w = sp.weight
    for k, colls in scored.edge_collectives.items():
        e = sp.edges[k]
        if e.in_idx >= 0 and not is_param_gather(sp, e):
            yield colls, float(w[e.dst])


def test_async_tp_hides_its_share_of_the_in_node_gathers_and_reduce_scatters():
    plain, fast = _pair((4, 2))
    assert fast.mesh.device.async_tp == ASYNC_TP_HIDDEN and plain.mesh.device.async_tp == 0
    rng = np.random.default_rng(1)
    gained = 0.0
    for _ in range(6):
        a = plain.expand([int(rng.integers(len(c))) for c in plain.problem.costs])
        p, f = score_assignment(plain, a), score_assignment(fast, a)
        hideable = sum(hidden_by_async_tp(fast, colls) * w for colls, w in _in_line(fast, f))
        # never slower, and never more off than its share of the collectives it may hide
        assert f.cost.step_s <= p.cost.step_s * (1 + 1e-12)
        assert p.cost.step_s - f.cost.step_s <= hideable * (1 + 1e-9) + 1e-15
        kinds = {c.kind for colls, _ in _in_line(fast, f) for c in colls}
        assert hideable == 0 or kinds & {"all_gather", "reduce_scatter"}
        gained += p.cost.step_s - f.cost.step_s
    assert gained > 0  # some plan gathered or reduce-scattered over tp in line


def test_collectives_that_cross_nodes_are_not_hidden():
    plain, fast = _pair((2, 16))  # tp spans two nodes of 8
    assert not fast.mesh.in_node("tp")
    rng = np.random.default_rng(2)
    for _ in range(3):
        a = plain.expand([int(rng.integers(len(c))) for c in plain.problem.costs])
        assert score_assignment(fast, a).cost.step_s == pytest.approx(
            score_assignment(plain, a).cost.step_s, rel=1e-12)
