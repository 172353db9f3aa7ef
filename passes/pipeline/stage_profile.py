"""What a pipeline stage costs, read off the intra-op plan of a stage's stand-in.

The pipeline planner (:mod:`autopar.planning.pipeline`) plans one stand-in stage on the stage
submesh: the model's embedding and head with the blocks one stage holds, traced as a depth
proxy whose kept activations are held once per microbatch in flight
(:func:`autopar.capture.depth_proxy.stage_representative`). Every stage runs that layout (each
in a recomputation mode of its own: the layout priced in each mode planned is one profile per
mode, ``StageProfile.recompute``); this pass splits the plan's cost into the three parts the
slicing DP (:mod:`.stage_split`) adds up:

- ``pre``: what runs before the first block (the embedding), on the first stage only;
- ``block``: one real block (the traced blocks' total over the blocks they stand for);
- ``post``: what runs after the last block (final norm, head, loss), on the last stage only.

Each part has forward and backward time per microbatch (compute, and the plan's collectives
inside the step, priced where the reading op runs), what runs once per step (the gradient
synchronisation after the last microbatch, and the gathers of parameters held whole across the
microbatches: ZeRO-1/2, a distributed optimizer), state bytes (parameters with their gradients and optimizer state,
as placed), bytes kept for the backward per microbatch, and its largest transient. A node
outside the blocks belongs to ``pre`` or ``post`` by where it runs: before the first block's
forward or after the last block's backward is ``pre``, between is ``post``.

The per-edge prices are those the plan's scoring sums; gradient syncs are bucketed there, so
the parts' syncs are scaled to the plan's bucketed total (each bucket at its real fill, as
:func:`autopar.passes.problem.bucket_fill.score` reports plans), and the rest to the plan's step
time less it: the parts add up to the plan's own cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopar.ir import stage_kind
from autopar.ir.graph import node_layer
from autopar.ir.placements import local_shape
from autopar.passes.cost.cost_model import loss_collectives
from autopar.passes.memory import zero
from autopar.passes.problem import bucket_fill
from autopar.passes.problem.step_memory import step_usage
from autopar.passes.problem.types import ShardingProblem

PARTS = ("pre", "block", "post")


@dataclass(frozen=True, slots=True)
class PartCost:
    """One part's cost per device: times per microbatch, sync per step, bytes."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    sync_s: float = 0.0
    state_bytes: float = 0.0
    saved_bytes: float = 0.0  # kept for the backward, per microbatch in flight
    transient_bytes: float = 0.0  # the most it holds briefly on top, while it runs
    recompute_s: float = 0.0  # of backward_s, forward work run again (recomputation)
    nodes: float = 0.0  # autograd nodes its forward records, per microbatch

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True, slots=True)
class StageProfile:
    pre: PartCost
    block: PartCost  # one real block
    post: PartCost
    boundary_bytes: float  # a block's input, per device and microbatch (sent between stages)
    weight_share: float  # the backward's share that computes weight gradients (deferrable)
    # whether the stage's backward splits into its input and weight parts: a stage that runs
    # its intra-op plan as one program (:func:`runs_as_program`) splits its lowered backward
    # unless that gathers parameters (:func:`autopar.ir.stage_kind.program_splits_backward`)
    splits_backward: bool = True
    # gradient bytes per device of parameters both ends read (a head tied to the embedding):
    # the first and last stages each hold a copy and sum their gradients once per step
    tied_bytes: float = 0.0
    # the recomputation mode its layout was priced in ("": the plan's own): the pipeline
    # planner weighs one profile per mode and records each stage's
    recompute: str = ""

    def part(self, name: str) -> PartCost:
        return getattr(self, name)


def runs_as_program(sp: ShardingProblem, choice: list[int]) -> bool:
    """Whether a stage of this layout runs as one lowered program rather than as a plain
    module replicated over ``dp`` (:func:`autopar.ir.stage_kind.runs_as_program`, which the
    runtime reads off the plan made)."""
    specs = (sp.strategies[i][choice[i]].outs[0] for i, n in enumerate(sp.nodes)
             if n.meta["autopar"].role == "param")
    return stage_kind.runs_as_program(sp.mesh.axes, sp.mesh.shape, specs, sp.zero1)


def gathers_in_backward(sp: ShardingProblem, choice: list[int]) -> bool:
    """Whether this layout's backward gathers a parameter (moves it out of its stored layout,
    ZeRO-3's re-gathering), as the lowered program's backward would."""
    def spec_out(i: int, k: int) -> tuple:
        return tuple(sp.strategies[i][choice[i]].outs[k])

    return any(e.in_idx >= 0 and sp.nodes[e.src].meta["autopar"].param_like
               and sp.nodes[e.dst].meta["autopar"].phase == "bwd"
               and spec_out(e.src, e.out_idx)
               != tuple(sp.strategies[e.dst][choice[e.dst]].ins[e.in_idx])
               for e in sp.edges)


