"""Capture: the joint forward+backward ATen graph of one training step, on fake tensors.

``capture(model, example_inputs)`` traces ``loss = model(*inputs); grads = autograd.grad(loss,
params)`` with ``make_fx`` under a ``FakeTensorMode``: parameters built on the meta device (or
real ones) become fake tensors, so a 70B model is traced without allocating its weights.

Repeated blocks (the children of an ``nn.ModuleList`` that share a type) are tagged with
their index, forward and backward alike, by module hooks that annotate the nodes being traced.
The solver uses those tags to give every layer one shared set of variables.

A pipeline stage's step (an activation out, seeded by its gradient; the input's gradient
returned too) is traced by the same code in a :class:`StageMode` (:mod:`autopar.capture.stage`).

Hugging Face MoE layers whose experts implementation cannot be traced are traced with one that
can (:mod:`autopar.capture.hf_experts`).
"""

from __future__ import annotations

import operator
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten

from autopar.capture import _torch_compat as compat
from autopar.capture.depth_proxy import truncated
from autopar.capture.hf_experts import traceable_experts
from autopar.capture.trace_errors import explain
from autopar.ir.errors import CaptureError
from autopar.ir.graph import NodeFacts, PlanGraph, StageIO, TensorMeta
from autopar.ir.inputs import split_inputs
from autopar.ir.precision import Precision
from autopar.passes.memory import mixed_precision


def capture(
    model: nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    max_layers: int | None = None,
    precision: Precision | None = None,
) -> PlanGraph:
    """Trace one training step of ``model`` into a :class:`PlanGraph`.

    The model's output must be a scalar loss, an object with a ``.loss`` field (Hugging Face
    style) or a dict with ``"loss"``. With ``loss_fn``, the last positional input is the target:
    the model gets the others and the loss is ``loss_fn(output, target)``. With ``max_layers``,
    a deeper model is traced as a proxy of that many layers (see :mod:`autopar.capture.depth_proxy`).
    ``precision``: the mixed-precision policy the step is traced under (default fp32; see
    :mod:`autopar.passes.memory.mixed_precision`): its casts are ops of the captured graph.
    """
    precision = precision or Precision()
    all_names = [n for n, p in model.named_parameters() if p.requires_grad]
    with truncated(model, max_layers) as proxy, traceable_experts(model):
        pg = trace_joint(model, example_inputs, example_kwargs, loss_fn, precision)
    pg.proxy = proxy
    pg.all_param_names = all_names
    pg.precision = precision
    return pg


@dataclass(frozen=True, slots=True)
class StageMode:
    """How a pipeline stage's step differs from a whole training step
    (:func:`autopar.capture.stage.capture_stage`)."""

    input_grad: bool  # the first input is an activation: the step returns its gradient too
    # the output is an activation sent on, not a loss: the backward starts from its gradient,
    # the step's last input (the same shape and dtype as the output)
    seeded: bool
    blocks: tuple[nn.Module, ...] = ()  # the stage's repeated blocks, tagged as layers


