"""The module ``autopar.parallelize`` returns: DTensor parameters, a lowered joint graph inside.

Calling it with the inputs a single-device script would use (the whole global batch, on every
rank) slices this rank's pieces, runs the forward nodes of the lowered graph and returns the
loss, whole on every rank. ``loss.backward()`` reaches :class:`_JointStep.backward`, which runs
the backward nodes and makes one ``DTensor`` gradient per parameter, placed like the parameter.
It stores a fresh one in ``.grad`` itself where that is all autograd would do (no gradient yet,
no hook, a plain ``backward``); every other goes to autograd, whose accumulation adds to
``.grad``, runs hooks, or hands it to ``torch.autograd.grad``. So any ``torch.optim``
optimizer steps it, its state sharded like the parameters, and ``state_dict()`` holds DTensors
that ``torch.distributed.checkpoint`` saves and loads. torch's fused optimizer kernels
(``fused=True``) run on the local pieces (:mod:`.fused_optim`), and so do the elementwise ops
of their for-loop implementations (:mod:`.elementwise_fast_path`). ``clip_grad_norm_`` returns
the single-device norm on every rank, readable as a number (:mod:`.grad_norm`).

The submodules of the wrapped model are registered here under their own names, so parameter
and state-dict keys are the single-device model's keys. ``load_state_dict`` also takes whole
tensors (the single-device model's own ``state_dict()``, a Hugging Face model's weights): each
rank keeps its piece of each, placed as the plan places the parameter, with no communication.

The same code runs under ``LocalTensorMode`` (all ranks simulated in one process, as the SPMD
tests do): coordinates are then symbolic per-rank ints and every local tensor a LocalTensor,
which is why inputs and replicated shards are turned into LocalTensors here and nothing
branches on a coordinate in Python (:mod:`.redistribute`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from autopar.ir.errors import PlanError
from autopar.ir.graph import PlanGraph
from autopar.ir.inputs import constants_mismatch, split_inputs
from autopar.ir.placements import to_torch
from autopar.ir.plan import Plan
from autopar.runtime import _compat, elementwise_fast_path
from autopar.runtime.deferred_loss import DeferredLoss
from autopar.runtime.lower import LoweredGraph
from autopar.runtime.optim import fused as fused_optim
from autopar.runtime.optim import grad_norm
from autopar.runtime.optim.loss_scale import DynamicLossScale
from autopar.runtime.redistribute import CollectiveCounter, Comm

# (args, kwargs, current parameter specs) -> a new graph and plan keeping those specs
Replanner = Callable[[tuple, dict, dict], tuple[PlanGraph, Plan]]


class _JointStep(torch.autograd.Function):
    """Forward nodes in ``forward``, backward nodes in ``backward``; params are the inputs."""

    @staticmethod
    def forward(ctx: Any, call: ProgramCall, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        local, saved = call.run_forward()
        ctx.call = call
        ctx.saved_env = saved
        # the loss's collective runs on while the backward starts; waited for when read
        ctx.loss = call.lowered.loss_value(local, call.pm._comm)
        return local if ctx.loss is None else DeferredLoss(ctx.loss)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:  # type: ignore[override]
        call: ProgramCall = ctx.call
        saved, ctx.saved_env = ctx.saved_env, None  # free activations as soon as we are done
        grads = call.run_backward(saved, grad_loss)
        if ctx.loss is not None:  # done by now; leave no collective unwaited
            ctx.loss.resolve()
        if call.pm._profile is not None:  # parallelize(profile=...): a profiled step ends
            call.pm._profile.backward_done(call.pm)
        return (None, *store_fresh_grads(ctx, call.pm._param_list, grads))


def store_fresh_grads(ctx: Any, params: list[torch.Tensor], grads: list, skip: int = 0
                       ) -> list:
    """Store each gradient in ``.grad`` here where autograd would only store it: the parameter
    has none yet, no hook watches it, this backward accumulates into it (not
    ``torch.autograd.grad``) and the layout is the parameter's. Autograd's own accumulation
    of a DTensor costs a DTensor op per parameter. The others go back to autograd. (A pre-hook
    registered on the parameter's accumulator node itself cannot be seen from here, and does
    not see a gradient stored here; tensor hooks and post-accumulate hooks are honoured.)
    ``skip``: tensor inputs of the Function before the parameters."""
    edges = ctx.next_functions[skip:]  # one per tensor input: the parameters, in order
    if len(edges) != len(params):
        return grads
    out = []
    for (node, _), p, g in zip(edges, params, grads):
        if (g is not None and node is not None and p.grad is None
                and not p._backward_hooks and p._post_accumulate_grad_hooks is None
                and _engine_accumulates(node)
                and _compat.local_of(g).stride() == _compat.local_of(p).stride()):
            p.grad = g
            g = None
        out.append(g)
    return out


def _engine_accumulates(node: Any) -> bool:
    """Whether this backward runs the parameter's gradient accumulator: not under
    ``torch.autograd.grad`` (where torch refuses the question) nor ``backward(inputs=...)``
    leaving the parameter out."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


