"""Property tests of the compute rule families (matmul, pointwise, reduction, norm, loss, random).

Each test draws small shapes (dims the mesh does not divide included), a mesh (2, 3 or 2x2),
traces the op on real float64 tensors, and checks every strategy ``node_strategies`` offers by
simulating all ranks against the full-tensor result. Key strategies (the Megatron matmul
layouts, sequence-parallel norms, Partial reductions) are asserted to be offered.
"""

from __future__ import annotations

import pytest
import torch
from harness.rules import (
    MESHES,
    Checked,
    check_all,
    check_graph,
    one_axis,
    replicated_strategy,
    traced_node,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.ir.placements import Partial, R, Shard
from autopar.passes.strategies.registry import node_strategies

aten = torch.ops.aten
F64 = torch.float64
PS, PM = Partial("sum"), Partial("max")
S = Shard

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
PER_OP = settings(SETTINGS, max_examples=4)  # for tests parametrized over many ops

meshes = st.sampled_from(MESHES)
size = st.integers(1, 6)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64)


def _common_checks(c: Checked) -> None:
    assert replicated_strategy(c) in c.strategies
    assert not c.result.missing_rule
    assert len(set(c.strategies)) == len(c.strategies)


def _divides(n: int, mesh: tuple[int, ...]) -> bool:
    return len(mesh) == 1 and n % mesh[0] == 0


# --- matmul ------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm", "mv", "dot"])
@settings(SETTINGS, max_examples=8)
@given(meshes, size, size, size, size, st.sampled_from(["row", "full", "one"]),
       st.sampled_from([1.0, 0.0]))
def test_matmul_family(op, mesh, b, m, k, n, bias_kind, beta):
    torch.manual_seed(0)
    A, B = randn(m, k), randn(k, n)
    bias = {"row": randn(n), "full": randn(m, n), "one": randn(1, n)}[bias_kind]
    if op == "mm":
        c = check_all(aten.mm.default, (A, B), mesh_shape=mesh)
    elif op == "addmm":
        c = check_all(aten.addmm.default, (bias, A, B), {"beta": beta}, mesh_shape=mesh)
    elif op == "bmm":
        c = check_all(aten.bmm.default, (randn(b, m, k), randn(b, k, n)), mesh_shape=mesh)
    elif op == "baddbmm":
        c = check_all(aten.baddbmm.default, (bias, randn(b, m, k), randn(b, k, n)), mesh_shape=mesh)
    elif op == "mv":
        c = check_all(aten.mv.default, (A, randn(k)), mesh_shape=mesh)
    else:
        c = check_all(aten.dot.default, (randn(k), randn(k)), mesh_shape=mesh)
    _common_checks(c)
    if op == "mm" and len(mesh) == 1:
        n_ = mesh[0]
        assert one_axis(c, (R, PS), (PS,)) and one_axis(c, (PS, R), (PS,))
        assert one_axis(c, (S(1), S(0)), (PS,)) == (k % n_ == 0 and k > 1)
        assert one_axis(c, (S(0), R), (S(0),)) == (m % n_ == 0 and m > 1)
        assert one_axis(c, (R, S(1)), (S(1),)) == (n % n_ == 0 and n > 1)
    if op == "mm" and mesh == (2, 2) and m % 2 == 0 and n % 2 == 0:
        # 2-D: data parallel on the first axis, Megatron column parallel on the second
        want = (((S(0), R), (R, S(1))), ((S(0), S(1)),))
        assert any((s.ins, s.outs) == want for s in c.strategies)
    if op == "addmm" and len(mesh) == 1 and k % mesh[0] == 0 and k > 1:
        want_bias = R if beta == 0 else PS
        assert one_axis(c, (want_bias, S(1), S(0)), (PS,))  # bias added once
    if op == "bmm" and _divides(b, mesh) and b > 1:
        assert one_axis(c, (S(0), S(0)), (S(0),))


