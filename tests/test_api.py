"""``autopar.parallelize``: its API and its answers to bad input, on the simulated mesh."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from harness.spmd import assert_same_training, fake_world, mesh_for, train_parallel, train_single

import autopar
from autopar.capture.joint import capture
from autopar.ir.errors import MeshError, PlanError
from autopar.ir.options import Options
from autopar.models import get_preset
from autopar.planning.planner import make_plan


def _mlp(seed: int = 0, **changes):
    preset = get_preset("mlp-tiny")
    if changes:
        preset = preset.replace(**changes)
    torch.manual_seed(seed)
    return preset.build(device="cpu"), preset.example_inputs(8, 0, device="cpu")


def test_mesh_of_another_size_than_the_world() -> None:
    model, inputs = _mlp()
    with fake_world(4), pytest.raises(MeshError, match=r"2 devices.*4 ranks.*torchrun"):
        autopar.parallelize(model, mesh_for((2,)), inputs)


def test_a_mesh_priced_for_gpus_on_cpu_processes_warns() -> None:
    model, inputs = _mlp()
    with fake_world(2), pytest.warns(UserWarning, match=r"plans for device 'h100' but the "
                                     r"processes run on cpu.*device='cpu'"):
        autopar.parallelize(model, autopar.Mesh((2,), ("dp",)), inputs, time_limit_s=1.0)


def test_mesh_without_a_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    model, inputs = _mlp()
    with pytest.raises(MeshError, match="no process group.*torchrun --nproc-per-node 4"):
        autopar.parallelize(model, mesh_for((2, 2)), inputs)


def test_planning_shows_its_progress_on_rank_0s_terminal(monkeypatch) -> None:
    import io

    import autopar.api as api
    from autopar.report.plan_progress import PlanProgress

    shown = io.StringIO()
    asked: list[float] = []

    def on_a_terminal(limit_s: float) -> PlanProgress:  # stands for stderr being a terminal
        asked.append(limit_s)
        return PlanProgress(limit_s, shown, tty=False, delay_s=0.0)

    monkeypatch.setattr(api, "plan_progress", on_a_terminal)
    model, inputs = _mlp()
    with fake_world(2):
        autopar.parallelize(copy.deepcopy(model), mesh_for((2,)), inputs, time_limit_s=7.0)
        lines = shown.getvalue().splitlines()
        assert asked == [7.0]
        assert any(ln.startswith("planning: ") and "limit 7 s" in ln for ln in lines), lines
        assert any("best step" in ln for ln in lines), lines
    plan = make_plan(model, mesh_for((2,)), inputs, options=Options.of(time_limit_s=1.0)).plan
    fresh = _mlp()[0]
    with fake_world(2):
        autopar.parallelize(fresh, mesh_for((2,)), inputs, plan=plan)
    assert asked == [7.0]  # a given plan: no planning, nothing shown


def test_one_device_needs_no_launcher() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    model, inputs = _mlp()
    want = train_single(copy.deepcopy(model), inputs, 2)
    try:
        pm = autopar.parallelize(model, autopar.Mesh((1,), ("dp",), "cpu"), inputs,
                                 time_limit_s=1.0)
        assert_same_training(train_parallel(pm, inputs, 2), want)
    finally:
        dist.destroy_process_group()


def test_plan_for_another_model_or_mesh(tmp_path) -> None:
    model, inputs = _mlp()
    other, other_inputs = _mlp(hidden=(24, 24, 24))
    foreign = make_plan(other, mesh_for((2,)), other_inputs, options=Options.of(time_limit_s=1.0)).plan
    own = make_plan(model, mesh_for((2,)), inputs, options=Options.of(time_limit_s=1.0)).plan
    path = tmp_path / "plan.json"
    own.save(path)
    with fake_world(2):
        with pytest.raises(PlanError, match="make a new plan"):
            autopar.parallelize(copy.deepcopy(model), mesh_for((2,)), inputs, plan=foreign)
    with fake_world(4):
        with pytest.raises(PlanError, match="made for mesh"):
            autopar.parallelize(copy.deepcopy(model), mesh_for((4,)), inputs, plan=own)
    with fake_world(2):  # a plan JSON path is used as given
        pm = autopar.parallelize(model, mesh_for((2,)), inputs, plan=str(path))
        assert pm.plan.decided.params == own.decided.params


def test_inputs_of_another_shape_replan_keeping_param_layouts() -> None:
    model, inputs = _mlp()
    small = (inputs[0][:4], inputs[1][:4])
    want = train_single(copy.deepcopy(model), small, 2)
    with fake_world(2):
        pm = autopar.parallelize(model, mesh_for((2,)), inputs, time_limit_s=1.0)
        layouts = {n: p.placements for n, p in pm.named_parameters()}
        got = train_parallel(pm, small, 2)
        assert [n.meta["autopar"].out.shape for n in pm.graph.graph.nodes
                if n.op == "placeholder" and n.meta["autopar"].role == "input"][0] == (4, 16)
        assert {n: p.placements for n, p in pm.named_parameters()} == layouts
    assert_same_training(got, want)


def test_inputs_of_another_shape_with_a_given_plan() -> None:
    model, inputs = _mlp()
    plan = make_plan(model, mesh_for((2,)), inputs, options=Options.of(time_limit_s=1.0)).plan
    with fake_world(2):
        pm = autopar.parallelize(model, mesh_for((2,)), inputs, plan=plan)
        with pytest.raises(PlanError, match=r"float32\[4, 16\].*plan=None"):
            pm(inputs[0][:4], inputs[1][:4])


class _WithDiag(nn.Module):
    """``aten.diag`` has no sharding rule: it must still run (replicated) and be named."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.lin(x) @ torch.diag(self.scale), y)


