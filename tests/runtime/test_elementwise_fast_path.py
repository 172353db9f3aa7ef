"""Elementwise ops on DTensors placed alike run on the local pieces
(``runtime/elementwise_fast_path``).

The fast path must give bit for bit what DTensor's own dispatch gives (values, placements,
global shape, stride and dtype), take the local call only where every DTensor argument is
placed as the first one or is a replicated scalar, and hand every other call to DTensor's
dispatch. Every case runs on a simulated mesh (``LocalTensorMode``) twice from the same values,
the handler installed and not. The last tests step torch's for-loop optimizers on DTensor
parameters, and train autopar models with for-loop and foreach AdamW against one device.
"""

from __future__ import annotations

import pytest
import torch
from harness.spmd import assert_same_training, fake_world, mesh_for, reference_plan, run_case
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autopar.models.mlp import MLP, MLPConfig
from autopar.runtime import elementwise_fast_path as fast
from autopar.runtime._compat import as_local, reconcile

MESHES = [((4,), (Shard(0),)),  # 10 rows on 4 ranks: uneven pieces
          ((4,), (Replicate(),)),
          ((2, 2), (Shard(1), Shard(0))),
          ((2, 2), (Replicate(), Shard(1)))]
SHAPE = (10, 6)


@pytest.fixture
def calls(monkeypatch):
    """How many handled calls ran on the local pieces, and how many went to DTensor."""
    counts = {"local": 0, "dtensor": 0}
    real_local, real_dispatch = fast._local_call, fast.dtensor_dispatch

    def local(op, args, kwargs):
        out = real_local(op, args, kwargs)
        counts["local"] += 1
        return out

    def dispatch(op, args, kwargs):
        counts["dtensor"] += 1
        return real_dispatch(op, args, kwargs)

    monkeypatch.setattr(fast, "_local_call", local)
    monkeypatch.setattr(fast, "dtensor_dispatch", dispatch)
    return counts


def _values(n: int, positive: bool = False) -> list[torch.Tensor]:
    """``n`` tensors of ``SHAPE`` (made outside LocalTensorMode, whose random ops draw per rank)."""
    gen = torch.Generator().manual_seed(0)
    out = [torch.randn(SHAPE, generator=gen) for _ in range(n)]
    return [t.abs() + 0.1 for t in out] if positive else out


# name -> (number of tensor operands, positive operands?, the call on them)
OPS = {
    "add_ alpha": (2, False, lambda a, b: a.add_(b, alpha=0.5)),
    "sub": (2, False, lambda a, b: a - b),
    "mul_ number": (1, False, lambda a: a.mul_(0.9)),
    "mul": (2, False, lambda a, b: a * b),
    "div number": (1, False, lambda a: a / 3.0),
    "div_ rounding": (2, True, lambda a, b: a.div_(b, rounding_mode="floor")),
    "lerp_": (2, False, lambda a, b: a.lerp_(b, 0.1)),
    "addcmul_": (3, False, lambda a, b, c: a.addcmul_(b, c, value=0.01)),
    "addcdiv_": (3, True, lambda a, b, c: a.addcdiv_(b, c, value=-0.1)),
    "sqrt": (1, True, lambda a: a.sqrt()),
    "rsqrt_": (1, True, lambda a: a.rsqrt_()),
    "neg abs sign exp": (1, False, lambda a: a.neg().abs().sign().exp()),
    "maximum": (2, False, lambda a, b: torch.maximum(a, b)),
    "clamp_": (1, False, lambda a: a.clamp_(-0.5, 0.5)),
    "pow": (1, True, lambda a: a.pow(1.5)),
    "copy_": (2, False, lambda a, b: a.copy_(b)),
    "zero_ fill_": (1, False, lambda a: a.zero_().fill_(2.0)),
}


