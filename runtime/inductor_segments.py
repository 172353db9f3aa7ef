"""Runs of plain steps compiled by Inductor: the per-rank program below Python.

``parallelize(..., compile=True)`` compiles what the per-rank program runs between its
collectives. A *run* is a maximal stretch of consecutive plain steps (an op on values already
in place: no reshard, no parameter gather, no rank-aware kernel, no in-op reduction, not the
loss seed; see :mod:`.step_code`; ops taking tensors in lists, like ``cat``, included), cut
after every step that may start a gradient sync so the syncs still start where the plan put
them. Each run becomes one FX graph of ATen ops, compiled
by ``torch._inductor.compile`` on the first call with that call's local tensors (fused C++
kernels on CPU, Triton on CUDA), and called as one function: its inputs the values it reads
from before the run, its outputs the values read after it (by later steps, by the backward,
or handed back as the loss or a gradient). Values made and last read inside a run never reach
Python.

What stays eager: every collective (it runs between runs, as planned, so the collectives
executed are still exactly the predicted ones) and random ops (Inductor's generator differs
from eager's; running them eagerly keeps the program's numbers equal to one device's). ATen's
fused attention kernels are tagged random for their dropout; called with ``dropout_p=0`` they
are not, and join the run. Views
are written as ``reshape``: a local kernel may lay memory out otherwise than the fake tensors
the graph was traced on (see ``lower._call_localized``), and a reshape copies only then.

A compiled run is specialized to the sizes and strides it first saw; a call with other
strides (a non-contiguous input, say) compiles again for those.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.fx as fx

from autopar.ir.errors import first_line

_VIEWS = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
          torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}
MIN_OPS = 2  # a run shorter than this (getitems not counted) stays eager: nothing to fuse


class CompiledRun:
    """``steps`` (consecutive plain steps of one phase) as one Inductor-compiled function.

    ``reads``: what the run reads from before it, as ``(producer, item)``, in call order;
    ``writes``: the values it hands out, in order, each ``(name, n_items)`` where ``n_items``
    is None for a tensor and the tuple's length for a multi-output op (handed out item by
    item); ``frees``: values made before the run that it reads last (the caller pops them)."""

    def __init__(self, steps: list[Any], template: Callable[[Any], tuple[tuple, dict]]) -> None:
        self.names = [s.name for s in steps]
        made = set(self.names)
        freed_inside = {name for s in steps for name in s.free_after}
        self.frees = sorted(freed_inside - made)
        graph = fx.Graph()
        nodes: dict[tuple[str, int | None], fx.Node] = {}
        self.reads: list[tuple[str, int | None]] = []

        def value(producer: str, item: int | None) -> fx.Node:
            key = (producer, item)
            if key not in nodes:
                if producer in made:  # an item of a multi-output op inside the run
                    nodes[key] = graph.call_function(operator.getitem,
                                                     (nodes[(producer, None)], item))
                else:
                    nodes[key] = graph.placeholder(f"in{len(self.reads)}")
                    self.reads.append(key)
            return nodes[key]

        for s in steps:
            if s.is_getitem:
                i = s.inputs[0]
                nodes[(s.name, None)] = value(i.producer, i.item)
                continue
            if s.flat is not None:
                args, kwargs = template(s)
                args = list(args)
                for pos, i in zip(s.flat, s.inputs):
                    args[pos] = value(i.producer, i.item)
            else:  # tensors in lists (cat): the node's own args, in tensor_inputs order
                fill = iter([value(i.producer, i.item) for i in s.inputs])
                args, kwargs = fx.node.map_arg((s.node.args, s.node.kwargs),
                                               lambda _, fill=fill: next(fill))
            target = _VIEWS.get(s.node.target, s.node.target)
            nodes[(s.name, None)] = graph.call_function(target, tuple(args), dict(kwargs))
        self.writes: list[tuple[str, int | None]] = []
        outs: list[fx.Node] = []
        for s in steps:
            if s.name in freed_inside:
                continue
            n_items = _n_items(s)
            self.writes.append((s.name, n_items))
            if n_items is None:
                outs.append(nodes[(s.name, None)])
            else:
                outs += [value(s.name, k) for k in range(n_items)]
        graph.output(tuple(outs))
        self.graph_module = fx.GraphModule({}, graph)
        self._compiled: dict[tuple, Callable[..., Any]] = {}

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        key = tuple(a.stride() for a in args)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = self._compile(list(args))
        return fn(*args)

    def _compile(self, args: list[torch.Tensor]) -> Callable[..., Any]:
        """Inductor's function for these inputs; where Inductor fails (no C++ compiler, an op
        it cannot lower), the run's graph as it is, eagerly, with a warning: every rank still
        runs the same collectives, so no rank waits for another that stopped."""
        import torch._inductor

        try:
            return torch._inductor.compile(self.graph_module, args)
        except Exception as e:  # noqa: BLE001 - any failure of the compiler, reported below
            ops = sorted({str(n.target) for n in self.graph_module.graph.nodes
                          if n.op == "call_function"})
            warnings.warn(
                f"Inductor could not compile a run of the per-rank program ({len(self.names)} "
                f"steps from {self.names[0]!r}: {', '.join(ops[:6])}"
                f"{', ...' if len(ops) > 6 else ''}), so it runs eagerly: "
                f"{first_line(e)}. "
                "parallelize(..., compile=False) runs the whole program eagerly without trying",
                stacklevel=2)
            return self.graph_module

    def code(self, label: str, read: Callable[[str, int | None], str]) -> list[str]:
        """The lines of the generated program that call this run (``label``: its name there;
        ``read``: the expression for a value in ``env``)."""
        lines = [f"    _o = {label}({''.join(read(p, i) + ', ' for p, i in self.reads)})"]
        k = 0
        for name, n_items in self.writes:
            if n_items is None:
                lines.append(f"    env[{name!r}] = _o[{k}]")
                k += 1
            else:
                items = "".join(f"_o[{k + j}], " for j in range(n_items))
                lines.append(f"    env[{name!r}] = ({items})")
                k += n_items
        return lines


def fusible(s: Any) -> bool:
    """A plain step Inductor may run: not random, its result a tensor or tensors, and every
    graph value it reads a tensor."""
    if s.is_getitem:
        return True
    nodes: list[fx.Node] = []
    fx.node.map_arg((s.node.args, s.node.kwargs), nodes.append)
    if len(nodes) != len(s.inputs):  # a SymInt or other non-tensor value among the args
        return False
    target = s.node.target
    if isinstance(target, torch._ops.OpOverload) and (
            torch.Tag.nondeterministic_seeded in target.tags) and not _no_dropout(s, target):
        return False
    return _n_items(s) is not None or isinstance(s.node.meta.get("val"), torch.Tensor)


def _no_dropout(s: Any, target: torch._ops.OpOverload) -> bool:
    """An op tagged random only for its dropout (fused attention), called without it."""
    for k, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            p = s.node.args[k] if k < len(s.node.args) else s.node.kwargs.get("dropout_p", 0.0)
            return isinstance(p, (int, float)) and p == 0
    return False


def runs(steps: list[Any], plain: Callable[[Any], bool],
         launches: Collection[int] = ()) -> dict[int, int]:
    """The runs worth compiling, as ``{first step: one past the last}``: maximal stretches of
    ``plain`` and :func:`fusible` steps, each ending at a step in ``launches`` (after which the
    caller may start gradient syncs), with at least :data:`MIN_OPS` ops."""
    out: dict[int, int] = {}
    start: int | None = None

    def close(end: int) -> None:
        if start is not None and sum(not t.is_getitem for t in steps[start:end]) >= MIN_OPS:
            out[start] = end

    for k, s in enumerate(steps):
        if not (plain(s) and fusible(s)):
            close(k)
            start = None
            continue
        if start is None:
            start = k
        if k in launches:
            close(k + 1)
            start = None
    close(len(steps))
    return out


def _n_items(s: Any) -> int | None:
    """The tuple length of a multi-output op whose items are all tensors, else None."""
    val = s.node.meta.get("val")
    if isinstance(val, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in val):
        return len(val)
    return None