def test_op_without_rule_runs_replicated_with_one_warning() -> None:
    torch.manual_seed(0)
    model = _WithDiag()
    inputs = (torch.randn(8, 4), torch.randn(8, 4))
    want = train_single(copy.deepcopy(model), inputs, 2)
    with fake_world(2):
        with pytest.warns(UserWarning, match="no sharding rule for .*aten.diag") as rec:
            pm = autopar.parallelize(model, mesh_for((2,)), inputs, time_limit_s=1.0)
        assert sum("no sharding rule" in str(w.message) for w in rec) == 1
        got = train_parallel(pm, inputs, 2)
    assert_same_training(got, want)


def test_grad_accumulation_and_no_grad() -> None:
    model, inputs = _mlp()
    ref = copy.deepcopy(model)
    (ref(*inputs) + ref(*inputs)).backward()
    with fake_world(2):
        pm = autopar.parallelize(model, mesh_for((2,)), inputs, time_limit_s=1.0)
        with torch.no_grad():
            pm(*inputs)
        pm(*inputs).backward()
        pm(*inputs).backward()  # adds to .grad, like autograd on one device
        from autopar.runtime._compat import reconcile

        grads = {n: reconcile(p.grad.full_tensor()) for n, p in pm.named_parameters()}
        placements = {n: p.grad.placements == p.placements for n, p in pm.named_parameters()}
    assert all(placements.values())
    for n, p in ref.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-7), n


def test_gradients_reach_autograd_grad_hooks_and_chosen_inputs() -> None:
    """The backward stores fresh gradients in ``.grad`` itself (cheaper than autograd's DTensor
    accumulation) only where autograd would do just that: ``torch.autograd.grad`` still gets
    them and leaves ``.grad`` alone, hooks on a parameter still see them, and
    ``backward(inputs=...)`` still fills only the parameters named."""
    from autopar.runtime import parallel_module
    from autopar.runtime._compat import reconcile

    model, inputs = _mlp()
    ref = copy.deepcopy(model)
    ref(*inputs).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    def whole(t: torch.Tensor) -> torch.Tensor:
        return reconcile(t.full_tensor())

    with fake_world(2):
        pm = autopar.parallelize(model, mesh_for((2,)), inputs, time_limit_s=1.0)
        names = [n for n, _ in pm.named_parameters()]
        params = list(pm.parameters())
        got = torch.autograd.grad(pm(*inputs), params)
        assert all(p.grad is None for p in params)
        for n, g in zip(names, got):
            assert torch.allclose(whole(g), want[n], rtol=1e-5, atol=1e-7), n
        seen: dict[str, torch.Tensor] = {}

        def hook(g: torch.Tensor) -> None:
            seen["hook"] = whole(g)

        def post_hook(p: torch.Tensor) -> None:
            seen["post"] = whole(p.grad)

        params[0].register_hook(hook)
        params[1].register_post_accumulate_grad_hook(post_hook)
        pm(*inputs).backward(inputs=params[:2])
        assert torch.allclose(seen["hook"], want[names[0]], rtol=1e-5, atol=1e-7)
        assert torch.allclose(seen["post"], want[names[1]], rtol=1e-5, atol=1e-7)
        assert all(p.grad is not None for p in params[:2])
        assert all(p.grad is None for p in params[2:])
        pm.zero_grad(set_to_none=True)
        handed: list = []
        store = parallel_module.store_fresh_grads

        def spy(*args):
            handed.append(store(*args))
            return handed[-1]

        with pytest.MonkeyPatch.context() as m:
            m.setattr(parallel_module, "store_fresh_grads", spy)
            pm(*inputs).backward()
        (returned,) = handed  # the two hooked parameters' gradients go through autograd
        assert [g is None for g in returned] == [False, False] + [True] * (len(params) - 2)
        for n, p in zip(names, params):
            assert torch.allclose(whole(p.grad), want[n], rtol=1e-5, atol=1e-7), n