def test_megatron_2d_layouts_are_offered():
    """dp x tp: batch rows on the first axis, column / row (contraction) parallel on the second."""
    c = check_all(aten.mm.default, (randn(4, 6), randn(6, 8)), mesh_shape=(2, 2))
    col = (((S(0), R), (R, S(1))), ((S(0), S(1)),))
    row = (((S(0), S(1)), (R, S(0))), ((S(0), PS),))
    have = {(s.ins, s.outs) for s in c.strategies}
    assert col in have and row in have
    ln = check_all(aten.native_layer_norm.default, (randn(4, 6, 8), [8], randn(8), randn(8), 1e-5),
                   mesh_shape=(2, 2))
    assert any(s.ins[0] == (S(0), S(1)) for s in ln.strategies)  # dp x sequence parallel


# --- pointwise ---------------------------------------------------------------------------------

shapes = st.lists(size, min_size=1, max_size=3)


def _broadcast_of(shape: list[int], drop: int, ones: list[bool]) -> list[int]:
    out = shape[drop:]
    return [1 if o else s for s, o in zip(out, ones)]


BINARY = {
    "add": lambda a, b: (aten.add.Tensor, (a, b), {"alpha": 2}),
    "add_scalar": lambda a, b: (aten.add.Tensor, (a, 1.5), {}),
    "sub": lambda a, b: (aten.sub.Tensor, (a, b), {}),
    "mul": lambda a, b: (aten.mul.Tensor, (a, b), {}),
    "div": lambda a, b: (aten.div.Tensor, (a, b.abs() + 1), {}),
    "mul_scalar": lambda a, b: (aten.mul.Scalar, (a, 3.0), {}),
    "add_inplace": lambda a, b: (aten.add_.Tensor, (a, b), {}),
    "div_inplace": lambda a, b: (aten.div_.Scalar, (a, 2.0), {}),
    "maximum": lambda a, b: (aten.maximum.default, (a, b), {}),
    "eq": lambda a, b: (aten.eq.Tensor, (a.round(), b.round()), {}),
    "where": lambda a, b: (aten.where.self, (a > 0, a, b), {}),
    "masked_fill0": lambda a, b: (aten.masked_fill.Scalar, (a, b > 0, 0.0), {}),
    "masked_fill_inf": lambda a, b: (aten.masked_fill.Scalar, (a, b > 0, float("-inf")), {}),
    "gelu_backward": lambda a, b: (aten.gelu_backward.default, (a, b), {}),
    "silu_backward": lambda a, b: (aten.silu_backward.default, (a, b), {}),
    "threshold_backward": lambda a, b: (aten.threshold_backward.default, (a, b, 0.0), {}),
    "tanh_backward": lambda a, b: (aten.tanh_backward.default, (a, b), {}),
    "neg": lambda a, b: (aten.neg.default, (a,), {}),
    "exp": lambda a, b: (aten.exp.default, (a,), {}),
    "rsqrt": lambda a, b: (aten.rsqrt.default, (a.abs() + 0.5,), {}),
    "pow": lambda a, b: (aten.pow.Tensor_Scalar, (a, 2), {}),
    "gelu": lambda a, b: (aten.gelu.default, (a,), {}),
    "silu": lambda a, b: (aten.silu.default, (a,), {}),
    "sigmoid": lambda a, b: (aten.sigmoid.default, (a,), {}),
    "bitwise_not": lambda a, b: (aten.bitwise_not.default, (a > 0,), {}),
    "clone": lambda a, b: (aten.clone.default, (a,), {}),
    "to_f32": lambda a, b: (aten._to_copy.default, (a,), {"dtype": torch.float32}),
    "to_int": lambda a, b: (aten._to_copy.default, (a,), {"dtype": torch.int64}),
    "zeros_like": lambda a, b: (aten.zeros_like.default, (a,), {}),
    "ones_like": lambda a, b: (aten.ones_like.default, (a,), {}),
    "fill": lambda a, b: (aten.fill.Scalar, (a, 2.0), {}),
    "dropout_backward": lambda a, b: (aten.native_dropout_backward.default, (a, b > 0, 2.0), {}),
    "log_sigmoid_backward": lambda a, b: (aten.log_sigmoid_backward.default,
                                          (a, b, aten.log_sigmoid_forward(b)[1]), {}),
    "where_scalar": lambda a, b: (aten.where.ScalarOther, (b > 0, a, 0.0), {}),
}
BROADCASTING = {"add", "sub", "mul", "div", "add_inplace", "maximum", "eq", "where",
                "masked_fill0", "masked_fill_inf"}
