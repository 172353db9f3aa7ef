"""A plain pipeline stage run under its plan's precision and recomputation, as the SPMD runtime
runs a whole step under them.

The SPMD runtime applies both to the traced step: the precision policy is traced into the
graph (:mod:`autopar.passes.memory.mixed_precision`: each parameter cast once to the compute dtype at
the start of the step, the policy's casts around its ops) and recomputation rewrites it
(:mod:`autopar.passes.memory.recompute`: per block, ``full`` everything computed inside it,
``selective`` the attention's internals but not its projections). A plain stage module (not a
traced program: :mod:`.pipeline_stages`' modules, under torch's pipeline schedules and their
autograd backward) gets the same from :class:`PlannedStage`, with the same code:

- precision: the stage's parameters go through :func:`mixed_precision.cast_params` (the fp32
  masters stay the optimizer's; their gradients leave in fp32 through the casts' backward) and
  its forward runs under :func:`mixed_precision.policy`, by ``torch.func.functional_call``,
  as capture traces a step; the schedule's loss runs under the policy too;
- recomputation: each block the stage calls (through ``call_block``, :class:`BlockCalls`) runs
  under ``torch.utils.checkpoint`` (``use_reentrant=False``): ``full`` keeps only the block's
  inputs, as per-block activation checkpointing does; ``selective`` keeps every result but
  those of ops inside an attention module and outside its projections (torch's selective
  checkpointing, with :func:`autopar.capture.joint.module_tag`'s tags and
  :func:`autopar.passes.memory.recompute.selective`'s rule; random draws are always kept).
  Recomputing runs the block again under the policy, with the same cast parameters.

Split backwards (torch's ``stage_backward_input`` then ``stage_backward_weight``, the
zero-bubble schedules' I and W actions) walk the same autograd graph in two passes, and a
checkpointed block is recomputed in each (the first stage, whose input has no gradient, runs
its backward whole, in the W action: once). torch's weight pass makes one autograd call per
group of parameters, each of which would recompute the blocks again; :func:`one_weight_pass`
merges the groups into one call. ``selective`` keeps its saved results for one pass only
(torch's selective checkpointing), so it is refused under a split backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from autopar.capture.joint import module_tag
from autopar.ir.errors import PlanError
from autopar.ir.options import FIXED_RECOMPUTE_MODES
from autopar.ir.precision import Precision
from autopar.passes.memory import mixed_precision
from autopar.passes.memory.recompute import draws, selective

BlockRunner = Callable[[nn.Module, tuple, dict], Any]


class BlockCalls:
    """Mixin of stage modules: blocks are called through :meth:`call_block`, which a plan's
    recomputation wraps (:class:`PlannedStage` sets ``block_runner``)."""

    block_runner: BlockRunner | None = None

    def call_block(self, block: nn.Module, *args: Any, **kwargs: Any) -> Any:
        run = self.block_runner
        return block(*args, **kwargs) if run is None else run(block, args, kwargs)


def check_modes(precision: Precision, recompute: str, split_backward: str | None = None
                ) -> None:
    """What plain stages run: fp32 or bf16, a fixed recompute mode, and selective
    recomputation only under schedules whose backward is one pass (``split_backward``: the
    name of a schedule that splits it into input and weight passes, else None)."""
    if recompute not in FIXED_RECOMPUTE_MODES:
        raise PlanError(f"pipeline stages recompute in a fixed mode, one of "
                        f"{', '.join(FIXED_RECOMPUTE_MODES)}, not {recompute!r}: pass one ('auto' is the "
                        "planner's choice, made when planning)")
    if precision.loss_scaling:
        raise PlanError(f"{precision.name} needs dynamic loss scaling, which pipeline stages do "
                        "not do yet: use bf16 (fp32's range, no scaling) or fp32")
    if recompute == "selective" and split_backward:
        raise PlanError(f"selective recomputation (torch's selective checkpointing) hands each "
                        f"kept result to one backward pass only, and schedule {split_backward} "
                        "runs two over every block (input, then weight gradients): recompute "
                        "'full' (or 'none'), or use a schedule with a whole backward (1F1B, "
                        "GPipe, Interleaved1F1B, LoopedBFS)")


def distinct_modes(recompute: str | Sequence[str]) -> list[str]:
    """The recompute modes ``recompute`` names (one, or one per stage), each once."""
    return [recompute] if isinstance(recompute, str) else list(dict.fromkeys(recompute))


def modes_frontend(model: nn.Module, family: str | None, frontend: str, prec: Precision,
                   recompute: str) -> str:
    """autopar's stage modules, which a plan's precision and recomputation reach (torch's
    traced stages run ATen ops, past the precision policy's torch functions, and have no
    blocks to checkpoint)."""
    if frontend == "module" or (frontend == "auto" and family is not None):
        return "module"
    what = f"{prec.name} with recompute={recompute!r}"
    if frontend == "trace":
        raise PlanError(f"torch's traced stages run their ATen ops as traced, in fp32 without "
                        f"recomputation, not {what}: use frontend='module' (or 'auto')")
    raise PlanError(f"pipeline stages run {what} in autopar's stage modules, for autopar's "
                    f"GPT-2, Llama-3 and MoE models and Hugging Face Llama-style decoders, not "
                    f"{type(model).__name__} (torch's traced stages run in fp32 without "
                    "recomputation): use precision='fp32' and recompute='none', or a mesh "
                    "without a 'pp' axis")


def under_policy(loss_fn: Callable, prec: Precision) -> Callable:
    """The schedule's loss under the precision policy, as the traced step computes its loss."""

    def loss(out: Any, target: torch.Tensor) -> torch.Tensor:
        with mixed_precision.policy(prec):
            return loss_fn(out, target)
    return loss


