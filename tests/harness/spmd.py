"""Shared by the runtime tests: train a model on one device and as an SPMD program, compare.

The SPMD side runs every rank in this one process under ``LocalTensorMode`` on a fake process
group (torch's own single-process simulation: each tensor holds one value per rank, collectives
are computed across them) or, in ``test_gloo.py``, as real gloo processes.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import HealthCheck, Phase
from torch.distributed.tensor import DTensor

import autopar
from autopar.capture.joint import capture
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.ir.plan import Plan
from autopar.runtime._compat import reconcile

AXES = {1: ("dp",), 2: ("dp", "tp"), 3: ("dp", "sp", "tp")}
LR = 1e-3
# Adam divides by sqrt(v) + eps: with the default eps a gradient element that is nearly zero
# (a layer-norm bias, the attention key bias: 0 in exact arithmetic) has its rounding noise,
# which differs with the reduction order, blown up to a full-size update, on one device as on
# many, and the comparison would measure that noise (1e-5 relative at eps=1e-6, 1e-6 at 1e-4).
EPS = 1e-4
RNG_SEED = 1234  # the generator's state at the start of both trainings (run_case)

# the property tests' draws: AUTOPAR_EXAMPLES cases (more than the default run's, to search
# wider); every plan source, the reference layouts completed by the solver
EXAMPLES = int(os.environ.get("AUTOPAR_EXAMPLES", "8"))
PLANS = ["solver", "data_parallel", "fsdp", "megatron_tp", "dp_tp_2d"]
# no shrinking: one example costs seconds; the failure message names the case
SETTINGS = dict(deadline=None, derandomize=True,
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextlib.contextmanager
def fake_group(size: int) -> Iterator[None]:
    """A fake process group of ``size`` ranks (this process is rank 0; nothing is sent)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_world(size: int) -> Iterator[Any]:
    """A fake process group of ``size`` ranks and LocalTensorMode over them."""
    from torch.distributed._local_tensor import LocalTensorMode

    with fake_group(size), LocalTensorMode(size) as mode:
        yield mode


def mesh_for(shape: tuple[int, ...]) -> Mesh:
    return Mesh(shape, AXES[len(shape)], "cpu")


def _loss_of(out: Any) -> torch.Tensor:
    """The loss a model returned: itself, or a Hugging Face output's ``.loss``."""
    return out if isinstance(out, torch.Tensor) else out.loss


# called between the backward and the optimizer step with the parameters and the step number
# (``torch.nn.utils.clip_grad_norm_`` with the step's options); what it returns is recorded
Clip = Callable[[Iterator[nn.Parameter], int], torch.Tensor]


def _forward_backward(model: nn.Module, inputs: tuple, kwargs: dict | None,
                      micro: list[tuple] | None) -> torch.Tensor:
    """One step's forward and backward; the loss. With ``micro`` (micro-batches, each a
    positional inputs tuple) the gradients accumulate over them, each loss divided by their
    number as gradient accumulation does, and the loss is the sum of those."""
    if micro is None:
        loss = _loss_of(model(*inputs, **(kwargs or {})))
        loss.backward()
        return loss.detach()
    total = None
    for batch in micro:
        loss = _loss_of(model(*batch, **(kwargs or {}))) / len(micro)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None
    return total