LINEAR_ALL = {"add", "sub", "add_inplace", "where"}
LINEAR_ONE = {"mul", "div", "mul_scalar", "div_inplace", "masked_fill0", "gelu_backward",
              "silu_backward", "threshold_backward", "tanh_backward", "neg", "clone", "to_f32",
              "dropout_backward", "zeros_like", "log_sigmoid_backward", "where_scalar"}


@pytest.mark.parametrize("name", sorted(BINARY))
@PER_OP
@given(meshes, shapes, st.integers(0, 2), st.lists(st.booleans(), min_size=3, max_size=3))
def test_pointwise_family(name, mesh, shape, drop, ones):
    torch.manual_seed(0)
    a = randn(*shape)
    if name in BROADCASTING:
        b = randn(*_broadcast_of(shape, min(drop, len(shape) - 1), ones))
    else:
        b = randn(*shape)
    target, args, kwargs = BINARY[name](a, b)
    c = check_all(target, args, kwargs, mesh_shape=mesh)
    _common_checks(c)
    if len(mesh) != 1:
        return
    n_ = mesh[0]
    out_shape = c.node.meta["val"].shape
    for d, s in enumerate(out_shape):  # every output dim that divides can be sharded
        if s % n_ == 0 and s > 1:
            assert any(st_.outs == ((S(d),),) for st_ in c.strategies), (name, d)
    has_p = any(st_.outs[0] == (PS,) and PS in [i[0] for i in st_.ins] for st_ in c.strategies)
    assert has_p == (name in LINEAR_ALL | LINEAR_ONE), name
    if name in ("add", "sub"):  # P + R is not P
        assert not one_axis(c, (PS, R), (PS,)) and one_axis(c, (PS, PS), (PS,))


# --- reductions ----------------------------------------------------------------------------------

REDUCTIONS = ["sum", "sum_all", "mean", "mean_all", "amax", "amin", "max_dim", "argmax", "var",
              "logsumexp", "softmax", "log_softmax", "softmax_bwd", "log_softmax_bwd", "cumsum",
              "topk", "sort", "max_all"]


@pytest.mark.parametrize("name", REDUCTIONS)
@PER_OP
@given(meshes, st.lists(size, min_size=1, max_size=3), st.data(), st.booleans())
def test_reduction_family(name, mesh, shape, data, keepdim):
    torch.manual_seed(0)
    x = randn(*shape)
    nd = len(shape)
    dim = data.draw(st.integers(-nd, nd - 1))
    dims = data.draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True))
    op = {
        "sum": (aten.sum.dim_IntList, (x, dims, keepdim)),
        "sum_all": (aten.sum.default, (x,)),
        "mean": (aten.mean.dim, (x, dims, keepdim)),
        "mean_all": (aten.mean.default, (x,)),
        "amax": (aten.amax.default, (x, dims, keepdim)),
        "amin": (aten.amin.default, (x, dims, keepdim)),
        "max_all": (aten.max.default, (x,)),
        "max_dim": (aten.max.dim, (x, dim, keepdim)),
        "argmax": (aten.argmax.default, (x, dim, keepdim)),
        "var": (aten.var.correction, (x, dims)),
        "logsumexp": (aten.logsumexp.default, (x, dims, keepdim)),
        "softmax": (aten._softmax.default, (x, dim, False)),
        "log_softmax": (aten._log_softmax.default, (x, dim, False)),
        "softmax_bwd": (aten._softmax_backward_data.default, (x, x.softmax(dim), dim, F64)),
        "log_softmax_bwd": (aten._log_softmax_backward_data.default,
                            (x, x.log_softmax(dim), dim, F64)),
        "cumsum": (aten.cumsum.default, (x, dim)),
        "topk": (aten.topk.default, (x, 1, dim)),
        "sort": (aten.sort.default, (x, dim)),
    }[name]
    kwargs = {"correction": 1, "keepdim": keepdim} if name == "var" else {}
    c = check_all(op[0], op[1], kwargs, mesh_shape=mesh)
    _common_checks(c)
    if len(mesh) == 1:
        n_ = mesh[0]
        red = dims if name in ("sum", "mean", "amax") else list(range(nd))
        want = {"sum": PS, "sum_all": PS, "mean": PS, "mean_all": PS, "amax": PM}.get(name)
        for d in red:
            if want is not None and shape[d] % n_ == 0 and shape[d] > 1:
                assert any(s.ins[0] == (S(d),) and s.outs[0] == (want,) for s in c.strategies)