def trace_joint(model, example_inputs, example_kwargs, loss_fn, precision,
                stage: StageMode | None = None) -> PlanGraph:
    """The joint forward+backward trace both captures share: a whole step's (:func:`capture`,
    which adds the depth proxy and the names) or, with ``stage``, one pipeline stage's
    (:func:`autopar.capture.stage.capture_stage`)."""
    example_kwargs = dict(example_kwargs or {})
    example_inputs = tuple(example_inputs)
    if loss_fn is not None and not example_inputs:
        raise CaptureError(
            "loss_fn was given but there are no example inputs: pass example_inputs=(inputs..., "
            "target); the last one is handed to loss_fn(output, target)"
        )
    named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    named_buffers = list(model.named_buffers()) + frozen
    if not named_params:
        raise CaptureError("the model has no trainable parameters: there is nothing to plan")

    fake_mode = compat.new_fake_mode()
    t0 = time.perf_counter()
    params = {n: _fake(p, fake_mode, requires_grad=True) for n, p in named_params}
    buffers = {n: _fake(b, fake_mode) for n, b in named_buffers}
    args = tuple(_fake_tree(a, fake_mode) for a in example_inputs)
    kwargs = {k: _fake_tree(v, fake_mode) for k, v in example_kwargs.items()}
    stage = stage or StageMode(False, False)
    if stage.input_grad:  # a stage's activation input: the step returns its gradient
        args = (_fake(example_inputs[0], fake_mode, requires_grad=True), *args[1:])

    param_list = list(params.values())

    def step(params_in, buffers_in, tensors_in):
        # the call's non-tensor inputs are constants of the trace, put back in their places
        args_in, kwargs_in = call.rebuild(tensors_in)
        seed = None
        if stage.seeded:  # the output's gradient, received from the next stage
            args_in, seed = args_in[:-1], args_in[-1]
        with compat.annotate({"autopar_phase": "fwd"}):
            with compat.annotate({"autopar_cast": "param"}):
                state = {**mixed_precision.cast_params(params_in, precision), **buffers_in}
            with mixed_precision.policy(precision):
                loss = _forward(state, args_in, kwargs_in)
            if seed is None and precision.mixed and loss.dtype != torch.float32:
                loss = loss.float()  # the loss, and the backward's seed, in fp32
        with compat.annotate({"autopar_phase": "bwd"}):
            wrt = list(params_in.values()) + ([args_in[0]] if stage.input_grad else [])
            grads = torch.autograd.grad(loss, wrt, grad_outputs=seed, allow_unused=True)
        return loss, grads

    def _forward(state, args_in, kwargs_in):
        if stage.seeded:  # a stage's output: an activation, not a loss
            out = torch.func.functional_call(model, state, args_in, kwargs_in, strict=False)
            if not isinstance(out, torch.Tensor) or not out.is_floating_point():
                raise CaptureError(
                    f"a pipeline stage must return one floating-point tensor, "
                    f"{type(model).__name__} returned {type(out).__name__}{_shape_of(out)}: "
                    "return the activation the next stage reads")
            return out
        if loss_fn is None:
            out = torch.func.functional_call(model, state, args_in, kwargs_in, strict=False)
            loss = _extract_loss(out)
        else:
            out = torch.func.functional_call(
                model, state, args_in[:-1], kwargs_in, strict=False
            )
            loss = loss_fn(out, args_in[-1])
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise CaptureError("loss_fn must return a scalar tensor")
        return loss

    if stage.seeded:  # the output's gradient: a tensor like the output, the last input
        args = (*args, _output_like(model, params, buffers, args, kwargs, fake_mode,
                                    precision))
    tensors, call = split_inputs(args, kwargs)
    hooks, open_tags = _tag_repeated_blocks(model, list(stage.blocks) or None)
    try:
        with fake_mode, compat.preserve_node_meta(), compat.annotation_scope(), \
                warnings.catch_warnings():
            # the layer-tagging backward hooks fire on blocks whose input needs no gradient
            # (an MLP's first layer); torch warns about it, harmlessly
            warnings.filterwarnings("ignore", message=".*Full backward hook.*")
            try:
                gm = make_fx(step, tracing_mode="real")(params, buffers, tensors)
            finally:
                # a trace that raised inside a block left its tag open: close it here, before
                # the annotation scope restores, not whenever the garbage collector does
                while open_tags:
                    open_tags.pop().__exit__(None, None, None)
    except CaptureError:
        raise
    except Exception as e:  # the user's model failed under tracing: say where, keep the cause
        if loss_fn is not None and isinstance(e, TypeError):
            hint = (f"with loss_fn, the last of the {len(example_inputs)} example inputs is the "
                    "target, handed to loss_fn(output, target), and the model is called with "
                    "the others: pass example_inputs=(inputs..., target)")
            raise CaptureError(
                f"tracing the training step failed with {type(e).__name__}: {e}. {hint}") from e
        raise CaptureError(explain(e, model)) from e
    finally:
        for h in hooks:
            h.remove()
    trace_s = time.perf_counter() - t0
    _drop_unused_items(gm)
    if any(not callable_module(b) for b in (list(stage.blocks) or repeated_blocks(model))):
        _fill_block_spans(gm)

    input_names = [f"arg{i}" for i in range(len(args))] + [f"kw:{k}" for k in kwargs]
    if stage.seeded:
        input_names[len(args) - 1] = GRAD_OUT
    pg = _annotate_graph(
        gm,
        list(params),
        list(buffers),
        input_names,
        [_tree_leaf_count(a) for a in args] + [_tree_leaf_count(v) for v in kwargs.values()],
        param_list,
    )
    pg.trace_s = trace_s
    pg.call_inputs = call
    if stage.input_grad or stage.seeded:
        pg.stage = _stage_io(pg, stage)
    return pg


