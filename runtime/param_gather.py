"""Parameter gathers, one all-gather per layer and phase, as FSDP gathers a module's parameters.

A sharded parameter that an op needs whole is gathered at that op. Within one phase (forward or
backward), the gathers that the ops of one layer need over the same mesh axis go out as a single
all-gather when the first of those ops runs (:func:`autopar.passes.cost.buckets.gather_groups`, which
the scorer uses too, so the plan lists exactly these collectives): every rank hands in its shards
flattened into one buffer and cuts the gathered buffer back into whole parameters. They are
dropped after the last op of the group that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.passes.cost.buckets import ParamGather, gather_group_bytes, gather_groups, gather_move
from autopar.runtime.redistribute import Comm


@dataclass(slots=True)
class GatherGroup:
    axis: int  # the mesh axis it gathers over
    producers: list[str] = field(default_factory=list)  # parameter placeholders, in slot order
    dims: list[int] = field(default_factory=list)  # the tensor dim each is split along
    nbytes: float = 0.0  # what each rank hands in

    def run(self, env: dict[str, Any], comm: Comm) -> list[torch.Tensor]:
        """Every member whole (on this axis), from this rank's shards in ``env``."""
        n = comm.shape[self.axis]
        shards = [env[p] for p in self.producers]
        flat = torch.cat([t.reshape(-1) for t in shards])
        rows = comm.all_gather(flat, 0, self.axis, "parameter gather").view(n, -1)
        out, offset = [], 0
        for t, d in zip(shards, self.dims):
            block = rows[:, offset: offset + t.numel()].reshape(n, *t.shape)
            shape = list(t.shape)
            shape[d] *= n
            out.append(block.movedim(0, d).reshape(shape))  # rank-major along d, as S(d) splits
            offset += t.numel()
        return out


def group_gathers(steps: list[Any], unit_of: Any, metas: dict[str, Any],
                  mesh_shape: tuple[int, ...]) -> list[GatherGroup]:
    """Group the parameter gathers of one phase's ``steps``; each grouped input gets
    ``group`` (an index into the result) and ``slot`` (its place in the group), and the last
    step that reads a group lists it in ``drop_gathers``."""
    found: list[ParamGather] = []
    where: list[tuple[int, Any]] = []  # (step index, input) per gather
    for k, s in enumerate(steps):
        for inp in s.inputs:
            if inp.reason == "parameter gather" and inp.moves and \
                    gather_move(inp.src, inp.dst) is not None:
                found.append(ParamGather(len(found), unit_of(s.node), metas[inp.producer],
                                         inp.src, inp.dst))
                where.append((k, inp))
    groups = []
    for members in gather_groups(found):
        axis, _ = gather_move(members[0].src, members[0].dst)  # type: ignore[misc]
        group = GatherGroup(axis, nbytes=gather_group_bytes(members, mesh_shape))
        last = -1
        for g in members:
            k, inp = where[g.index]
            inp.group, inp.slot = len(groups), len(group.producers)
            group.producers.append(inp.producer)
            group.dims.append(gather_move(g.src, g.dst)[1])  # type: ignore[index]
            last = max(last, k)
        steps[last].drop_gathers.append(len(groups))
        groups.append(group)
    return groups