# --- norms ---------------------------------------------------------------------------------------


@settings(SETTINGS, max_examples=8)
@given(meshes, size, size, st.integers(2, 5), st.booleans(), st.booleans())
def test_norm_family(mesh, batch, seq, hidden, affine, bias):
    torch.manual_seed(0)
    x = randn(batch, seq, hidden)
    w = randn(hidden) if affine else None
    b = randn(hidden) if bias else None
    fwd = check_all(aten.native_layer_norm.default, (x, [hidden], w, b, 1e-5), mesh_shape=mesh)
    _common_checks(fwd)
    out, mean, rstd = aten.native_layer_norm(x, [hidden], w, b, 1e-5)
    mask = [True, w is not None, b is not None]
    bwd = check_all(aten.native_layer_norm_backward.default,
                    (randn(batch, seq, hidden), x, [hidden], mean, rstd, w, b, mask),
                    mesh_shape=mesh)
    _common_checks(bwd)
    rms = check_all(aten._fused_rms_norm.default, (x, [hidden], w, 1e-5), mesh_shape=mesh)
    _common_checks(rms)
    if len(mesh) == 1 and seq % mesh[0] == 0 and seq > 1:
        # sequence parallel: the norm is over the hidden dim only
        assert any(s.ins[0] == (S(1),) and s.outs[0] == (S(1),) for s in fwd.strategies)
        grads = [PS if m else R for m in mask[1:]]
        assert any(s.ins[0] == (S(1),) and [o[0] for o in s.outs] == [S(1), *grads]
                   for s in bwd.strategies)


# --- losses --------------------------------------------------------------------------------------


@settings(SETTINGS, max_examples=8)
@given(meshes, size, st.integers(2, 5), st.sampled_from([0, 1, 2]), st.booleans())
def test_loss_family(mesh, n, classes, reduction, weighted):
    torch.manual_seed(0)
    lp = randn(n, classes).log_softmax(1)
    t = torch.randint(0, classes, (n,))
    w = randn(classes).abs() if weighted else None
    fwd = check_all(aten.nll_loss_forward.default, (lp, t, w, reduction, -100), mesh_shape=mesh)
    _common_checks(fwd)
    total = aten.nll_loss_forward(lp, t, w, reduction, -100)[1]
    g = randn(n) if reduction == 0 else torch.tensor(0.7, dtype=F64)
    bwd = check_all(aten.nll_loss_backward.default, (g, lp, t, w, reduction, -100, total),
                    mesh_shape=mesh)
    _common_checks(bwd)
    x, y = randn(n, classes), randn(n, classes)
    _common_checks(check_all(aten.mse_loss.default, (x, y, reduction), mesh_shape=mesh))
    gm = randn(n, classes) if reduction == 0 else torch.tensor(0.7, dtype=F64)
    _common_checks(check_all(aten.mse_loss_backward.default, (gm, x, y, reduction),
                             mesh_shape=mesh))
    if _divides(n, mesh) and n > 1 and not (weighted and reduction == 1):
        assert any(s.ins[0] == (S(0),) for s in fwd.strategies)  # data parallel loss


def test_nll_loss_2d_and_mean_impl():
    torch.manual_seed(0)
    lp = randn(2, 3, 4, 2).log_softmax(1)
    t = torch.randint(0, 3, (2, 4, 2))
    for mesh in MESHES:
        c = check_all(aten.nll_loss2d_forward.default, (lp, t, None, 1, -100), mesh_shape=mesh)
        if mesh != (3,):  # nothing divides by 3 here
            assert any(s.impls == ("nll_loss_mean_global",) * len(mesh) for s in c.strategies)


