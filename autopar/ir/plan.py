"""The Plan: frozen, versioned, JSON round-trip, readable as a table.

A plan says how every parameter, input and traced node is placed on the mesh, which collectives
that implies, what the cost model predicts for it, and how the solver got there: its fields
are grouped as :class:`Decisions` (``plan.decided``), :class:`Predictions`
(``plan.predicted``) and :class:`Provenance` (``plan.provenance``). The runtime executes
``plan.decided.nodes`` as given; ``params`` and ``inputs`` are the user-facing summary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.ir.errors import PlanError
from autopar.ir.param_state import ParamState
from autopar.ir.placements import Spec, format_spec, parse_spec
from autopar.ir.precision import Precision

# 2: in-op all-reduces (``raw_out``), parameter gathers listed one per layer and phase, gradient
# reduce-scatters in buckets. 3: the batch-sharded mean nll_loss all-reduces its count of kept
# targets inside the op. 4: the first gradient bucket's size is the plan's (one size for
# every bucket on a device whose communication does not overlap compute). 5: the plan's
# precision (the graph's casts) and recomputation are part of what runs. An older plan's
# collectives would not match what now runs. 6: parameters' ZeRO stages (views re-gathered in
# the backward) and optimizer state offloaded to the host. 7: pipeline stages and schedule
# (``Plan.decided.pipeline``; the placements are then a stage's, on the stage submesh). 8: the
# file groups its fields as the Plan does (``decided``, ``predicted``, ``provenance``); a
# version 7 file holds the same fields in one flat object and is read as it is.
PLAN_VERSION = 8
READ_VERSIONS = (7, PLAN_VERSION)
# which group of a version 8 file each field of the flat (version 7) object goes to
_GROUP_OF = {
    **dict.fromkeys(("mesh", "params", "inputs", "input_shapes", "precision", "recompute",
                     "param_state", "schedule", "stages", "first_bucket_bytes", "merged_sums",
                     "nodes"), "decided"),
    **dict.fromkeys(("cost", "collectives"), "predicted"),
    **dict.fromkeys(("model", "memory_budget", "memory_limit_source", "solver", "timings",
                     "missing_rules", "references"), "provenance"),
}


@dataclass(frozen=True, slots=True)
class PlanCost:
    step_s: float
    compute_s: float
    comm_s: float
    mem_bytes: float  # peak bytes per device

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> PlanCost:
        return cls(float(d["step_s"]), float(d["compute_s"]), float(d["comm_s"]),
                   float(d["mem_bytes"]))


@dataclass(frozen=True, slots=True)
class CollectiveUse:
    """One kind of collective on one axis, summed over the step."""

    kind: str
    axis: str
    count: int
    bytes: float  # total over the step, per device
    time_s: float
    reason: str  # "resharding", "gradient sync", "parameter gather", "loss"


@dataclass(frozen=True, slots=True)
class NodePlacement:
    ins: tuple[Spec, ...]
    outs: tuple[Spec, ...]
    impls: tuple[str | None, ...] = ()
    raw_outs: tuple[Spec, ...] = ()  # the op's own outputs, all-reduced into ``outs`` in the op


@dataclass(frozen=True)
class Recompute:
    """What a plan recomputes: the mode asked for and the one applied, the recomputed forward
    nodes (by name, in the traced graph), and what the cost model says it costs and saves."""

    asked: str = "none"
    mode: str = "none"
    nodes: tuple[str, ...] = ()
    layers: tuple[int, ...] = ()  # traced layers with recomputed nodes
    time_s: float = 0.0  # predicted extra step time (compute and collectives run again)
    saved_bytes: float = 0.0  # predicted peak memory it saves, per device
    per_layer: dict[int, int] = field(default_factory=dict)  # layer -> nodes recomputed

    def to_json(self) -> dict:
        return {"asked": self.asked, "mode": self.mode, "nodes": list(self.nodes),
                "layers": list(self.layers), "time_s": self.time_s,
                "saved_bytes": self.saved_bytes,
                "per_layer": {str(k): v for k, v in self.per_layer.items()}}

    @classmethod
    def from_json(cls, d: dict | None) -> Recompute:
        if not d:
            return cls()
        return cls(d.get("asked", "none"), d.get("mode", "none"), tuple(d.get("nodes", ())),
                   tuple(d.get("layers", ())), float(d.get("time_s", 0.0)),
                   float(d.get("saved_bytes", 0.0)),
                   {int(k): int(v) for k, v in d.get("per_layer", {}).items()})


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """One stage (a virtual stage where a rank holds several) in pipeline order: the blocks
    ``[first_block, end_block)`` of the model's repeated list, with the embedding where
    ``first`` and the head where ``last``, on pipeline rank ``rank``."""

    index: int
    rank: int
    first_block: int
    end_block: int
    first: bool
    last: bool
    time_s: float  # forward + backward per microbatch
    memory_bytes: float  # per device: its state, transients and in-flight activations
    in_flight: int  # microbatches whose activations it holds at once
    forward_s: float = 0.0  # of time_s, the forward
    recompute_s: float = 0.0  # of the backward, recomputation
    sync_s: float = 0.0  # its gradient sync, once per step after its last backward
    split_s: float = 0.0  # a split backward's cost beyond the whole one, per microbatch
    # its recomputation mode ("none", "selective", "full"); "": the plan's own (a plan
    # written before stages chose their own)
    recompute: str = ""

    @property
    def blocks(self) -> int:
        return self.end_block - self.first_block

    def recompute_mode(self, plan_mode: str) -> str:
        """The mode this stage runs: its own, or the plan's (``plan_mode``) where unset."""
        return self.recompute or plan_mode