def train_single(model: nn.Module, inputs: tuple, steps: int,
                 adamw: dict | None = None, kwargs: dict | None = None,
                 micro: list[tuple] | None = None, clip: Clip | None = None) -> dict[str, Any]:
    """``steps`` AdamW steps (``adamw``: more of its options, ``{"fused": True}``) of
    ``model(*inputs, **kwargs)``, or accumulated over ``micro`` (see :func:`_forward_backward`);
    ``clip`` runs before each step (its results: ``"norms"``). ``grads``: the last step's, as
    the optimizer got them."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, **(adamw or {}))
    losses, grads, norms = [], {}, []
    for step in range(steps):
        loss = _forward_backward(model, inputs, kwargs, micro)
        if clip is not None:
            norms.append(clip(model.parameters(), step))
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return {"losses": losses, "grads": grads, "params": params, "buffers": buffers,
            "norms": norms}


def train_parallel(pm: nn.Module, inputs: tuple, steps: int,
                   adamw: dict | None = None, kwargs: dict | None = None,
                   micro: list[tuple] | None = None, clip: Clip | None = None) -> dict[str, Any]:
    """As :func:`train_single`, inside the fake world; results gathered to whole tensors
    (``norms``: what ``clip`` returned, as the user gets it)."""
    # the parallel model's: the optimizer state its plan offloads is kept on the host
    opt = pm.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS, **(adamw or {}))
    losses, grads, per_step, norms = [], {}, [], []
    for step in range(steps):
        pm.collectives.reset()
        loss = _forward_backward(pm, inputs, kwargs, micro)
        per_step.append(list(pm.collectives.records))
        if clip is not None:
            norms.append(clip(pm.parameters(), step))
        grads = {n: _whole(p.grad) for n, p in pm.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(reconcile(loss))
    params = {n: _whole(p) for n, p in pm.named_parameters()}
    buffers = {n: _whole(b) if isinstance(b, DTensor) else reconcile(b.detach()).clone()
               for n, b in pm.named_buffers()}
    return {"losses": losses, "grads": grads, "params": params, "buffers": buffers,
            "collectives": per_step, "norms": norms}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return reconcile(t.detach().full_tensor()).clone()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error (elementwise would divide rounding noise by zeros)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(b.norm().item(), 1e-12))


def assert_same_training(got: dict, want: dict, tol: float = 1e-5, what: str = "",
                         param_tol: float | None = None) -> None:
    """Losses, gradients, parameters and buffers of two trainings equal within ``tol``
    (norm-wise relative error; ``param_tol``, where given, for the parameters after the
    optimizer's steps: AdamW divides each gradient element by its own magnitude, so a
    parameter that is all updates, a zero-initialised bias, carries the rounding of its
    gradient's smallest, cancelling sums into its value)."""
    assert len(got["losses"]) == len(want["losses"])
    for i, (g, w) in enumerate(zip(got["losses"], want["losses"])):
        assert math.isclose(g.item(), w.item(), rel_tol=tol, abs_tol=1e-7), (
            f"{what} step {i}: loss {g.item()} vs single device {w.item()}")
    for key in ("grads", "params", "buffers"):
        assert got[key].keys() == want[key].keys(), f"{what} {key}: different names"
        for name in want[key]:
            g, w = got[key][name], want[key][name]
            if not w.is_floating_point():  # a counter (BatchNorm's num_batches_tracked)
                assert torch.equal(g, w), f"{what} {key[:-1]} {name}: {g} vs {w}"
                continue
            err, limit = rel_err(g, w), (param_tol or tol) if key == "params" else tol
            assert err < limit, f"{what} {key[:-1]} {name}: relative error {err:.2e}"


def reference_plan(model: nn.Module, family: str, name: str, mesh: Mesh, inputs: tuple,
                   time_limit_s: float = 5.0, kwargs: dict | None = None) -> Plan | None:
    """A hand-written layout (params and inputs pinned) completed by the solver; ``None`` where
    it does not apply to the mesh or cannot be expressed on this graph. ``kwargs``: keyword
    inputs (a Hugging Face model's), pinned in call order after the positional ones."""
    from autopar.api import complete_plan
    from autopar.ir.errors import PlanError
    from autopar.models.reference_plans import REFERENCE_PLANS

    first = inputs[0] if inputs else next(iter((kwargs or {}).values()))
    ref = REFERENCE_PLANS[name](model, mesh.shape, mesh.axes, family,
                                batch_size=first.shape[0])
    if ref is None:
        return None
    graph = capture(model, inputs, kwargs)
    try:
        return complete_plan(graph, mesh, ref.params, ref.inputs,
                             Options.of(time_limit_s=time_limit_s))
    except PlanError:
        return None


def run_case(model: nn.Module, inputs: tuple, mesh_shape: tuple[int, ...],
             plan: Plan | str | None = None, steps: int = 3, time_limit_s: float = 5.0,
             adamw: dict | None = None, kwargs: dict | None = None,
             micro: list[tuple] | None = None, clip: Clip | None = None
             ) -> tuple[dict, dict, nn.Module]:
    """Train a copy on one device and the model on the simulated mesh; return both results.
    Both start from the same generator state, so random ops (dropout) draw alike. With
    ``micro``, ``inputs`` (parallelize's example) has the micro-batches' shapes."""
    torch.manual_seed(RNG_SEED)
    want = train_single(copy.deepcopy(model), inputs, steps, adamw, kwargs, micro, clip)
    mesh = mesh_for(mesh_shape)
    with fake_world(mesh.size):
        pm = autopar.parallelize(model, mesh, inputs, kwargs, plan=plan,
                                 time_limit_s=time_limit_s)
        torch.manual_seed(RNG_SEED)
        got = train_parallel(pm, inputs, steps, adamw, kwargs, micro, clip)
    return got, want, pm


def collective_totals(records: list, by_reason: bool = True) -> dict[tuple, tuple[int, float]]:
    from autopar.runtime.redistribute import CollectiveCounter

    return CollectiveCounter(list(records)).totals(by_reason)


def routed_totals(pm: nn.Module) -> tuple[dict[tuple[str, str], tuple[int, float]], bool]:
    """What the lowered program should issue per step, priced by ``route_collectives``, and
    whether any reshard leaves the cost model's ascending axis order (nested shards)."""
    from autopar.ir.placements import local_shape
    from autopar.passes.cost.buckets import bucket_collectives, sync_groups
    from autopar.passes.cost.cost_model import axes_label, route_collectives
    from autopar.passes.cost.reshard_route import route

    lowered = pm._active[1]
    mesh = Mesh(lowered.mesh_shape, lowered.plan.decided.mesh_axes, "cpu")
    merged = lowered.plan.merged_axes()  # sums over these axis sets run as one collective
    out: dict[tuple[str, str], list] = {}
    deviates = False
    edges = [(m, a, b) for m, a, b, _ in lowered.edges()]
    syncs = []  # bucketed syncs: one collective per bucket and axis, as grad_sync runs
    for group, kind in sync_groups(lowered.grad_moves(), mesh.shape, lowered.bucketed,
                                   lowered.plan.decided.first_bucket_bytes):
        if kind is None:
            syncs.append((group[0].meta, group[0].src, group[0].dst))
            continue
        for ckind, axes, nbytes in bucket_collectives(group, mesh.shape, merged):
            slot = out.setdefault((ckind, axes_label(mesh.axes, axes)), [0, 0.0])
            slot[0] += 1
            slot[1] += nbytes
    for ax, nbytes in lowered.gather_collectives():  # parameter gathers batched per layer
        slot = out.setdefault(("all_gather", mesh.axes[ax]), [0, 0.0])
        slot[0] += 1
        slot[1] += nbytes
    for meta, src, dst in edges + syncs:
        if src == dst or meta is None:
            continue
        steps, _ = route(src, dst, local_shape(meta.shape, src, mesh.shape), mesh.shape)
        deviates |= steps != [(ax, dst[ax]) for ax in range(len(src)) if src[ax] != dst[ax]]
        for c in route_collectives(meta, src, dst, mesh, merged):
            slot = out.setdefault((c.kind, c.axis), [0, 0.0])
            slot[0] += 1
            slot[1] += c.bytes
    return {k: (v[0], v[1]) for k, v in out.items()}, deviates


def planned_totals(plan: Plan) -> dict[tuple[str, str, str], tuple[int, float]]:
    return {(c.kind, c.axis, c.reason): (c.count, c.bytes) for c in plan.predicted.collectives}


def check_collectives(records: list, pm: nn.Module, what: str = "") -> None:
    """Executed == the plan's prediction (kind, axis, reason, count, bytes) wherever every
    reshard runs in the cost model's order; where a nested-shard transition cannot, executed ==
    what ``route_collectives`` prices for the route that runs (see ``reshard_route``)."""
    routed, deviates = routed_totals(pm)
    assert collective_totals(records, by_reason=False) == routed, what
    if not deviates:
        assert collective_totals(records) == planned_totals(pm.plan), what


# imported once by the fork server, so a started worker begins with them loaded
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint",
            "torch.distributed.pipelining", "autopar", "autopar.api", "autopar.runtime",
            "harness.spmd"]