def test_nll_loss_mean_with_ignored_targets_is_exact():
    """Batch-sharded mean nll divides by the kept targets of all ranks (all-reduced inside the
    op): loss and total_weight equal the single-device values though one rank keeps fewer."""
    from autopar.passes.strategies import simulate
    from autopar.passes.strategies.registry import op_info

    lp = randn(4, 6).log_softmax(1)
    t = torch.tensor([1, -100, 2, 3])
    node = traced_node(aten.nll_loss_forward.default, lp, t, None, 1, -100)
    dp = next(s for s in node_strategies(node, (2,)).strategies if s.ins[0] == (S(0),))
    loss, total = simulate.run_sharded(aten.nll_loss_forward.default, (lp, t, None, 1, -100), {},
                                       op_info(node), dp, (2,))
    want_loss, want_total = aten.nll_loss_forward(lp, t, None, 1, -100)
    assert dp.raw_outs == ((Partial(),), (Partial(),)) and dp.outs == ((Partial(),), (R,))
    assert torch.equal(total, want_total)
    assert torch.allclose(loss, want_loss)


def test_nll_loss_mean_with_the_target_whole_needs_no_collective():
    """Batch-sharded log-probabilities, the target whole on every rank: each rank counts the
    kept targets itself, so the op all-reduces nothing, and the mean is still exact though
    the ranks keep different numbers of targets."""
    from autopar.passes.strategies import simulate
    from autopar.passes.strategies.registry import op_info

    lp = randn(4, 6).log_softmax(1)
    t = torch.tensor([1, -100, -100, 3])
    node = traced_node(aten.nll_loss_forward.default, lp, t, None, 1, -100)
    for mesh in ((2,), (2, 2)):
        s = next(s for s in node_strategies(node, mesh).strategies
                 if s.ins == (((S(0),) * len(mesh)), (R,) * len(mesh)))
        assert s.impls == ("nll_loss_mean_whole_target",) * len(mesh) and not s.raw_outs
        loss, total = simulate.run_sharded(aten.nll_loss_forward.default,
                                           (lp, t, None, 1, -100), {}, op_info(node), s, mesh)
        want_loss, want_total = aten.nll_loss_forward(lp, t, None, 1, -100)
        assert s.outs == ((Partial(),) * len(mesh), (R,) * len(mesh))
        assert torch.equal(total, want_total)
        assert torch.allclose(loss, want_loss)


def test_one_rank_aware_kernel_per_op_never_two_across_mesh_axes():
    """Only the first named impl of a strategy runs, so a strategy naming two different ones
    (one per mesh axis) would run half its layout wrong: none is made."""
    lp = randn(4, 6).log_softmax(1)
    node = traced_node(aten.nll_loss_forward.default, lp, torch.tensor([1, 2, 0, 3]),
                       None, 1, -100)
    strategies = node_strategies(node, (2, 2)).strategies
    assert {i for s in strategies for i in s.impls if i} == {
        "nll_loss_mean_global", "nll_loss_mean_whole_target"}
    assert all(len({i for i in s.impls if i}) <= 1 for s in strategies)


# --- random ops and factories ------------------------------------------------------------------


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
@pytest.mark.parametrize("target, make_args", [
    (aten.native_dropout.default, lambda x: (x, 0.3, True)),
    (aten.bernoulli.p, lambda x: (x, 0.5)),
    (aten.bernoulli.default, lambda x: (x.abs().clamp(max=1),)),
    (aten.rand_like.default, lambda x: (x,)),
    (aten.randn_like.default, lambda x: (x,)),
    (aten.normal.Tensor_float, lambda x: (x, 2.0)),
    (aten.uniform_.default, lambda x: (x, -1.0, 1.0)),
    (aten.bernoulli_.float, lambda x: (x, 0.4)),
    (aten.randn.default, lambda x: (list(x.shape),)),
])
def test_a_sharded_random_op_draws_the_single_device_values_on_every_rank(target, make_args, mesh):
    """Each rank draws the whole tensor from a generator in the single device's state and
    keeps its piece: with the same seed, its values are the single device's at its place, so
    shards differ from one another (a local draw would repeat one mask on every shard)."""
    from autopar.passes.strategies import simulate
    from autopar.passes.strategies.localize import LocalContext, local_call
    from autopar.passes.strategies.registry import op_info

    torch.manual_seed(0)
    call = make_args(randn(4, 8))
    tensors = [a for a in call if isinstance(a, torch.Tensor)]  # first in these ops' args
    node = traced_node(target, *call)
    info = op_info(node)
    torch.manual_seed(5)
    want = target(*[a.clone() if isinstance(a, torch.Tensor) else a for a in call])
    want = [want] if isinstance(want, torch.Tensor) else list(want)
    checked = 0
    for s in node_strategies(node, mesh).strategies:
        if not any(isinstance(p, Shard) for p in s.outs[0]):
            continue
        assert {i for i in s.impls if i} == {"random_whole_draw"}
        pieces = [simulate.shard(t, spec, mesh) for t, spec in zip(tensors, s.ins)]
        for coord in simulate.coords(mesh):
            args = [p[coord] for p in pieces] + list(call[len(tensors):])
            torch.manual_seed(5)  # every rank's generator in the single device's state
            got = local_call(target, tuple(args), {}, LocalContext(info, s, mesh, coord))
            got = [got] if isinstance(got, torch.Tensor) else list(got)
            for g, w, spec in zip(got, want, s.outs):
                assert torch.equal(g, simulate.shard(w, spec, mesh)[coord]), (s, coord)
        checked += 1
    assert checked


