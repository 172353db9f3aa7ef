"""Reusable harness for validating sharding rules against full-tensor results.

``traced_node(target, *args, **kwargs)`` traces ``target(*args, **kwargs)`` on small real tensors
with ``make_fx`` and returns the fx node of ``target`` with ``meta["val"]`` and
``meta["autopar"]`` filled, as :mod:`autopar.capture.joint` leaves them. ``check_all`` enumerates every
strategy the registry gives that node on a mesh and runs :func:`simulate.check_strategy` on each.

Import it from a test file in this folder with ``from rule_harness import ...`` (pytest puts the
test's folder on ``sys.path``; there are no ``__init__.py`` files in ``tests/``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.capture.joint import _metas
from autopar.ir.graph import NodeFacts
from autopar.ir.placements import local_shape
from autopar.passes.strategies import simulate
from autopar.passes.strategies.localize import LocalContext, local_call
from autopar.passes.strategies.registry import NodeStrategies, Strategy, node_strategies, op_info

MESHES: list[tuple[int, ...]] = [(2,), (3,), (2, 2)]


def traced_node(target: Any, *args: Any, allow_direct: bool = True, **kwargs: Any) -> fx.Node:
    """The node of ``target`` in a ``make_fx`` trace of ``target(*args, **kwargs)``.

    Every tensor (also inside lists) becomes a graph input, so the node's tensor inputs are the
    call's tensors in the registry's flattened order. If ``target`` decomposes under
    ``make_fx`` (a CompositeImplicit op on CPU), the node is built by hand instead, unless
    ``allow_direct=False``, which raises.
    """
    flat, spec = tree_flatten((args, kwargs))
    is_t = [isinstance(x, torch.Tensor) for x in flat]
    tensors = [x for x, t in zip(flat, is_t) if t]

    def f(*ts):
        it = iter(ts)
        vals = [next(it) if t else x for x, t in zip(flat, is_t)]
        a, k = tree_unflatten(vals, spec)
        return target(*a, **k)

    gm = make_fx(f, tracing_mode="real")(*[t.clone() for t in tensors])
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]
    if not found:
        if not allow_direct:
            ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            raise AssertionError(f"{target} did not survive tracing; the graph has {ops}")
        # decomposed on CPU (e.g. _fused_rms_norm) but kept by other backends: build it by hand
        gm = _direct_graph(target, flat, is_t, spec)
        found = [n for n in gm.graph.nodes if n.op == "call_function"]
    node = found[-1]
    for n in gm.graph.nodes:
        if n.op in ("call_function", "placeholder"):
            kind = "placeholder" if n.op == "placeholder" else str(n.target)
            n.meta["autopar"] = NodeFacts(n.name, kind, _metas(n.meta.get("val")), "activation")
    node.meta["harness_graph"] = gm  # keep the graph alive with the node
    return node


def _direct_graph(target: Any, flat: list, is_t: list[bool], spec: Any) -> fx.GraphModule:
    g = fx.Graph()
    vals = []
    for i, (x, t) in enumerate(zip(flat, is_t)):
        if t:
            ph = g.placeholder(f"t{i}")
            ph.meta["val"] = x
            vals.append(ph)
        else:
            vals.append(x)
    a, k = tree_unflatten(vals, spec)
    node = g.call_function(target, tuple(a), dict(k))
    ra, rk = tree_unflatten(list(flat), spec)
    node.meta["val"] = target(*simulate._clone_tree(ra), **simulate._clone_tree(rk))
    g.output(node)
    return fx.GraphModule(torch.nn.Module(), g)


@dataclass
class Checked:
    node: fx.Node
    result: NodeStrategies
    mesh_shape: tuple[int, ...]

    @property
    def strategies(self) -> list[Strategy]:
        return self.result.strategies


def check_all(
    target: Any,
    args: tuple,
    kwargs: dict | None = None,
    mesh_shape: tuple[int, ...] = (2,),
    values: bool = True,
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> Checked:
    """Trace ``target(*args, **kwargs)``, check every strategy on ``mesh_shape``, return them.

    ``values=False`` checks only per-rank output shapes and dtypes (random ops, ``empty``)."""
    kwargs = kwargs or {}
    node = traced_node(target, *args, **kwargs)
    res = node_strategies(node, mesh_shape)
    info = op_info(node)
    for s in res.strategies:
        if values:
            simulate.check_strategy(target, args, kwargs, info, s, mesh_shape, atol, rtol)
        else:
            check_local_shapes(target, args, kwargs, s, mesh_shape, node)
    return Checked(node, res, mesh_shape)


def check_local_shapes(
    target: Any, args: tuple, kwargs: dict, strategy: Strategy, mesh_shape: tuple[int, ...],
    node: fx.Node,
) -> None:
    """Every rank's local outputs have the shard's shape and the full output's dtype."""
    info = op_info(node)
    tensors = simulate._flatten_tensors((args, kwargs))
    placed = [simulate.shard(t, s, mesh_shape) for t, s in zip(tensors, strategy.ins)]
    for c in simulate.coords(mesh_shape):
        it = iter([pl[c] for pl in placed])
        a, k = simulate._replace_tensors((args, kwargs), it)
        out = local_call(target, a, k, LocalContext(info, strategy, mesh_shape, c))
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for j, (o, meta) in enumerate(zip(outs, info.outputs)):
            if meta is None or not isinstance(o, torch.Tensor):
                continue
            want = local_shape(meta.shape, strategy.outs[j], mesh_shape)
            assert tuple(o.shape) == want, f"{strategy} rank {c} out {j}: {tuple(o.shape)} != {want}"
            assert o.dtype == meta.dtype, f"{strategy} rank {c} out {j}: {o.dtype} != {meta.dtype}"


