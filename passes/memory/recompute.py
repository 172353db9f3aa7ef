"""Recomputation: forward results the backward reads are computed again there instead of kept.

Tag first, act second (DESIGN): :func:`recompute_nodes` marks, per repeated layer, the forward
nodes a mode recomputes; :func:`apply_recompute` rewrites the joint graph: each marked node is
copied into the backward, just before the first backward op of its layer that reads it (as
activation checkpointing re-runs a block right before the block's backward), and every
backward read of it goes to the copy. The forward's result is then freed after its last
forward reader, and the copy lives from its recomputation to its last backward reader. The
planner plans the rewritten graph (copies are ordinary nodes with strategies, their input
reshards and in-op collectives priced again), and the runtime runs it as written: nothing
depends on autograd hooks, and the collectives counted are still the plan's.

Modes, per repeated layer (a block of an ``nn.ModuleList``, as capture tags them):

- ``none``: every forward result the backward reads is kept.
- ``full``: everything computed inside the layer is recomputed; the layer keeps only what it
  reads from outside (its input, the parameters), as per-block activation checkpointing does.
- ``selective``: the GEMMs' outputs are kept, everything else is recomputed, as
  torchtitan's per-op selective checkpointing and PyTorch's "save the matmuls" policy do:
  the norms (with their fp32 intermediates under bf16), activations, elementwise products
  and residual adds are recomputed from the kept GEMM outputs. Inside the attention
  (Megatron's selective recomputation: the ops of a module named ``*Attention*`` other than
  its linear projections: rotary embeddings, the head reshapes, the scores, softmax and
  dropout or the fused attention kernel) even the GEMMs are recomputed, so an unfused
  attention keeps no ``S x S`` tensor. Megatron's definition alone (the attention core
  only) kept the norms' and the MLP's elementwise results, which with a fused attention
  kernel saved almost nothing: Llama-3 8B (seq 8192, bf16) was counted at 134 GiB where
  torchtitan's selective run held 82 GiB.

Never recomputed: random ops (a second draw would differ; what reads their result reads the
kept draw), ops that write an input in place (BatchNorm's running statistics would be updated
twice), and a parameter's cast to the compute dtype (mixed precision), which is no activation.

Choosing the mode is the planner's (``recompute="auto"``): see :mod:`autopar.planning.planner`; what a
plan records of it is :class:`autopar.ir.plan.Recompute`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autopar.ir.errors import PlanError
from autopar.ir.graph import NodeFacts, PlanGraph
from autopar.ir.options import check_recompute
from autopar.passes.cost.cost_model import GEMM_OPS
from autopar.passes.strategies.registry import mutated_inputs

SUFFIX = "_rc"  # a recomputed copy's name: the original's plus this


def recompute_nodes(pg: PlanGraph, mode: str) -> list[str]:
    """The forward nodes ``mode`` recomputes, in graph order (the tagging half)."""
    check_recompute(mode)
    if mode in ("none", "auto"):
        return []
    out = []
    for n in pg.graph.nodes:
        f: NodeFacts = n.meta.get("autopar")
        if f is None or n.op != "call_function" or f.phase != "fwd" or f.layer is None:
            continue
        if not _recomputable(n, f):
            continue
        if mode == "selective" and not selective(n.meta.get("custom") or {}, f.op):
            continue
        out.append(n.name)
    return needed_in_backward(pg, out)


# the ops whose outputs selective mode keeps outside the attention core: the GEMMs (costly
# to run again, and what the backward of the ops after them reads)
KEPT_BY_SELECTIVE = GEMM_OPS | {"aten.convolution.default", "aten._scaled_mm.default"}


def selective(tags: dict, op: str | None = None) -> bool:
    """Whether selective mode recomputes an op (its name as ``NodeFacts.op``; ``None``: any
    GEMM) carrying these module tags (:func:`autopar.capture.joint.module_tag`, nested tags
    merged): anything inside an attention module but its projections; elsewhere any op but
    a GEMM."""
    if tags.get("autopar_attention") and not tags.get("autopar_projection"):
        return True
    return op is not None and op not in KEPT_BY_SELECTIVE


def _recomputable(n: fx.Node, f: NodeFacts) -> bool:
    if "param_cast" in f.extra or f.role != "activation":
        return False
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        if draws(target, n.args, n.kwargs):
            return False
        if mutated_inputs(n):
            return False
    return True


def draws(target: torch._ops.OpOverload, args: tuple | list, kwargs: dict) -> bool:
    """Whether an op draws random numbers with these arguments (a second run would draw
    others): seeded ops, attention kernels only with dropout."""
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" not in names:
        return True
    k = names.index("dropout_p")
    p = args[k] if len(args) > k else kwargs.get("dropout_p", 0.0)
    return bool(p)


def needed_in_backward(pg: PlanGraph, candidates: list[str]) -> list[str]:
    """Of the candidates, those whose value a backward op reads (directly, or through another
    recomputed node): only those need a copy. A candidate no backward op reaches is freed in
    the forward anyway."""
    cand = set(candidates)
    by_name = {n.name: n for n in pg.graph.nodes}
    need: set[str] = set()
    stack = [c for c in candidates
             if any(u.meta["autopar"].phase == "bwd" for u in by_name[c].users
                    if "autopar" in u.meta)]
    while stack:
        c = stack.pop()
        if c in need:
            continue
        need.add(c)
        for a in by_name[c].all_input_nodes:
            if a.name in cand:
                stack.append(a.name)
    return [c for c in candidates if c in need]


def apply_recompute(pg: PlanGraph, names: list[str] | tuple[str, ...]) -> PlanGraph:
    """A copy of ``pg`` whose backward recomputes ``names`` (the acting half; ``pg`` itself
    is left as it is). Each copy is named ``<original>_rc`` and carries the original's facts
    with phase ``"bwd"``; ``PlanGraph.recomputed`` maps copies to originals."""
    if not names:
        return pg
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    value, old_output = graph.graph_copy(pg.graph, env, return_output_node=True)  # type: ignore[misc]
    graph.output(value).meta = dict(old_output.meta)
    nodes = {n.name: n for n in graph.nodes}
    missing = [x for x in names if x not in nodes]
    if missing:
        raise PlanError(f"the plan recomputes nodes this graph does not have ({missing[:3]}): "
                        "it was made for another model or other input shapes; plan again")
    chosen = [nodes[x] for x in names]
    chosen_set = set(chosen)
    by_layer: dict[int | None, list[fx.Node]] = {}
    for n in chosen:
        by_layer.setdefault(n.meta["autopar"].layer, []).append(n)
    copies: dict[str, str] = {}
    for members in by_layer.values():
        readers = [u for n in members for u in n.users
                   if u not in chosen_set and _phase(u) == "bwd"]
        if not readers:
            continue
        # in the graph as it is now: a layer's copies made before may read this layer's
        # members (a layer reading another's value: an MLP-Mixer's transposes), and then go
        # first among the readers
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(readers, key=order.__getitem__)
        made: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(first):
            for n in members:  # graph order: a copy's recomputed inputs are copied first
                c = graph.node_copy(n, lambda a, made=made: made.get(a, a))
                c._rename(n.name + SUFFIX)
                c.meta = dict(n.meta)
                f: NodeFacts = n.meta["autopar"]
                c.meta["autopar"] = NodeFacts(c.name, f.op, f.outputs, f.role, "bwd", f.flops,
                                              f.layer, f.param_name, f.input_index,
                                              {**f.extra, "recomputes": n.name})
                made[n] = c
                copies[c.name] = n.name
        for n, c in made.items():
            for u in list(n.users):
                if u is not c and u not in made.values() and _phase(u) == "bwd":
                    u.replace_input_with(n, c)
    graph.lint()
    gm = _graph_module(pg.gm, graph)
    # every other field (a pipeline stage's boundary and pins among them) as the original's
    return dataclasses.replace(pg, gm=gm, recomputed=copies)


def _graph_module(root: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule of ``graph`` whose Python code is generated when first run or read, not
    now: a planner builds a mode graph per recomputation mode and mesh shape and only reads
    its nodes (405B's mesh-shape search spent 37 of its 557 profiled seconds generating code
    no one ran). The lazy class is torch's own (what ``torch.compile`` uses); a torch without
    it gets the eager one."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - older torch
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def _phase(n: fx.Node) -> str:
    f = n.meta.get("autopar")
    return f.phase if f is not None else ("none" if n.op != "output" else "bwd")