class ProgramCall:
    """One forward call: the program, this rank's placeholder values, where grads go."""

    def __init__(self, pm: ParallelModule, lowered: LoweredGraph, env: dict[str, Any]) -> None:
        self.pm = pm
        self.lowered = lowered
        self.env = env

    def run_forward(self) -> tuple[torch.Tensor, dict[str, Any]]:
        # the forward fills env with every value it keeps; let go of it, or those values
        # would live (through ctx.call) as long as the loss, past the backward
        env, self.env = self.env, {}
        return self.lowered.forward(env, self.pm._comm)

    def run_backward(self, saved: dict[str, Any], grad_loss: torch.Tensor) -> list:
        return self.run_stage_backward(saved, grad_loss)[0]

    def run_stage_backward(self, saved: dict[str, Any], grad_out: torch.Tensor,
                           carry: dict[int, torch.Tensor] | None = None, sync: bool = True
                           ) -> tuple[list, torch.Tensor | None]:
        """The parameters' gradients as DTensors and (a pipeline stage's) its input's local
        gradient. ``grad_out``: the loss's gradient, or a stage's output gradient.
        ``carry``, ``sync``: a gradient sync deferred over micro-batches
        (:meth:`LoweredGraph.stage_backward`)."""
        scaler = self.pm.loss_scale
        if scaler is not None:  # fp16: the backward starts from the scaled loss's gradient
            grad_out = scaler.seed(grad_out)
        locals_, dx = self.lowered.stage_backward(saved, grad_out, self.pm._comm, carry, sync)
        if scaler is not None:
            locals_ = scaler.unscale_or_skip(locals_, self.pm._comm, self.pm._param_list)
        out: list[DTensor | None] = []
        for p, g in zip(self.pm._param_list, locals_):
            if g is None:
                out.append(None)
                continue
            out.append(_compat.dtensor_like(p, g))
        return out, dx