# the input name of a stage's output gradient (a stage step's last input)
GRAD_OUT = "grad_out"


def _output_like(model: nn.Module, params: dict, buffers: dict, args: tuple, kwargs: dict,
                 mode: Any, precision: Precision) -> torch.Tensor:
    """A fake tensor like the stage's output: its gradient's example. The forward runs once
    on the fake tensors, under the step's precision, to learn its shape and dtype (no graph
    is recorded)."""
    with mode, torch.no_grad(), mixed_precision.policy(precision):
        state = {**mixed_precision.cast_params(params, precision), **buffers}
        out = torch.func.functional_call(model, state, args, kwargs, strict=False)
        if not isinstance(out, torch.Tensor):
            raise CaptureError(
                f"a pipeline stage must return one tensor, {type(model).__name__} returned "
                f"{type(out).__name__}: return the activation the next stage reads")
        return torch.empty_like(out)


def _stage_io(pg: PlanGraph, stage: StageMode) -> StageIO:
    """The stage's boundary nodes: its activation input, that input's gradient (the step's
    last output) and its output's gradient (its last input)."""
    inputs = {n.meta["autopar"].input_index: n.name for n in pg.graph.nodes
              if n.op == "placeholder" and n.meta["autopar"].role == "input"}
    out_node = next(n for n in pg.graph.nodes if n.op == "output")
    flat_out = tree_flatten(out_node.args[0])[0]
    dx = flat_out[-1] if stage.input_grad else None
    if stage.input_grad and not isinstance(dx, fx.Node):
        raise CaptureError("the stage's output does not depend on its input activation: a "
                           "pipeline stage must compute its output from what it receives")
    return StageIO(inputs[0] if stage.input_grad else None,
                   dx.name if isinstance(dx, fx.Node) else None,
                   inputs[max(inputs)] if stage.seeded else None)


def _fake(t: torch.Tensor, mode, requires_grad: bool = False) -> torch.Tensor:
    """A fake copy of ``t`` (a meta tensor becomes a fake CPU tensor: nothing is allocated)."""
    with torch.no_grad():
        if t.device.type == "meta":
            with mode:
                out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        else:
            out = mode.from_tensor(t.detach())
    return out.requires_grad_(requires_grad) if requires_grad or out.requires_grad else out


def _fake_tree(x: Any, mode) -> Any:
    if isinstance(x, torch.Tensor):
        return _fake(x, mode)
    if isinstance(x, (list, tuple)):
        return type(x)(_fake_tree(v, mode) for v in x)
    if isinstance(x, dict):
        return {k: _fake_tree(v, mode) for k, v in x.items()}
    return x


def _tree_leaf_count(x: Any) -> int:
    return sum(isinstance(v, torch.Tensor) for v in tree_flatten(x)[0])


def _extract_loss(out: Any) -> torch.Tensor:
    loss = out
    if not isinstance(out, torch.Tensor):
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise CaptureError(
            "the model must return a scalar loss (or an output with a .loss field); it returned "
            f"{type(out).__name__}{_shape_of(out)}. Pass the targets so it computes the loss, "
            "or give loss_fn=(output, target) -> loss"
        )
    return loss


