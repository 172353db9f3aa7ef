"""Pipelines on gloo: measured bubble and step per schedule, a heavy head's split, and plan
fidelity (predicted against measured step time over many plans of one model).

Three parts, each planned here (planning needs no processes) and run on local gloo processes
(``cpu`` device profile, 1 intra-op thread each):

a. **Bubble per schedule.** A GPT-2 of 8 blocks on pp=2 (2 processes) and pp=4 (4 processes),
   every schedule torch ships at a fixed microbatch count ``m``. ``plan_pipeline(...,
   options=Options.of(schedule=X, microbatches=m,
                      virtual=v))`` chooses the split; ``build_pipeline`` runs it.
b. **Heavy head.** The same GPT-2 with a large vocabulary (its head costs several blocks): the
   planner's split against equal block counts, same schedule and ``m``, each predicted
   (``plan_pipeline`` / ``predict_split``) and measured.
c. **Plan fidelity.** Plans of one model on 4 processes: reference layouts and the solver's
   plans through ``parallelize(..., plan=...)``, pipelines (pp=2 x dp=2, pp=4) through
   ``build_pipeline``; ranked by predicted (``plan.predicted.cost.step_s``) and by measured step time,
   with Spearman's rank correlation (target 0.9) and a bootstrap interval over rounds.

Definitions, the same on both sides:

* **bubble**: over the pipeline's ranks, idle time over ``ranks x span``, where the span runs
  from the first stage action's start to the last one's end on any rank (the schedule alone:
  the gradient sync after it is left out). Predicted: ``passes/pipeline/schedule.simulate``'s
  ``bubble_fraction`` (its replay starts at the first forward). Measured: from the runtime's
  per-action timings (``runtime/pipeline/events``: forward, backward, input- and weight-
  backward of each stage and microbatch), on the monotonic clock the processes share.
* **textbook**: ``(p-1)/(v*m)`` is idle over *ideal* time; as a share of the step it is
  ``x/(1+x)``, the column comparable with the other two.
* **step**: forward + backward + gradient sync + reading the loss, from a barrier, slowest
  rank; median over rounds after warm-up. The optimizer step runs untimed (the cost model
  has no optimizer term). Predicted: ``plan.predicted.cost.step_s`` (a pipeline: its schedule replayed
  plus the slowest rank's gradient sync).

Helpers: ``_pipeline_runs`` (what runs in each rank, and the calibration), ``_pipeline_stats``
(bubble, ranks, Spearman), ``_pipeline_report`` (tables, findings, the RESULTS.md section).
About 2-3 minutes on 2 cores (``--quick``: about 1).

    python benchmarks/pipeline.py                # prints the tables
    python benchmarks/pipeline.py --quick        # 5 rounds, pp=2 bubble only
    python benchmarks/pipeline.py --write        # and updates benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import update_results  # noqa: E402
from _pipeline_report import (  # noqa: E402
    bubble_table,
    calibration_lines,
    fidelity_table,
    findings,
    heavy_table,
    med,
    results_body,
)
from _pipeline_runs import Job, worker  # noqa: E402
from _pipeline_stats import (  # noqa: E402
    COMPUTE_KINDS,
    schedule_bubble,
)

from autopar.ir.mesh import Mesh  # noqa: E402
from autopar.ir.options import Options
from autopar.ir.schedules import SCHEDULES  # noqa: E402
from autopar.ir.schedules import schedule as schedule_info  # noqa: E402

PRESET = "gpt2-tiny"
MODEL = (("n_layer", 8), ("d_model", 128))  # 8 blocks, vocabulary 256
HEAVY = MODEL + (("vocab_size", 8192),)  # the head (and embedding) about 5 blocks' work
BATCH, SEQ = 16, 64
M_BUBBLE = 8
HEAVY_SCHEDULE, HEAVY_PP = "1F1B", 2
TARGET_RHO = 0.9
TIME_LIMIT_S = 10.0


# --- planning ----------------------------------------------------------------------------------


def _model(fields: tuple) -> tuple[Any, tuple]:
    from autopar.models import get_preset

    preset = get_preset(PRESET).replace(**dict(fields))
    return preset.build("meta"), preset.example_inputs(BATCH, SEQ)


def pipeline_job(name: str, fields: tuple, pp: int, dp: int, schedule: str, m: int
                 ) -> tuple[Job, dict[str, Any]]:
    """The planner's pipeline for ``schedule`` with ``m`` microbatches, as a job to run, and
    what it predicts. With dp > 1 the runtime's stages are plain modules replicated over dp
    (gradients all-reduced at the end), so the prediction is for that layout (the planner's
    data-parallel stage reference with the plan's split and schedule)."""
    from autopar.models.reference_plans import applicable_plans
    from autopar.planning.pipeline import plan_pipeline, predict_split

    model, inputs = _model(fields)
    mesh = Mesh((pp, dp), ("pp", "dp"), "cpu")
    info = schedule_info(schedule)  # build_pipeline's key, and 2 stages per rank where any
    key, v = info.key, info.stages_per_rank or 2
    refs = applicable_plans(model, (dp,), ("dp",), "gpt2", batch_size=BATCH // m) if dp > 1 \
        else None
    planned = plan_pipeline(model, mesh, inputs, references=refs,
                            options=Options.of(schedule=schedule, microbatches=m, virtual=v,
                                               time_limit_s=TIME_LIMIT_S))
    pipe = planned.plan.decided.pipeline
    split = tuple((s.first_block, s.end_block) for s in pipe.stages)
    pred = {"step_s": planned.plan.predicted.cost.step_s, "bubble": pipe.bubble, "sync_s": pipe.sync_s,
            "textbook": pipe.textbook_bubble, "planned": planned, "mesh": mesh}
    if dp > 1:
        ref = planned.as_reference("data_parallel")
        plan = ref.plan
        plan = dataclasses.replace(plan, decided=dataclasses.replace(plan.decided, pipeline=pipe))
        ref = dataclasses.replace(ref, plan=plan)
        pred["own_step_s"] = pred["step_s"]
        pred["step_s"], pred["bubble"] = predict_split(ref, mesh, split)
        pred["ref"] = ref
    job = Job(name, PRESET, fields, BATCH, SEQ, (pp, dp), ("pp", "dp"), key, m, v, split)
    return job, pred


def spmd_jobs() -> list[tuple[Job, dict[str, Any]]]:
    """Reference layouts and the solver's plans of the fidelity model on 4 devices."""
    from autopar.models.reference_plans import applicable_plans
    from autopar.planning.planner import make_plan

    model, inputs = _model(MODEL)
    out = []
    wanted = {(4,): {"dp": ["data_parallel", "fsdp"], "tp": ["megatron_tp"]},
              (2, 2): {"dp,tp": ["dp_tp_2d", "fsdp_tp_2d"]}}
    for shape, by_axes in wanted.items():
        for axes_text, names in by_axes.items():
            axes = tuple(axes_text.split(","))
            mesh = Mesh(shape, axes, "cpu")
            refs = applicable_plans(model, shape, axes, "gpt2", batch_size=BATCH)
            planned = make_plan(model, mesh, inputs, references=refs,
                                options=Options.of(time_limit_s=TIME_LIMIT_S))
            label = "x".join(f"{a}={n}" for a, n in zip(axes, shape))
            plans = [(f"{n} ({label})", planned.as_reference(n).plan) for n in names]
            if "kept" not in planned.plan.provenance.solver.method and axes != ("tp",):
                plans.append((f"solver ({label})", planned.plan))
            for name, plan in plans:
                job = Job(name, PRESET, MODEL, BATCH, SEQ, shape, axes,
                          plan=json.dumps(plan.to_json()))
                out.append((job, {"step_s": plan.predicted.cost.step_s}))
    return out


# --- running -----------------------------------------------------------------------------------


def run(jobs: list[Job], nproc: int, warmup: int, rounds: int) -> dict[str, Any]:
    """Every job on ``nproc`` processes, interleaved. Per job and round: the slowest rank's
    step; for pipelines the slowest rank's gradient sync and, with no dp, the measured bubble,
    span and each stage's busy time per microbatch. The calibration: medians over ranks."""
    from autopar.runtime.launch import launch

    ranks = launch(worker, nproc, (jobs, warmup, rounds, True), timeout_s=1800)
    cal = {k: med([r["calibration"][k] for r in ranks]) for k in ranks[0]["calibration"]}
    out: dict[str, Any] = {"calibration": cal}
    for job in jobs:
        recs = [r["jobs"][job.name] for r in ranks]
        res: dict[str, Any] = {"steps": [max(rank[k]["step_s"] for rank in recs)
                                         for k in range(rounds)]}
        if job.is_pipeline:
            res["syncs"] = [max(e[4] - e[3] for rank in recs for e in rank[k]["events"]
                                if e[0] == "sync") for k in range(rounds)]
        if job.is_pipeline and job.mesh[1] == 1:
            per_round = [[(i, ev[0], ev[3], ev[4], ev[1]) for i, rank in enumerate(recs)
                          for ev in rank[k]["events"]] for k in range(rounds)]
            got = [schedule_bubble(evs, job.mesh[0]) for evs in per_round]
            res["bubbles"] = [b for b, _ in got]
            res["spans"] = [s for _, s in got]
            res["stage_s"] = [med([stage_busy(evs, s) / job.microbatches for evs in per_round])
                              for s in range(len(job.split))]
        out[job.name] = res
    return out


def stage_busy(events: Sequence[tuple], stage: int) -> float:
    """Compute time of ``stage`` in one step, from ``(rank, kind, start, end, stage)``."""
    return sum(e[3] - e[2] for e in events if e[4] == stage and e[1] in COMPUTE_KINDS)


# --- the three parts ---------------------------------------------------------------------------


def bubble_part(pps: Sequence[int]) -> list[tuple[Job, dict]]:
    out = []
    for pp in pps:
        for sched in SCHEDULES:
            out.append(pipeline_job(f"bubble pp={pp} {sched}", MODEL, pp, 1, sched, M_BUBBLE))
    return out


def heavy_part() -> list[tuple[Job, dict]]:
    from autopar.planning.pipeline import predict_split

    job, pred = pipeline_job("heavy planner", HEAVY, HEAVY_PP, 1, HEAVY_SCHEDULE, M_BUBBLE)
    blocks = dict(HEAVY)["n_layer"]
    equal = tuple((k * blocks // HEAVY_PP, (k + 1) * blocks // HEAVY_PP)
                  for k in range(HEAVY_PP))
    step, bubble = predict_split(pred["planned"], pred["mesh"], equal)
    eq_pred = dict(pred, step_s=step, bubble=bubble)
    return [(job, pred), (dataclasses.replace(job, name="heavy equal", split=equal), eq_pred)]


def fidelity_part() -> list[tuple[Job, dict]]:
    out = spmd_jobs()
    for sched in ("1F1B", "GPipe", "Interleaved1F1B"):
        out.append(pipeline_job(f"{sched} (pp=2 x dp=2, m=4)", MODEL, 2, 2, sched, 4))
    for sched in ("1F1B", "ZBVZeroBubble", "Interleaved1F1B"):
        out.append(pipeline_job(f"{sched} (pp=4, m=8)", MODEL, 4, 1, sched, M_BUBBLE))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="5 rounds; the pp=4 bubble left out")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 12)")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rounds = args.rounds or (5 if args.quick else 12)
    t0 = time.time()
    load_before = os.getloadavg()[0]
    bub = bubble_part((2,) if args.quick else (2, 4))
    heavy = heavy_part()
    fid = fidelity_part()
    plan_s = time.time() - t0
    print(f"planned {len(bub) + len(heavy) + len(fid)} runs in {plan_s:.0f} s", flush=True)
    two = [j for j, _ in bub + heavy if math.prod(j.mesh) == 2]
    four = [j for j, _ in bub + fid if math.prod(j.mesh) == 4]
    got2 = run(two, 2, args.warmup, rounds)
    print(f"2 processes done at {time.time() - t0:.0f} s", flush=True)
    got4 = run(four, 4, args.warmup, rounds)
    got = {**got2, **got4}
    cals = [got2["calibration"], got4["calibration"]]

    btab = bubble_table(bub, got)
    htab, hnote = heavy_table(heavy, got)
    ftab, fsum = fidelity_table(fid, got, TARGET_RHO)
    cal = calibration_lines(*cals)
    found = findings(bub, fid, got, cals)
    total_s = time.time() - t0
    load = os.getloadavg()[0]
    print("\nBubble per schedule\n\n" + btab)
    print("\nHeavy head\n\n" + htab + "\n\n" + hnote)
    print("\nPlan fidelity\n\n" + ftab + "\n\n" + fsum)
    print("\n" + "\n".join(found))
    print("\n" + "\n".join(cal))
    print(f"\n{total_s:.0f} s in all; load average {load_before:.1f} before, {load:.1f} at the "
          "end")
    if args.write:
        cmd = "python benchmarks/pipeline.py" + (" --quick" if args.quick else "") + \
            (f" --rounds {args.rounds}" if args.rounds else "") + " --write"
        cfg = {"cmd": cmd, "date": datetime.date.today().isoformat(), "total_s": total_s,
               "load": load, "load_before": load_before, "rounds": rounds,
               "warmup": args.warmup, "preset": PRESET,
               "model": ", ".join(f"{k}={v}" for k, v in MODEL), "batch": BATCH, "seq": SEQ,
               "m": M_BUBBLE, "vocab": dict(HEAVY)["vocab_size"],
               "heavy_schedule": HEAVY_SCHEDULE, "heavy_pp": HEAVY_PP}
        update_results("Pipelines", results_body(cfg, btab, htab, hnote, ftab, fsum, cal,
                                                 found))


if __name__ == "__main__":
    main()
