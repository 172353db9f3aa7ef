"""A stage program's backward split in two, as the zero-bubble schedules run it: the steps its
input's gradient needs (the I action), then the weights' gradients (the W action), equal to
the whole backward to the bit.

One process (a gloo world of one): both stages of a 2-stage GPT-2 and Llama-3 are planned
(:func:`autopar.planning.stage_plans.plan_stages`) in bf16 with recomputation and in fp32,
and each runs as two :class:`StageProgram` s on the same weights, one whole and one split;
their input gradients and parameter gradients must be equal, and the split must really split
(matmuls in both halves on the last stage, everything in the W half on the first, whose
input is token ids). The end to end run of a zero-bubble schedule (ZBV) over stage programs
on 8 processes, equal to one device, is in ``test_pipeline_tp.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from harness.spmd import four_block_model, one_process

from autopar.capture.stage import StageInputs, trace_stage
from autopar.ir.mesh import Mesh
from autopar.ir.precision import Precision
from autopar.passes.memory.recompute import apply_recompute
from autopar.planning.stage_plans import plan_stages
from autopar.runtime.pipeline import stages as ps
from autopar.runtime.pipeline.stage_program import StageProgram

BATCH, SEQ = 4, 8
_MM = ("aten.mm", "aten.addmm", "aten.bmm")


def _programs(preset: str, precision: Precision, recompute: str, dmesh) -> list:
    """Per stage: (whole program, split program, its example input, the targets)."""
    model, (tokens, targets) = four_block_model(preset, BATCH, SEQ)
    path = ps.find_blocks(model)[0]
    ranges = ((0, 2), (2, 4))
    mesh = Mesh.from_device_mesh(dmesh)
    loss_fn = ps.loss_fn_for(model)
    first = StageInputs((tuple(tokens.shape),), ("int64",))
    plans, inputs = plan_stages(ps.module_stages(model, path, ranges, [0, 1]), path, first,
                                StageInputs((tuple(targets.shape),), ("int64",)), loss_fn,
                                mesh, {}, None, 1.0, precision=precision, recompute=recompute)
    out = []
    for s in (0, 1):
        progs = []
        for split in (False, True):
            fresh, _ = four_block_model(preset, BATCH, SEQ)  # the same weights, its own copy
            mod = ps.module_stages(fresh, path, ranges, [s])[s]
            graph = trace_stage(mod, inputs[s], s == 1, loss_fn, path, precision)
            graph = apply_recompute(graph, plans[s].decided.recompute.nodes)
            prog = StageProgram(mod, dmesh, graph, plans[s])
            prog.split_weights = split
            progs.append(prog)
        torch.manual_seed(2)
        x = (tokens if s == 0 else
             torch.randn(inputs[1].shapes[0]).to(getattr(torch, inputs[1].dtypes[0])))
        out.append((*progs, x, targets))
    return out


def _run(prog: StageProgram, x: torch.Tensor, targets: torch.Tensor, last: bool
         ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """One micro-batch's forward and backward (the last stage's loss, the first's output
    against a fixed gradient); the W action's runner run as torch's stage runs it, right after
    (the schedule may run it later; what it computes does not change). The input's
    gradient, and the parameters' as whole tensors."""
    x = x.clone().requires_grad_(x.is_floating_point())
    out = prog(x, targets=targets) if last else prog(x)
    torch.manual_seed(3)
    out.backward(None if last else torch.randn_like(out))
    if prog.split_weights:
        assert all(p.grad is None for p in prog.parameters())  # the W action makes them
    prog.weight_runner()()
    return x.grad, {n: p.grad.full_tensor() for n, p in prog.named_parameters()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _mms(steps) -> int:
    return sum(str(s.node.target).startswith(_MM) for s in steps)


@pytest.mark.parametrize("preset,precision,recompute", [
    ("gpt2-tiny", "bf16", "selective"), ("llama3-tiny", "bf16", "full"),
    ("llama3-tiny", "fp32", "none")])
def test_split_backward_equals_the_whole(preset: str, precision: str, recompute: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with one_process():
        dmesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        for s, (whole, split, x, targets) in enumerate(
                _programs(preset, Precision(precision), recompute, dmesh)):
            halves = split._active[1].bwd_split
            assert halves is not None, (preset, s)
            if s == 0:  # token ids in: no input gradient, the whole backward in the W half
                assert not halves.input and _mms(halves.weight) > 0
            else:  # dx's matmuls in I, the weights' in W
                assert _mms(halves.input) > 0 and _mms(halves.weight) > 0
            dx, grads = _run(whole, x, targets, s == 1)
            dx_split, grads_split = _run(split, x, targets, s == 1)
            assert split.weight_actions == 1 and whole.weight_actions == 0
            if s == 1:
                assert dx is not None and torch.equal(dx, dx_split), (preset, s)
            assert grads.keys() == grads_split.keys()
            for n, g in grads.items():
                assert torch.equal(g, grads_split[n]), (preset, s, n)
                assert g.dtype == torch.float32 and math.isfinite(float(g.norm()))


def test_stage_programs_recompute_each_in_its_own_mode() -> None:
    """Stage plans made one mode per stage (a pipeline plan's choice: the first stage, holding
    more microbatches in flight, recomputes; the last does not), run chained as stage
    programs: the loss and every gradient equal the single device's eager step."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from autopar.ir.errors import PlanError
    from autopar.runtime.pipeline.stage_program import build_programs

    with one_process():
        dmesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        model, (tokens, targets) = four_block_model("llama3-tiny", BATCH, SEQ)
        ref = copy.deepcopy(model)
        path = ps.find_blocks(model)[0]
        ranges = ((0, 2), (2, 4))
        loss_fn = ps.loss_fn_for(model)
        plans, inputs = plan_stages(ps.module_stages(model, path, ranges, [0, 1]), path,
                                    StageInputs((tuple(tokens.shape),), ("int64",)),
                                    StageInputs((tuple(targets.shape),), ("int64",)), loss_fn,
                                    Mesh.from_device_mesh(dmesh), {}, None, 1.0,
                                    recompute=("full", "none"))
        assert [p.decided.recompute.mode for p in plans] == ["full", "none"]
        assert plans[0].decided.recompute.nodes and not plans[1].decided.recompute.nodes
        with pytest.raises(PlanError, match="2 recompute modes for a pipeline of 3 stages"):
            plan_stages(ps.module_stages(model, path, ((0, 1), (1, 2), (2, 4)), [0, 1, 2]),
                        path, StageInputs((tuple(tokens.shape),), ("int64",)),
                        StageInputs((tuple(targets.shape),), ("int64",)), loss_fn,
                        Mesh.from_device_mesh(dmesh), {}, None, 1.0, recompute=("full", "none"))
        progs, mods = [], []
        for s in (0, 1):
            mods.append(mod := ps.module_stages(model, path, ranges, [s])[s])
            graph = trace_stage(mod, inputs[s], s == 1, loss_fn, path, None)
            graph = apply_recompute(graph, plans[s].decided.recompute.nodes)
            progs.append(StageProgram(mod, dmesh, graph, plans[s]))
        # the runtime refuses a plan made in another mode than the stage runs
        from autopar.runtime.pipeline.stage_program import PlannedStages

        with pytest.raises(PlanError, match="stage 1's plan computes in fp32 with recompute "
                                            "'none', but the pipeline runs fp32 with recompute "
                                            "'full'"):
            build_programs(model, path, ranges, [], dmesh, None, loss_fn,
                           torch.device("cpu"), PlannedStages(tuple(plans), tuple(inputs)),
                           None, "full")
        loss = progs[1](progs[0](tokens), targets=targets)
        loss.backward()
        want = ref(tokens, targets)
        want.backward()
        assert torch.equal(loss.detach(), want.detach())
        grads = {n: p.grad for n, p in ref.named_parameters()}
        # the stage modules keep the model's names
        got = {n: _whole(p.grad) for mod in mods for n, p in mod.named_parameters()}
        assert got.keys() == grads.keys()
        for n, g in got.items():
            assert torch.allclose(g, grads[n], rtol=1e-5, atol=1e-7), n