class PlannedStage(nn.Module):
    """``stage`` (a plain stage module with :class:`BlockCalls`) run under ``precision`` and
    ``recompute`` (see the module doc). Its parameters are the stage's own objects, so torch's
    pipeline stage scales and steps them as it would the stage's."""

    def __init__(self, stage: nn.Module, precision: Precision, recompute: str) -> None:
        super().__init__()
        check_modes(precision, recompute)
        if not isinstance(stage, BlockCalls):
            raise PlanError(f"{type(stage).__name__} does not call its blocks through "
                            "call_block: a plan's recomputation cannot reach them")
        self.stage = stage
        self.precision = precision
        self.recompute = recompute
        # each module's name in the stage: a block's cast parameters are found by it
        self._names = {id(m): n for n, m in stage.named_modules()}
        self._casts: dict[str, torch.Tensor] = {}
        self._tags: list[dict] = []  # the module tags open while a block runs (selective)
        if recompute != "none":
            stage.block_runner = self._run_block
        if recompute == "selective":
            for name, mod in stage.named_modules():
                tag = module_tag(mod)
                if tag is not None and name:
                    mod.register_forward_pre_hook(lambda m, a, t=tag: self._open(t))
                    mod.register_forward_hook(lambda m, a, o: self._close(), always_call=True)

    def _open(self, tag: dict) -> None:
        self._tags.append(tag)

    def _close(self) -> None:
        self._tags.pop()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.precision.mixed:
            return self.stage(*args, **kwargs)
        # the masters cast once per forward, as the traced step casts them once per step
        self._casts = mixed_precision.cast_params(dict(self.stage.named_parameters()),
                                                  self.precision)
        try:
            with mixed_precision.policy(self.precision):
                return torch.func.functional_call(self.stage, self._casts, args, kwargs)
        finally:
            self._casts = {}

    def _run_block(self, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        prefix = self._names[id(block)] + "."
        casts = {k[len(prefix):]: v for k, v in self._casts.items() if k.startswith(prefix)}
        keys, n = list(casts), len(args)

        def run(*flat: Any, **kw: Any) -> Any:
            # the recomputation runs in the backward, outside this forward's functional_call:
            # the block reads the same cast parameters, handed in as checkpoint inputs
            if not keys:
                return block(*flat, **kw)
            return torch.func.functional_call(block, dict(zip(keys, flat[n:])), flat[:n], kw)

        return checkpoint(run, *args, *casts.values(), use_reentrant=False,
                          context_fn=self._contexts, **kwargs)

    def _contexts(self) -> tuple[Any, Any]:
        """The block's forward context and its recomputation's: the policy again (the
        backward runs outside the forward's), and for ``selective`` torch's selective
        checkpointing with the SPMD runtime's rule."""
        if self.recompute == "full":
            return contextlib.nullcontext(), _Reentrant(self._policy)
        fwd, rec = create_selective_checkpoint_contexts(self._choose)
        return fwd, _Reentrant(lambda: _both(rec, self._policy()))

    def _policy(self) -> contextlib.AbstractContextManager:
        return mixed_precision.policy(self.precision)

    def _choose(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        tags: dict = {}
        for t in self._tags:  # nested modules' tags merged, inner over outer, as capture's
            tags.update(t)
        keep = (not selective(tags, str(op)) or draws(op, args, kwargs)
                or getattr(op, "_schema", None) is not None and op._schema.is_mutable)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


def one_weight_pass(stage: Any) -> None:
    """Make torch's pipeline ``stage`` compute its weight gradients (a split backward's W
    action) in one autograd call rather than one per group of parameters, each of which would
    recompute every checkpointed block again. The gradients are the same: a group is the
    parameters reached from some intermediates of the input pass, each intermediate belongs
    to one group, and the merged call clamps every intermediate's gradient to the one the
    input pass saved, as torch's call clamps them within a group. Left as torch's where its
    saved state is not the (inputs, groups, outputs, output grads) this was written for."""
    weights = stage.backward_weight_one_chunk

    def backward_weight_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
        state = getattr(stage, "backward_state", {}).get(mb)
        groups = state[1] if isinstance(state, tuple) and len(state) == 4 else None
        if isinstance(groups, list) and len(groups) > 1 and all(
                isinstance(g, dict) and {"params", "intermediates", "grads"} <= g.keys()
                for g in groups):
            groups[:] = [_merged(groups)]
        return weights(mb, *args, **kwargs)

    stage.backward_weight_one_chunk = backward_weight_one_chunk


def _merged(groups: list[dict]) -> dict:
    out: dict[str, Any] = {"params": set(), "intermediates": [], "grads": []}
    for g in groups:
        inter = list(g["intermediates"])
        out["params"] |= set(g["params"])
        out["intermediates"] += inter
        # an intermediate no gradient reached: no edge (torch's own call would fail there)
        out["grads"] += [t if t is not None else () for t in g["grads"] or [None] * len(inter)]
    return out


class _Reentrant:
    """A context made anew on each entry: a split backward recomputes a block twice."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.make = make
        self.open: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> None:
        cm = self.make()
        cm.__enter__()
        self.open.append(cm)

    def __exit__(self, *exc: Any) -> Any:
        return self.open.pop().__exit__(*exc)
