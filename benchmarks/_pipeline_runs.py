"""What runs inside each gloo rank for ``benchmarks/pipeline.py``: every job built once, then
timed round by round (all jobs in each round, so load from other programs hits them alike),
and a short calibration of the ``cpu`` device profile's figures on the same processes.

A job is a plan to run: an SPMD plan through ``autopar.parallelize(..., plan=...)`` or a
pipeline through ``autopar.runtime.pipeline.runner.build_pipeline`` with the split, schedule,
microbatches and stages per rank the planner chose. A measured step is forward + backward +
gradient sync (and reading the loss, which a training loop logs), timed from a barrier on
each rank; the optimizer step (fused AdamW) runs after it, untimed, because the cost model has
no optimizer term.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Job:
    name: str
    preset: str  # an autopar.models preset
    fields: tuple[tuple[str, Any], ...]  # its config changed by preset.replace(**fields)
    batch: int
    seq: int
    mesh: tuple[int, ...]
    axes: tuple[str, ...]
    schedule: str = ""  # build_pipeline's key; empty for an SPMD plan
    microbatches: int = 1
    virtual: int = 1
    split: tuple[tuple[int, int], ...] = ()
    plan: str = ""  # the SPMD plan as JSON

    @property
    def is_pipeline(self) -> bool:
        return bool(self.schedule)


def build_model(job: Job) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model with real weights (seed 0) and the global batch (seed 1), alike on every rank."""
    from autopar.models import get_preset

    preset = get_preset(job.preset).replace(**dict(job.fields))
    torch.manual_seed(0)
    model = preset.build("cpu")
    torch.manual_seed(1)
    return model, preset.example_inputs(job.batch, job.seq, "cpu")


class _Runner:
    """One job on this rank: ``step()`` runs and times one training step."""

    def __init__(self, job: Job) -> None:
        model, self.inputs = build_model(job)
        self.job = job
        if job.is_pipeline:
            from torch.distributed.device_mesh import init_device_mesh

            from autopar.runtime.pipeline.runner import build_pipeline

            dmesh = init_device_mesh("cpu", job.mesh, mesh_dim_names=job.axes)
            self.module: Any = build_pipeline(
                model, self.inputs, dmesh, split=list(job.split), schedule=job.schedule,
                n_microbatches=job.microbatches, virtual=job.virtual, frontend="module")
        else:
            import autopar
            from autopar.ir.mesh import Mesh
            from autopar.ir.plan import Plan

            plan = Plan.from_json(json.loads(job.plan))
            self.module = autopar.parallelize(model, Mesh(job.mesh, job.axes, "cpu"),
                                              self.inputs, plan=plan)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4, fused=True)

    def step(self) -> dict[str, Any]:
        dist.barrier()
        t0 = time.perf_counter()
        if self.job.is_pipeline:
            loss = self.module.step(*self.inputs)
        else:
            loss = self.module(*self.inputs)
            loss.backward()
        float(loss.detach())
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        out: dict[str, Any] = {"step_s": t1 - t0}
        if self.job.is_pipeline:
            # runner events are relative to the step's start, taken inside step() a few us
            # after t0; perf_counter is the system's monotonic clock, shared by the ranks
            out["events"] = [(e.kind, e.stage, e.microbatch, t0 + e.start_s, t0 + e.end_s)
                             for e in self.module.last_step_events]
        return out


def worker(jobs: list[Job], warmup: int, rounds: int, calibrate: bool) -> dict[str, Any]:
    """Every job built, ``warmup`` untimed rounds, then ``rounds`` rounds of one step per job
    (the job order rotated each round). Returns per job the per-round measurements."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {"rank": dist.get_rank(), "calibration": {}}
    if calibrate:
        out["calibration"] = calibration()
    runners = [_Runner(j) for j in jobs]
    got: dict[str, list] = {j.name: [] for j in jobs}
    for r in range(warmup + rounds):
        k = r % len(runners)
        for runner in runners[k:] + runners[:k]:
            rec = runner.step()
            if r >= warmup:
                got[runner.job.name].append(rec)
    out["jobs"] = got
    return out


# --- calibration: the cpu profile's figures measured on these processes ------------------------


def calibration() -> dict[str, float]:
    """Measured on all ranks at once (as a step runs them): the float32 matmul rate of one
    rank; a tiny and a 1 MiB all-reduce, each both right after a barrier (ranks in step) and
    right after 5 ms of matmuls (as in a step, where ranks sharing cores drift apart); and a
    64 KiB point-to-point send (a pipeline's boundary tensor) between ranks 0 and 1."""
    rank = dist.get_rank()
    a, b = torch.randn(2048, 128), torch.randn(128, 512)
    for _ in range(3):
        a @ b
    dist.barrier()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        a @ b
        n += 1
    out = {"matmul_flops": n * 2 * 2048 * 128 * 512 / (time.perf_counter() - t0)}
    for label, numel in (("tiny", 1), ("1mib", 2**18)):
        x = torch.ones(numel)
        for when in ("barrier", "compute"):
            times = []
            for _ in range(14):
                dist.barrier()
                t = time.perf_counter()
                while when == "compute" and time.perf_counter() - t < 0.005:
                    a @ b
                t = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t)
            out[f"allreduce_{label}_{when}_s"] = statistics.median(times[2:])
    x = torch.ones(2**14)  # 64 KiB
    times = []
    for _ in range(14):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
        times.append((time.perf_counter() - t) / 2)
    out["send_64kib_s"] = statistics.median(times[2:])
    return out
