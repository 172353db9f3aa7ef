"""Lowering: a traced joint graph plus a Plan become a per-rank program on local tensors.

Every rank walks the same node list. Before a node runs, each tensor input is moved from its
producer's output spec to the spec the node's strategy needs (:mod:`.redistribute`, one
reshard per producer->consumer edge, exactly the edges the scorer priced, so the collectives
executed are the ones :attr:`Plan.predicted.collectives` predicted); then the op runs on local shards
through :func:`localize.local_call`, the same entry point the rule validator uses (or, for the
many ops with no rank-aware kernel and no global sizes in their arguments, directly). A
strategy that all-reduces its partial result inside the op (``Strategy.raw_outs``, Megatron's
row-parallel linear) runs that all-reduce right after the kernel, once for all its consumers.
Parameter gathers are batched, one all-gather per layer and phase, at the layer's first read
(:mod:`.param_gather`).

The graph is split where capture tagged it: forward nodes (phase ``"fwd"``) come first and run
in the module's forward; the values the backward nodes read are kept; the backward nodes run
from ``autograd.Function.backward`` with the graph's ``ones_like(loss)`` seed scaled by the
incoming gradient. Gradients leave in their parameter's spec (in DDP-style buckets when the
plan priced them so, each started as soon as its gradients exist and overlapped with the rest
of the backward, :mod:`.grad_sync`), the loss replicated.

A pipeline stage's graph (``pg.stage``, :mod:`autopar.capture.stage`) ends in an activation,
not a loss: its forward returns that output moved into the layout it is sent in, its backward
starts from the output's gradient (a placeholder set when the backward starts, not a seed
scaled) and also returns the input's gradient, moved into the layout its input came in; both
moves are edges the plan priced as ``"stage boundary"``.

Only even shards execute: the planner never emits others (``registry.expand`` filters them, so
a dim the mesh does not divide is simply not split on that axis) and :func:`validate` rejects a
given plan that has one, naming the node.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from autopar.ir.errors import PlanError
from autopar.ir.graph import PlanGraph, TensorMeta
from autopar.ir.mesh import Mesh
from autopar.ir.placements import (
    Partial,
    Replicate,
    Spec,
    evenly_divides,
    local_shape,
    spec_str,
)
from autopar.ir.plan import Plan
from autopar.passes.cost.buckets import GradSync, bucket_collectives, sync_groups
from autopar.passes.cost.cost_model import axes_label, reshard_collectives, sum_axes
from autopar.passes.memory.zero import grad_target
from autopar.passes.problem.edge_costs import gather_unit
from autopar.passes.problem.stage_boundary import REASON as BOUNDARY
from autopar.passes.strategies.localize import (
    LocalContext,
    finish_call,
    is_static,
    local_call,
    localizer_for,
)
from autopar.passes.strategies.registry import (
    OpInfo,
    Strategy,
    mutated_inputs,
    op_info,
    tensor_inputs,
)
from autopar.runtime import _compat
from autopar.runtime.deferred_loss import LossValue
from autopar.runtime.grad_sync import GradSyncSchedule
from autopar.runtime.observe import profiling
from autopar.runtime.param_gather import GatherGroup, group_gathers
from autopar.runtime.redistribute import Comm, redistribute
from autopar.runtime.step_code import Program, compile_steps


@dataclass(slots=True)
class _Input:
    producer: str
    item: int | None  # which output of a multi-output producer (getitem), else None
    src: Spec
    dst: Spec
    reason: str
    moves: bool = True  # src != dst, worked out once
    group: int | None = None  # a parameter gather batched with its layer's (param_gather)
    slot: int = 0  # its place in that group


@dataclass(slots=True)
class _Step:
    node: fx.Node
    name: str
    is_getitem: bool
    inputs: list[_Input]
    strategy: Strategy
    info: OpInfo | None
    free_after: list[str]  # values no later step of this phase (nor the backward) reads
    # flat args (the common case): positions of the tensor inputs in ``node.args``, else None
    flat: list[int] | None = None
    # the op runs on local shards as it is: no rank-aware kernel, no global sizes to rewrite
    direct: bool = False
    drop_gathers: list[int] = field(default_factory=list)  # parameter groups last read here
    # what the hot loop would otherwise fetch from the node on every call
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    fn: Any = None  # the op's C++ callable (an OpOverload's ``_op``), else the target
    ctx: LocalContext | None = None  # made on first run (the rank's coordinate is fixed)
    # (args, kwargs) once localized, for an op whose localizer is static (see step_code)
    localized: tuple[tuple, dict] | None = None


@dataclass(frozen=True, slots=True)
class _Slice:
    """A ZeRO-1 gradient: all-reduced into ``dst`` (whole on the split axes), then sliced
    into the spec of its parameter (placeholder ``node``)."""

    node: str
    dst: Spec


@dataclass(slots=True)
class SplitBackward:
    """A pipeline stage's backward in two (:meth:`LoweredGraph.stage_backward_input` and
    :meth:`LoweredGraph.stage_backward_weight`, a zero-bubble schedule's I and W actions): the
    backward steps its input's gradient needs, in order, then the others (the parameters'
    gradients), with their gradient sync."""

    input: list[_Step]
    weight: list[_Step]
    grad_sync: GradSyncSchedule


class LoweredGraph:
    """The per-rank program for one (graph, plan) pair; between calls it holds no tensors but
    the graph's lifted constants."""

    def __init__(self, pg: PlanGraph, plan: Plan, compile: bool = False,
                 device: torch.device | None = None) -> None:
        """``device``: where the program runs (the mesh's device type); factory ops and copies
        in the graph name the device it was traced on (capture traces on the CPU), and run on
        this one instead."""
        validate(pg, plan)
        self.device = device if device is not None and device.type != "cpu" else None
        # gradients summed across ranks in another dtype than their own (mixed precision with
        # reduce_dtype='bf16'): cast before the collective, back after, as the plan priced it
        p = plan.decided.precision
        self.reduce_dtype = p.reduce_dtype if p.mixed and p.reduce != "fp32" else None
        self.compile = compile  # runs of plain steps compiled by Inductor (inductor_segments)
        self.pg = pg
        self.plan = plan
        self.mesh_shape = tuple(plan.decided.mesh_shape)
        nodes = list(pg.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.placeholders_by_role: dict[str, list[fx.Node]] = {
            "input": [], "param": [], "buffer": []}
        for n in self.placeholders:
            self.placeholders_by_role.setdefault(n.meta["autopar"].role, []).append(n)
        # tensors tracing lifted into the graph module (HF models make a few): whole on every
        # rank, so the scorer gives their edges no collectives and neither do we
        self.constants = {n.name: _fetch_attr(pg.gm, str(n.target))
                          for n in nodes if n.op == "get_attr"}
        calls = [n for n in nodes if n.op == "call_function"]
        phases = [n.meta["autopar"].phase for n in calls]
        n_fwd = sum(p == "fwd" for p in phases)
        if any(p != "fwd" for p in phases[:n_fwd]):
            raise PlanError("internal: the traced graph interleaves forward and backward nodes")
        out_node = next(n for n in nodes if n.op == "output")
        flat_out = tree_flatten(out_node.args[0])[0]
        self.loss = pg.loss_node  # a pipeline stage's: its output (the loss on the last)
        self.grads = [g.name if isinstance(g, fx.Node) else None
                      for g in flat_out[1:1 + len(pg.param_names)]]
        # a pipeline stage (pg.stage): its output's gradient arrives with the backward, which
        # starts from it; its input's gradient leaves with the parameters' (stage_boundary)
        st = pg.stage
        self.output_grad = st.output_grad if st is not None else None
        self.input_grad = st.input_grad if st is not None else None
        self.boundary: list[tuple[str, Spec]] = []  # (node, the layout it leaves in)
        if self.output_grad is not None:
            self.boundary.append((self.loss, self.spec(self.output_grad)))
        if st is not None and st.input is not None and self.input_grad is not None:
            self.boundary.append((self.input_grad, self.spec(st.input)))
        self.seed = _seed_node(calls[n_fwd:], pg.loss_node)
        bwd_reads = {i.producer for s in calls[n_fwd:] for i in self._inputs(s)}
        bwd_reads |= {g for g in self.grads if g}
        # the forward keeps what the backward reads (placeholders included) and the loss
        kept = {self.loss} if pg.has_loss else set()
        self.saved = sorted((bwd_reads - {n.name for n in calls[n_fwd:]}
                             - {self.output_grad}) | kept)
        self.fwd = self._steps(calls[:n_fwd], keep=set(self.saved))
        self.bwd = self._steps(calls[n_fwd:], keep={g for g in self.grads + [self.input_grad]
                                                    if g})
        # parameter gathers, one all-gather per layer and phase (see param_gather)
        metas = {n.name: n.meta["autopar"].out for n in nodes
                 if "autopar" in n.meta and n.meta["autopar"].param_like}
        self.fwd_gathers = group_gathers(self.fwd, gather_unit, metas, self.mesh_shape)
        self.bwd_gathers = group_gathers(self.bwd, gather_unit, metas, self.mesh_shape)
        self.param_specs = {pg.param_node(p).name: self.spec(pg.param_node(p).name)
                            for p in pg.param_names}
        # ZeRO-1: gradients summed whole, then sliced into their parameter's spec
        self.sliced_after_sync: dict[int, _Slice] = {}
        # gradients go in DDP-style buckets when the plan priced them so, each move started
        # as soon as its gradients exist (see grad_sync)
        self.bucketed = grad_sync_mode(self)
        reads = {i.producer: k for k, s in enumerate(self.bwd) for i in s.inputs}
        self.grad_sync = GradSyncSchedule([s.name for s in self.bwd], reads, self.grads,
                                          self.grad_moves(), self.mesh_shape, self.bucketed,
                                          plan.decided.first_bucket_bytes, self.reduce_dtype)
        # a pipeline stage's backward split into its input's and its weights' (or None)
        self.bwd_split = self._split_backward(calls[n_fwd:])
        # (id(self.fwd / self.bwd), Inductor-compiled runs[, "profiled"]) -> its code
        self._compiled: dict[tuple, Program] = {}

    # --- building -----------------------------------------------------------------------------

    def spec(self, name: str, out: int = 0) -> Spec:
        if name in self.constants:
            return (Replicate(),) * len(self.mesh_shape)
        return self.plan.decided.nodes[name].outs[out]

    def _inputs(self, n: fx.Node) -> list[_Input]:
        place = self.plan.decided.nodes[n.name]
        if n.target is operator.getitem:
            src, k = n.args[0], int(n.args[1])
            return [_Input(src.name, k, self.spec(src.name, k), place.ins[0], "resharding")]
        out = []
        for a, dst in zip(tensor_inputs(n), place.ins):
            reason = "parameter gather" if a.meta["autopar"].param_like else "resharding"
            out.append(_Input(a.name, None, self.spec(a.name), dst, reason))
        return out

    def _steps(self, nodes: list[fx.Node], keep: set[str]) -> list[_Step]:
        steps = []
        for n in nodes:
            place = self.plan.decided.nodes[n.name]
            get = n.target is operator.getitem
            inputs = self._inputs(n)
            for i in inputs:
                i.moves = i.src != i.dst
            direct = not get and not any(place.impls) and localizer_for(n.target) is None
            steps.append(_Step(n, n.name, get, inputs,
                               Strategy(place.ins, place.outs, place.impls, place.raw_outs),
                               None if get else op_info(n), [], _flat_slots(n), direct,
                               args=_placed(tuple(n.args), self.device),
                               kwargs=_placed(dict(n.kwargs), self.device),
                               fn=getattr(n.target, "_op", n.target)))
        last: dict[str, int] = {}
        for i, s in enumerate(steps):
            for inp in s.inputs:
                last[inp.producer] = i
        for name, i in last.items():
            if name not in keep:
                steps[i].free_after.append(name)
        return steps

    def _split_backward(self, bwd: list[fx.Node]) -> SplitBackward | None:
        """A stage's backward as :class:`SplitBackward`: the nodes its input's gradient
        depends on (none on the first stage, whose input is token ids), then the rest, each
        in the traced order; the gradient sync runs in the second. None where it does not
        split: not a stage, parameters gathered in the backward (each half would gather them
        again, collectives the plan did not price), or a parameter's gradient (or the loss's
        seed) on the input gradient's path."""
        if self.pg.stage is None or self.bwd_gathers:
            return None
        by_name = {n.name: n for n in bwd}
        need: set[str] = set()
        todo = [self.input_grad] if self.input_grad is not None else []
        while todo:
            name = todo.pop()
            if name in need or name not in by_name:
                continue
            need.add(name)
            todo += [i.producer for i in self._inputs(by_name[name])]
        if any(g in need for g in self.grads if g) or (
                self.seed is not None and self.seed in by_name and self.seed not in need):
            return None
        first = [n for n in bwd if n.name in need]
        rest = [n for n in bwd if n.name not in need]
        later = {i.producer for n in rest for i in self._inputs(n)}
        weight = self._steps(rest, keep={g for g in self.grads if g})
        reads = {i.producer: k for k, s in enumerate(weight) for i in s.inputs}
        sync = GradSyncSchedule([s.name for s in weight], reads, self.grads, self.grad_moves(),
                                self.mesh_shape, self.bucketed,
                                self.plan.decided.first_bucket_bytes, self.reduce_dtype)
        keep = later | ({self.input_grad} if self.input_grad is not None else set())
        return SplitBackward(self._steps(first, keep=keep), weight, sync)

    def edges(self) -> list[tuple[TensorMeta, Spec, Spec, str]]:
        """Every reshard one step runs outside gradient syncs (:meth:`grad_moves`) and batched
        parameter gathers (:meth:`gather_collectives`): (tensor, from, to, reason)."""
        metas = {n.name: n.meta["autopar"].outputs for n in self.pg.graph.nodes
                 if "autopar" in n.meta}
        out = [(metas[i.producer][i.item or 0], i.src, i.dst, i.reason)
               for s in self.fwd + self.bwd for i in s.inputs if i.group is None]
        for s in self.fwd + self.bwd:  # all-reduces inside an op (a planned partial result)
            out += [(m, a, b, "resharding") for m, a, b in
                    zip(metas[s.name], s.strategy.raw_outs, s.strategy.outs) if a != b]
        rep = (Replicate(),) * len(self.mesh_shape)
        if self.pg.has_loss:
            out.append((metas[self.loss][0], self.spec(self.loss), rep, "loss"))
        out += [(metas[n][0], self.spec(n), dst, BOUNDARY) for n, dst in self.boundary]
        if self.plan.decided.precision.loss_scaling:  # the overflow flag (runtime.loss_scale)
            flag = TensorMeta((), torch.float32)
            out.append((flag, (Partial(),) * len(self.mesh_shape), rep, "loss scaling"))
        return out

    def gather_collectives(self) -> list[tuple[int, float]]:
        """``(mesh axis, bytes each rank hands in)`` of every batched parameter gather."""
        return [(g.axis, g.nbytes) for g in self.fwd_gathers + self.bwd_gathers]

    # --- running ------------------------------------------------------------------------------

    def place_input(self, name: str, full: torch.Tensor, comm: Comm) -> torch.Tensor:
        """This rank's piece of a user input given whole (slicing needs no communication)."""
        rep = (Replicate(),) * len(self.mesh_shape)
        return redistribute(full, rep, self.spec(name), comm, "input")

    def place_local(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """An input already split as planned (a pipeline stage's, received from its
        neighbour in its pinned layout), checked against the shape this rank's piece has."""
        meta = next(n for n in self.placeholders if n.name == name).meta["autopar"].out
        want = local_shape(meta.shape, self.spec(name), self.mesh_shape)
        if tuple(local.shape) != want:
            raise PlanError(
                f"input {name} arrived as a piece of shape {list(local.shape)}, but its layout "
                f"{spec_str(self.spec(name))} of the traced {list(meta.shape)} gives each rank "
                f"{list(want)}: the neighbouring stage sends another layout or batch; plan both "
                "stages for the same boundary and micro-batch")
        return local

    def forward(self, env: dict[str, Any], comm: Comm) -> tuple[torch.Tensor, dict[str, Any]]:
        """Run the forward nodes on ``env`` (placeholder name -> local tensor).

        Returns this rank's loss as computed (in its planned spec; see :meth:`loss_value`), or
        a pipeline stage's output moved into the layout it is sent in, and the values the
        backward needs."""
        self._run(self.fwd, self.fwd_gathers, env, comm)
        out = env[self.loss]
        if self.output_grad is not None:
            out = redistribute(out, self.spec(self.loss), self.boundary[0][1], comm, BOUNDARY)
        return out, {k: env[k] for k in self.saved}

    def whole_loss(self, local: torch.Tensor, comm: Comm, wait: bool = True) -> torch.Tensor:
        """The loss whole on every rank, by its own collective (if it needs one)."""
        rep = (Replicate(),) * len(self.mesh_shape)
        with contextlib.nullcontext() if wait else comm.deferred():
            return redistribute(local, self.spec(self.loss), rep, comm, "loss")

    def loss_value(self, local: torch.Tensor, comm: Comm) -> LossValue | None:
        """A training step's loss on its way to whole (see :mod:`.deferred_loss`): its
        collective issued now, waited for on first read. None: it is whole already."""
        spec = self.spec(self.loss)
        if all(isinstance(p, Replicate) for p in spec):
            return None
        axes = sum_axes(spec, (Replicate(),) * len(spec))
        if axes is not None:  # a sum: reduced in place on a copy we own (Comm.start_sum)
            return LossValue(*comm.start_sum(local.detach().clone(), axes, "loss"))
        return LossValue(self.whole_loss(local, comm, wait=False))

    def backward(self, saved: dict[str, Any], grad_loss: torch.Tensor | None,
                 comm: Comm) -> list[torch.Tensor | None]:
        """Local gradients, one per parameter (in ``pg.param_names`` order), in its spec.
        Takes ``saved`` over: each value leaves it after its last reader."""
        return self.stage_backward(saved, grad_loss, comm)[0]

    def stage_backward(self, saved: dict[str, Any], grad_out: torch.Tensor | None, comm: Comm,
                       carry: dict[int, torch.Tensor] | None = None, sync: bool = True
                       ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """:meth:`backward`, and a pipeline stage's input gradient in the layout its input
        came in (None where the stage has none). ``grad_out``: the loss's incoming gradient,
        or a stage's output gradient as received (in the output's boundary layout).
        ``sync=False``: the gradients that would move into their parameter's layout (the
        gradient sync) are added into ``carry`` instead and come back ``None``; a later call
        with ``sync=True`` and the same ``carry`` moves them with its own (see
        :class:`.grad_sync.GradSyncRun`)."""
        env = saved  # not a copy: the copy's source would hold every activation to the end
        grad_loss = self._backward_seed(env, grad_out)
        syncs = self.grad_sync.start(comm, env, carry, sync)
        self._run(self.bwd, self.bwd_gathers, env, comm, grad_loss, syncs.step_done)
        return self._synced(syncs.finish(), comm), self._input_grad(env, comm)

    def stage_backward_input(self, saved: dict[str, Any], grad_out: torch.Tensor | None,
                             comm: Comm) -> torch.Tensor | None:
        """A split backward's first half (:attr:`bwd_split`): the steps the input's gradient
        needs, on ``saved`` (which keeps what the second half reads), and the input's gradient
        as :meth:`stage_backward` returns it."""
        split = self.bwd_split
        assert split is not None, "internal: this stage's backward does not split"
        grad_loss = self._backward_seed(saved, grad_out)
        self._run(split.input, [], saved, comm, grad_loss)
        return self._input_grad(saved, comm)

    def stage_backward_weight(self, saved: dict[str, Any], comm: Comm,
                              carry: dict[int, torch.Tensor] | None = None, sync: bool = True
                              ) -> list[torch.Tensor | None]:
        """A split backward's second half, on what :meth:`stage_backward_input` left in
        ``saved``: the parameters' gradients as :meth:`stage_backward` returns them (``carry``,
        ``sync`` as there)."""
        split = self.bwd_split
        assert split is not None, "internal: this stage's backward does not split"
        syncs = split.grad_sync.start(comm, saved, carry, sync)
        self._run(split.weight, [], saved, comm, None, syncs.step_done)
        return self._synced(syncs.finish(), comm)

    def _backward_seed(self, env: dict[str, Any], grad_out: torch.Tensor | None
                       ) -> torch.Tensor | None:
        """Place a stage's received output gradient in ``env``; the loss's gradient (what
        the seed is scaled by) where the graph ends in a loss."""
        if self.output_grad is not None:  # the backward starts from the gradient received
            env[self.output_grad] = grad_out
            return None
        return grad_out

    def _synced(self, grads: list[torch.Tensor | None], comm: Comm
                ) -> list[torch.Tensor | None]:
        for i, g in self.sliced_after_sync.items():  # ZeRO-1: each rank keeps its part
            if grads[i] is not None:
                grads[i] = redistribute(grads[i], g.dst, self.param_specs[g.node], comm,
                                        "gradient sync")
        return grads

    def _input_grad(self, env: dict[str, Any], comm: Comm) -> torch.Tensor | None:
        """A stage's input gradient, moved into the layout its input came in (None: none)."""
        if self.input_grad is None:
            return None
        node, dst = self.boundary[-1]
        return redistribute(env.pop(node), self.spec(node), dst, comm, BOUNDARY)

    def grad_moves(self) -> list[GradSync]:
        """Every gradient that must move into its parameter's spec (``index``: the parameter's
        position in ``pg.param_names``)."""
        moves = []
        for i, (pname, g) in enumerate(zip(self.pg.param_names, self.grads)):
            node = self.pg.param_node(pname)
            src, dst = None if g is None else self.spec(g), self.param_specs[node.name]
            if src is not None and src != dst:
                meta = node.meta["autopar"].out
                if self.reduce_dtype is not None:  # summed in the plan's reduction dtype
                    meta = TensorMeta(meta.shape, self.reduce_dtype)
                if self.plan.decided.param_state.zero1:  # summed whole, then sliced (passes.zero)
                    whole = grad_target(src, dst)
                    if whole != dst:
                        self.sliced_after_sync[i] = _Slice(node.name, whole)
                    dst = whole
                if src != dst:
                    moves.append(GradSync(i, meta, src, dst))
        return moves

    def _run(self, steps: list[_Step], gathers: list[GatherGroup], env: dict[str, Any],
             comm: Comm, grad_loss: torch.Tensor | None = None,
             step_done: Callable[[int], None] | None = None) -> None:
        """Run one phase: the plain steps as generated code, the others by :meth:`_exec_step`
        (see :mod:`.step_code`)."""
        # Inductor cannot compile for LocalTensorMode's simulated ranks: they run eagerly
        key: tuple = (id(steps), self.compile and not _compat.local_tensor_mode_active())
        if profiling.ACTIVE:  # a profiled step: the program with its units' ranges
            key += ("profiled",)
        program = self._compiled.get(key)
        if program is None:
            for s in steps:
                s.localized = self._localize_once(s, comm)
            split = self.bwd_split
            launches = (set(self.grad_sync.by_step) if steps is self.bwd else
                        set(split.grad_sync.by_step)
                        if split is not None and steps is split.weight else set())
            marked = len(key) > 2
            program = self._compiled[key] = compile_steps(
                steps, _call_localized, launches, self.seed, fuse=key[1],
                marks=profiling.unit_marks(steps) if marked else None,
                marker=profiling.UnitMarker() if marked else None)
        program(env, comm, grad_loss, step_done, {}, gathers, self._exec_step)

    def _localize_once(self, s: _Step, comm: Comm) -> tuple[tuple, dict] | None:
        """The step's args made local once, if its op only needs global sizes rewritten."""
        if s.direct or s.is_getitem or s.flat is None or any(s.strategy.impls):
            return None
        fn = localizer_for(s.node.target)
        if fn is None or not is_static(fn):
            return None
        assert s.info is not None
        ctx = LocalContext(s.info, s.strategy, self.mesh_shape, comm.coord)
        return fn(ctx, s.args, dict(s.kwargs))  # the tensor slots are left as they are

    def _exec_step(self, s: _Step, env: dict[str, Any], comm: Comm,
                   grad_loss: torch.Tensor | None, gathered: dict[int, list[torch.Tensor]],
                   gathers: list[GatherGroup]) -> None:
        """One step in general: its inputs resharded or gathered as planned, a rank-aware
        kernel or localized args where the op needs them, in-op reductions, the loss seed."""
        vals = []
        for inp in s.inputs:
            if inp.group is not None:  # the whole layer's parameters at its first read
                g = gathered.get(inp.group)
                if g is None:
                    g = gathered[inp.group] = gathers[inp.group].run(env, comm)
                vals.append(g[inp.slot])
                continue
            v = env[inp.producer]
            if inp.item is not None:
                v = v[inp.item]
            vals.append(redistribute(v, inp.src, inp.dst, comm, inp.reason)
                        if inp.moves else v)
        if s.is_getitem:
            env[s.name] = vals[0]
            return
        if s.flat is not None:  # skip the generic walk over the args
            args_list = list(s.args)
            for pos, v in zip(s.flat, vals):
                args_list[pos] = v
            # a localizer may edit its kwargs; a direct call does not
            args, kwargs = tuple(args_list), s.kwargs if s.direct else dict(s.kwargs)
        else:
            args, kwargs = _substitute(s.args, s.kwargs, iter(vals), env)
        ctx = None
        if s.direct:
            out = s.fn(*args, **kwargs)
        else:
            ctx = s.ctx
            if ctx is None or ctx.coord is not comm.coord:
                assert s.info is not None
                ctx = s.ctx = LocalContext(s.info, s.strategy, self.mesh_shape, comm.coord)
            out = _call(s.node.target, args, kwargs, ctx)
        if s.strategy.raw_outs:
            out = _reduce_in_op(out, s.strategy, comm)
            if ctx is not None:
                out = finish_call(out, ctx)
        if s.name == self.seed and grad_loss is not None:
            out = out * grad_loss.to(out.dtype)
        env[s.name] = out


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _call_localized(fn: Any, target: Any, args: tuple, kwargs: dict) -> Any:
    """``fn`` (op ``target``) on args already local. A local kernel may lay memory out
    otherwise than the fake tensors it was traced on (SDPA on CPU does), so a view that
    traced fine may need its input made contiguous."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError:
        if target not in _VIEWS or args[0].is_contiguous():
            raise
        return fn(args[0].contiguous(), *args[1:], **kwargs)


def _call(target: Any, args: tuple, kwargs: dict, ctx: LocalContext) -> Any:
    """``target`` localized for this rank (see :func:`local_call`), then as above."""
    return _call_localized(lambda *a, **kw: local_call(target, a, kw, ctx), target, args, kwargs)


def _reduce_in_op(out: Any, strategy: Strategy, comm: Comm) -> Any:
    """The op's partial outputs all-reduced into the layouts its consumers read."""
    if isinstance(out, torch.Tensor):
        return redistribute(out, strategy.raw_outs[0], strategy.outs[0], comm)
    return type(out)(redistribute(t, a, b, comm) if isinstance(t, torch.Tensor) else t
                     for t, a, b in zip(out, strategy.raw_outs, strategy.outs))


def _flat_slots(n: fx.Node) -> list[int] | None:
    """Where the tensor inputs sit when every node argument is a top-level tensor arg."""
    if any(isinstance(v, (fx.Node, list, tuple, dict)) for v in n.kwargs.values()):
        return None
    slots = []
    for i, a in enumerate(n.args):
        if isinstance(a, fx.Node):
            if not isinstance(a.meta.get("val"), torch.Tensor):
                return None
            slots.append(i)
        elif isinstance(a, (list, tuple, dict)) and any(
                isinstance(x, fx.Node) for x in (a.values() if isinstance(a, dict) else a)):
            return None
    return slots


def _placed(a: Any, device: torch.device | None) -> Any:
    """A node's args (or kwargs) with the device the graph was traced on (the CPU) replaced by
    the one it runs on; unchanged where that is the CPU too (``device`` None)."""
    if device is None:
        return a
    if isinstance(a, torch.device):
        return device if a.type == "cpu" else a
    if isinstance(a, (list, tuple)):
        return type(a)(_placed(x, device) for x in a)
    if isinstance(a, dict):
        return {k: _placed(v, device) for k, v in a.items()}
    return a


def _substitute(args: tuple, kwargs: dict, vals: Any, env: dict[str, Any]
                ) -> tuple[tuple, dict]:
    """A node's ``args`` and ``kwargs`` with tensor inputs taken from ``vals`` in
    :func:`tensor_inputs` order."""
    return _sub(tuple(args), vals, env), _sub(dict(kwargs), vals, env)


def _sub(a: Any, vals: Any, env: dict[str, Any]) -> Any:
    # a module-level function, not a closure: a recursive closure refers to itself, and the
    # cycle kept the step's input values alive until the garbage collector ran (measured:
    # llama3-tiny DP's peak 1.115x the prediction with the collector off, 1.000 without it)
    if isinstance(a, fx.Node):
        return next(vals) if isinstance(a.meta.get("val"), torch.Tensor) else env[a.name]
    if isinstance(a, (list, tuple)):
        return type(a)(_sub(x, vals, env) for x in a)
    if isinstance(a, dict):
        return {k: _sub(x, vals, env) for k, x in a.items()}
    return a


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _seed_node(bwd: list[fx.Node], loss: str) -> str | None:
    for n in bwd:
        if n.target is torch.ops.aten.ones_like.default and any(
            a.name == loss for a in tensor_inputs(n)
        ):
            return n.name
    return None


# --- validation: was the plan made for this graph, and how did it price gradient syncs ---------


def validate(pg: PlanGraph, plan: Plan) -> None:
    """Raise :class:`PlanError` unless ``plan`` was made for this traced graph."""
    fix = "make a new plan for this model and these inputs (parallelize(..., plan=None))"
    nd = len(plan.decided.mesh_shape)
    for n in pg.graph.nodes:
        if n.op not in ("placeholder", "call_function"):
            continue
        place = plan.decided.nodes.get(n.name)
        if place is None:
            raise PlanError(f"the plan has no placement for graph node {n.name!r} "
                            f"({n.meta['autopar'].op}): it was made for another model; {fix}")
        facts = n.meta["autopar"]
        n_in = 1 if n.target is operator.getitem else len(tensor_inputs(n))
        if n.op == "call_function" and len(place.ins) != n_in:
            raise PlanError(f"plan node {n.name!r} places {len(place.ins)} inputs but the traced "
                            f"op {facts.op} has {n_in}; {fix}")
        if len(place.outs) != len(facts.outputs):
            raise PlanError(f"plan node {n.name!r} places {len(place.outs)} outputs but the "
                            f"traced op {facts.op} has {len(facts.outputs)}; {fix}")
        metas: list[TensorMeta | None] = list(facts.outputs)
        if n.op == "call_function":
            metas += [a.meta["autopar"].outputs[int(n.args[1])] if n.target is operator.getitem
                      else a.meta["autopar"].out for a in _input_nodes(n)]
        if n.op == "call_function" and n.target is not operator.getitem:
            inputs = tensor_inputs(n)
            for i in mutated_inputs(n):
                placed = plan.decided.nodes.get(inputs[i].name)
                src = placed.outs[0] if placed is not None else None
                if src is not None and tuple(src) != tuple(place.ins[i]):
                    raise PlanError(
                        f"plan node {n.name!r} ({facts.op}) writes its input {inputs[i].name!r} "
                        f"in place but the plan moves it from {spec_str(src)} to "
                        f"{spec_str(place.ins[i])} first, so the write would land on a copy; "
                        f"{fix}")
        for meta, spec in zip(metas, list(place.outs) + list(place.ins)):
            if len(spec) != nd:
                raise PlanError(f"plan node {n.name!r} has spec {spec_str(spec)} for a "
                                f"{nd}-axis mesh; {fix}")
            if meta is not None and not evenly_divides(meta.shape, spec, plan.decided.mesh_shape):
                raise PlanError(
                    f"plan node {n.name!r} splits a tensor of shape {list(meta.shape)} as "
                    f"{spec_str(spec)} on mesh {tuple(plan.decided.mesh_shape)}, which does not divide "
                    f"evenly; autopar runs only even shards (the planner replicates such dims). "
                    f"{fix}")
    for pname in pg.param_names:
        if pname not in plan.decided.params:
            raise PlanError(f"the plan does not place parameter {pname!r}; {fix}")
        node_spec = plan.decided.nodes[pg.param_node(pname).name].outs[0]
        if tuple(plan.decided.params[pname]) != tuple(node_spec):
            raise PlanError(f"the plan places parameter {pname!r} as "
                            f"{spec_str(plan.decided.params[pname])} in its summary but as "
                            f"{spec_str(node_spec)} in its graph; {fix}")
    traced = {pg.input_names[n.meta["autopar"].input_index]: list(n.meta["autopar"].out.shape)
              for n in pg.graph.nodes if n.op == "placeholder"
              and n.meta["autopar"].role == "input" and n.meta["autopar"].out is not None}
    for key, shape in plan.decided.input_shapes.items():
        if key in traced and list(shape) != traced[key]:
            raise PlanError(f"the plan was made for input {key} of shape {list(shape)}, the "
                            f"model was traced with {traced[key]}; {fix}")


def _input_nodes(n: fx.Node) -> list[fx.Node]:
    return [n.args[0]] if n.target is operator.getitem else tensor_inputs(n)


# Does the plan fit this program? Tensor sizes enter the byte counts, so re-deriving
# :attr:`Plan.predicted.collectives` from the graph's tensors catches a plan made for other parameter or
# activation shapes (a plan records node names and specs, not every shape). It also tells how
# the plan priced gradient syncs: one collective per gradient, or DDP-style buckets
# (:mod:`autopar.passes.cost.buckets`), which the runtime then issues the same way.

Totals = dict[tuple[str, str, str], list]


def grad_sync_mode(lowered: LoweredGraph) -> bool:
    """``True`` if the plan lists gradient syncs bucketed, ``False`` if one per gradient;
    :class:`PlanError` if its collectives fit this graph neither way."""
    listed = {(c.kind, c.axis, c.reason): [c.count, c.bytes]
              for c in lowered.plan.predicted.collectives}
    for bucketed in (False, True):
        if _same(predicted(lowered, bucketed), listed):
            return bucketed
    raise PlanError(
        "the plan's collectives do not match this model's tensors (it was made for other "
        "parameter or activation shapes, by an older autopar that batched collectives "
        "differently, or edited by hand); make a new plan for this model and these inputs "
        "(parallelize(..., plan=None))")


def predicted(lowered: LoweredGraph, bucketed: bool) -> Totals:
    """``(kind, axis, reason) -> [count, bytes]`` per step as the cost model prices it."""
    mesh = Mesh(lowered.mesh_shape, lowered.plan.decided.mesh_axes, "cpu")
    merged = lowered.plan.merged_axes()  # as the plan was priced, whatever this mesh's links
    out: Totals = {}

    def add(kind: str, axis: str, reason: str, nbytes: float) -> None:
        slot = out.setdefault((kind, axis, reason), [0, 0.0])
        slot[0] += 1
        slot[1] += nbytes

    for meta, src, dst, reason in lowered.edges():
        if src != dst and meta is not None:
            for c in reshard_collectives(meta, src, dst, mesh, merged=merged):
                add(c.kind, c.axis, reason, c.bytes)
    for ax, nbytes in lowered.gather_collectives():
        add("all_gather", mesh.axes[ax], "parameter gather", nbytes)
    for group, kind in sync_groups(lowered.grad_moves(), mesh.shape, bucketed,
                                   lowered.plan.decided.first_bucket_bytes):
        if kind is not None:
            for ckind, axes, nbytes in bucket_collectives(group, mesh.shape, merged):
                add(ckind, axes_label(mesh.axes, axes), "gradient sync", nbytes)
        else:
            for c in reshard_collectives(group[0].meta, group[0].src, group[0].dst, mesh,
                                         merged=merged):
                add(c.kind, c.axis, "gradient sync", c.bytes)
    return out


def _same(a: Totals, b: Totals) -> bool:
    return a.keys() == b.keys() and all(
        a[k][0] == b[k][0] and math.isclose(a[k][1], b[k][1], rel_tol=1e-9) for k in a)