def stage_recompute(recompute: str | Sequence[str], n_stages: int) -> tuple[str, ...]:
    """Each of ``n_stages`` stages' recompute mode: ``recompute`` for all, or one per stage
    (a pipeline plan's stages may each recompute as their microbatches in flight allow)."""
    if isinstance(recompute, str):
        return (recompute,) * n_stages
    modes = tuple(recompute)
    if len(modes) != n_stages:
        raise PlanError(f"{len(modes)} recompute modes for a pipeline of {n_stages} stages: "
                        "give one mode, or one per stage")
    return modes


@dataclass(frozen=True, slots=True)
class ScheduleOption:
    """A (schedule, stages per rank, microbatches) the planner weighed."""

    schedule: str
    virtual: int
    microbatches: int
    step_s: float  # inf where it does not fit or cannot be cut
    bubble: float
    mem_bytes: float
    note: str = ""  # why it was left out, where it was


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline half of a plan: ``size`` stages' ranks along mesh axis ``axis``, the
    schedule (torch's name), stages per rank, microbatches, and the stages. ``step_s`` is the
    schedule replayed on the stages' times plus each rank's gradient sync; ``bubble`` is the
    replay's idle share, beside the textbook ``(p-1)/(v*m)``."""

    axis: str
    size: int
    schedule: str
    virtual: int
    microbatches: int
    stages: tuple[PipelineStage, ...]
    rank_memory_bytes: tuple[float, ...]
    step_s: float
    bubble: float
    textbook_bubble: float
    send_s: float  # one boundary tensor between ranks, per microbatch and direction
    sync_s: float  # the slowest rank's gradient sync, once per step
    weight_share: float  # of a backward, the weight-gradient part (zero-bubble schedules)
    reason: str = ""
    options: tuple[ScheduleOption, ...] = ()
    # the runtime's costs the replay charged (passes.pipeline_cost.Overheads): per action,
    # per send or receive posted, and the ranks' speed with k of them computing (empty: full)
    action_s: float = 0.0
    post_s: float = 0.0
    speed: tuple[float, ...] = ()

    def stage_recompute(self, plan_mode: str) -> tuple[str, ...]:
        """Each stage's recomputation mode, in pipeline order (``plan_mode``, the plan's
        ``decided.recompute.mode``, where a stage records none)."""
        return tuple(st.recompute_mode(plan_mode) for st in self.stages)

    def to_json(self) -> dict[str, Any]:
        return {"axis": self.axis, "size": self.size, "schedule": self.schedule,
                "virtual": self.virtual, "microbatches": self.microbatches,
                "rank_memory_bytes": list(self.rank_memory_bytes), "step_s": self.step_s,
                "bubble": self.bubble, "textbook_bubble": self.textbook_bubble,
                "send_s": self.send_s, "sync_s": self.sync_s,
                "weight_share": self.weight_share, "reason": self.reason,
                "options": [asdict(o) for o in self.options], "action_s": self.action_s,
                "post_s": self.post_s, "speed": list(self.speed)}

    @classmethod
    def from_json(cls, d: dict[str, Any], stages: list[dict]) -> PipelinePlan:
        return cls(d["axis"], int(d["size"]), d["schedule"], int(d["virtual"]),
                   int(d["microbatches"]), tuple(PipelineStage(**s) for s in stages),
                   tuple(float(x) for x in d["rank_memory_bytes"]), float(d["step_s"]),
                   float(d["bubble"]), float(d["textbook_bubble"]), float(d["send_s"]),
                   float(d["sync_s"]), float(d.get("weight_share", 0.5)), d.get("reason", ""),
                   tuple(ScheduleOption(**o) for o in d.get("options", ())),
                   float(d.get("action_s", 0.0)), float(d.get("post_s", 0.0)),
                   tuple(float(x) for x in d.get("speed", ())))


@dataclass(frozen=True, slots=True)
class SolverInfo:
    status: str
    time_s: float
    method: str = ""
    variables: int = 0
    nodes: int = 0
    shared_layers: int = 0
    objective: float = 0.0
    # the whole planning call's time limit, and what it cut short ("": the search ran to its
    # end; autopar.ir.deadline); the solver's lower bound on the objective where it has one
    time_limit_s: float | None = None
    limit_cut: str = ""
    lower_bound: float | None = None


@dataclass(frozen=True)
class Decisions:
    """What a plan decided: what the runtime runs.

    - ``mesh_shape``, ``mesh_axes``, ``device``: the mesh the placements are on (a pipeline
      plan's: one stage's submesh, the pipeline axis left out; :attr:`Plan.full_mesh` has it)
      and the device profile's name it was priced for;
    - ``params``, ``inputs``: each parameter's and input's placement per mesh axis (the
      user-facing summary; ``input_shapes``: the inputs' shapes the plan was made for);
    - ``nodes``: every traced node's input and output placements, and the op's own
      implementation where a rule picks one: what the runtime lowers, node by node;
    - ``precision``: the compute dtype and the gradients' reduction dtype;
    - ``recompute``: the activations recomputed in the backward (with the mode asked for,
      and the price the cost model puts on it);
    - ``param_state``: each parameter's ZeRO stage, optimizer state kept on the host;
    - ``pipeline``: the stages and schedule, or None (the placements are then the whole
      mesh's);
    - ``first_bucket_bytes``: the first gradient bucket's size the plan was priced with
      (:mod:`autopar.passes.cost.buckets`); the runtime fills its buckets the same way, so
      it issues the collectives the plan lists;
    - ``merged_sums``: axis sets whose sums run as one all-reduce over the flattened group,
      as the plan was priced (:func:`autopar.passes.cost.cost_model.merged_sums`); the
      runtime does the same. Empty: axis by axis.
    """

    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    device: str
    params: dict[str, Spec]
    inputs: dict[str, Spec]
    nodes: dict[str, NodePlacement]
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    precision: Precision = field(default_factory=Precision)
    recompute: Recompute = field(default_factory=Recompute)
    param_state: ParamState = field(default_factory=ParamState)
    pipeline: PipelinePlan | None = None
    first_bucket_bytes: int = 2**20
    merged_sums: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class Predictions:
    """What the cost model predicts for the plan: ``cost`` (the step's time, its compute and
    communication, the peak memory per device; a pipeline's: the schedule replayed) and
    ``collectives`` (each kind on each axis, summed over the step, with why it runs)."""

    cost: PlanCost
    collectives: tuple[CollectiveUse, ...] = ()


@dataclass(frozen=True)
class Provenance:
    """How the plan was found: ``solver`` (status, time, method, problem size),
    ``references`` (the reference layouts' predicted costs, each as the solver completed
    it), ``timings`` (seconds per planning phase), ``missing_rules`` (ops with no sharding
    rule, run replicated, and their counts), ``model`` (the name it was made for),
    ``memory_budget`` (the per-device limit it was held to; None: none) and
    ``memory_limit_source`` (where that limit came from: ``given``, or the device's capacity
    less its reserve)."""

    solver: SolverInfo
    model: str = ""
    references: dict[str, PlanCost] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    missing_rules: dict[str, int] = field(default_factory=dict)
    memory_budget: float | None = None
    memory_limit_source: str = ""


@dataclass(frozen=True)
class Plan:
    """A plan: how a model's training step runs on a mesh, in three groups.

    - ``decided`` (:class:`Decisions`): what runs: the mesh, every placement, the precision,
      recomputation, parameter state and pipeline;
    - ``predicted`` (:class:`Predictions`): what the cost model says it costs: step time,
      compute and communication, memory, the collectives;
    - ``provenance`` (:class:`Provenance`): how it was found: the solver, the reference
      layouts weighed, the planning time, the memory limit it was held to.

    The file is versioned (:data:`PLAN_VERSION`); :meth:`from_json` reads that version and
    version 7 (the same fields, ungrouped) and refuses another, saying which it is and how to
    make the plan again. Frozen; ``to_json``/``from_json``
    round-trip it exactly (``save``/``load`` through a file).
    """

    decided: Decisions
    predicted: Predictions
    provenance: Provenance

    def __getattr__(self, name: str) -> Any:
        # only for names the class lacks: a field read as before the grouping says where it is
        for group, cls in (("decided", Decisions), ("predicted", Predictions),
                           ("provenance", Provenance)):
            if name in cls.__dataclass_fields__:
                raise AttributeError(f"'Plan' object has no attribute {name!r}: it is "
                                     f"plan.{group}.{name} (the {cls.__name__} group)")
        raise AttributeError(f"'Plan' object has no attribute {name!r}")

    @property
    def full_mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The whole mesh's shape and axes, the pipeline axis (outermost) included."""
        d = self.decided
        if d.pipeline is None:
            return d.mesh_shape, d.mesh_axes
        return (d.pipeline.size, *d.mesh_shape), (d.pipeline.axis, *d.mesh_axes)

    def merged_axes(self) -> tuple[tuple[int, ...], ...]:
        """:attr:`Decisions.merged_sums` as mesh-axis indices."""
        d = self.decided
        pos = {a: k for k, a in enumerate(d.mesh_axes)}
        try:
            return tuple(tuple(pos[a] for a in names) for names in d.merged_sums)
        except KeyError as e:
            raise PlanError(f"the plan merges sums over axis {e.args[0]!r}, which its mesh "
                            f"{d.mesh_axes} does not have: make the plan again") from None

    # --- JSON ---------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The file format (version :data:`PLAN_VERSION`): ``version`` and one object per
        group, ``decided``, ``predicted`` and ``provenance``."""
        doc: dict[str, Any] = {"version": PLAN_VERSION, "decided": {}, "predicted": {},
                               "provenance": {}}
        for key, value in self._fields_json().items():
            doc[_GROUP_OF[key]][key] = value
        return doc

    def _fields_json(self) -> dict[str, Any]:
        d, pr, pv = self.decided, self.predicted, self.provenance
        return {
            "model": pv.model,
            "mesh": {"shape": list(d.mesh_shape), "axes": list(d.mesh_axes),
                     "device": d.device},
            "params": {k: format_spec(v) for k, v in d.params.items()},
            "inputs": {k: format_spec(v) for k, v in d.inputs.items()},
            "input_shapes": d.input_shapes,
            "cost": pr.cost.to_json(),
            "memory_budget": pv.memory_budget,
            "memory_limit_source": pv.memory_limit_source,
            "precision": d.precision.to_json(),
            "recompute": d.recompute.to_json(),
            "param_state": d.param_state.to_json(),
            **({"schedule": d.pipeline.to_json(),
                "stages": [asdict(st) for st in d.pipeline.stages]}
               if d.pipeline is not None else {}),
            "first_bucket_bytes": d.first_bucket_bytes,
            "merged_sums": [list(a) for a in d.merged_sums],
            "solver": asdict(pv.solver),
            "timings": pv.timings,
            "collectives": [asdict(c) for c in pr.collectives],
            "missing_rules": pv.missing_rules,
            "references": {k: v.to_json() for k, v in pv.references.items()},
            "nodes": {
                k: {"in": [format_spec(s) for s in v.ins], "out": [format_spec(s) for s in v.outs],
                    **({"impl": list(v.impls)} if v.impls else {}),
                    **({"raw_out": [format_spec(s) for s in v.raw_outs]} if v.raw_outs else {})}
                for k, v in d.nodes.items()
            },
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Plan:
        try:
            version = int(doc["version"])
            if version not in READ_VERSIONS:
                raise PlanError(
                    f"plan version {version} is not supported (this autopar reads versions "
                    f"{' and '.join(map(str, READ_VERSIONS))}): make the plan again with "
                    "`autopar plan ... --json`"
                )
            d = doc if version == 7 else {**doc["decided"], **doc["predicted"],
                                          **doc["provenance"]}
            decided = Decisions(
                mesh_shape=tuple(d["mesh"]["shape"]),
                mesh_axes=tuple(d["mesh"]["axes"]),
                device=d["mesh"].get("device", ""),
                params={k: parse_spec(v) for k, v in d["params"].items()},
                inputs={k: parse_spec(v) for k, v in d.get("inputs", {}).items()},
                nodes={
                    k: NodePlacement(tuple(parse_spec(s) for s in v["in"]),
                                     tuple(parse_spec(s) for s in v["out"]),
                                     tuple(v.get("impl", ())),
                                     tuple(parse_spec(s) for s in v.get("raw_out", ())))
                    for k, v in d.get("nodes", {}).items()
                },
                input_shapes=dict(d.get("input_shapes", {})),
                precision=Precision.from_json(d.get("precision")),
                recompute=Recompute.from_json(d.get("recompute")),
                param_state=ParamState.from_json(d.get("param_state")),
                pipeline=(PipelinePlan.from_json(d["schedule"], d["stages"])
                          if "schedule" in d else None),
                first_bucket_bytes=int(d["first_bucket_bytes"]),
                merged_sums=tuple(tuple(a) for a in d.get("merged_sums", ())),
            )
            predicted = Predictions(
                cost=PlanCost.from_json(d["cost"]),
                collectives=tuple(CollectiveUse(**c) for c in d.get("collectives", [])),
            )
            provenance = Provenance(
                solver=SolverInfo(**d["solver"]),
                model=d.get("model", ""),
                references={k: PlanCost.from_json(v) for k, v in d.get("references", {}).items()},
                timings=dict(d.get("timings", {})),
                missing_rules=dict(d.get("missing_rules", {})),
                memory_budget=d.get("memory_budget"),
                memory_limit_source=d.get("memory_limit_source", ""),
            )
            return cls(decided, predicted, provenance)
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"not a valid autopar plan ({type(e).__name__}: {e}); "
                            "make one with `autopar plan MODEL --json PLAN.json`") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        p = Path(path)
        if not p.exists():
            raise PlanError(f"plan file {p} does not exist")
        try:
            return cls.from_json(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file {p} is not JSON ({e})") from e
