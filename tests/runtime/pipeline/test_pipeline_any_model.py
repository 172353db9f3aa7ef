"""Pipelines of the models people bring: blocks that are ``nn.ModuleDict``s in an
``nn.ModuleList``, whose parts the forward calls (``blk["attn"](x)``), never the block itself.

Capture tags each block's ops from the calls of its parts and the ops between them (the
attention and residual adds written in the model's forward), so the planner finds the repeated
blocks and picks stages; torch's splitter cuts before each stage's first block's first part;
the user's ``loss_fn`` computes the loss from the last stage's output. One launch of 4 gloo
processes trains it on pp=2 x dp=2, equal to one device.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from harness.hand_written import VOCAB, DictDecoder, lm_loss
from harness.spmd import EPS, LR, fake_world, rel_err, start_method

import autopar
from autopar.capture.joint import capture
from autopar.planning.pipeline import plan_pipeline

BATCH, SEQ, STEPS = 8, 8, 3


def _model_and_inputs() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = DictDecoder()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, (tokens, torch.randint(0, VOCAB, (BATCH, SEQ)))


def test_blocks_called_through_their_parts_are_tagged_alike() -> None:
    model, (x, y) = _model_and_inputs()
    pg = capture(model, (x, y), loss_fn=lm_loss)
    assert pg.num_layers == 4
    ops: dict[tuple, list[str]] = {}
    for n in pg.graph.nodes:
        f = n.meta["autopar"]
        if n.op == "call_function" and f.layer is not None:
            ops.setdefault((f.phase, f.layer), []).append(f.op)
    for phase in ("fwd", "bwd"):
        # every block the same ops, the attention and residual adds between its parts included
        assert all(ops[(phase, i)] == ops[(phase, 0)] for i in range(4)), phase
        assert "aten.add.Tensor" in ops[("fwd", 0)]
    assert any("attention" in op for op in ops[("fwd", 0)])
    blocks = {f.layer for n in pg.graph.nodes if (f := n.meta["autopar"]).role == "grad"
              and f.param_name.startswith("layers.")}
    assert blocks == {0, 1, 2, 3}  # the blocks' gradients, each in its block


def test_the_planner_picks_stages() -> None:
    model, inputs = _model_and_inputs()
    with fake_world(4):
        planned = plan_pipeline(model, autopar.Mesh((2, 2), ("pp", "dp"), "cpu"), inputs,
                                loss_fn=lm_loss)
    stages = planned.plan.decided.pipeline.stages
    assert [(st.first_block, st.end_block) for st in stages][0][0] == 0
    assert stages[-1].end_block == 4 and len(stages) >= 2


def _worker() -> dict:
    model, (x, y) = _model_and_inputs()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    want = []
    for _ in range(STEPS):
        loss = lm_loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    pm = autopar.parallelize(model, autopar.Mesh((2, 2), ("pp", "dp"), "cpu"), (x, y),
                             loss_fn=lm_loss, time_limit_s=2.0)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    got = []
    for _ in range(STEPS):
        loss = pm(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        got.append(loss.item())
    whole = dict(ref.named_parameters())
    errors = {}
    for name, p in pm.named_parameters():
        model_name = name.split(".", 2)[2]  # stages.<s>.<model's name>
        errors[model_name] = rel_err(p.detach(), whole[model_name].detach())
    return {"got": got, "want": want, "errors": errors, "frontend": pm.runner.frontend}


def test_pipelined_on_2_stages_by_2_replicas_equals_one_device() -> None:
    from autopar.runtime.launch import launch

    reports = launch(_worker, 4, (), timeout_s=300,
                     start_method=start_method())
    names = set()
    for rep in reports:
        assert rep["frontend"] == "trace"
        for g, w in zip(rep["got"], rep["want"]):
            assert abs(g - w) <= 1e-5 * abs(w), (rep["got"], rep["want"])
        assert max(rep["errors"].values()) < 1e-5, rep["errors"]
        names |= set(rep["errors"])
    model, _ = _model_and_inputs()
    assert names == {n for n, _ in model.named_parameters()}  # every parameter on a stage
