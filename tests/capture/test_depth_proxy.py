import numpy as np
import pytest

from autopar.capture.joint import capture
from autopar.ir.depth import DepthProxy
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.models import get_preset
from autopar.passes.problem import sharding_problem
from autopar.passes.problem.scoring import score_assignment
from autopar.planning.planner import make_plan


def test_untraced_layers_map_to_the_layer_they_stand_for():
    p = DepthProxy("layers", total=10, kept=4)
    assert p.traced_name("layers.0.w") == "layers.0.w"
    assert p.traced_name("layers.2.w") == "layers.2.w"
    assert p.traced_name("layers.9.w") == "layers.3.w"  # the real last layer
    assert p.traced_name("layers.3.w") in ("layers.1.w", "layers.2.w")  # a real middle one
    assert p.traced_name("layers.8.w") in ("layers.1.w", "layers.2.w")
    assert p.traced_name("norm.weight") == "norm.weight"
    assert p.layer_weight(0) == p.layer_weight(3) == 1 and p.layer_weight(1) == 4.0


@pytest.mark.parametrize("name,depth_field", [("llama3-tiny", "n_layers"), ("gpt2-tiny", "n_layer")])
def test_a_proxy_poses_the_same_problem_as_the_full_trace(name, depth_field):
    preset = get_preset(name).replace(**{depth_field: 10})
    model = preset.build("meta")
    inputs = preset.example_inputs(4, 32)
    mesh = Mesh((2, 2), ("dp", "tp"))
    full_pg = capture(model, inputs)
    proxy_pg = capture(model, inputs, max_layers=4)
    assert proxy_pg.proxy is not None and full_pg.proxy is None
    assert len(proxy_pg.nodes()) < 0.6 * len(full_pg.nodes())
    assert len(list(model.parameters())) == len(proxy_pg.all_param_names)  # model restored
    full, proxy = sharding_problem.build(full_pg, mesh), sharding_problem.build(proxy_pg, mesh)
    fp, pp = full.problem, proxy.problem
    assert fp.num_nodes == pp.num_nodes and fp.edges == pp.edges
    for a, b in zip(fp.costs + fp.edge_costs, pp.costs + pp.edge_costs):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-15)
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = [int(rng.integers(len(c))) for c in fp.costs]
        sf = score_assignment(full, full.expand(x))
        sp_ = score_assignment(proxy, proxy.expand(x))
        assert sp_.cost.step_s == pytest.approx(sf.cost.step_s, rel=1e-9)
        # a middle layer's short-lived temporaries are weighted like its saved activations, so
        # the proxy's peak errs high (safe for a budget), by little
        assert sf.cost.mem_bytes <= sp_.cost.mem_bytes <= 1.10 * sf.cost.mem_bytes
        assert [c.count for c in sp_.collectives] == [c.count for c in sf.collectives]


def test_proxy_plan_lists_every_parameter():
    preset = get_preset("llama3-tiny").replace(n_layers=10)
    model = preset.build("meta")
    planned = make_plan(model, Mesh((2,), ("dp",)), preset.example_inputs(4, 32),
                        options=Options.of(time_limit_s=5, max_layers=4))
    assert set(planned.plan.decided.params) == {n for n, _ in model.named_parameters()}
