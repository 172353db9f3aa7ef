"""Property tests of the data-movement rule families: views, indexing, embedding, attention, MoE.

Each test draws small shapes (dims the mesh does not divide included) and a mesh (2, 3 or 2x2),
traces the op on real tensors, and validates every strategy ``node_strategies`` offers by
simulating all ranks against the full-tensor result (localizers and special impls included).
Key strategies are asserted to be offered: batch-sharded views, vocab-parallel embedding,
head-sharded attention, expert-parallel gathers and matmuls.
"""

from __future__ import annotations

import torch
from harness.rules import MESHES, Checked, check_all, traced_node
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from autopar.ir.placements import Partial, R, Shard
from autopar.passes.strategies.registry import Strategy, node_strategies

aten = torch.ops.aten
P = Partial("sum")
S = Shard
INT_MAX = 9223372036854775807

SETTINGS = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
meshes = st.sampled_from(MESHES)
size = st.integers(1, 6)
shapes = st.lists(size, min_size=1, max_size=4).map(tuple)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(tuple(shape), dtype=torch.float64)


def has(c: Checked | list[Strategy], ins: tuple | None = None, outs: tuple | None = None,
        impl: str | None = None) -> bool:
    """A strategy with these placements on mesh axis 0 (other axes replicated) exists."""
    strategies = c.strategies if isinstance(c, Checked) else c
    for s in strategies:
        if any(p != R for spec in s.ins + s.outs for p in spec[1:]):
            continue
        if ins is not None and tuple(spec[0] for spec in s.ins) != tuple(ins):
            continue
        if outs is not None and tuple(spec[0] for spec in s.outs)[: len(outs)] != tuple(outs):
            continue
        if impl is not None and impl not in s.impls:
            continue
        return True
    return False


def split_by(n: int, mesh: tuple[int, ...]) -> bool:
    """Whether mesh axis 0 divides a dim of size ``n`` into more than one piece."""
    return n > 1 and n % mesh[0] == 0


# --- reshapes --------------------------------------------------------------------------------


