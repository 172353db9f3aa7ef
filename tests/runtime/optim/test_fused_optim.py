"""torch's fused optimizer kernels on DTensors run on the local pieces (``runtime/optim/fused``).

The fast path must give bit for bit what DTensor's own dispatch gives, take the local call
only where every gradient and state is placed as its parameter, and hand every other call to
DTensor's dispatch. Parameters, gradients and states are DTensors on a simulated mesh
(``LocalTensorMode``); each case is run twice from the same values, the handler installed and
not, and compared exactly. The last tests train autopar models with ``AdamW(fused=True)``
against one device.
"""

from __future__ import annotations

import pytest
import torch
from harness.spmd import assert_same_training, fake_world, mesh_for, reference_plan, run_case
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autopar.models.mlp import MLP, MLPConfig
from autopar.runtime import _compat
from autopar.runtime._compat import as_local, reconcile
from autopar.runtime.optim import fused as fused_optim

# (mesh shape, parameter placements, gradient placements or None for the parameter's)
CASES = [
    ((4,), (Replicate(),), None),
    ((4,), (Shard(0),), None),  # 10 rows on 4 ranks: uneven pieces
    ((2, 2), (Shard(0), Replicate()), None),
    ((2, 2), (Shard(1), Shard(0)), None),
    ((4,), (Replicate(),), (Shard(0),)),  # gradient placed otherwise: DTensor's dispatch
    ((2, 2), (Replicate(), Shard(1)), (Replicate(), Replicate())),
]
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, fused=True),
    "adamw-tensor-lr": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
}
SHAPES = [(10, 6), (6,), (8, 4)]


@pytest.fixture
def local_calls(monkeypatch):
    """How many fused calls took the local path and how many went to DTensor's dispatch."""
    counts = {"local": 0, "dtensor": 0}
    real = fused_optim._local_call

    def counting(op, args, kwargs):
        call = real(op, args, kwargs)
        counts["local" if call is not None else "dtensor"] += 1
        return call

    monkeypatch.setattr(fused_optim, "_local_call", counting)
    return counts


def _place(shape, placements) -> tuple:
    """``placements`` with a shard of a dim the tensor lacks replaced by Replicate."""
    return tuple(Replicate() if isinstance(p, Shard) and p.dim >= len(shape) else p
                 for p in placements)


def _values() -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Each parameter's first value and its gradients at 3 steps (made outside LocalTensorMode,
    whose random ops draw per rank)."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=gen), [torch.randn(s, generator=gen) for _ in range(3)])
            for s in SHAPES]


def _train(values, mesh, placements, grad_placements, make_opt, mode: str
           ) -> list[torch.Tensor]:
    """Three optimizer steps from ``values``; every parameter and state afterwards, whole.
    ``mode``: "plain" (whole tensors, one device), "dtensor" (DTensors, DTensor's own
    dispatch), "fast" (DTensors, the handler installed)."""
    if mode == "dtensor":
        fused_optim.uninstall()
    try:
        params, grads = [], []
        for p, gs in values:
            shape = p.shape
            # under LocalTensorMode, one copy per rank: an in-place kernel must not update
            # one plain tensor once per simulated rank (as_local is the identity outside it)
            p, gs = as_local(p.clone()), [as_local(g.clone()) for g in gs]
            if mode != "plain":
                p = distribute_tensor(p, mesh, _place(shape, placements))
                gpl = _place(shape, grad_placements or placements)
                gs = [distribute_tensor(g, mesh, gpl) for g in gs]
            params.append(torch.nn.Parameter(p))
            grads.append(gs)
        opt = make_opt(params)
        for step in range(3):
            for p, g in zip(params, grads):
                p.grad = g[step]
            opt.step()
        out = [_whole(p.detach()) for p in params]
        for state in opt.state.values():
            out += [_whole(v) for v in state.values() if isinstance(v, torch.Tensor)]
        return out
    finally:
        fused_optim.install()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return reconcile(t.full_tensor() if isinstance(t, DTensor) else t)


