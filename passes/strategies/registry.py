"""The registry of sharding rules, keyed by ATen op, and their expansion to an N-D mesh.

A *rule function* describes one op on ONE mesh axis: given an :class:`OpInfo` (the op, its
arguments with tensors replaced by :class:`TensorMeta`, its outputs) it returns the list of
:class:`Rule`s, each a placement per tensor input and per output that computes the right
result when every rank runs the op on its local pieces. :func:`expand` takes the Cartesian
product over mesh axes (DTensor does the same), keeps the strategies whose shards divide
evenly, and drops duplicates. An op with no rule gets the all-replicated strategy and is
reported by name: planning never fails on an unknown op.

Tensor inputs are numbered in the order :func:`tensor_inputs` finds them: positional args, then
kwargs, descending into lists (``cat``'s tensor list counts element by element).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autopar.ir.graph import TensorMeta
from autopar.ir.placements import Partial, Placement, R, Replicate, Shard, Spec, evenly_divides


@dataclass(frozen=True, slots=True)
class Rule:
    """One valid way to run an op on one mesh axis."""

    ins: tuple[Placement, ...]
    outs: tuple[Placement, ...]
    # a local kernel other than "run the same op on the shards" (see localize.SPECIAL_IMPLS)
    impl: str | None = None
    # what the kernel returns when the rule all-reduces a partial output inside the op (its
    # impl then finishes the op on the reduced values: ``localize.register_finish``)
    raw_outs: tuple[Placement, ...] = ()


@dataclass(frozen=True, slots=True)
class Strategy:
    """A rule per mesh axis, stacked: ``ins[i]`` / ``outs[j]`` are specs (one placement per axis)."""

    ins: tuple[Spec, ...]
    outs: tuple[Spec, ...]
    impls: tuple[str | None, ...] = ()
    # the op's own output specs when the strategy all-reduces a partial result inside the op
    # (``outs`` is then what consumers see); empty when the op's outputs are ``outs``
    raw_outs: tuple[Spec, ...] = ()

    @property
    def op_outs(self) -> tuple[Spec, ...]:
        """What the local kernel returns, before any in-op all-reduce."""
        return self.raw_outs or self.outs

    def __repr__(self) -> str:
        def fmt(specs):
            return ", ".join("(" + ",".join(repr(p) for p in s) + ")" for s in specs)

        reduced = f" (all-reduced from [{fmt(self.raw_outs)}])" if self.raw_outs else ""
        return f"[{fmt(self.ins)}] -> [{fmt(self.outs)}]{reduced}"


@dataclass(frozen=True, slots=True)
class OpInfo:
    target: Any  # the OpOverload (or operator.getitem)
    args: tuple  # node.args with each input tensor replaced by its TensorMeta
    kwargs: dict
    inputs: tuple[TensorMeta, ...]  # tensor inputs in flattened order
    outputs: tuple[TensorMeta | None, ...]
    name: str = ""

    @property
    def out(self) -> TensorMeta:
        return self.outputs[0]  # type: ignore[return-value]

    def arg(self, i: int, name: str | None = None, default: Any = None) -> Any:
        if i < len(self.args):
            return self.args[i]
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        return default


RuleFn = Callable[[OpInfo], list[Rule]]
_RULES: dict[Any, RuleFn] = {}


def register(*ops: Any) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` for ops given as OpOverloads, OpOverloadPackets, or callables."""

    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            _RULES[op] = fn
        return fn

    return deco


def rule_fn(target: Any) -> RuleFn | None:
    _load_rule_modules()
    fn = _RULES.get(target)
    if fn is None and hasattr(target, "overloadpacket"):
        fn = _RULES.get(target.overloadpacket)
    return fn


def registered_ops() -> list[Any]:
    _load_rule_modules()
    return list(_RULES)


_LOADED = False


def _load_rule_modules() -> None:
    """Import every rule family once (they register themselves)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib
    import pkgutil

    from autopar.passes import strategies as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name not in ("registry", "localize", "__init__"):
            importlib.import_module(f"{pkg.__name__}.{mod.name}")


# --- op info --------------------------------------------------------------------------------


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in the canonical flattened order."""
    found: list[fx.Node] = []
    _collect_tensors(node.args, found)
    _collect_tensors(node.kwargs, found)
    return found


def _collect_tensors(a: Any, found: list[fx.Node]) -> None:
    if isinstance(a, fx.Node):
        if _is_tensor_node(a):
            found.append(a)
    elif isinstance(a, (list, tuple)):
        for x in a:
            _collect_tensors(x, found)
    elif isinstance(a, dict):
        for x in a.values():
            _collect_tensors(x, found)


def _tensor_arg_keys(node: fx.Node) -> list[int | str]:
    """For each of :func:`tensor_inputs`, the top-level argument it sits in (its position, or
    its keyword's name)."""
    found: list[fx.Node] = []
    keys: list[int | str] = []
    for key, a in [*enumerate(node.args), *node.kwargs.items()]:
        _collect_tensors(a, found)
        keys += [key] * (len(found) - len(keys))
    return keys


# ops that write an input their schema does not mark as written: (training flag's position,
# the positions it writes when training)
_HIDDEN_WRITES = {torch.ops.aten.native_batch_norm.default: (5, (3, 4))}  # running stats


