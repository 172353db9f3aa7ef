"""The pipeline schedules: the one table the planner and the runtime both read.

One :class:`ScheduleInfo` per schedule torch runs, under its canonical name (torch's class
name less ``Schedule``: ``"1F1B"``, ``"ZBVZeroBubble"``): where its stages sit on the
pipeline ranks (``"loop"``: stage ``s`` on rank ``s % p``; ``"v"``: down the ranks and back
up), how many stages a rank holds (fixed, or any), whether it splits the backward into its
input and weight parts, and the other spellings a user may give it (the command line's and
the runtime's lower-case names: ``"zbv"``, ``"1f1b"``, ``"interleaved_1f1b"``, ...).
:func:`schedule` resolves any of them; :func:`stage_placement` is the one definition of which
rank runs which stage.

The order of :data:`SCHEDULES` is the order the planner weighs them in.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir.errors import PlanError

LOOP, V = "loop", "v"  # stage placements


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    """One pipeline schedule. ``stages_per_rank``: the count it needs (None: any, ``v``);
    ``key``: its short lower-case name (what the runtime reports it as); ``aliases``: more
    spellings accepted for it. torch's conditions on the microbatch count ``m``:
    ``fills_every_stage``, at least one per stage (else ``fewer_microbatches`` is the
    schedule to suggest); ``rounds_of_p``, ``m`` runs in rounds of ``p``.
    ``forwards_first``: every forward runs before any backward, so a rank holds every
    microbatch's activations at once."""

    name: str
    placement: str
    stages_per_rank: int | None
    splits_backward: bool
    key: str
    aliases: tuple[str, ...] = ()
    fills_every_stage: bool = False
    fewer_microbatches: str = ""
    rounds_of_p: bool = False
    forwards_first: bool = False

    @property
    def torch_class_name(self) -> str:
        return f"Schedule{self.name}"

    def torch_class(self) -> type:
        """torch's schedule class (``torch.distributed.pipelining.schedules``)."""
        import torch.distributed.pipelining.schedules as torch_schedules

        cls = getattr(torch_schedules, self.torch_class_name, None)
        if cls is None:
            raise PlanError(f"this torch has no {self.torch_class_name}: use another pipeline "
                            "schedule, or a torch that has it")
        return cls

    @property
    def single_stage(self) -> bool:
        """One stage per rank (torch's ``PipelineScheduleSingle``)."""
        return self.stages_per_rank == 1

    @property
    def v_shaped(self) -> bool:
        return self.placement == V

    def spellings(self) -> tuple[str, ...]:
        return (self.name, self.key, *self.aliases)


SCHEDULE_TABLE: tuple[ScheduleInfo, ...] = (
    ScheduleInfo("GPipe", LOOP, 1, False, "gpipe", forwards_first=True),
    ScheduleInfo("1F1B", LOOP, 1, False, "1f1b", fills_every_stage=True,
                 fewer_microbatches="GPipe"),
    ScheduleInfo("Interleaved1F1B", LOOP, None, False, "interleaved_1f1b", ("interleaved",),
                 rounds_of_p=True),
    ScheduleInfo("InterleavedZeroBubble", LOOP, None, True, "interleaved_zb",
                 rounds_of_p=True),
    ScheduleInfo("LoopedBFS", LOOP, None, False, "looped_bfs", forwards_first=True),
    ScheduleInfo("ZBVZeroBubble", V, 2, True, "zbv", ("zbvzerobubble",)),
    ScheduleInfo("DualPipeV", V, 2, True, "dualpipev", fills_every_stage=True,
                 fewer_microbatches="ZBVZeroBubble"),
)
SCHEDULES: tuple[str, ...] = tuple(s.name for s in SCHEDULE_TABLE)  # canonical names, in order
SINGLE_STAGE = tuple(s.name for s in SCHEDULE_TABLE if s.single_stage)
V_SHAPED = tuple(s.name for s in SCHEDULE_TABLE if s.v_shaped)
LOOPED = tuple(s.name for s in SCHEDULE_TABLE if not s.single_stage and not s.v_shaped)


def _fold(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


_BY_SPELLING: dict[str, ScheduleInfo] = {_fold(n): s for s in SCHEDULE_TABLE
                                         for n in s.spellings()}


def schedule(name: str | ScheduleInfo) -> ScheduleInfo:
    """The schedule of any accepted spelling, whatever its case, ``_`` or ``-``
    (``"zbv"``, ``"ZBVZeroBubble"``, ``"interleaved-1f1b"``)."""
    if isinstance(name, ScheduleInfo):
        return name
    found = _BY_SPELLING.get(_fold(str(name)))
    if found is None:
        raise PlanError(f"unknown pipeline schedule {name!r}: use one of {', '.join(SCHEDULES)} "
                        f"(or {', '.join(s.key for s in SCHEDULE_TABLE)})")
    return found


def canonical_name(name: str) -> str:
    """The schedule's canonical (torch) name (``"zbv"`` -> ``"ZBVZeroBubble"``)."""
    return schedule(name).name


def splits_backward(name: str) -> bool:
    """Whether the schedule runs backward-for-input and -for-weights as separate actions."""
    return schedule(name).splits_backward


def stage_placement(pp: int, n_stages: int, placement: str) -> dict[int, int]:
    """Stage index -> pipeline rank, as torch's schedules place them: ``"loop"`` puts stage
    ``s`` on rank ``s % pp``; ``"v"`` runs down the ranks and back up (with two stages per
    rank, rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``). Written here, not imported
    from torch's private ``_utils``; a test checks it against torch's."""
    if placement == LOOP:
        return {s: s % pp for s in range(n_stages)}
    if placement != V:
        raise PlanError(f"unknown stage placement {placement!r}: use {LOOP!r} or {V!r}")
    if n_stages % pp:
        raise PlanError(f"{n_stages} stages do not fold evenly onto {pp} ranks for a V-shaped "
                        "schedule: use a multiple of pp stages")
    return {s: (s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp) for s in range(n_stages)}


def stage_rank(name: str | ScheduleInfo, pp: int, stage: int) -> int:
    """The pipeline rank that runs ``stage`` under schedule ``name`` on ``pp`` ranks."""
    if schedule(name).v_shaped:
        return stage % pp if (stage // pp) % 2 == 0 else pp - 1 - stage % pp
    return stage % pp