def part_of_nodes(sp: ShardingProblem) -> list[str]:
    """Each node's part: ``block`` inside a repeated block, else ``pre`` or ``post`` by
    where it runs (module docstring)."""
    layers = [node_layer(n) for n in sp.nodes]
    phases = [n.meta["autopar"].phase for n in sp.nodes]
    in_block = [i for i, ly in enumerate(layers) if ly is not None]
    if not in_block:
        raise ValueError("the stage's graph has no repeated blocks")
    # the first block op that runs (its parameters' placeholders come first in the graph)
    first_fwd = min(i for i in in_block if phases[i] != "bwd" and sp.nodes[i].op != "placeholder")
    bwd_blocks = [i for i in in_block if phases[i] == "bwd"]
    last_bwd = max(bwd_blocks) if bwd_blocks else len(sp.nodes)
    out = []
    for i, n in enumerate(sp.nodes):
        if layers[i] is not None:
            out.append("block")
        elif n.op == "placeholder":
            out.append("")  # decided by its first reader, below
        elif i < first_fwd or i > last_bwd:
            out.append("pre")
        else:
            out.append("post")
    index = {n: i for i, n in enumerate(sp.nodes)}
    for i, n in enumerate(sp.nodes):
        if not out[i]:
            readers = sorted(index[u] for u in n.users if u in index)
            out[i] = out[readers[0]] if readers and out[readers[0]] else "pre"
    return out


def stage_profile(sp: ShardingProblem, choice: list[int], blocks: int,
                  dp_size: int = 1) -> StageProfile:
    """The parts of the plan ``choice`` on ``sp``, a stand-in traced for ``blocks`` real
    blocks (``block`` is their total over ``blocks``). ``dp_size``: the ways a stage's
    boundary tensor is split (its batch over the data-parallel axes)."""
    # priced as plans are reported, each at its own buckets' fill (the problem's fills are
    # one solution's: a stage whose buckets fill would pay another plan's near-empty ones)
    scored = bucket_fill.score(sp, choice)
    parts = part_of_nodes(sp)
    weight = sp.weight if sp.weight is not None else np.ones(len(sp.nodes))
    phase = [n.meta["autopar"].phase for n in sp.nodes]
    fwd = {p: 0.0 for p in PARTS}
    bwd = {p: 0.0 for p in PARTS}
    sync = {p: 0.0 for p in PARTS}
    wgrad = 0.0  # backward time of ops that make parameter gradients only

    again = {p: 0.0 for p in PARTS}  # recomputed copies' compute, within the backward
    nodes = {p: 0.0 for p in PARTS}
    for i, n in enumerate(sp.nodes):
        if phase[i] == "fwd" and n.op == "call_function":
            nodes[parts[i]] += float(weight[i])
    copies = {i for i, n in enumerate(sp.nodes) if "recomputes" in n.meta["autopar"].extra}

    def add(i: int, t: float) -> None:
        (bwd if phase[i] == "bwd" else fwd)[parts[i]] += t
        if i in copies:
            again[parts[i]] += t

    # the weight share is read off the blocks past the first traced one: the first block's
    # input gradient only feeds the embedding's weight gradient, so all of it would count
    grad_makers = _weight_gradient_nodes(sp)
    layers = [node_layer(n) for n in sp.nodes]
    first = min((ly for ly in layers if ly is not None), default=None)
    later = any(ly is not None and ly != first for ly in layers)
    block_bwd = 0.0
    for i, s in enumerate(choice):
        t = float(sp.node_cost[i][s])
        add(i, t)
        if phase[i] == "bwd" and layers[i] is not None and (layers[i] != first or not later):
            block_bwd += t
            wgrad += t if i in grad_makers else 0.0
    tied = _tied_params(sp, parts)
    tied_sync = {p: 0.0 for p in PARTS}  # a tied copy's own sync, at the other end
    for k, colls in scored.edge_collectives.items():
        e = sp.edges[k]
        t = sum(c.time_s for c in colls) * float(weight[e.dst])
        if e.in_idx < 0 or e.once:  # once per step: a gradient sync, a held parameter's gather
            sync[parts[e.dst]] += t
            if e.dst in tied:
                tied_sync["post" if parts[e.dst] == "pre" else "pre"] += t
        else:
            add(e.dst, t)
    loss_i = sp.loss_index
    loss_meta = sp.nodes[loss_i].meta["autopar"].out
    fwd[parts[loss_i]] += sum(c.time_s for c in loss_collectives(
        loss_meta, sp.strategies[loss_i][choice[loss_i]].outs[0], sp.mesh))

    # scale to the plan's own totals (its gradient syncs go out in buckets, its gathers per
    # layer); the plan's cost weighs what runs once per step 1/microbatches
    m = sp.microbatches
    plan_sync = scored.once_s if m > 1 else sum(
        c.time_s for c in scored.collectives if c.reason == "gradient sync")
    raw_sync = sum(sync.values())
    raw_rest = sum(fwd.values()) + sum(bwd.values())
    k_sync = plan_sync / raw_sync if raw_sync > 0 else 0.0
    k_rest = (scored.cost.step_s - plan_sync / m) / raw_rest if raw_rest > 0 else 0.0

    state, saved, transient = _memory_parts(sp, choice, parts, tied)

    def make(p: str, per: float) -> PartCost:
        return PartCost(fwd[p] * k_rest / per, bwd[p] * k_rest / per,
                        (sync[p] + tied_sync[p]) * k_sync / per,
                        state[p] / per, saved[p] / per, transient[p], again[p] * k_rest / per,
                        nodes[p] / per)

    return StageProfile(
        make("pre", 1.0), make("block", float(blocks)), make("post", 1.0),
        boundary_bytes=_boundary_bytes(sp, parts) / max(1, dp_size),
        weight_share=min(0.9, wgrad / block_bwd) if block_bwd > 0 else 0.5,
        splits_backward=not runs_as_program(sp, choice) or stage_kind.program_splits_backward(
            gathers_in_backward(sp, choice)),
        tied_bytes=_tied_bytes(sp, choice, tied),
    )


