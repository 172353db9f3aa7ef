"""A stage's boundary under Megatron tensor parallelism with sequence parallelism.

A stage program whose plan leaves its output split over the sequence on ``tp`` (Megatron's
sequence parallelism, Korthikanti et al. 2022) sends it in the boundary's pinned layout:
batch over ``dp``, whole on ``tp`` (``autopar.capture.stage.boundary_spec``), so the move is
the all-gather over ``tp`` of what each rank holds, ``1/tp`` of the dp share; priced on the
producer as the runtime runs it (``passes/problem/stage_boundary.py``). The output in the
boundary's own layout moves nothing. (Megatron sends the ``1/tp`` piece across the pipeline
link and gathers after it: autopar's boundary layout is fixed whole on ``tp``, so its
``pp`` send carries the whole dp share; docs/pipelines.md, Limits.)"""

from __future__ import annotations

import math

import torch
from torch import nn

from autopar.capture.stage import capture_stage, pin_boundary
from autopar.ir.mesh import Mesh
from autopar.ir.placements import Replicate, Shard
from autopar.passes.cost.cost_model import collective_time, members_per_node
from autopar.passes.problem import sharding_problem

B, S, H = 4, 8, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_sequence_parallel_output_is_priced_as_its_gather_to_the_boundary():
    stage = Stage().to("meta")
    pg = capture_stage(stage, (torch.randn(B, S, H, device="meta"),), None, list(stage.blocks))
    mesh = Mesh((2, 4), ("dp", "tp"), "h100")
    sp = sharding_problem.build(pin_boundary(pg, mesh), mesh)
    boundary = (Shard(0), Replicate())  # batch over dp, whole on tp
    assert [dst for _, dst in sp.boundary] == [boundary, boundary]  # output, input's gradient
    for i, _ in sp.boundary:
        price = {s.outs[0]: float(sp.unary[i][k]) for k, s in enumerate(sp.strategies[i])}
        assert price[boundary] == 0.0
        # sequence parallel: each tp rank holds 1/tp of its dp share; the gather moves the rest
        share = B * S * H * 4 / 2  # fp32 bytes of a dp share
        gather = collective_time("all_gather", share, 4, mesh.bandwidth[1], mesh.latency[1],
                                 mesh.device.collective_overhead, members_per_node(mesh, (1,)),
                                 mesh.device.nccl)
        assert math.isclose(price[(Shard(0), Shard(1))], gather, rel_tol=1e-9)
        # the split on tp costs the gather whatever the dim; the batch must also leave tp
        assert price[(Shard(0), Shard(1))] < price[(Shard(1), Shard(1))]
