"""What a plan does with its parameters' state: each parameter's ZeRO stage and the optimizer
state it keeps on the host. How the planner chooses them is :mod:`autopar.passes.memory.zero`."""

from __future__ import annotations

from dataclasses import dataclass, field

STAGE_NAMES = {0: "replicated (DDP)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 (FSDP)"}


@dataclass(frozen=True)
class ParamState:
    """What a plan does with its parameters' state: the ZeRO stage of each parameter (by
    name), the mesh axes each stage shards the state over beyond its tensor-parallel split,
    the parameters whose optimizer state is offloaded to the host, and what that costs."""

    stages: dict[str, int] = field(default_factory=dict)
    axes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    offloaded: tuple[str, ...] = ()
    offload_s: float = 0.0  # predicted step time offloading adds
    offload_bytes: float = 0.0  # optimizer state per device kept on the host instead
    regathered: bool = False  # the backward reads parameters afresh (their views copied)
    zero1: bool = False  # gradients of split parameters all-reduced whole (grad_target)

    def count(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self.stages.values():
            out[s] = out.get(s, 0) + 1
        return dict(sorted(out.items()))

    def to_json(self) -> dict:
        return {"stages": dict(self.stages), "axes": {k: list(v) for k, v in self.axes.items()},
                "offloaded": list(self.offloaded), "offload_s": self.offload_s,
                "offload_bytes": self.offload_bytes, "regathered": self.regathered,
                "zero1": self.zero1}

    @classmethod
    def from_json(cls, d: dict | None) -> ParamState:
        if not d:
            return cls()
        return cls({k: int(v) for k, v in d.get("stages", {}).items()},
                   {k: tuple(v) for k, v in d.get("axes", {}).items()},
                   tuple(d.get("offloaded", ())), float(d.get("offload_s", 0.0)),
                   float(d.get("offload_bytes", 0.0)), bool(d.get("regathered", False)),
                   bool(d.get("zero1", False)))