def start_method() -> str:
    """How the multi-process tests start their workers: ``forkserver``, with torch and autopar
    imported once in the server (each worker is a fork of it, not a fresh interpreter that
    imports them again: about 3 s of CPU per worker on the 2-core machine). The workers still
    start clean, as spawned ones do: the server is a fresh interpreter that ran no collective
    and no OpenMP region, unlike the test process (the reason ``launch`` does not fork).
    The server keeps the environment of its first start: pass a worker what it needs as
    arguments, as these tests do; each tensor among them travels as a file descriptor, of
    which the server hands a worker at most 256 (``test_pipeline_tp.py`` sends bytes).
    ``tests/runtime/test_launch.py`` keeps ``launch``'s default, ``spawn``."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server first starts
    return "forkserver"


def spawn_reports(worker: Callable, args: tuple, nprocs: int, out_dir: Any,
                  timeout_s: float) -> list[dict]:
    """Run ``worker(rank, *args)`` on ``nprocs`` spawned processes (gloo tests) and read back
    each rank's ``rank{r}.json`` report from ``out_dir``; fail the test past ``timeout_s``."""
    import json
    import time
    from pathlib import Path

    import pytest
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False,
                             start_method=start_method())
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail(f"gloo workers still running after {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(nprocs)]


def train_usage_error(argv: list[str], capsys: Any) -> str:
    """``autopar train ARGV``'s error: it exits 2 with one ``autopar: error:`` line and no
    traceback; the line."""
    from autopar.cli.main import main

    assert main(["train", *argv]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error: "), err
    assert "Traceback" not in out + err
    return lines[0]


def four_block_model(preset_name: str, batch: int, seq: int) -> tuple[nn.Module, tuple]:
    """A preset with 4 blocks, weights seeded, and example inputs (batch x seq), seeded."""
    from autopar.models import get_preset

    preset = get_preset(preset_name)
    preset = preset.replace(n_layer=4) if preset.family == "gpt2" else preset.replace(n_layers=4)
    torch.manual_seed(0)
    model = preset.build("cpu")
    torch.manual_seed(1)
    return model, preset.example_inputs(batch, seq, "cpu")


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """This process as a world of one (gloo), for autopar's single-device SPMD run."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def one_device_run(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                   microbatches: int, precision: str, steps: int) -> dict:
    """autopar's single-device run of ``model`` (``parallelize`` on a one-device mesh: the
    traced step under ``precision``'s policy), each step the batch as ``microbatches``
    micro-batches whose losses, divided by their number, are backwarded in turn (as a
    pipeline accumulates them), ``steps`` AdamW steps: each step's loss, the last step's
    gradients and the parameters after."""
    m, rows = microbatches, tokens.shape[0] // microbatches
    with one_process():
        pm = autopar.parallelize(model, autopar.Mesh((1,), ("dp",), "cpu"),
                                 (tokens[:rows], targets[:rows]), precision=precision,
                                 recompute="none", time_limit_s=2.0)
        opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
        losses: list[float] = []
        grads: dict = {}
        for _ in range(steps):
            total = 0.0
            for xs, ys in zip(tokens.chunk(m), targets.chunk(m)):
                part = pm(xs, ys) / m
                part.backward()
                total += float(part.detach())
            losses.append(total)
            grads = {n: _held(p.grad) for n, p in pm.named_parameters()}
            opt.step()
            opt.zero_grad()
        return {"losses": losses, "grads": grads,
                "params": {n: _held(p) for n, p in pm.named_parameters()}}


def _held(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