def mutated_inputs(node: fx.Node) -> frozenset[int]:
    """Which of the node's tensor inputs (:func:`tensor_inputs` order) the op writes in place:
    those its schema marks ``Tensor(a!)``, and ``native_batch_norm``'s running stats in
    training, which its schema does not mark."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return frozenset()
    args = schema.arguments
    written = {i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write}
    hidden = _HIDDEN_WRITES.get(node.target)
    if hidden is not None and len(node.args) > hidden[0] and node.args[hidden[0]]:
        written |= set(hidden[1])
    if not written:
        return frozenset()
    names = {args[i].name for i in written}
    return frozenset(k for k, key in enumerate(_tensor_arg_keys(node))
                     if key in written or key in names)


def _is_tensor_node(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def _meta_of(n: fx.Node) -> TensorMeta:
    v = n.meta["val"]
    return TensorMeta(tuple(int(s) for s in v.shape), v.dtype)


def op_info(node: fx.Node) -> OpInfo:
    def sub(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return _meta_of(a) if _is_tensor_node(a) else a.meta.get("val")
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a

    outs = node.meta["autopar"].outputs if "autopar" in node.meta else ()
    return OpInfo(
        node.target,
        tuple(sub(a) for a in node.args),
        {k: sub(v) for k, v in node.kwargs.items()},
        tuple(_meta_of(n) for n in tensor_inputs(node)),
        tuple(outs),
        node.name,
    )


# --- expansion to the mesh ------------------------------------------------------------------


def replicated_rule(info: OpInfo) -> Rule:
    return Rule(tuple(R for _ in info.inputs), tuple(R for _ in info.outputs))


@dataclass(slots=True)
class NodeStrategies:
    strategies: list[Strategy]
    missing_rule: bool = False
    notes: list[str] = field(default_factory=list)


def node_strategies(node: fx.Node, mesh_shape: tuple[int, ...]) -> NodeStrategies:
    """All valid N-D strategies of ``node`` (never empty: all-replicated is always valid)."""
    info = op_info(node)
    if node.target is operator.getitem:
        return NodeStrategies(_getitem_strategies(node, info, mesh_shape))
    fn = rule_fn(node.target)
    if fn is None:
        return NodeStrategies(expand(info, [replicated_rule(info)], mesh_shape), True)
    rules = fn(info)
    return NodeStrategies(expand(info, rules, mesh_shape))


def _getitem_strategies(node, info, mesh_shape) -> list[Strategy]:
    # a getitem follows one output of its producer: any spec it can hold, it passes through
    src = node.args[0]
    idx = node.args[1]
    metas = src.meta["autopar"].outputs if "autopar" in src.meta else None
    meta = metas[idx] if metas else info.out
    if meta is None:
        return [Strategy((), ((R,) * len(mesh_shape),))]
    specs = all_specs(meta, mesh_shape, allow_partial=True)
    return [Strategy((s,), (s,)) for s in specs]


def all_specs(
    meta: TensorMeta, mesh_shape: tuple[int, ...], allow_partial: bool = False
) -> list[Spec]:
    per_axis: list[Placement] = [R] + [Shard(d) for d in range(len(meta.shape))]
    if allow_partial:
        per_axis.append(Partial("sum"))
    out = []
    for spec in itertools.product(per_axis, repeat=len(mesh_shape)):
        if evenly_divides(meta.shape, spec, mesh_shape):
            out.append(tuple(spec))
    return out


def expand(info: OpInfo, rules: Iterable[Rule], mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """N-D strategies: one rule per mesh axis, kept when every shard divides evenly.

    A mesh axis of size 1 only takes all-replicated rules, since sharding over one device is
    the same layout and would only multiply the strategy count.
    """
    rules = list(dict.fromkeys(rules))  # dedupe, keep order
    rep = replicated_rule(info)
    if rep not in rules:
        rules.insert(0, rep)
    per_axis = [rules if n > 1 else [rep] for n in mesh_shape]
    seen: set = set()
    out: list[Strategy] = []
    for combo in itertools.product(*per_axis):
        ins = tuple(tuple(r.ins[i] for r in combo) for i in range(len(info.inputs)))
        outs = tuple(tuple(r.outs[j] for r in combo) for j in range(len(info.outputs)))
        if not _divides(info.inputs, ins, mesh_shape):
            continue
        if not _divides(info.outputs, outs, mesh_shape):
            continue
        key = (ins, outs)
        if key in seen:
            continue
        impls = tuple(r.impl for r in combo)
        if len({i for i in impls if i}) > 1:
            continue  # one rank-aware kernel runs per op (localize.local_call): not two
        seen.add(key)
        raw: tuple[Spec, ...] = ()
        if any(r.raw_outs for r in combo):
            raw = tuple(tuple((r.raw_outs or r.outs)[j] for r in combo)
                        for j in range(len(info.outputs)))
        out.append(Strategy(ins, outs, impls if any(impls) else (), raw))
    return out + _reduced_in_op(out, seen)


def _reduced_in_op(strategies: list[Strategy], seen: set) -> list[Strategy]:
    """For each strategy whose op makes a partial result (an output partial on a mesh axis
    where an input is sharded: a contraction split over that axis), the same op followed by
    its all-reduce, priced with the op. Every consumer that needs the whole value then shares that
    one reduction (Megatron's row-parallel linear), where reduction on the edges would pay it
    once per consumer, e.g. again for the copy the backward reads."""
    extra = []
    for s in strategies:
        made = [k for k in range(len(s.outs[0]) if s.outs else 0)
                if any(isinstance(i[k], Shard) for i in s.ins)]
        outs = tuple(tuple(R if k in made and isinstance(p, Partial) else p
                           for k, p in enumerate(spec)) for spec in s.outs)
        if outs == s.outs or (s.ins, outs) in seen:
            continue  # nothing to reduce, or the op gives that layout without a collective
        extra.append(Strategy(s.ins, outs, s.impls, raw_outs=s.op_outs))
    return extra


def _divides(metas, specs, mesh_shape) -> bool:
    for meta, spec in zip(metas, specs):
        if meta is None:
            if any(not isinstance(p, Replicate) for p in spec):
                return False
            continue
        if not evenly_divides(meta.shape, spec, mesh_shape):
            return False
    return True
