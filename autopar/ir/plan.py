"""The Plan: frozen, versioned, JSON round-trip, readable as a table.

A plan says how every parameter, input and traced node is placed on the mesh, which collectives
that implies, what the cost model predicts for it, and how the solver got there. The runtime
executes ``nodes`` as given; ``params`` and ``inputs`` are the user-facing summary.
"""

from __future__ import annotations

import json
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
# (``Plan.pipeline``; the placements are then a stage's, on the stage submesh).
PLAN_VERSION = 7


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

    @property
    def blocks(self) -> int:
        return self.end_block - self.first_block


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


@dataclass(frozen=True)
class Plan:
    model: str
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    device: str
    params: dict[str, Spec]
    inputs: dict[str, Spec]
    nodes: dict[str, NodePlacement]
    collectives: tuple[CollectiveUse, ...]
    cost: PlanCost
    solver: SolverInfo
    timings: dict[str, float] = field(default_factory=dict)
    missing_rules: dict[str, int] = field(default_factory=dict)
    references: dict[str, PlanCost] = field(default_factory=dict)
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    memory_budget: float | None = None
    # the first gradient bucket's size the plan was priced with (passes.buckets); the runtime
    # fills its buckets the same way, so it issues the collectives the plan lists
    first_bucket_bytes: int = 2**20
    # axis sets whose sums run as one all-reduce over the flattened group, as the plan was
    # priced (passes.cost_model.merged_sums); the runtime does the same. Absent: axis by axis
    merged_sums: tuple[tuple[str, ...], ...] = ()
    precision: Precision = field(default_factory=Precision)
    # where the memory limit came from: "given", or the device's capacity less its reserve
    memory_limit_source: str = ""
    recompute: Recompute = field(default_factory=Recompute)
    # each parameter's ZeRO stage and the optimizer state kept on the host (passes.zero)
    param_state: ParamState = field(default_factory=ParamState)
    # pipeline stages and schedule; the mesh and every placement above are then one stage's
    # (the mesh less the pipeline axis), the same layout on every stage
    pipeline: PipelinePlan | None = None
    version: int = PLAN_VERSION

    @property
    def full_mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The whole mesh's shape and axes, the pipeline axis (outermost) included."""
        if self.pipeline is None:
            return self.mesh_shape, self.mesh_axes
        return ((self.pipeline.size, *self.mesh_shape),
                (self.pipeline.axis, *self.mesh_axes))

    def merged_axes(self) -> tuple[tuple[int, ...], ...]:
        """:attr:`merged_sums` as mesh-axis indices."""
        pos = {a: k for k, a in enumerate(self.mesh_axes)}
        try:
            return tuple(tuple(pos[a] for a in names) for names in self.merged_sums)
        except KeyError as e:
            raise PlanError(f"the plan merges sums over axis {e.args[0]!r}, which its mesh "
                            f"{self.mesh_axes} does not have: make the plan again") from None

    # --- JSON ---------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "model": self.model,
            "mesh": {"shape": list(self.mesh_shape), "axes": list(self.mesh_axes),
                     "device": self.device},
            "params": {k: format_spec(v) for k, v in self.params.items()},
            "inputs": {k: format_spec(v) for k, v in self.inputs.items()},
            "input_shapes": self.input_shapes,
            "cost": self.cost.to_json(),
            "memory_budget": self.memory_budget,
            "memory_limit_source": self.memory_limit_source,
            "precision": self.precision.to_json(),
            "recompute": self.recompute.to_json(),
            "param_state": self.param_state.to_json(),
            **({"schedule": self.pipeline.to_json(),
                "stages": [asdict(st) for st in self.pipeline.stages]}
               if self.pipeline is not None else {}),
            "first_bucket_bytes": self.first_bucket_bytes,
            "merged_sums": [list(a) for a in self.merged_sums],
            "solver": asdict(self.solver),
            "timings": self.timings,
            "collectives": [asdict(c) for c in self.collectives],
            "missing_rules": self.missing_rules,
            "references": {k: v.to_json() for k, v in self.references.items()},
            "nodes": {
                k: {"in": [format_spec(s) for s in v.ins], "out": [format_spec(s) for s in v.outs],
                    **({"impl": list(v.impls)} if v.impls else {}),
                    **({"raw_out": [format_spec(s) for s in v.raw_outs]} if v.raw_outs else {})}
                for k, v in self.nodes.items()
            },
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        try:
            version = int(d["version"])
            if version != PLAN_VERSION:
                raise PlanError(
                    f"plan version {version} is not supported (this autopar reads version "
                    f"{PLAN_VERSION}): make the plan again with `autopar plan ... --json`"
                )
            return cls(
                model=d.get("model", ""),
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
                collectives=tuple(CollectiveUse(**c) for c in d.get("collectives", [])),
                cost=PlanCost.from_json(d["cost"]),
                solver=SolverInfo(**d["solver"]),
                timings=dict(d.get("timings", {})),
                missing_rules=dict(d.get("missing_rules", {})),
                references={k: PlanCost.from_json(v) for k, v in d.get("references", {}).items()},
                input_shapes=dict(d.get("input_shapes", {})),
                memory_budget=d.get("memory_budget"),
                memory_limit_source=d.get("memory_limit_source", ""),
                precision=Precision.from_json(d.get("precision")),
                recompute=Recompute.from_json(d.get("recompute")),
                param_state=ParamState.from_json(d.get("param_state")),
                pipeline=(PipelinePlan.from_json(d["schedule"], d["stages"])
                          if "schedule" in d else None),
                first_bucket_bytes=int(d["first_bucket_bytes"]),
                merged_sums=tuple(tuple(a) for a in d.get("merged_sums", ())),
                version=version,
            )
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
