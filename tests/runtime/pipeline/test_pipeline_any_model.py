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
import torch.nn.functional as F
from harness.spmd import EPS, LR, fake_world, rel_err

import autopar
from autopar.capture.joint import capture
from autopar.planning.pipeline import plan_pipeline

BATCH, SEQ, VOCAB, STEPS = 8, 8, 64, 3


class DictDecoder(nn.Module):
    """A decoder written by hand: each block a ModuleDict of its parts."""

    def __init__(self, n_layers: int = 4, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d),
            "ln2": nn.LayerNorm(d), "up": nn.Linear(d, 4 * d), "down": nn.Linear(4 * d, d),
        }) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, s, d = x.shape
        for blk in self.layers:
            qkv = blk["qkv"](blk["ln1"](x)).view(b, s, 3, self.heads, d // self.heads)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](a.transpose(1, 2).reshape(b, s, d))
            x = x + blk["down"](F.gelu(blk["up"](blk["ln2"](x))))
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


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

    reports = launch(_worker, 4, (), timeout_s=300)
    names = set()
    for rep in reports:
        assert rep["frontend"] == "trace"
        for g, w in zip(rep["got"], rep["want"]):
            assert abs(g - w) <= 1e-5 * abs(w), (rep["got"], rep["want"])
        assert max(rep["errors"].values()) < 1e-5, rep["errors"]
        names |= set(rep["errors"])
    model, _ = _model_and_inputs()
    assert names == {n for n, _ in model.named_parameters()}  # every parameter on a stage