def node_values(gm: fx.GraphModule, flat_inputs: list) -> dict[fx.Node, Any]:
    """Run ``gm`` on real flattened inputs (one per placeholder) and keep every node's value."""
    vals: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            vals[n] = super().run_node(n)
            return vals[n]

    with torch.no_grad():
        Recorder(gm).run(*flat_inputs, enable_io_processing=False)
    return vals


def check_graph(
    gm: fx.GraphModule,
    flat_inputs: list,
    mesh_shape: tuple[int, ...] = (2,),
    select: Callable[[fx.Node], bool] = lambda n: True,
    per_target: int = 1,
    random_ops: Iterable[Any] = (),
    atol: float = 1e-4,
    rtol: float = 1e-3,
) -> dict[str, int]:
    """Check every strategy of the selected nodes of a captured graph on the real values its
    inputs take in a real run (so norm statistics, loss targets, masks are consistent).

    Nodes need ``meta["autopar"]`` (``capture`` fills it). At most ``per_target`` nodes per op
    are checked; ops in ``random_ops`` are checked for shapes only. Returns checks per op."""
    vals = node_values(gm, flat_inputs)
    random_ops = set(random_ops)
    done: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        key = str(n.target)
        if done.get(key, 0) >= per_target or not select(n):
            continue
        done[key] = done.get(key, 0) + 1

        def real(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return vals[a]
            if isinstance(a, (list, tuple)):
                return type(a)(real(x) for x in a)
            return a

        args = tuple(real(a) for a in n.args)
        kwargs = {k: real(v) for k, v in n.kwargs.items()}
        info = op_info(n)
        for s in node_strategies(n, mesh_shape).strategies:
            try:
                if n.target in random_ops or n.target.overloadpacket in random_ops:
                    check_local_shapes(n.target, args, kwargs, s, mesh_shape, n)
                else:
                    simulate.check_strategy(n.target, args, kwargs, info, s, mesh_shape,
                                            atol, rtol)
            except Exception as e:
                raise AssertionError(f"{n.name} = {key}{info.inputs}: {s}: {e}") from e
    return done


def replicated_strategy(checked: Checked) -> Strategy:
    n = len(checked.mesh_shape)
    ins = tuple(simulate.replicated(n) for _ in op_info(checked.node).inputs)
    outs = tuple(simulate.replicated(n) for _ in op_info(checked.node).outputs)
    return Strategy(ins, outs)


def has_rule(checked: Checked, pred: Callable[[Strategy], bool]) -> bool:
    return any(pred(s) for s in checked.strategies)


def one_axis(checked: Checked, ins: Iterable, outs: Iterable) -> bool:
    """Whether a strategy with these per-input / per-output placements (1-D mesh) exists."""
    want = (tuple((p,) for p in ins), tuple((p,) for p in outs))
    return any((s.ins, s.outs) == want for s in checked.strategies)


def rand(*shape: int, dtype: torch.dtype = torch.float32, gen: torch.Generator | None = None):
    """A small random tensor (doubles keep tolerances tight for reductions)."""
    if dtype.is_floating_point:
        return torch.randn(*shape, generator=gen, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(0, 5, shape, generator=gen, dtype=dtype)