def _run(name: str, mesh, placements, installed: bool) -> list[torch.Tensor]:
    """The op on DTensors of ``values``; its result and every operand after it, as DTensors."""
    n, positive, call = OPS[name]
    fast.install() if installed else fast.uninstall()
    try:
        ts = [distribute_tensor(as_local(v.clone()), mesh, placements)
              for v in _values(n, positive)]
        out = call(*ts)
        outs = [] if out is None else list(out) if isinstance(out, (list, tuple)) else [out]
        return outs + ts
    finally:
        fast.install()


def _snapshot(t: DTensor) -> tuple:
    """What DTensor's dispatch decides about a result: its placement, layout and values
    (taken inside the simulated world)."""
    assert type(t) is DTensor
    return (t.placements, t.shape, t.stride(), t.dtype, t._spec.tensor_meta,
            reconcile(t.full_tensor()))


def _same(got: tuple, want: tuple, what: str) -> None:
    assert got[:-1] == want[:-1], what
    assert torch.equal(got[-1], want[-1]), what


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("mesh_shape,placements", MESHES)
def test_op_on_locals_equals_dtensor_dispatch(name, mesh_shape, placements, calls) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(torch.Size(mesh_shape).numel()):
        mesh = init_device_mesh("cpu", mesh_shape)
        want = _run(name, mesh, placements, installed=False)
        assert calls == {"local": 0, "dtensor": 0}
        got = _run(name, mesh, placements, installed=True)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(_snapshot(g), _snapshot(w), f"{name} on {mesh_shape} {placements}, tensor {i}")
    assert calls["local"] >= 1 and calls["dtensor"] == 0


def _both(make) -> tuple:
    """``make(mesh)`` run with the handler uninstalled, then installed, on a 2-rank mesh; the
    snapshots of the DTensors it returns (a DTensor, or a tuple of them)."""
    from torch.distributed.device_mesh import init_device_mesh

    results = []
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        for installed in (False, True):
            fast.install() if installed else fast.uninstall()
            try:
                out = make(mesh)
                results.append(tuple(_snapshot(t) for t in out) if isinstance(out, (tuple, list))
                               else _snapshot(out))
            finally:
                fast.install()
    return tuple(results)


def test_differently_placed_arguments_go_to_dtensor(calls) -> None:
    """DTensor redistributes the second operand; the handler does not guess how."""
    def make(mesh):
        a = distribute_tensor(as_local(torch.ones(4, 2)), mesh, (Shard(0),))
        b = distribute_tensor(as_local(torch.arange(8.0).view(4, 2)), mesh, (Replicate(),))
        return a.add_(b)

    want, got = _both(make)
    _same(got, want, "Shard + Replicate")
    assert calls == {"local": 0, "dtensor": 1}


def test_partial_goes_to_dtensor(calls) -> None:
    def make(mesh):
        a = DTensor.from_local(as_local(torch.arange(4.0)), mesh, (Partial(),), run_check=False)
        return a * 2.0

    want, got = _both(make)
    _same(got, want, "Partial * 2")
    assert calls == {"local": 0, "dtensor": 1}


def test_plain_tensor_beside_a_dtensor_is_dtensors_to_refuse(calls) -> None:
    """DTensor refuses a plain tensor operand (no implicit replication); so it still does."""
    def make(mesh):
        a = distribute_tensor(as_local(torch.ones(4)), mesh, (Shard(0),))
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            a.add_(as_local(torch.ones(4)))
        return a

    want, got = _both(make)
    _same(got, want, "after the refused call")
    assert calls == {"local": 0, "dtensor": 1}


def test_broadcast_goes_to_dtensor_and_a_replicated_scalar_does_not(calls) -> None:
    def make(mesh):
        a = distribute_tensor(as_local(torch.ones(4, 2)), mesh, (Shard(0),))
        row = distribute_tensor(as_local(torch.tensor([2.0, 3.0])), mesh, (Replicate(),))
        scalar = distribute_tensor(as_local(torch.tensor(0.5)), mesh, (Replicate(),))
        return a * row, a * scalar

    (want_row, want_scalar), (got_row, got_scalar) = _both(make)
    _same(got_row, want_row, "broadcast row")
    _same(got_scalar, want_scalar, "replicated scalar")
    assert calls == {"local": 1, "dtensor": 1}