class ParallelModule(nn.Module):
    """A model whose step runs as a planned SPMD program on a device mesh."""

    def __init__(self, model: nn.Module, device_mesh: Any, graph: PlanGraph, plan: Plan,
                 replan: Replanner | None = None, compile: bool = False) -> None:
        super().__init__()
        self._compile = compile  # Inductor compiles the per-rank program's runs of plain steps
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b)
        self.device_mesh = device_mesh
        self._device = torch.device(device_mesh.device_type)  # inputs follow (nccl: cuda)
        self.collectives = CollectiveCounter()
        coord = tuple(device_mesh.get_coordinate())
        self._comm = Comm(device_mesh, tuple(plan.decided.mesh_axes),
                          tuple(plan.decided.mesh_shape), coord, self.collectives)
        self._replan = replan
        self._profile: Any = None  # a step to profile (runtime.profiling.arm), else None
        self._programs: dict[tuple, tuple[PlanGraph, LoweredGraph]] = {}
        self._install(graph, plan)
        _distribute_state(self, graph, plan, device_mesh)
        self._register_load_state_dict_pre_hook(_place_whole_tensors, with_module=True)
        self._param_list = [self.get_parameter(n) for n in graph.param_names]
        self._buffer_list = [_get_tensor(self, n) for n in graph.buffer_names]
        # fp16 plans scale the loss dynamically (loss_scale); its state: scale, skipped steps
        self.loss_scale = DynamicLossScale() if plan.decided.precision.loss_scaling else None
        fused_optim.install()
        elementwise_fast_path.install()
        grad_norm.install()  # clip_grad_norm_'s total reads as one device's on every rank

    @property
    def plan(self) -> Plan:
        return self._active[1].plan

    def make_optimizer(self, cls: type[torch.optim.Optimizer], **kwargs: Any) -> Any:
        """``cls(self.parameters(), **kwargs)``, keeping in host memory the optimizer state
        of the parameters the plan offloads (:mod:`autopar.runtime.optim.offload`)."""
        from autopar.runtime.optim.offload import make_optimizer

        return make_optimizer(self.named_parameters(), set(self.plan.decided.param_state.offloaded),
                              cls, **kwargs)

    @property
    def graph(self) -> PlanGraph:
        return self._active[0]

    def _install(self, graph: PlanGraph, plan: Plan) -> None:
        self._comm.merge(plan.merged_axes())  # its sums over several axes: one collective
        self._active = (graph, LoweredGraph(graph, plan, self._compile, self._device))
        self._active_sig = _graph_signature(graph)  # the input (shape, dtype)s it runs on
        self._programs[self._active_sig] = self._active

    # --- calling --------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._profile is not None and torch.is_grad_enabled():
            self._profile.forward_starts(self)
        graph = self._active[0]
        leaves = _flatten_inputs(args, kwargs, graph)
        lowered = self._program_for(args, kwargs, leaves)
        if lowered.pg is not graph:  # another program: its keyword inputs may come in another order
            leaves = _flatten_inputs(args, kwargs, lowered.pg)
        with torch.no_grad():  # the program's own autograd is _JointStep, not torch's tape
            env = self._placeholders(lowered, leaves)
        if not torch.is_grad_enabled():
            return lowered.whole_loss(lowered.forward(env, self._comm)[0], self._comm)
        return _JointStep.apply(ProgramCall(self, lowered, env), *self._param_list)

    def _placeholders(self, lowered: LoweredGraph, leaves: list[torch.Tensor],
                      pieces: bool = False) -> dict:
        """This rank's value of every graph input: input slices, parameter and buffer shards,
        lifted constants. ``pieces``: the inputs are this rank's pieces already (a pipeline
        stage's, received in their planned layout), given for the leading input nodes."""
        env: dict[str, Any] = {}
        local = _compat.local_tensor_mode_active()

        def here(t: torch.Tensor) -> torch.Tensor:
            return _compat.as_local(t) if local else t.to(self._device)

        by_role = lowered.placeholders_by_role
        for node, value in zip(by_role["input"], leaves):
            env[node.name] = (lowered.place_local(node.name, here(value)) if pieces else
                              lowered.place_input(node.name, here(value), self._comm))
        for name, value in lowered.constants.items():
            env[name] = here(value)
        for node, p in zip(by_role["param"], self._param_list):
            env[node.name] = _compat.local_of(p)
        for node, b in zip(by_role["buffer"], self._buffer_list):
            env[node.name] = _compat.local_of(b) if isinstance(b, DTensor) else b
        return env

    def _program_for(self, args: tuple, kwargs: dict, leaves: list[torch.Tensor]
                     ) -> LoweredGraph:
        """The program for inputs of these shapes (``leaves``: the flat tensor inputs)."""
        graph, active = self._active[0], self._active_sig
        if len(leaves) == len(active) and all(
                t.shape == shape and t.dtype == dtype for t, (shape, dtype) in zip(leaves, active)):
            return self._active[1]  # the common call: the shapes of the last one
        sig = tuple((tuple(t.shape), t.dtype) for t in leaves)
        hit = self._programs.get(sig)  # every installed program, the active one included
        if hit is not None:
            self._active, self._active_sig = hit, sig
            self._comm.merge(hit[1].plan.merged_axes())
            return hit[1]
        traced = _describe(_graph_signature(graph))
        if self._replan is None:
            raise PlanError(
                f"the inputs have shapes {_describe(sig)} but the plan was made for {traced}: "
                "a given plan fits only the shapes it was made for. Call with those shapes, or "
                "parallelize with plan=None so autopar replans for new shapes")
        # same parameter layouts, new activation layouts: retrace and solve again
        new_graph, new_plan = self._replan(args, kwargs, dict(self.plan.decided.params))
        self._install(new_graph, new_plan)
        return self._active[1]