def _shape_of(x: Any) -> str:
    return f" of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else ""


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's layers: the children of ``nn.ModuleList``s whose members share one type,
    and, outside those, blocks kept as numbered attributes (:func:`numbered_blocks`)."""
    blocks: list[nn.Module] = []
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2:
            kinds = {type(c) for c in mod}
            if len(kinds) == 1 and any(True for _ in next(iter(mod)).parameters()):
                blocks.extend(mod)
    inside = {id(m) for b in blocks for m in b.modules()}
    for mod in model.modules():
        if id(mod) not in inside and not isinstance(mod, nn.ModuleList):
            found = numbered_blocks(mod)
            blocks.extend(found)
            inside |= {id(m) for b in found for m in b.modules()}
    return blocks


def numbered_blocks(parent: nn.Module) -> list[nn.Module]:
    """Blocks a module keeps as numbered attributes (``self.block0``, ``self.block1``, ...):
    two or more children named one prefix and consecutive numbers, of one type, each made of
    submodules and holding parameters of the same names and shapes; in number order."""
    groups: dict[str, dict[int, nn.Module]] = {}
    for name, child in parent.named_children():
        match = re.fullmatch(r"(.*?[A-Za-z_])(\d+)", name)
        if match and any(True for _ in child.children()):
            groups.setdefault(match[1], {})[int(match[2])] = child
    for members in groups.values():
        order = sorted(members)
        if len(order) < 2 or order != list(range(order[0], order[0] + len(order))):
            continue
        mods = [members[i] for i in order]
        shapes = [[(n, p.shape) for n, p in m.named_parameters()] for m in mods]
        if len({type(m) for m in mods}) == 1 and shapes[0] and all(s == shapes[0] for s in shapes):
            return mods  # one group per module: a second would interleave its layer numbers
    return []


def _tag_repeated_blocks(model: nn.Module, blocks: list[nn.Module] | None = None
                         ) -> tuple[list[Any], list[Any]]:
    """Hooks tagging each block's nodes with its index (``blocks``: the model's own, else
    :func:`repeated_blocks`), and the stack of tags open while tracing."""
    handles, stack = [], []

    def enter(tag: dict) -> None:
        cm = compat.annotate(tag)
        cm.__enter__()
        stack.append(cm)

    def leave() -> None:
        if stack:
            stack.pop().__exit__(None, None, None)

    for i, block in enumerate(repeated_blocks(model) if blocks is None else blocks):
        layer = {"autopar_layer": i}
        # a block the forward never calls (an nn.ModuleDict): its parts called in its stead,
        # and the ops between them adopted afterwards (_fill_block_spans)
        for part in called_parts(block):
            handles.append(part.register_forward_pre_hook(lambda m, a, t=layer: enter(t)))
            handles.append(part.register_forward_hook(lambda m, a, o: leave()))
            handles.append(part.register_full_backward_pre_hook(lambda m, g, t=layer: enter(t)))
            handles.append(part.register_full_backward_hook(lambda m, gi, go: leave()))
        # the forward's attention internals, which selective recomputation recomputes
        # (passes.recompute), and its projections inside, which it keeps
        for sub in block.modules():
            tag = module_tag(sub)
            if tag is not None:
                handles.append(sub.register_forward_pre_hook(lambda m, a, t=tag: enter(t)))
                handles.append(sub.register_forward_hook(lambda m, a, o: leave()))
    return handles, stack


def callable_module(mod: nn.Module) -> bool:
    """Whether ``mod`` has a forward of its own (an ``nn.ModuleDict`` or ``nn.ModuleList``
    has none: the model calls its members)."""
    return type(mod).forward is not nn.Module.forward


def called_parts(block: nn.Module) -> list[nn.Module]:
    """The modules a forward calls for ``block``: itself where it has a forward, else its
    members', depth-first."""
    if callable_module(block):
        return [block]
    return [part for child in block.children() for part in called_parts(child)]


def _fill_block_spans(gm: fx.GraphModule) -> None:
    """Blocks called through their parts (:func:`called_parts`) leave the ops between the
    parts untagged (an attention's softmax, a residual add written in the model's forward).
    Each block spans from its first tagged op to the next block's first, in each phase (the
    backward runs the blocks in reverse); the last block's span ends as many ops after its
    last tagged op as the block before it had after its own, the blocks being alike. Only
    untagged ops inside a span are adopted."""
    for phase in ("fwd", "bwd"):
        seq = [n for n in gm.graph.nodes if n.op == "call_function"
               and (n.meta.get("custom") or {}).get("autopar_phase", "bwd") == phase]
        layer_at = [(n.meta.get("custom") or {}).get("autopar_layer") for n in seq]
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for pos, layer in enumerate(layer_at):
            if layer is not None:
                first.setdefault(layer, pos)
                last[layer] = pos
        order = sorted(first, key=first.__getitem__)  # the blocks in the order they run
        for j, layer in enumerate(order):
            if j + 1 < len(order):
                end = first[order[j + 1]]
            else:
                tail = first[layer] - last[order[j - 1]] - 1 if j else 0
                end = min(last[layer] + 1 + tail, len(seq))
            for pos in range(first[layer], end):
                if layer_at[pos] is None:
                    custom = seq[pos].meta.get("custom") or {}
                    seq[pos].meta["custom"] = {**custom, "autopar_layer": layer}


