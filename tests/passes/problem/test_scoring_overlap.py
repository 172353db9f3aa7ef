"""The step's price with communication beside compute (scoring.step_segments and
passes/cost/overlap.py), against the summed price the solver minimises."""

import numpy as np
import pytest

from autopar.capture.joint import capture
from autopar.ir.mesh import Mesh
from autopar.models import get_preset
from autopar.passes.cost.overlap import overlapped_step, serial_step
from autopar.passes.problem import sharding_problem
from autopar.passes.problem.scoring import overlaps, score_assignment, step_segments


def test_gpu_steps_credit_overlap_and_the_cpu_adds_everything_up():
    preset = get_preset("llama3-tiny")
    pg = capture(preset.build("meta"), preset.example_inputs(8, 64))
    gpu, cpu = (sharding_problem.build(pg, Mesh((4, 2), ("dp", "tp"), d)) for d in ("h100", "cpu"))
    assert overlaps(gpu) and not overlaps(cpu)
    rng = np.random.default_rng(0)
    hidden = 0.0
    for _ in range(4):
        a = [int(rng.integers(len(c))) for c in gpu.problem.costs]
        g = score_assignment(gpu, gpu.expand(a))
        assert g.cost.step_s <= g.cost.compute_s + g.cost.comm_s * (1 + 1e-9)
        # never faster than its compute, nor than its communication alone
        assert g.cost.step_s >= g.cost.compute_s * (1 - 1e-9)
        hidden += g.cost.compute_s + g.cost.comm_s - g.cost.step_s
        segs = step_segments(gpu, gpu.expand(a), g.edge_collectives)
        # the segments hold all the compute and every edge's collectives
        assert serial_step(segs) == pytest.approx(
            g.cost.compute_s + sum(c.time_s for c in g.collectives
                                   if c.reason not in ("loss", "loss scaling")), rel=1e-6)
        assert overlapped_step(segs) == pytest.approx(g.cost.step_s, rel=1e-9)
        c = score_assignment(cpu, cpu.expand(a)).cost
        assert c.step_s == pytest.approx(c.compute_s + c.comm_s, rel=1e-12)
    assert hidden > 0  # some gradient sync or gather ran beside compute