def test_result_of_another_dtype_is_placed_with_it(calls) -> None:
    def make(mesh):
        a = distribute_tensor(as_local(torch.arange(8).view(4, 2)), mesh, (Shard(0),))
        return a * 0.5  # long * float: a float result

    want, got = _both(make)
    assert got[3] == torch.float32
    _same(got, want, "long * float")
    assert calls == {"local": 1, "dtensor": 0}


OPTIMIZERS = {  # their for-loop implementations
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adam amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=False),
    "sgd momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=False),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, foreach=False),
}


def _train(mesh, placements, make_opt) -> list[torch.Tensor]:
    """Three steps of an optimizer on DTensor parameters; every parameter and state, whole."""
    gen = torch.Generator().manual_seed(0)
    values = [(torch.randn(s, generator=gen), [torch.randn(s, generator=gen) for _ in range(3)])
              for s in (SHAPE, (6,))]
    params, grads = [], []
    for p, gs in values:
        pl = tuple(Replicate() if isinstance(x, Shard) and x.dim >= p.dim() else x
                   for x in placements)
        params.append(torch.nn.Parameter(distribute_tensor(as_local(p.clone()), mesh, pl)))
        grads.append([distribute_tensor(as_local(g.clone()), mesh, pl) for g in gs])
    opt = make_opt(params)
    for step in range(3):
        for p, g in zip(params, grads):
            p.grad = g[step]
        opt.step()
    out = [reconcile(p.detach().full_tensor()) for p in params]
    for state in opt.state.values():
        out += [reconcile(v.full_tensor()) for v in state.values() if isinstance(v, DTensor)]
    return out


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mesh_shape,placements", MESHES[::2])
def test_optimizer_step_equals_dtensor_dispatch(opt_name, mesh_shape, placements,
                                                calls) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(torch.Size(mesh_shape).numel()):
        mesh = init_device_mesh("cpu", mesh_shape)
        fast.uninstall()
        try:
            want = _train(mesh, placements, OPTIMIZERS[opt_name])
        finally:
            fast.install()
        got = _train(mesh, placements, OPTIMIZERS[opt_name])
    assert len(got) == len(want) > 2
    assert all(torch.equal(g, w) for g, w in zip(got, want)), f"{opt_name}: not bit for bit"
    assert calls["local"] >= 3 and calls["dtensor"] == 0


def test_the_ops_it_covers() -> None:
    ops = {str(op) for op in fast.elementwise_ops()}
    assert {"aten.mul_.Tensor", "aten.addcdiv_.default", "aten.sqrt.default"} <= ops
    assert not any("out" in op.split(".")[-1] for op in ops)  # out= is the caller's to place
    assert not any("_foreach_" in op for op in ops)  # DTensor's own dispatch is as quick


@pytest.mark.parametrize("source,mesh_shape", [("data_parallel", (4,)), ("fsdp", (2,)),
                                               ("dp_tp_2d", (2, 2))])
@pytest.mark.parametrize("foreach", [False, True])
def test_training_with_unfused_adamw_equals_single_device(source, mesh_shape, foreach,
                                                         calls) -> None:
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_dim=8, hidden=(12, 8), out_dim=6))
    inputs = (torch.randn(8, 8), torch.randn(8, 6))
    plan = reference_plan(model, "mlp", source, mesh_for(mesh_shape), inputs)
    got, want, _ = run_case(model, inputs, mesh_shape, plan, adamw={"foreach": foreach})
    assert_same_training(got, want, what=f"AdamW foreach={foreach}, {source} on {mesh_shape}")
    assert calls["dtensor"] == 0
    assert calls["local"] >= (0 if foreach else 3 * 8 * 4)  # 3 steps, 8 ops, 4 parameters
