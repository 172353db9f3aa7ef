"""Data parallelism as an assignment (``passes/problem/data_parallel.py``): it is data
parallelism, and a model whose steps the axis sweeps cannot take (one block applied at every
layer) plans no slower than it (the planner weighs it as a candidate plan)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.capture.joint import capture
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.ir.placements import R, S
from autopar.passes.problem import bucket_fill, sharding_problem
from autopar.passes.problem.data_parallel import data_parallel_assignment
from autopar.planning.planner import make_plan

MESH = Mesh((2, 2), ("dp", "tp"), "cpu")


class SharedBlock(nn.Module):
    """ALBERT's shape: one attention + MLP block applied at every layer."""

    def __init__(self, vocab: int = 128, d: int = 48, heads: int = 3, reps: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.n1, self.n2, self.norm = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab)
        self.heads, self.reps = heads, reps

    def block(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(self.n1(x)).split(d, -1))
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.n2(x))))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for _ in range(self.reps):
            x = self.block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


@pytest.fixture(scope="module")
def shared_block():
    torch.manual_seed(0)
    model = SharedBlock()
    inputs = (torch.randint(0, 128, (8, 32)), torch.randint(0, 128, (8, 32)))
    pg = capture(model, inputs)
    return model, inputs, sharding_problem.build(pg, MESH, None)


def test_the_assignment_is_data_parallelism(shared_block) -> None:
    _, _, sp = shared_block
    start = data_parallel_assignment(sp)
    assert start is not None
    choice = sp.expand(start)
    for i, node in enumerate(sp.nodes):
        meta = node.meta["autopar"]
        spec = sp.strategies[i][choice[i]].outs[0]
        if node.op == "placeholder" and meta.role == "param":
            assert spec == (R, R), f"{meta.param_name}: {spec}"
        if meta.role == "input":
            assert spec == (S(0), S(0)), f"input {meta.input_index}: {spec}"


def test_a_shared_block_plans_no_slower_than_data_parallelism(shared_block) -> None:
    model, inputs, sp = shared_block
    start = data_parallel_assignment(sp)
    assert start is not None
    dp = bucket_fill.score(sp, sp.expand(start)).cost  # data parallelism (the test above)
    planned = make_plan(model, MESH, inputs, options=Options.of(
        memory_budget=math.inf, time_limit_s=5.0, workers=1))
    # without data parallelism among its candidates the planner chose a plan 4x slower
    assert planned.plan.predicted.cost.step_s <= dp.step_s * 1.0001
