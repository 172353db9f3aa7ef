import resource
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.capture.joint import capture
from autopar.ir.errors import CaptureError
from autopar.models import get_preset


def _tiny_gpt():
    preset = get_preset("gpt2-tiny")
    return preset, preset.build("meta"), preset.example_inputs(2, 16)


def test_joint_graph_identifies_params_grads_inputs_and_loss():
    preset, model, inputs = _tiny_gpt()
    pg = capture(model, inputs)
    names = [n for n, _ in model.named_parameters()]
    assert pg.param_names == names
    assert sorted(pg.grad_of.values()) == sorted(names)  # every parameter has its gradient
    roles = {}
    for n in pg.graph.nodes:
        roles.setdefault(pg.facts(n).role, []).append(n)
    assert len(roles["param"]) == len(names)
    assert len(roles["input"]) == 2
    assert len(roles["loss"]) == 1 and pg.facts(roles["loss"][0]).out.shape == ()
    for g, pname in pg.grad_of.items():
        gnode = next(n for n in pg.graph.nodes if n.name == g)
        assert pg.facts(gnode).out.shape == tuple(dict(model.named_parameters())[pname].shape)
    assert pg.num_layers == preset.config.n_layer
    phases = [pg.facts(n).phase for n in pg.graph.nodes if n.op == "call_function"]
    first_bwd = phases.index("bwd")
    assert "bwd" not in phases[:first_bwd] and "fwd" not in phases[first_bwd:]
    assert sum(pg.facts(n).flops for n in pg.graph.nodes) > 0


def test_backward_nodes_carry_their_layer():
    _, model, inputs = _tiny_gpt()
    pg = capture(model, inputs)
    bwd_layers = {pg.facts(n).layer for n in pg.graph.nodes
                  if n.op == "call_function" and pg.facts(n).phase == "bwd"}
    assert {0, 1} <= bwd_layers


def test_llama3_70b_is_planned_without_allocating_weights():
    preset = get_preset("llama3-70b")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    model = preset.build("meta")
    pg = capture(model, preset.example_inputs(8, 2048))
    took = time.perf_counter() - t0
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    assert grown_gib < 4, f"capture grew RSS by {grown_gib:.1f} GiB: weights were allocated"
    assert pg.num_layers == 80
    assert took < 120


@dataclass
class Out:
    loss: torch.Tensor
    logits: torch.Tensor


class HFStyle(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        logits = self.head(h)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return Out(loss, logits)


def test_keyword_inputs_and_loss_field():
    ids = torch.randint(0, 32, (2, 5))
    pg = capture(HFStyle(), (), {"input_ids": ids, "attention_mask": torch.ones(2, 5),
                                "labels": ids})
    assert pg.input_names == ["kw:input_ids", "kw:attention_mask", "kw:labels"]
    assert len(pg.grad_of) == 3


def test_loss_fn_takes_the_last_input_as_target():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    pg = capture(model, (x, y), loss_fn=F.mse_loss)
    assert len(pg.grad_of) == 4


def test_non_scalar_output_is_a_clear_error():
    model = nn.Linear(4, 2)
    with pytest.raises(CaptureError, match="scalar loss"):
        capture(model, (torch.randn(3, 4),))


def test_loss_fn_without_a_target_among_the_inputs_says_where_the_target_goes():
    model = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(CaptureError, match=r"last of the 1 example inputs is the target.*"
                       r"example_inputs=\(inputs\.\.\., target\)"):
        capture(model, (torch.randn(3, 4),), loss_fn=lambda out, target: out.sum())


class _DataDependent(nn.Module):
    """A block whose output shape depends on the values: it cannot be traced."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x[x > 0].sum() * self.w.sum() + x * self.w


def test_data_dependent_shapes_are_a_clear_error():
    with pytest.raises(CaptureError, match="data-dependent"):
        capture(_DataDependent(), (torch.randn(4),))


def test_a_trace_that_fails_inside_a_repeated_block_leaks_no_layer_tag():
    import gc

    import torch.fx.traceback as fxt

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([_DataDependent(), _DataDependent()])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.sum()

    before = dict(fxt.current_meta)
    with pytest.raises(CaptureError):
        capture(Model(), (torch.randn(4),))
    gc.collect()  # a tag left open would be closed here and restore a stale annotation
    assert dict(fxt.current_meta) == before