@SETTINGS
@given(meshes, st.lists(size, min_size=1, max_size=3))
def test_random_and_factories(mesh, shape):
    torch.manual_seed(0)
    x = randn(*shape)
    n = shape[0] * 2
    for target, args, values in [
        (aten.native_dropout.default, (x, 0.3, True), False),
        (aten.native_dropout.default, (x, 0.0, True), True),  # p=0: identity, mask all true
        (aten.bernoulli_.float, (x, 1.0), True),
        (aten.bernoulli.p, (x, 0.5), False),
        (aten.rand_like.default, (x,), False),
        (aten.empty_like.default, (x,), False),
        (aten.ones.default, (shape,), True),
        (aten.zeros.default, (shape,), True),
        (aten.full.default, (shape, 1.5), True),
        (aten.empty.memory_format, (shape,), False),
        (aten.randn.default, (shape,), False),
        (aten.new_zeros.default, (x, shape), True),
        (aten.new_full.default, (x, shape, 3.0), True),
        (aten.arange.default, (n,), True),
        (aten.arange.start_step, (3, 3 + 2 * n, 2), True),
        (aten.scalar_tensor.default, (2.0,), True),
    ]:
        c = check_all(target, args, mesh_shape=mesh, values=values)
        _common_checks(c)
        out = c.node.meta["val"]
        out = out[0] if isinstance(out, tuple) else out
        if len(mesh) == 1 and out.dim() and out.shape[0] % mesh[0] == 0 and out.shape[0] > 1:
            assert any(s.outs[0] == (S(0),) for s in c.strategies), target


# --- convolutions, pools, batch/group norm, BCE ---------------------------------------------------


@pytest.mark.parametrize("transposed", [False, True])
@settings(SETTINGS, max_examples=4)
@given(meshes, st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.booleans(),
       st.sampled_from([1, 2]))
