"""Repeated blocks found however a model keeps them: an ``nn.ModuleList`` of ``nn.ModuleDict``s
whose parts the forward calls, or numbered attributes (``self.block0``, ``self.block1``). Each
block's ops carry its index, forward and backward, and the blocks match op for op; the model
trains on dp x tp (simulated) as on one device."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness.hand_written import DictDecoder, lm_loss
from harness.spmd import assert_same_training, fake_world, mesh_for, train_parallel, train_single

import autopar
from autopar.capture.joint import capture, numbered_blocks
from autopar.ir.errors import PlanError
from autopar.planning.pipeline import plan_pipeline


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)  # two numbered parts inside a block: not blocks themselves
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln2(self.ln1(x)))))


class AttributeBlocks(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.block0, self.block1, self.block2 = Block(d), Block(d), Block(d)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        return self.out(self.block2(self.block1(self.block0(self.inp(x)))))


class WithLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return lm_loss(self.model(x), y) if x.dtype == torch.long else \
            F.mse_loss(self.model(x), y)


def _per_layer_ops(pg) -> dict[tuple, list[str]]:
    ops: dict[tuple, list[str]] = {}
    for n in pg.graph.nodes:
        f = n.meta["autopar"]
        if n.op == "call_function" and f.layer is not None:
            ops.setdefault((f.phase, f.layer), []).append(f.op)
    return ops


def test_numbered_attributes_are_blocks() -> None:
    model = AttributeBlocks()
    assert numbered_blocks(model) == [model.block0, model.block1, model.block2]
    assert numbered_blocks(model.block0) == []  # ln1, ln2: leaves, not blocks
    pg = capture(WithLoss(model), (torch.randn(4, 8), torch.randn(4, 4)))
    ops = _per_layer_ops(pg)
    assert pg.num_layers == 3
    for phase in ("fwd", "bwd"):
        assert all(ops[(phase, i)] == ops[(phase, 0)] for i in range(3)), phase


def _inputs(kind: str):
    torch.manual_seed(0)
    if kind == "dict":
        model = DictDecoder(n_layers=3)
        x = torch.randint(0, 64, (8, 8))
        return WithLoss(model), (x, torch.randint(0, 64, (8, 8)))
    return WithLoss(AttributeBlocks()), (torch.randn(8, 8), torch.randn(8, 4))


@pytest.mark.parametrize("kind", ["dict", "attributes"])
def test_dp_by_tp_equals_one_device(kind: str) -> None:
    model, inputs = _inputs(kind)
    want = train_single(copy.deepcopy(model), inputs, 2)
    with fake_world(4):
        pm = autopar.parallelize(model, mesh_for((2, 2)), inputs, time_limit_s=2.0)
        assert pm.graph.num_layers == 3
        got = train_parallel(pm, inputs, 2)
    assert_same_training(got, want, 1e-5, kind)


def test_numbered_attributes_are_not_cut_into_stages_yet() -> None:
    model, inputs = _inputs("attributes")
    with pytest.raises(PlanError, match=r"keep its blocks in one nn.ModuleList \(numbered "
                       r"attributes, self.block0, self.block1, are not cut yet\)"):
        plan_pipeline(model, autopar.Mesh((2,), ("pp",), "cpu"), inputs)
