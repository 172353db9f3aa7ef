"""The planner's modes: what is done to the traced graph, and offered to the solver, before it
places anything. A :class:`Mode` is a value: the activations recomputed, whether parameters
are gathered again in the backward (ZeRO-3) or their gradients all-reduced whole (ZeRO-1),
and whether optimizer state may live on the host. ``Mode.label`` is how it reads
(``"none+zero3"``, ``"full+zero3+offload"``); :meth:`Mode.parse` reads it back.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

from autopar.ir.errors import PlanError
from autopar.ir.graph import PlanGraph
from autopar.ir.mesh import Mesh
from autopar.ir.options import FIXED_RECOMPUTE_MODES, MemoryOptions, fits_budget
from autopar.passes.memory import recompute as recompute_mode
from autopar.passes.memory import zero as zero_mod
from autopar.passes.problem.sharding_problem import least_peak

# the label's suffixes, in the order they are written
REGATHER = "+zero3"  # parameters gathered again in the backward (ZeRO-3)
WHOLE_GRADS = "+zero1"  # gradients of split parameters all-reduced whole (ZeRO-1)
OFFLOADED = "+offload"  # optimizer state offered to the host


@dataclass(frozen=True, slots=True)
class Mode:
    """``recompute``: the activations recomputed (``none``, ``selective``, ``full``);
    ``regather``: parameters gathered again in the backward (ZeRO-3); ``whole_grads``: the
    gradients of split parameters all-reduced whole (ZeRO-1); ``offload``: optimizer state
    offered to the solver for host memory."""

    recompute: str = "none"
    regather: bool = False
    whole_grads: bool = False
    offload: bool = False

    def __post_init__(self) -> None:
        if self.recompute not in FIXED_RECOMPUTE_MODES:
            raise PlanError(f"unknown recompute mode {self.recompute!r} in a planner mode: use "
                            f"one of {', '.join(FIXED_RECOMPUTE_MODES)}")

    @property
    def label(self) -> str:
        """How the mode reads: the recompute mode, then ``+zero3``, ``+zero1``, ``+offload``."""
        return (self.recompute + (REGATHER if self.regather else "")
                + (WHOLE_GRADS if self.whole_grads else "") + (OFFLOADED if self.offload else ""))

    def __str__(self) -> str:
        return self.label

    @classmethod
    def parse(cls, label: str) -> Mode:
        """The mode a label names (``"full+zero3"``); an unknown part is refused by name."""
        head, *rest = label.split("+")
        known = {REGATHER[1:]: "regather", WHOLE_GRADS[1:]: "whole_grads",
                 OFFLOADED[1:]: "offload"}
        flags = {}
        for part in rest:
            if part not in known:
                raise PlanError(f"unknown part {part!r} of planner mode {label!r}: a mode is a "
                                f"recompute mode with any of "
                                f"{', '.join('+' + k for k in known)}")
            flags[known[part]] = True
        return cls(head, **flags)

    @classmethod
    def of(cls, mode: Mode | str) -> Mode:
        return mode if isinstance(mode, Mode) else cls.parse(mode)

    @property
    def base(self) -> Mode:
        """The mode without offload."""
        return replace(self, offload=False)

    @property
    def plain(self) -> Mode:
        """The mode without recomputation (re-gathering and offload as they are)."""
        return replace(self, recompute="none")

    def offloaded(self) -> Mode:
        return replace(self, offload=True)


def candidate_modes(recompute: str, zero: str, held: bool = False) -> list[Mode]:
    """The modes the planner tries, first the one every other starts from: each recompute
    mode asked for (``auto``: none, selective, full), with and without re-gathering where the
    ZeRO stage is left to it (``full`` always re-gathers then: each layer keeps nothing), and
    ZeRO-1 (whole gradients all-reduced) beside the first. ZeRO-1 moves the bytes ZeRO-2
    does and holds whole gradients, so without gradient accumulation priced it does not win;
    it is weighed, not assumed away. ``held``: a pipeline stage, whose parameters gathered
    once per step are held whole across its microbatches (Megatron's distributed optimizer
    with full recomputation), so ``full`` is also tried without re-gathering; ZeRO-1 is not
    (a stage holds its whole gradients to the step's end either way, and all-reduces them at
    twice ZeRO-2's reduce-scatter bytes)."""
    asked = ["none", "selective", "full"] if recompute == "auto" else [recompute]
    out = []
    for mode in asked:
        if held and zero == "auto" and mode == "full":
            out += [Mode(mode), Mode(mode, regather=True)]
        elif zero == "3" or (zero == "auto" and mode == "full"):
            out.append(Mode(mode, regather=True))
        elif zero == "auto" and mode != "full":
            out += [Mode(mode), Mode(mode, regather=True)] + (
                [Mode(mode, whole_grads=True)] if mode == asked[0] and not held else [])
        else:
            out.append(Mode(mode, whole_grads=zero == "1"))
    return out


def reference_mode(recompute: str, zero: str | None = None) -> Mode:
    """The mode a fixed policy's layout is completed in. ``zero`` pins the ZeRO stage of the
    parameters the layout stores split: ``"3"`` re-gathers them in the backward (FSDP's
    reshard after forward), ``"2"`` keeps what the forward gathered, ``"1"`` also all-reduces
    their gradients whole (a distributed optimizer). None: full recomputation re-gathers (what
    FSDP with per-block activation checkpointing does), the others keep what they gather."""
    if zero is None or str(zero) == "auto":
        return Mode(recompute, regather=recompute == "full")
    stage = str(zero)
    if stage not in ("1", "2", "3"):
        raise PlanError(f"a reference layout's ZeRO stage {zero!r}: use 1, 2, 3 or None")
    return Mode(recompute, regather=stage == "3", whole_grads=stage == "1")


def mode_graph(pg: PlanGraph, mode: Mode | str) -> PlanGraph:
    """``pg`` with a mode's recomputation and re-gathering applied (the nodes it copies into
    the backward). Without re-gathering, a parameter's views are not recomputed even where
    the mode recomputes the rest of the layer: the stage is ZeRO-2, the gathered copy kept.

    The rewritten graph is a pure function of ``pg``'s traced graph and the nodes copied, so
    it is made once per traced graph and node list in this process (:data:`_MODE_GRAPHS`)
    and shared: a mesh-shape search plans the same traced stand-in on several shapes, each
    in every mode. Each call's result carries its own ``pg``'s other fields (the depth proxy,
    the microbatches). The planner only reads these graphs (nothing in it rewrites a node)."""
    mode = Mode.of(mode)
    names = recompute_mode.recompute_nodes(pg, mode.recompute)
    chain = set(zero_mod.regather_nodes(pg))
    if mode.regather:
        chosen = chain | set(names)
        names = [n.name for n in pg.graph.nodes if n.name in chosen]
    else:
        names = [n for n in names if n not in chain]
    if not names:
        return pg
    made = _MODE_GRAPHS.setdefault(pg.gm, {})
    key = tuple(names)
    if key not in made:
        made[key] = recompute_mode.apply_recompute(pg, names)
    hit = made[key]
    return replace(pg, gm=hit.gm, recomputed=hit.recomputed)


def least_need(pg: PlanGraph, mesh: Mesh, memory: MemoryOptions, limit: float | None
               ) -> float | None:
    """Where no plan the planner can make of ``pg`` on ``mesh`` fits ``limit``: the least
    peak of any of them (a lower bound, :func:`least_peak`, in each mode the planner may
    try under ``memory``, with the optimizer state on the host wherever it may offer that;
    a reference layout's mode counts only as one of these, as
    :func:`autopar.planning.planner.make_plan` keeps it). None where some mode's bound fits,
    or there is no limit: then only planning tells. The modes are bounded leanest first, so a graph that may fit
    costs one bound."""
    if limit is None:
        return None
    held = pg.proxy is not None and pg.proxy.microbatches > 1
    offload = "auto" if memory.offload == "auto" else memory.offload
    graphs: dict[tuple, PlanGraph] = {}  # modes with one graph are bounded once
    for mode in reversed(candidate_modes(memory.recompute, memory.zero, held)):
        mpg = mode_graph(pg, mode)
        graphs.setdefault(tuple(mpg.recomputed.items()), mpg)
    least = float("inf")
    for mpg in graphs.values():  # (the strategy lists: the mesh's, which its problems share)
        least = min(least, least_peak(mpg, mesh, offload))
        if fits_budget(least, limit):
            return None
    return least


# traced graph -> the nodes recomputed -> that mode graph (weakly keyed: gone with the trace)
_MODE_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