def test_conv_family(transposed, mesh, n, cin, cout, bias, groups):
    torch.manual_seed(0)
    if cin % groups or cout % groups:
        groups = 1
    x = randn(n, cin, 5, 4)
    w = randn(cin, cout // groups, 3, 3) if transposed else randn(cout, cin // groups, 3, 3)
    b = randn(cout) if bias else None
    conv_args = ([1, 1], [1, 0], [1, 1], transposed, [0, 0], groups)
    fwd = check_all(aten.convolution.default, (x, w, b, *conv_args), mesh_shape=mesh)
    _common_checks(fwd)
    out = aten.convolution(x, w, b, *conv_args)
    bwd = check_all(aten.convolution_backward.default,
                    (torch.randn_like(out), x, w, [cout] if bias else None, *conv_args,
                     [True, True, bias]), mesh_shape=mesh)
    _common_checks(bwd)
    if mesh == (2,) and groups == 1 and cin % 2 == 0:
        assert any(st_.outs == ((PS,),) and st_.ins[0] == (S(1),) for st_ in fwd.strategies)


def _bn_stats(x):
    dims = [0, *range(2, x.dim())]
    return x.mean(dims), 1 / (x.var(dims, unbiased=False) + 1e-5).sqrt()


@pytest.mark.parametrize("case", ["bn_train", "bn_eval", "gn", "maxpool", "avgpool",
                                  "adaptive", "bce_logits", "bce", "smooth_l1", "glu"])
@pytest.mark.parametrize("mesh", MESHES)
def test_misc_compute_ops(case, mesh):
    torch.manual_seed(0)
    x, g = randn(4, 6, 4, 2), randn(4, 6, 4, 2)
    w, b, rm, rv = randn(6), randn(6), randn(6), randn(6).abs() + 0.5
    if case in ("bn_train", "bn_eval"):
        train = case == "bn_train"
        _common_checks(check_all(aten.native_batch_norm.default,
                                 (x, w, b, rm.clone(), rv.clone(), train, 0.1, 1e-5),
                                 mesh_shape=mesh))
        mean, invstd = _bn_stats(x) if train else (None, None)
        _common_checks(check_all(aten.native_batch_norm_backward.default,
                                 (g, x, w, rm, rv, mean, invstd, train, 1e-5, [True] * 3),
                                 mesh_shape=mesh))
    elif case == "gn":
        c = check_all(aten.native_group_norm.default, (x, w, b, 4, 6, 8, 3, 1e-5),
                      mesh_shape=mesh)
        _common_checks(c)
        _, mean, rstd = aten.native_group_norm(x, w, b, 4, 6, 8, 3, 1e-5)
        _common_checks(check_all(aten.native_group_norm_backward.default,
                                 (g, x, mean, rstd, w, 4, 6, 8, 3, [True] * 3), mesh_shape=mesh))
    elif case == "maxpool":
        args = ([2, 2], [2, 2], [0, 0], [1, 1], False)
        _common_checks(check_all(aten.max_pool2d_with_indices.default, (x, *args),
                                 mesh_shape=mesh))
        out, idx = aten.max_pool2d_with_indices(x, *args)
        _common_checks(check_all(aten.max_pool2d_with_indices_backward.default,
                                 (torch.randn_like(out), x, *args, idx), mesh_shape=mesh))
    elif case == "avgpool":
        args = ([2, 2], [2, 2], [0, 0], False, True, None)
        _common_checks(check_all(aten.avg_pool2d.default, (x, *args), mesh_shape=mesh))
        out = aten.avg_pool2d(x, *args)
        _common_checks(check_all(aten.avg_pool2d_backward.default,
                                 (torch.randn_like(out), x, *args), mesh_shape=mesh))
    elif case == "glu":
        _common_checks(check_all(aten.glu.default, (x, 1), mesh_shape=mesh))
        _common_checks(check_all(aten.glu_backward.default, (g[:, :3].contiguous(), x, 1),
                                 mesh_shape=mesh))
    elif case == "adaptive":
        _common_checks(check_all(aten._adaptive_avg_pool2d.default, (x, [2, 1]), mesh_shape=mesh))
    elif case in ("bce_logits", "bce"):
        p = torch.rand(4, 6, dtype=F64) * 0.8 + 0.1
        target = aten.binary_cross_entropy_with_logits.default if case == "bce_logits" else \
            aten.binary_cross_entropy.default
        for reduction in (0, 1, 2):
            args = (randn(4, 6) if case == "bce_logits" else p, torch.rand(4, 6, dtype=F64),
                    randn(6).abs())
            if case == "bce_logits":
                args = (*args, randn(6).abs())
            _common_checks(check_all(target, (*args, reduction), mesh_shape=mesh))
        gb = torch.tensor(0.3, dtype=F64)
        if case == "bce":
            _common_checks(check_all(aten.binary_cross_entropy_backward.default,
                                     (gb, p, torch.rand(4, 6, dtype=F64), None, 1),
                                     mesh_shape=mesh))
    else:
        y = randn(4, 6)
        for reduction in (0, 1, 2):
            _common_checks(check_all(aten.smooth_l1_loss.default, (x[:, :, 0, 0], y, reduction, 0.5),
                                     mesh_shape=mesh))
            gb = randn(4, 6) if reduction == 0 else torch.tensor(0.3, dtype=F64)
            _common_checks(check_all(aten.smooth_l1_loss_backward.default,
                                     (gb, x[:, :, 0, 0].contiguous(), y, reduction, 0.5),
                                     mesh_shape=mesh))


# --- the validator itself -------------------------------------------------------------------------


def _strategy(ins, outs, impls=()):
    from autopar.passes.strategies.registry import Strategy

    return Strategy(tuple((p,) for p in ins), tuple((p,) for p in outs), impls)


@pytest.mark.parametrize("target, args, ins, outs", [
    (aten.add.Tensor, (randn(4, 3), randn(4, 3)), (PS, R), (PS,)),  # bias counted n times
    (aten.exp.default, (randn(4, 3),), (PS,), (PS,)),  # nonlinear
    (aten.mul.Tensor, (randn(4, 3), randn(4, 3)), (PS, PS), (PS,)),  # cross terms missing
    (aten.mean.dim, (randn(4, 3), [0]), (S(0),), (PS,)),  # local mean, no global count
    (aten.amax.default, (randn(4, 3), [1]), (PM,), (PS,)),  # max pieces are not addends
    (aten.mm.default, (randn(4, 6), randn(6, 2)), (S(1), R), (PS,)),  # contraction half-sharded
    (aten._softmax.default, (randn(4, 6), 1, False), (S(1),), (S(1),)),  # normalised dim split
    (aten.add.Tensor, (randn(4, 3), randn(3)), (S(1), R), (S(1),)),  # wrong broadcast operand
])
def test_validator_catches_wrong_rules(target, args, ins, outs):
    from autopar.passes.strategies import simulate
    from autopar.passes.strategies.registry import op_info

    node = traced_node(target, *args)
    with pytest.raises((AssertionError, RuntimeError)):
        simulate.check_strategy(target, args, {}, op_info(node), _strategy(ins, outs), (2,))


# --- no rule -------------------------------------------------------------------------------------


@torch.library.custom_op("autopar_test::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return x.flip(0) * 2


@_mystery.register_fake
def _(x):
    return torch.empty_like(x)


def test_op_without_rule_is_replicated_and_reported():
    node = traced_node(torch.ops.autopar_test.mystery.default, randn(4, 2))
    for mesh in MESHES:
        res = node_strategies(node, mesh)
        assert res.missing_rule
        assert [s.outs for s in res.strategies] == [((R,) * len(mesh),)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="_fused_rms_norm_backward has no CPU kernel")
def test_fused_rms_norm_backward_on_gpu():
    x = randn(2, 4, 6).cuda()
    w = randn(6).cuda()
    rstd = aten._fused_rms_norm(x, [6], w, 1e-5)[1]
    for mesh in MESHES:
        c = check_all(aten._fused_rms_norm_backward.default,
                      (torch.randn_like(x), x, [6], rstd, w, [True, True]), mesh_shape=mesh)
        _common_checks(c)
        if mesh == (2,):
            assert one_axis(c, (S(1), S(1), S(1), R), (S(1), PS))


# --- every compute node of the tiny reference models, on the values of a real step ------------

MY_FAMILIES = ("matmul", "pointwise", "reduction", "norm", "loss", "random", "conv")
RANDOM_OPS = [aten.native_dropout, aten.bernoulli_, aten.bernoulli, aten.rand_like,
              aten.randn_like, aten.empty_like, aten.empty, aten.empty_strided, aten.rand,
              aten.randn]


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama3-tiny", "mlp-tiny"])
def test_reference_model_nodes(preset):
    models = pytest.importorskip("autopar.models")
    from autopar.capture.joint import capture
    from autopar.passes.strategies.registry import rule_fn

    torch.manual_seed(0)
    p = models.get_preset(preset)
    pg = capture(p.build("meta"), p.example_inputs(2, 8))
    model = p.build("cpu")
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    flat = [state[n].detach() for n in pg.param_names + pg.buffer_names]
    flat += list(p.example_inputs(2, 8, device="cpu"))

    def mine(n) -> bool:
        fn = rule_fn(n.target)
        return fn is not None and fn.__module__.rsplit(".", 1)[-1] in MY_FAMILIES

    done = check_graph(pg.gm, flat, (2,), select=mine, random_ops=RANDOM_OPS)
    assert "aten.mm.default" in done or "aten.addmm.default" in done