def _distribute_state(pm: nn.Module, graph: PlanGraph, plan: Plan, mesh: Any) -> None:
    """Parameters and buffers become DTensors placed as the plan says (tied ones stay tied)."""
    from torch.distributed.tensor import distribute_tensor

    device = torch.device(mesh.device_type)
    specs = {pname: plan.decided.params[pname] for pname in graph.param_names}
    buf_nodes = [n for n in graph.graph.nodes
                 if n.op == "placeholder" and n.meta["autopar"].role == "buffer"]
    for bname, n in zip(graph.buffer_names, buf_nodes):
        specs[bname] = plan.decided.nodes[n.name].outs[0]
    new_of: dict[int, torch.Tensor] = {}
    name_of = _names_by_id(pm)
    for mod in pm.modules():
        for store, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for key, t in list(store.items()):
                if t is None or isinstance(t, DTensor):
                    continue
                if id(t) not in new_of:
                    name = name_of.get(id(t))
                    if name is None or name not in specs:
                        continue
                    if t.is_meta:
                        raise PlanError(f"{name} is on the meta device: materialise the model "
                                        "(to_empty + init) before parallelize")
                    placements = [to_torch(p) for p in specs[name]]
                    d = distribute_tensor(t.detach().to(device), mesh, placements)
                    if _compat.local_tensor_mode_active():
                        # a replicated piece comes back as the plain tensor; the simulation
                        # needs every rank's piece as one LocalTensor (the optimizer writes it)
                        d = DTensor.from_local(_compat.as_local(d.to_local()), mesh, placements,
                                               run_check=False, shape=d.shape, stride=d.stride())
                    new_of[id(t)] = nn.Parameter(d, requires_grad=t.requires_grad) if is_param else d
                store[key] = new_of[id(t)]


def _place_whole_tensors(pm: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    """``load_state_dict``'s pre-hook: a whole tensor given for a DTensor parameter or buffer
    becomes this rank's piece of it, placed alike (a DTensor is copied as it is)."""
    from torch.distributed.tensor import distribute_tensor

    for name, t in [*pm.named_parameters(remove_duplicate=False),
                    *pm.named_buffers(remove_duplicate=False)]:
        value = state_dict.get(prefix + name)
        if not isinstance(t, DTensor) or not isinstance(value, torch.Tensor) or \
                isinstance(value, DTensor) or value.shape != t.shape:
            continue  # nothing to place; a shape that differs is load_state_dict's own error
        whole = value.detach().to(device=_compat.local_of(t).device, dtype=t.dtype)
        # src_data_rank=None: every rank slices its own piece, nothing is sent
        state_dict[prefix + name] = distribute_tensor(whole, t.device_mesh, t.placements,
                                                      src_data_rank=None)


def _names_by_id(pm: nn.Module) -> dict[int, str]:
    """Each parameter's and buffer's name, by tensor id (a tied tensor: its first name)."""
    out: dict[int, str] = {}
    for name, t in [*pm.named_parameters(), *pm.named_buffers()]:
        out.setdefault(id(t), name)
    return out


def _get_tensor(pm: nn.Module, name: str) -> torch.Tensor:
    mod_name, _, attr = name.rpartition(".")
    mod = pm.get_submodule(mod_name) if mod_name else pm
    return getattr(mod, attr)


# --- input signatures -----------------------------------------------------------------------


def _flatten_inputs(args: tuple, kwargs: dict, graph: PlanGraph) -> list[torch.Tensor]:
    """The call's tensor inputs in the traced order (positional, then keyword). Its other
    inputs are constants of the program: they must be the traced ones."""
    traced = graph.call_inputs
    if not kwargs and all(type(a) is torch.Tensor for a in args) and not any(
            n.startswith("kw:") for n in graph.input_names) and not (traced and traced.constants):
        return list(args)  # the common call, without the pytree walk
    kw_order = [n[3:] for n in graph.input_names if n.startswith("kw:")]
    missing = [k for k in kw_order if k not in kwargs]
    if missing or len(kwargs) != len(kw_order):
        raise PlanError(f"the model was traced with keyword inputs {kw_order}, called with "
                        f"{sorted(kwargs)}: call it with the inputs it was parallelized with")
    tensors, call = split_inputs(args, kwargs, kw_order)
    differ = traced and constants_mismatch(traced, call)
    if differ:
        raise PlanError(f"the model's non-tensor inputs are constants of its traced program, "
                        f"and {differ}: call it with the value it was parallelized with, or "
                        "parallelize it with example inputs holding this value")
    return tensors


def _graph_signature(graph: PlanGraph) -> tuple:
    nodes = [n for n in graph.graph.nodes if n.op == "placeholder"
             and n.meta["autopar"].role == "input"]
    return tuple((tuple(n.meta["autopar"].out.shape), n.meta["autopar"].out.dtype) for n in nodes)


def _describe(sig: tuple) -> str:
    return ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}" for s, d in sig) or "no tensors"