def test_graph_and_plan_agree_on_every_node() -> None:
    model, inputs = _mlp()
    graph = capture(model, inputs)
    plan = make_plan(model, mesh_for((2,)), inputs, graph=graph,
                     options=Options.of(time_limit_s=1.0)).plan
    from autopar.runtime.lower import LoweredGraph

    lowered = LoweredGraph(graph, plan)
    assert lowered.seed is not None  # the ones_like(loss) that backward scales
    assert lowered.loss in lowered.saved


def test_plan_with_an_uneven_shard_is_refused() -> None:
    import dataclasses

    from autopar.ir.placements import Shard

    model, inputs = _mlp()
    inputs = (inputs[0][:6], inputs[1][:6])  # a batch of 6 does not split over 4
    graph = capture(model, inputs)
    plan = make_plan(model, mesh_for((4,)), inputs, graph=graph,
                     options=Options.of(time_limit_s=1.0)).plan
    x = next(n.name for n in graph.graph.nodes if n.op == "placeholder"
             and n.meta["autopar"].role == "input")
    nodes = dict(plan.decided.nodes)
    nodes[x] = dataclasses.replace(nodes[x], outs=((Shard(0),),))
    bad = dataclasses.replace(plan, decided=dataclasses.replace(plan.decided, nodes=nodes))
    with fake_world(4), pytest.raises(PlanError, match=r"\[6, 16\].*does not divide evenly"):
        autopar.parallelize(model, mesh_for((4,)), inputs, plan=bad)


def test_torch_device_mesh_and_loss_fn() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    ref = copy.deepcopy(model)
    F.mse_loss(ref(x), y).backward()
    with fake_world(4):
        dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        pm = autopar.parallelize(model, dm, (x, y), loss_fn=F.mse_loss, time_limit_s=1.0)
        assert pm.plan.decided.mesh_axes == ("dp", "tp")
        pm(x, y).backward()
        from autopar.runtime._compat import reconcile

        grads = {n: reconcile(p.grad.full_tensor()) for n, p in pm.named_parameters()}
    for n, p in ref.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-7), n


def test_bucketed_gradient_syncs_run_as_the_plan_lists_them() -> None:
    """A plan that prices gradient all-reduces in DDP buckets gets them issued that way."""
    import dataclasses

    from harness.spmd import check_collectives, reference_plan

    from autopar.ir.plan import CollectiveUse
    from autopar.runtime.lower import LoweredGraph, predicted

    model, inputs = _mlp()
    plan = reference_plan(model, "mlp", "data_parallel", mesh_for((2,)), inputs)
    lowered = LoweredGraph(capture(model, inputs), plan)
    bucketed = predicted(lowered, bucketed=True)
    assert bucketed != predicted(lowered, bucketed=False)
    plan = dataclasses.replace(plan, predicted=dataclasses.replace(plan.predicted, collectives=tuple(
        CollectiveUse(k, a, n, b, 0.0, why) for (k, a, why), (n, b) in bucketed.items())))
    want = train_single(copy.deepcopy(model), inputs, 2)
    with fake_world(2):
        pm = autopar.parallelize(model, mesh_for((2,)), inputs, plan=plan)
        assert pm._active[1].bucketed
        got = train_parallel(pm, inputs, 2)
    assert_same_training(got, want)
    check_collectives(got["collectives"][-1], pm)
    syncs = [r for r in got["collectives"][-1] if r.reason == "gradient sync"]
    assert len(syncs) == 1  # 8 gradients, one bucket


def test_options_come_as_a_value_or_as_keywords_and_an_unknown_one_is_named() -> None:
    model, inputs = _mlp()
    with pytest.raises(TypeError, match=r"unknown option memory_limit: autopar's options are "
                                        r"memory_budget, recompute"):
        autopar.parallelize(model, mesh_for((1,)), inputs, memory_limit=2**30)
    with pytest.raises(PlanError, match=r"unknown recompute mode 'most'"):
        autopar.parallelize(model, mesh_for((1,)), inputs,
                            options=autopar.Options.of(time_limit_s=1.0), recompute="most")