def module_tag(mod: nn.Module) -> dict | None:
    """The tag a module's forward ops carry for selective recomputation (its attention
    internals recomputed, its projections kept: :func:`autopar.passes.memory.recompute.selective`);
    a pipeline stage's blocks are tagged alike at run time (:mod:`autopar.runtime.pipeline.planned_stage`)."""
    kind = type(mod).__name__.lower()
    if "attention" in kind:
        return {"autopar_attention": True, "autopar_projection": False}
    if isinstance(mod, nn.Linear) or kind in ("conv1d", "linear"):
        return {"autopar_projection": True}
    return None


def _metas(val: Any) -> tuple[TensorMeta | None, ...]:
    if isinstance(val, torch.Tensor):
        return (TensorMeta(tuple(int(s) for s in val.shape), val.dtype),)
    if isinstance(val, (list, tuple)):
        return tuple(
            TensorMeta(tuple(int(s) for s in v.shape), v.dtype) if isinstance(v, torch.Tensor)
            else None
            for v in val
        )
    return (None,)


def _drop_unused_items(gm: fx.GraphModule) -> None:
    """Remove the ``getitem`` nodes nothing reads. make_fx records some, and one may pick an
    output the op left as None (``convolution_backward``'s input gradient where the input
    needs none), which is no tensor to place."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is operator.getitem and not n.users:
            gm.graph.erase_node(n)
    gm.recompile()


def _annotate_graph(
    gm: fx.GraphModule,
    param_names: list[str],
    buffer_names: list[str],
    input_names: list[str],
    input_leaves: list[int],
    param_list: list[torch.Tensor],
) -> PlanGraph:
    from autopar.capture.flops import node_flops

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    owners: list[tuple[str, str | None, int | None]] = []
    owners += [("param", p, None) for p in param_names]
    owners += [("buffer", None, None) for _ in buffer_names]
    for idx, count in enumerate(input_leaves):
        owners += [("input", None, idx)] * count
    if len(owners) != len(placeholders):
        raise CaptureError(
            f"internal: {len(placeholders)} graph inputs for {len(owners)} tensors"
        )
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat_out = tree_flatten(out_node.args[0])[0]  # (loss, *grads); None where a grad is unused
    loss_arg, grad_args = flat_out[0], flat_out[1:]
    grad_of: dict[str, str] = {}
    for pname, g in zip(param_names, grad_args):
        if isinstance(g, fx.Node):
            grad_of[g.name] = pname

    layers: set[int] = set()
    for n in gm.graph.nodes:
        custom = n.meta.get("custom") or {}
        layer = custom.get("autopar_layer")
        if layer is not None:
            layers.add(layer)
        if n.op == "placeholder":
            role, pname, idx = owners[placeholders.index(n)]
            facts = NodeFacts(n.name, "placeholder", _metas(n.meta.get("val")), role,
                              param_name=pname, input_index=idx)
        elif n.op == "output":
            facts = NodeFacts(n.name, "output", (), "output")
        else:
            phase = custom.get("autopar_phase", "bwd")
            role = "activation"
            if n is loss_arg:
                role = "loss"
            elif n.name in grad_of:
                role = "grad"
            facts = NodeFacts(n.name, _op_name(n.target), _metas(n.meta.get("val")), role,
                              phase=phase, layer=layer, param_name=grad_of.get(n.name))
            facts.flops = node_flops(n)
            if custom.get("autopar_cast") == "param" and n.all_input_nodes:
                facts.extra["param_cast"] = n.all_input_nodes[0].meta["autopar"].param_name
        n.meta["autopar"] = facts
    _adopt_cast_layers(gm)
    return PlanGraph(gm, param_names, buffer_names, input_names, grad_of, loss_arg.name,
                     num_layers=len(layers))


def _adopt_cast_layers(gm: fx.GraphModule) -> None:
    """Mixed precision's casts run outside the layers' modules (a parameter's at the start of
    the step, its gradient's after the layer's backward), so no layer tagged them; they belong
    to the layer whose ops read the parameter, like the parameter itself, so repeated layers
    still line up node for node and share their variables."""
    for n in gm.graph.nodes:
        f = n.meta.get("autopar")
        if f is None or f.layer is not None or n.op != "call_function":
            continue
        if "param_cast" in f.extra:
            near = [u.meta["autopar"].layer for u in n.users if "autopar" in u.meta]
        elif f.role == "grad" and f.op == "aten._to_copy.default":
            near = [a.meta["autopar"].layer for a in n.all_input_nodes]
        else:
            continue
        layers = set(near) - {None}
        if len(layers) == 1:
            f.layer = layers.pop()


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))