@st.composite
def reshape_pairs(draw):
    """(src, dst): dst merges adjacent runs of src, splits a dim, and adds/removes size-1 dims."""
    src = draw(shapes)
    if draw(st.integers(0, 3)) == 0:  # any regrouping: (2, 3) -> (3, 2), (4, 6) -> (6, 4)...
        total = 1
        for x in src:
            total *= x
        dst_any: list[int] = []
        while total > 1 and len(dst_any) < 3:
            f = draw(st.sampled_from([d for d in range(1, total + 1) if total % d == 0]))
            dst_any.append(f)
            total //= f
        return src, tuple(dst_any + [total])
    dst: list[int] = []
    i = 0
    while i < len(src):
        run = draw(st.integers(1, len(src) - i))
        prod = 1
        for s in src[i : i + run]:
            prod *= s
        dst.append(prod)
        i += run
    k = draw(st.integers(0, len(dst) - 1))
    divisors = [d for d in range(2, dst[k]) if dst[k] % d == 0]
    if divisors and draw(st.booleans()):
        d = draw(st.sampled_from(divisors))
        dst[k : k + 1] = [d, dst[k] // d]
    if draw(st.booleans()):
        dst.insert(draw(st.integers(0, len(dst))), 1)
    return src, tuple(dst)


@settings(SETTINGS, max_examples=25)
@given(meshes, reshape_pairs(), st.sampled_from([aten.view.default, aten._unsafe_view.default]))
def test_view_family(mesh, pair, op):
    src, dst = pair
    c = check_all(op, (randn(*src), list(dst)), mesh_shape=mesh)
    assert has(c, (P,), (P,))
    if split_by(src[0], mesh) and split_by(dst[0], mesh):
        assert has(c, (S(0),), (S(0),)), "a batch-sharded view must stay batch-sharded"


@settings(SETTINGS, max_examples=15)
@given(meshes, shapes, st.integers(0, 2), st.data())
def test_expand(mesh, shape, lead, data):
    src = tuple(s if data.draw(st.booleans()) else 1 for s in shape)
    dst = [data.draw(size) for _ in range(lead)] + [
        s if s != 1 else data.draw(size) for s in src]
    c = check_all(aten.expand.default, (randn(*src), dst), mesh_shape=mesh)
    if split_by(dst[0], mesh) and (lead or src[0] == dst[0]):
        assert has(c, outs=(S(0),))


@settings(SETTINGS, max_examples=15)
@given(meshes, shapes, st.data())
def test_permutes(mesh, shape, data):
    x = randn(*shape)
    perm = data.draw(st.permutations(range(len(shape))))
    check_all(aten.permute.default, (x, list(perm)), mesh_shape=mesh)
    if len(shape) >= 2:
        d0, d1 = data.draw(st.integers(0, len(shape) - 1)), data.draw(st.integers(-len(shape), -1))
        check_all(aten.transpose.int, (x, d0, d1), mesh_shape=mesh)
        c = check_all(aten.t.default, (randn(*shape[:2]),), mesh_shape=mesh)
        if split_by(shape[0], mesh):
            assert has(c, (S(0),), (S(1),))


@settings(SETTINGS, max_examples=15)
@given(meshes, shapes, st.data())
def test_squeeze_unsqueeze(mesh, shape, data):
    ndim = len(shape)
    x = randn(*shape)
    check_all(aten.unsqueeze.default, (x, data.draw(st.integers(-ndim - 1, ndim))), mesh_shape=mesh)
    # squeeze of a dim that is not 1 is a no-op globally; a rank whose piece of it is 1 long
    # must not drop it (the "squeeze_global" impl)
    d = data.draw(st.integers(0, ndim - 1))
    c = check_all(aten.squeeze.dim, (x, d), mesh_shape=mesh)
    if shape[d] == mesh[0] and len(mesh) == 1:
        assert has(c, (S(d),), (S(d),), impl="squeeze_global")
    dims = sorted(set(data.draw(st.lists(st.integers(0, ndim - 1), max_size=ndim))))
    check_all(aten.squeeze.dims, (x, dims), mesh_shape=mesh)
    check_all(aten.squeeze.default, (x,), mesh_shape=mesh)


# --- splitting and joining -------------------------------------------------------------------


@settings(SETTINGS, max_examples=15)
@given(meshes, shapes, st.data())
def test_split_unbind(mesh, shape, data):
    ndim = len(shape)
    x = randn(*shape)
    d = data.draw(st.integers(0, ndim - 1))
    check_all(aten.split.Tensor, (x, data.draw(st.integers(1, 4)), d), mesh_shape=mesh)
    sizes = [shape[d] // 2, shape[d] - shape[d] // 2]
    check_all(aten.split_with_sizes.default, (x, sizes, d), mesh_shape=mesh)
    c = check_all(aten.unbind.int, (x, d), mesh_shape=mesh)
    others = [k for k in range(ndim) if k != d and split_by(shape[k], mesh)]
    if others:
        k = others[0]
        assert has(c, (S(k),), (S(k if k < d else k - 1),))


@settings(SETTINGS, max_examples=15)
@given(meshes, shapes, st.integers(1, 3), st.data())
def test_cat_stack(mesh, shape, n, data):
    ndim = len(shape)
    d = data.draw(st.integers(0, ndim - 1))
    parts = []
    for _ in range(n):
        s = list(shape)
        s[d] = data.draw(size)
        parts.append(randn(*s))
    c = check_all(aten.cat.default, (parts, d), mesh_shape=mesh)
    assert has(c, (P,) * n, (P,))
    check_all(aten.stack.default, ([randn(*shape) for _ in range(n)], d), mesh_shape=mesh)


@settings(SETTINGS, max_examples=20)
@given(meshes, shapes, st.data())
def test_slice_select(mesh, shape, data):
    ndim = len(shape)
    d = data.draw(st.integers(0, ndim - 1))
    x = randn(*shape)
    start = data.draw(st.integers(-shape[d], shape[d]))
    end = data.draw(st.sampled_from([INT_MAX, shape[d], -1, 1]))
    step = data.draw(st.integers(1, 2))
    check_all(aten.slice.Tensor, (x, d, start, end, step), mesh_shape=mesh)
    # HF writes x[:, :] everywhere: a whole-dim slice must keep the dim's shard
    c = check_all(aten.slice.Tensor, (x, d, 0, INT_MAX), mesh_shape=mesh)
    if split_by(shape[d], mesh):
        assert has(c, (S(d),), (S(d),))
    full = list(shape)
    full[d] = shape[d] + data.draw(st.integers(0, 3))
    off = data.draw(st.integers(0, full[d] - shape[d]))
    check_all(aten.slice_backward.default, (x, full, d, off, off + shape[d], 1), mesh_shape=mesh)
    idx = data.draw(st.integers(-shape[d], shape[d] - 1))
    y = check_all(aten.select.int, (x, d, idx), mesh_shape=mesh)
    assert y.strategies
    g = randn(*[s for k, s in enumerate(shape) if k != d])
    check_all(aten.select_backward.default, (g, list(shape), d, idx % shape[d]), mesh_shape=mesh)


@settings(SETTINGS, max_examples=10)
@given(meshes, shapes, st.data())
def test_pad_tril_repeat(mesh, shape, data):
    x = randn(*shape)
    pad = data.draw(st.lists(st.integers(0, 2), min_size=2, max_size=2 * len(shape)))
    pad = pad[: 2 * (len(pad) // 2)]
    check_all(aten.constant_pad_nd.default, (x, pad, 0.0), mesh_shape=mesh)
    check_all(aten.constant_pad_nd.default, (x, pad, 1.5), mesh_shape=mesh)
    if len(shape) >= 2:
        check_all(aten.tril.default, (x,), mesh_shape=mesh)
    reps = [data.draw(st.integers(1, 2)) for _ in range(len(shape) + 1)]
    check_all(aten.repeat.default, (x, reps), mesh_shape=mesh)


# --- gathers and scatters --------------------------------------------------------------------


@settings(SETTINGS, max_examples=15)
@given(meshes, size, size, size, st.data())
def test_index_select_gather_scatter(mesh, a, b, n, data):
    x = randn(a, b)
    d = data.draw(st.integers(0, 1))
    ids = torch.randint(0, x.shape[d], (n,))
    c = check_all(aten.index_select.default, (x, d, ids), mesh_shape=mesh)
    if split_by(x.shape[d], mesh):
        assert has(c, (S(d), R), (P,), impl="masked_index")
    idx_shape = [a, b]
    idx_shape[1 - d] = data.draw(st.sampled_from([idx_shape[1 - d], 1]))
    idx = torch.randint(0, x.shape[d], idx_shape)
    check_all(aten.gather.default, (x, d, idx), mesh_shape=mesh)
    src = randn(*idx_shape)
    check_all(aten.scatter_add.default, (x, d, idx, src), mesh_shape=mesh)
    perm = torch.argsort(torch.rand(a, b), dim=d)  # overwrite scatter: no duplicate targets
    check_all(aten.scatter.src, (x, d, perm, randn(a, b)), mesh_shape=mesh)
    check_all(aten.scatter.value, (x, d, perm, 0.0), mesh_shape=mesh)
    check_all(aten.index_add.default, (x, d, ids, randn(*[n if k == d else x.shape[k]
                                                           for k in range(2)])), mesh_shape=mesh)


@settings(SETTINGS, max_examples=15)
@given(meshes, size, size, size, st.integers(1, 8), st.data())
def test_index_and_index_put(mesh, e, f, d, n, data):
    """``w[ids]`` on stacked expert weights (HF ``batched_mm`` experts) and its backward."""
    w = randn(e, f, d)
    ids = torch.randint(0, e, (n,))
    c = check_all(aten.index.Tensor, (w, [ids]), mesh_shape=mesh)
    if split_by(e, mesh):
        assert has(c, (S(0), R), (P,), impl="masked_index"), "expert-parallel gather"
    if split_by(n, mesh):
        assert has(c, (R, S(0)), (S(0),))
    check_all(aten.index.Tensor, (w, [None, torch.randint(0, f, (2, n))]), mesh_shape=mesh)
    check_all(aten.index.Tensor, (w, [ids, None, torch.randint(0, d, (n,))]), mesh_shape=mesh)
    vals = randn(n, f, d)
    c = check_all(aten.index_put.default, (torch.zeros(e, f, d, dtype=torch.float64), [ids], vals,
                                           True), mesh_shape=mesh)
    if split_by(e, mesh):
        assert has(c, (S(0), R, R), (S(0),), impl="masked_index_put")
    if split_by(n, mesh):
        assert has(c, (P, S(0), S(0)), (P,))
    perm = torch.randperm(e)
    check_all(aten.index_put.default, (w, [perm], randn(e, f, d), False), mesh_shape=mesh)
    check_all(aten.index_put.default, (w, [perm], randn(1, d), False), mesh_shape=mesh)


# --- embedding -------------------------------------------------------------------------------


@settings(SETTINGS, max_examples=20)
@given(meshes, size, size, st.integers(2, 12), size, st.sampled_from([-1, 0, 3]),
       st.booleans())
def test_embedding(mesh, b, s, v, d, padding_idx, scale_by_freq):
    assume(padding_idx < v)
    w = randn(v, d)
    ids = torch.randint(0, v, (b, s))
    c = check_all(aten.embedding.default, (w, ids), mesh_shape=mesh)
    if split_by(v, mesh):
        assert has(c, (S(0), R), (P,), impl="vocab_parallel_embedding")
    if split_by(b, mesh):
        assert has(c, (R, S(0)), (S(0),))
    if split_by(d, mesh):
        assert has(c, (S(1), R), (S(2),))
    g = randn(b, s, d)
    c = check_all(aten.embedding_dense_backward.default, (g, ids, v, padding_idx, scale_by_freq),
                  mesh_shape=mesh)
    if split_by(v, mesh):
        assert has(c, (R, R), (S(0),), impl="vocab_parallel_embedding_backward")
    if split_by(b, mesh) and not scale_by_freq:
        assert has(c, (S(0), S(0)), (P,))


# --- attention -------------------------------------------------------------------------------

FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_CPU_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@settings(SETTINGS, max_examples=20)
@given(meshes, st.integers(1, 4), st.sampled_from([(4, 2), (4, 4), (2, 1), (3, 3), (6, 2)]),
       size, size, st.booleans(), st.sampled_from([None, "bhls", "1hls", "ls"]))
def test_sdpa_cpu(mesh, b, heads, lq, lk, causal, mask_kind):
    h, hkv = heads
    if causal:
        lk, mask_kind = lq, None  # the fused kernel takes no mask with is_causal
    torch.manual_seed(0)
    q, k, v = randn(b, h, lq, 8), randn(b, hkv, lk, 8), randn(b, hkv, lk, 8)
    kw = {}
    if mask_kind:
        shape = {"bhls": (b, h, lq, lk), "1hls": (1, h, lq, lk), "ls": (lq, lk)}[mask_kind]
        kw["attn_mask"] = randn(*shape)
    c = check_all(FLASH_CPU, (q, k, v, 0.0, causal), kw, mesh_shape=mesh)
    out, lse = FLASH_CPU(q, k, v, 0.0, causal, **kw)
    cb = check_all(FLASH_CPU_BWD, (randn(*out.shape), q, k, v, out, lse, 0.0, causal), kw,
                   mesh_shape=mesh)
    if split_by(h, mesh) and split_by(hkv, mesh):
        assert has(c, outs=(S(1), S(1))), "head-sharded attention"
        assert has(cb, outs=(S(1), S(1), S(1)))
    if split_by(b, mesh):
        assert has(c, outs=(S(0), S(0)))
    if split_by(lq, mesh):  # query-sequence split; causal ones shift the mask by the offset
        impl = "causal_query_split" if causal else None
        assert has(c, outs=(S(2), S(2)), impl=impl)
        assert has(cb, outs=(S(2), P, P), impl=impl)


def _gpu_sdpa_calls():
    """(op, args) of the CUDA kernels on meta tensors: the rules are checked by structure."""
    b, h, lq, lk, e = 2, 4, 6, 8, 16
    q, k, v = (torch.empty(b, h, n, e, device="meta") for n in (lq, lk, lk))
    out = torch.empty(b, h, lq, e, device="meta")
    lse = torch.empty(b, h, lq, device="meta")
    bias = torch.empty(1, h, lq, lk, device="meta")
    seed = torch.empty((), dtype=torch.int64, device="meta")
    calls = []
    if hasattr(aten, "_scaled_dot_product_efficient_attention"):
        calls.append((aten._scaled_dot_product_efficient_attention.default,
                      (q, k, v, bias, True, 0.0, False)))
        lse32 = torch.empty(b, h, 32, device="meta")
        calls.append((aten._scaled_dot_product_efficient_attention_backward.default,
                      (out, q, k, v, bias, out, lse32, seed, seed, 0.0, [True, True, True, True])))
    if hasattr(aten, "_scaled_dot_product_flash_attention"):
        calls.append((aten._scaled_dot_product_flash_attention.default, (q, k, v, 0.0, True)))
        calls.append((aten._scaled_dot_product_flash_attention_backward.default,
                      (out, q, k, v, out, lse, None, None, lq, lk, 0.0, True, seed, seed)))
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        calls.append((aten._scaled_dot_product_cudnn_attention.default,
                      (q, k, v, None, True, 0.0, False)))
        calls.append((aten._scaled_dot_product_cudnn_attention_backward.default,
                      (out, q, k, v, out, lse, seed, seed, bias, None, None, lq, lk, 0.0, False)))
    return calls


def _node_on_meta(op, args):
    import torch.fx as fx

    from autopar.capture.joint import _metas
    from autopar.ir.graph import NodeFacts

    g = fx.Graph()

    def lift(a):
        if isinstance(a, torch.Tensor):
            ph = g.placeholder(f"t{len(g.nodes)}")
            ph.meta["val"] = a
            return ph
        return type(a)(lift(x) for x in a) if isinstance(a, (list, tuple)) else a

    node = g.call_function(op, tuple(lift(a) for a in args))
    val = op(*args)
    node.meta["val"] = val
    node.meta["autopar"] = NodeFacts(node.name, str(op), _metas(val), "activation")
    return node


def test_sdpa_gpu_kernels_structure():
    """Batch and head splits of every CUDA SDPA kernel: q/k/v/out/lse/grads all split alike,
    RNG state whole, a head-broadcast bias whole under a batch split."""
    calls = _gpu_sdpa_calls()
    assert calls, "this torch has no CUDA SDPA kernels registered"
    for op, args in calls:
        try:
            node = _node_on_meta(op, args)
        except (RuntimeError, NotImplementedError):  # no meta kernel in this torch: skip it
            continue
        res = node_strategies(node, (2,))
        assert not res.missing_rule, op
        big = [i for i, a in enumerate(node.meta["autopar"].outputs)
               if a is not None and len(a.shape) >= 3 and a.shape[0] == 2]
        for dim in (0, 1):
            found = [s for s in res.strategies if s.ins[0] == (S(dim),)]
            assert found, f"{op}: no split of dim {dim}"
            st_ = found[0]
            assert st_.ins[1] == st_.ins[2] == (S(dim),)  # key, value
            for i in big:
                assert st_.outs[i] == (S(dim),), (op, i, st_)
        for s in res.strategies:
            assert all(spec[0] != S(2) for spec in s.ins[:1]), "no sequence split off the CPU kernel"


# --- MoE -------------------------------------------------------------------------------------


@settings(SETTINGS, max_examples=10)
@given(meshes, st.sampled_from([2, 4, 6]), size, size, size)
def test_expert_parallel_bmm(mesh, e, t, d, f):
    """Stacked expert weights [E, D, F] applied to dispatched tokens [E, T, D] split on E."""
    c = check_all(aten.bmm.default, (randn(e, t, d), randn(e, d, f)), mesh_shape=mesh)
    if split_by(e, mesh):
        assert has(c, (S(0), S(0)), (S(0),))


@settings(SETTINGS, max_examples=10)
@given(meshes, st.sampled_from([(3, 12), (4, 16), (4, 12), (2, 16)]), st.booleans())
def test_grouped_mm(mesh, groups, grad_form):
    # the CPU kernel wants 16-byte aligned rows: feature sizes whose shards stay multiples of 4
    e, m = groups
    k, n = 48, 48
    offs = torch.tensor(sorted(torch.randint(0, m + 1, (e - 1,)).tolist()) + [m],
                        dtype=torch.int32)
    if grad_form:  # the weight gradient: [K, M] x [M, N] -> [E, K, N]
        a = torch.randn(m, k).t().contiguous()
        c = check_all(aten._grouped_mm.default, (a, torch.randn(m, n), offs), mesh_shape=mesh,
                      atol=1e-3, rtol=1e-3)
        if split_by(e, mesh):
            assert has(c, (R, R, R), (S(0),), impl="expert_grouped_mm")
    else:
        c = check_all(aten._grouped_mm.default, (torch.randn(m, k), torch.randn(e, k, n), offs),
                      mesh_shape=mesh, atol=1e-3, rtol=1e-3)
        if len(mesh) == 1:
            assert has(c, (R, S(2), R), (S(1),))
        if split_by(e, mesh):  # expert parallel: each rank computes its experts' rows
            assert has(c, (R, S(0), R), (P,), impl="expert_grouped_mm")


@settings(SETTINGS, max_examples=6)
@given(meshes, size, size)
def test_histc(mesh, a, b):
    x = torch.randint(0, 4, (a, b)).float()
    c = check_all(aten.histc.default, (x, 4, 0, 3), mesh_shape=mesh)
    if split_by(a, mesh):
        assert has(c, (S(0),), (P,))


def test_traced_node_keeps_view_args():
    # the planner sees -1 in view sizes from user code; the localizer uses the output shape
    node = traced_node(aten.view.default, randn(4, 6), [-1, 3])
    res = node_strategies(node, (2,))
    assert has(res.strategies, (S(0),), (S(0),))


@settings(SETTINGS, max_examples=10)
@given(meshes, shapes, st.data())
def test_flip_roll_scatter_views(mesh, shape, data):
    ndim = len(shape)
    x = randn(*shape)
    d = data.draw(st.integers(0, ndim - 1))
    check_all(aten.flip.default, (x, [d]), mesh_shape=mesh)
    check_all(aten.roll.default, (x, [1], [d]), mesh_shape=mesh)
    start = data.draw(st.integers(0, shape[d]))
    src_shape = list(shape)
    src_shape[d] = shape[d] - start
    check_all(aten.slice_scatter.default, (x, randn(*src_shape), d, start, INT_MAX),
              mesh_shape=mesh)
    sel = [s for k, s in enumerate(shape) if k != d]
    check_all(aten.select_scatter.default, (x, randn(*sel), d, shape[d] - 1), mesh_shape=mesh)
    ids = torch.randint(0, shape[d], (data.draw(size),))
    g = torch.index_select(x, d, ids)
    check_all(aten.index_select_backward.default, (g, list(shape), d, ids), mesh_shape=mesh)