def _tied_params(sp: ShardingProblem, parts: list[str]) -> set[int]:
    """The parameters read by both ``pre`` and ``post`` (a head tied to the embedding)."""
    index = {n: i for i, n in enumerate(sp.nodes)}
    return {i for i, n in enumerate(sp.nodes)
            if n.meta["autopar"].role == "param"
            and {"pre", "post"} <= {parts[index[u]] for u in n.users if u in index}}


def _tied_bytes(sp: ShardingProblem, choice: list[int], tied: set[int]) -> float:
    """Gradient bytes per device of the ``tied`` parameters, as placed."""
    total = 0.0
    for i in tied:
        f = sp.nodes[i].meta["autopar"]
        spec = sp.strategies[i][choice[i]].outs[0]
        dtype = sp.grad_dtype or f.out.dtype
        total += math.prod(local_shape(tuple(f.out.shape), spec, sp.mesh.shape)) * dtype.itemsize
    return total


def _weight_gradient_nodes(sp: ShardingProblem) -> set[int]:
    """Backward ops whose results go straight (through views and casts only) to parameter
    gradients: the weight matmuls, which zero-bubble schedules defer."""
    index = {n: i for i, n in enumerate(sp.nodes)}
    to_grads: set[int] = set()  # gradients, and the free ops that lead only to them
    weights: set[int] = set()
    for i in reversed(range(len(sp.nodes))):
        f = sp.nodes[i].meta["autopar"]
        if f.phase != "bwd":
            continue
        users = [u for u in sp.nodes[i].users if u in index]
        feeds_grads = bool(users) and all(index[u] in to_grads for u in users)
        if f.role == "grad" or (f.flops == 0 and feeds_grads):
            to_grads.add(i)
        elif feeds_grads:
            weights.add(i)
    return weights


def _memory_parts(sp: ShardingProblem, choice: list[int], parts: list[str], tied: set[int]
                  ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """State, kept-per-microbatch and largest transient bytes of each part, from the step's
    buffers (:func:`autopar.passes.problem.step_memory.step_usage`). A ``tied`` parameter's state is held
    by both ends (the first and last stages each keep a copy)."""
    once: set[int] = set()  # a parameter's gathered copies: one per step, not per microbatch
    usage, live = step_usage(sp, choice, once)
    n_nodes = len(sp.nodes)
    turn = next((i for i, n in enumerate(sp.nodes) if n.meta["autopar"].phase == "bwd"),
                n_nodes)
    horizon = max((b for _, b in live), default=0) + 2
    state = {p: 0.0 for p in PARTS}
    saved = {p: 0.0 for p in PARTS}
    curve = np.zeros(horizon + 1)
    f = sp.in_flight or 1.0
    for k, (u, (a, b)) in enumerate(zip(usage, live)):
        if not u:
            continue
        owner = parts[k] if k < n_nodes else parts[min(a, n_nodes - 1)]
        role = sp.nodes[k].meta["autopar"].role if k < n_nodes else ""
        held_whole = k in once or (k < n_nodes and zero.param_root(sp.nodes[k]) is not None)
        if role in ("param", "grad") or (held_whole and a < turn <= b):
            state[owner] += u
            if k in tied:
                state["post" if owner == "pre" else "pre"] += u
        elif a < turn <= b:
            saved[owner] += u / f
        else:
            curve[a] += u
            curve[b + 1] -= u
    curve = np.cumsum(curve)[:n_nodes]
    transient = {p: 0.0 for p in PARTS}
    for i, p in enumerate(parts):
        transient[p] = max(transient[p], float(curve[i]))
    return state, saved, transient


def _boundary_bytes(sp: ShardingProblem, parts: list[str]) -> float:
    """The largest activation entering the blocks from outside them (a block's input)."""
    best = 0.0
    for n in sp.nodes:
        f = n.meta["autopar"]
        if f.phase != "fwd" or node_layer(n) is None:
            continue
        for a in n.all_input_nodes:
            fa = a.meta.get("autopar")
            if fa is not None and fa.role == "activation" and node_layer(a) is None \
                    and fa.out is not None and fa.out.dtype.is_floating_point:
                best = max(best, float(fa.out.nbytes))
    return best if math.isfinite(best) else 0.0