# DTensor's own dispatch has a sharding rule for these fused kernels only
DTENSOR_DISPATCHES = {"adamw", "adam-amsgrad", "adamw-tensor-lr"}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mesh_shape,placements,grad_placements", CASES)
def test_fused_step_equals_dtensor_dispatch(mesh_shape, placements, grad_placements, opt_name,
                                            local_calls) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    make, values = OPTIMIZERS[opt_name], _values()
    plain = _train(values, None, (), None, make, "plain")
    with fake_world(torch.Size(mesh_shape).numel()):
        mesh = init_device_mesh("cpu", mesh_shape)
        if opt_name not in DTENSOR_DISPATCHES:
            with pytest.raises(NotImplementedError, match="sharding strategy"):
                _train(values, mesh, placements, grad_placements, make, "dtensor")
            want = None
        else:
            want = _train(values, mesh, placements, grad_placements, make, "dtensor")
        assert local_calls == {"local": 0, "dtensor": 0}
        if grad_placements is not None and want is None:
            # placed otherwise and no rule to redistribute by: DTensor's error, as without us
            with pytest.raises(NotImplementedError, match="sharding strategy"):
                _train(values, mesh, placements, grad_placements, make, "fast")
            return
        got = _train(values, mesh, placements, grad_placements, make, "fast")
    what = f"{opt_name} on {mesh_shape} {placements}"
    for g, p in zip(got, plain):  # the kernel's vector and scalar loops may round apart
        torch.testing.assert_close(g, p, rtol=1e-6, atol=1e-7, msg=what)
    if want is not None:
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"{what}: not bit for bit"
    if grad_placements is None:
        assert local_calls == {"local": 3, "dtensor": 0}
    else:  # gradients placed otherwise than their parameters: DTensor's dispatch redistributes
        assert local_calls == {"local": 0, "dtensor": 3}


def test_partial_gradient_goes_to_dtensor_dispatch(local_calls) -> None:
    """A gradient still a sum of per-rank addends is DTensor's to handle, whatever it does."""
    from torch.distributed.device_mesh import init_device_mesh

    results = []
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        for install in (False, True):
            fused_optim.install() if install else fused_optim.uninstall()
            p = torch.nn.Parameter(distribute_tensor(as_local(torch.ones(4)), mesh,
                                                     (Replicate(),)))
            p.grad = DTensor.from_local(as_local(torch.arange(4.0)), mesh, (Partial(),),
                                        run_check=False)
            torch.optim.AdamW([p], lr=0.5, fused=True).step()
            results.append(reconcile(p.detach().full_tensor()))
    fused_optim.install()
    assert torch.equal(results[0], results[1])
    assert local_calls == {"local": 0, "dtensor": 1}


def test_fast_gradient_dtensor_matches_the_constructor() -> None:
    """``_compat.dtensor_like`` builds gradients with DTensor's ``__new__`` alone."""
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        ref = distribute_tensor(torch.randn(6, 3), mesh, (Shard(0),))
        local = torch.randn(3, 3)
        fast = _compat.dtensor_like(ref, local)
        slow = DTensor(local, ref._spec, requires_grad=False)
        assert type(fast) is DTensor
        assert fast._spec is ref._spec and fast._local_tensor is local
        for attr in ("shape", "dtype", "device", "requires_grad", "layout"):
            assert getattr(fast, attr) == getattr(slow, attr), attr
        assert fast.stride() == slow.stride()


@pytest.mark.parametrize("source,mesh_shape", [("data_parallel", (4,)), ("fsdp", (2,)),
                                               ("megatron_tp", (2,)), ("dp_tp_2d", (2, 2))])
def test_fused_adamw_training_equals_single_device(source, mesh_shape, local_calls) -> None:
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_dim=8, hidden=(12, 8), out_dim=6))
    inputs = (torch.randn(8, 8), torch.randn(8, 6))
    plan = reference_plan(model, "mlp", source, mesh_for(mesh_shape), inputs)
    assert plan is not None
    got, want, _ = run_case(model, inputs, mesh_shape, plan, adamw={"fused": True})
    assert_same_training(got, want, what=f"fused AdamW, {source} on {mesh_shape}")
    assert local_calls == {"local": 3, "dtensor": 0}


def test_fused_adamw_trains_gpt_like_one_device(local_calls) -> None:
    """The main job's model and mesh (``autopar train``: GPT, dp=2 x tp=2, the solver's plan)."""
    from autopar.models import get_preset

    preset = get_preset("gpt2-tiny")
    torch.manual_seed(0)
    model = preset.build(device="cpu")
    inputs = preset.example_inputs(4, 8, device="cpu")
    got, want, _ = run_case(model, inputs, (2, 2), None, adamw={"fused": True})
    assert_same_training(got, want, what="fused AdamW, gpt2-tiny on 2x2")
    assert local_calls == {"local": 3, "dtensor": 0}
