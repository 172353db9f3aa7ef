"""autopar's runtime against PyTorch's own parallel wrappers: same model, same run, 4 processes.

=============  ===================================================  =============================
config         PyTorch                                              autopar plan
=============  ===================================================  =============================
DP             ``DistributedDataParallel``                          ``data_parallel`` reference
TP (tp=4)      ``parallelize_module``, Colwise/Rowwise pairs        ``megatron_tp`` reference
FSDP           ``fully_shard`` per Linear and on the root           ``fsdp`` reference
solver         the fastest of the three above                       the solver's own plan
=============  ===================================================  =============================

The reference layouts (``autopar.models.reference_plans``) pin parameters and inputs; the planner
completes the rest at its best (``make_plan(references=...)`` then ``assemble_plan``). Plans are
made once, in this process (planning needs no processes), and handed to every rank.

The model is the MLP of ``autopar.models`` with widths ``in, H, in, H, out``: layers (0, 1) and
(2, 3) are the column-then-row pairs torch's tensor parallelism expects. Every config trains the
same initial weights on the same global batch with the same AdamW (the torch wrappers get each
rank's share of the batch, as their users would pass it; autopar gets the whole batch on every
rank). The DP pair also runs compiled, both sides: ``torch.compile(DDP(model))`` against
``parallelize(..., compile=True)`` (its per-rank program's runs of plain steps compiled by
Inductor between the collectives); ``--no-compiled`` leaves that pair out. ``--optimizer``
picks AdamW's implementation for every config: ``fused`` (the default, one
kernel per step, what torchtitan and Megatron train with), ``foreach``, or ``for-loop`` (torch's
pick on CPU when none is given: 8 ops per parameter). Unless it is ``for-loop`` already, the
DP pair also runs with the for-loop AdamW, as a row of its own.
A step is forward + backward + optimizer step, timed between barriers, slowest rank; configs are
interleaved round by round, each autopar run right after the torch run it is compared with, so
load from other programs hits them alike. Reported: the ratio of the medians, and the median of
the per-round ratios of those back-to-back blocks ("paired"), the steadier of the two, with
a bootstrap 95% interval for it.

    python benchmarks/runtime_vs_torch.py                  # prints the table
    python benchmarks/runtime_vs_torch.py --write          # and updates benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, table, update_results  # noqa: E402

from autopar.ir.devices import get_profile  # noqa: E402
from autopar.ir.mesh import Mesh  # noqa: E402
from autopar.ir.options import Options
from autopar.models import MLP, REFERENCE_PLANS, MLPConfig  # noqa: E402
from autopar.report.table import plan_table
from autopar.runtime.launch import launch  # noqa: E402

NPROC = 4
# (config, torch wrapper, reference plan, mesh axis name)
PAIRS = (("DP", "DDP", "data_parallel", "dp"),
         ("TP (tp=4)", "parallelize_module", "megatron_tp", "tp"),
         ("FSDP", "fully_shard", "fsdp", "dp"))
# --optimizer: AdamW's implementation, the same for every config
OPTIMIZERS = {"fused": {"fused": True}, "foreach": {"foreach": True},
              "for-loop": {"foreach": False, "fused": False}}
FOR_LOOP_DP = "DP, AdamW for-loop"  # the extra DP pair run with the for-loop AdamW
# the DP pair compiled: torch.compile(DDP(model)) vs parallelize(..., compile=True)
COMPILED_DP = "DP, compiled"
# DDP whose step also all-reduces its loss, as autopar returns the whole loss: what that costs
DDP_GLOBAL_LOSS = "torch DP, global loss"


@dataclass(frozen=True)
class Bench:
    width: int
    hidden: int
    batch: int
    warmup: int
    steps: int
    rounds: int
    seed: int
    plans: dict[str, dict]  # run name -> Plan JSON ("autopar DP", ..., "autopar solver")
    plan_axes: dict[str, str]  # run name -> mesh axis name the plan was made on
    optimizer: str = "fused"  # a key of OPTIMIZERS
    compiled: bool = True  # also run the DP pair compiled (COMPILED_DP)

    def adamw(self, model: nn.Module, optimizer: str | None = None) -> torch.optim.AdamW:
        return torch.optim.AdamW(model.parameters(), lr=1e-3,
                                 **OPTIMIZERS[optimizer or self.optimizer])

    def config(self) -> MLPConfig:
        return MLPConfig(in_dim=self.width, hidden=(self.hidden, self.width, self.hidden),
                         out_dim=self.width)


def make_plans(b: Bench, time_limit_s: float) -> tuple[dict[str, dict], dict[str, str], dict]:
    from autopar.ir.plan import SolverInfo
    from autopar.planning.assemble import assemble_plan
    from autopar.planning.planner import make_plan

    with torch.device("meta"):
        model = MLP(b.config())
    x = torch.empty(b.batch, b.width, device="meta")
    inputs = (x, torch.empty_like(x))
    plans: dict[str, dict] = {}
    axes: dict[str, str] = {}
    info: dict[str, Any] = {}
    for axis in ("dp", "tp"):
        mesh = Mesh((NPROC,), (axis,), "cpu")
        refs = {ref: REFERENCE_PLANS[ref](model, mesh.shape, mesh.axes, "mlp", batch_size=b.batch)
                for name, _, ref, ax in PAIRS if ax == axis}
        t0 = time.perf_counter()
        planned = make_plan(model, mesh, inputs, references=refs, model_name="MLP",
                            options=Options.of(time_limit_s=time_limit_s))
        info[f"planning {axis}"] = round(time.perf_counter() - t0, 2)
        if axis == "dp":
            plans["autopar solver"], axes["autopar solver"] = planned.plan.to_json(), axis
            info["solver plan"] = planned.plan
        for name, _, ref, ax in PAIRS:
            if ax != axis:
                continue
            choice = planned.reference_choices.get(ref)
            if choice is None:
                print(f"note: the {ref} layout does not apply to this model; skipping {name}")
                continue
            plan = assemble_plan(planned.graph, planned.problem, choice, "MLP", mesh,
                                 SolverInfo("reference", 0.0, ref), {}, {}, None)
            plans[f"autopar {name}"], axes[f"autopar {name}"] = plan.to_json(), axis
    return plans, axes, info


# --- inside each rank -------------------------------------------------------------------------


def _worker(b: Bench) -> dict[str, Any]:
    import torch.distributed as dist

    torch.manual_seed(b.seed)
    x = torch.randn(b.batch, b.width)
    y = torch.randn(b.batch, b.width)
    runs = _build_runs(b, x, y)
    times: dict[str, list[float]] = {name: [] for name in runs}
    first_loss: dict[str, float] = {}
    comms: dict[str, tuple[int, float]] = {}
    kinds: dict[str, dict[str, tuple[int, float]]] = {}
    for name, step in runs.items():  # warm-up; also the first loss, to check all agree
        for i in range(b.warmup):
            loss = step()
            if i == 0:
                first_loss[name] = _global_mean(loss) if step.local_batch else loss
    for _ in range(b.rounds):
        for name, step in runs.items():
            for _ in range(b.steps):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    for name, step in runs.items():
        if name.startswith("torch"):
            comms[name] = _torch_collectives(step)
            continue
        counter = getattr(step, "collectives", None)
        if counter is not None:
            counter.reset()
            step()
            comms[name] = (len(counter.records), float(sum(r.bytes for r in counter.records)))
            kinds[name] = {" ".join(k): v for k, v in counter.totals(by_reason=True).items()}
    latency = _collective_latency(b)
    # the step is as slow as its slowest rank
    t = torch.tensor([times[n] for n in runs], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"times": {n: t[i].tolist() for i, n in enumerate(runs)}, "first_loss": first_loss,
            "comms": comms, "kinds": kinds, "latency": latency}


def _collective_latency(b: Bench, reps: int = 15) -> dict[str, float]:
    """Median ms of gloo all-reduces over the 4 ranks: a tiny one, and the model's gradients
    as one flat buffer (DDP's bucket) or as one all-reduce per parameter. The fixed price of
    each synchronisation point on this machine, and what bucketing saves."""
    import torch.distributed as dist

    with torch.device("meta"):
        sizes = [p.numel() for p in MLP(b.config()).parameters()]
    flat, parts = torch.zeros(sum(sizes)), [torch.zeros(n) for n in sizes]
    mib = sum(sizes) * 4 / 2**20
    probes = {"tiny (4 B)": lambda: dist.all_reduce(torch.zeros(1)),
              f"all gradients ({mib:.1f} MiB) in 1": lambda: dist.all_reduce(flat),
              f"all gradients in {len(parts)} (one per parameter)":
                  lambda: [dist.all_reduce(t) for t in parts]}
    out = {}
    for label, fn in probes.items():
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[label] = statistics.median(ts) * 1e3
    return out


def _torch_collectives(step: _Step) -> tuple[int, float] | None:
    """Collectives one torch step issues, counted by torch's own CommDebugMode (it sees the
    c10d ops of DDP's reducer, FSDP2 and DTensor alike)."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its module hooks warn about inputs without grad
        step()
    n = mode.get_total_counts()
    return (n, float("nan")) if n else None


def _global_mean(local_loss: float) -> float:
    """The loss over the global batch from each rank's loss over its equal share."""
    import torch.distributed as dist

    t = torch.tensor([local_loss], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


class _Step:
    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                 y: torch.Tensor, collectives: Any = None, local_batch: bool = False,
                 global_loss: bool = False) -> None:
        self.model, self.opt, self.x, self.y = model, opt, x, y
        # torch's wrappers take this rank's share of the batch and return its own loss
        self.local_batch = local_batch and not global_loss
        # all-reduce that loss each step, as autopar's whole loss is: issued after the
        # forward, waited for at the end of the step
        self.global_loss = global_loss
        self.collectives = collectives

    def __call__(self) -> float:
        import torch.distributed as dist

        loss = self.model(self.x, self.y)
        work = None
        if self.global_loss:
            whole = loss.detach() / dist.get_world_size()
            work = dist.all_reduce(whole, async_op=True)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if work is not None:
            work.wait()
            return float(whole)
        full = getattr(loss, "full_tensor", None)
        return float((full() if full is not None else loss).detach())


def _build_runs(b: Bench, x: torch.Tensor, y: torch.Tensor) -> dict[str, _Step]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.nn.parallel import DistributedDataParallel as DDP

    import autopar
    from autopar.ir.plan import Plan

    rank, world = dist.get_rank(), dist.get_world_size()
    share = b.batch // world
    xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    meshes = {ax: init_device_mesh("cpu", (world,), mesh_dim_names=(ax,)) for ax in ("dp", "tp")}

    def fresh() -> nn.Module:
        torch.manual_seed(b.seed + 1)  # the same initial weights for every config
        return MLP(b.config())

    def step(model: nn.Module, optimizer: str | None = None, **kw: Any) -> _Step:
        return _Step(model, b.adamw(model, optimizer), **kw)

    def ours(plan_name: str, compile: bool = False) -> nn.Module:
        return autopar.parallelize(fresh(), meshes[b.plan_axes[plan_name]],
                                   example_inputs=(x, y), plan=Plan.from_json(b.plans[plan_name]),
                                   compile=compile)

    runs: dict[str, _Step] = {}
    runs["torch DP"] = step(DDP(fresh()), x=xs, y=ys, local_batch=True)
    runs[DDP_GLOBAL_LOSS] = step(DDP(fresh()), x=xs, y=ys, local_batch=True, global_loss=True)
    tp_model = fresh()
    n_layers = len(tp_model.layers)
    tp_plan = {f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
               for i in range(n_layers - n_layers % 2)}
    runs["torch TP (tp=4)"] = step(parallelize_module(tp_model, meshes["tp"], tp_plan), x=x, y=y)
    fs_model = fresh()
    for layer in fs_model.layers:
        fully_shard(layer, mesh=meshes["dp"])
    runs["torch FSDP"] = step(fully_shard(fs_model, mesh=meshes["dp"]), x=xs, y=ys,
                              local_batch=True)
    for name in b.plans:
        pm = ours(name)
        runs[name] = step(pm, x=x, y=y, collectives=getattr(pm, "collectives", None))
    if b.optimizer != "for-loop" and "autopar DP" in b.plans:
        runs[f"torch {FOR_LOOP_DP}"] = step(DDP(fresh()), "for-loop", x=xs, y=ys,
                                            local_batch=True)
        pm = ours("autopar DP")
        runs[f"autopar {FOR_LOOP_DP}"] = step(pm, "for-loop", x=x, y=y,
                                              collectives=getattr(pm, "collectives", None))
    if b.compiled and "autopar DP" in b.plans:
        runs[f"torch {COMPILED_DP}"] = step(torch.compile(DDP(fresh())), x=xs, y=ys,
                                            local_batch=True)
        pm = ours("autopar DP", compile=True)
        runs[f"autopar {COMPILED_DP}"] = step(pm, x=x, y=y, collectives=pm.collectives)
    # each autopar run right after the torch run it is compared with, so that the two see
    # about the same load in every round (see report: the paired ratio)
    order = ["torch DP", "autopar DP", DDP_GLOBAL_LOSS, "autopar solver", "torch TP (tp=4)",
             "autopar TP (tp=4)", "torch FSDP", "autopar FSDP"]
    return {n: runs[n] for n in order + [n for n in runs if n not in order] if n in runs}


PHASES = ("forward", "backward", "optimizer")


def single_process_phases(b: Bench, steps: int = 100) -> dict[str, dict[str, float]]:
    """Median ms of each phase of a step, plain module vs autopar on a 1-device mesh, one
    thread, one rank's share of the batch (what a data-parallel rank computes), the two
    interleaved step by step: what autopar's execution costs with no communication at all."""
    import autopar

    torch.set_num_threads(1)  # like each of the 4 ranks
    torch.manual_seed(b.seed)
    share = b.batch // NPROC
    x, y = torch.randn(share, b.width), torch.randn(share, b.width)
    runs = {}
    for name in ("plain", "autopar", "autopar compiled")[:3 if b.compiled else 2]:
        torch.manual_seed(b.seed + 1)
        model: nn.Module = MLP(b.config())
        if name != "plain":
            model = autopar.parallelize(model, Mesh((1,), ("dp",), "cpu"), example_inputs=(x, y),
                                        compile=name == "autopar compiled")
        runs[name] = (model, b.adamw(model))
    times: dict[str, dict[str, list[float]]] = {n: {p: [] for p in PHASES} for n in runs}
    for i in range(b.warmup + steps):
        for name, (model, opt) in runs.items():
            t0 = time.perf_counter()
            loss = model(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if i >= b.warmup:
                for phase, t in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
                    times[name][phase].append(t)
    return {n: {p: statistics.median(v) * 1e3 for p, v in d.items()} for n, d in times.items()}


def phases_text(ph: dict[str, dict[str, float]], share: int) -> str:
    plain, ours = ph["plain"], ph["autopar"]
    parts = [f"{p} {plain[p]:.2f} vs {ours[p]:.2f} ms ({ours[p] / plain[p]:.2f}x)"
             for p in PHASES]
    total = sum(ours.values()) / sum(plain.values())
    text = (f"one process, one thread, no communication, batch {share} (one rank's share), "
            f"plain module vs autopar on a 1-device mesh (DTensor parameters): "
            f"{'; '.join(parts)}; step {total:.2f}x")
    comp = ph.get("autopar compiled")
    if comp is not None:
        parts = [f"{p} {comp[p]:.2f} ms ({comp[p] / plain[p]:.2f}x)" for p in PHASES]
        text += (f"; compiled (`compile=True`): {'; '.join(parts)}; step "
                 f"{sum(comp.values()) / sum(plain.values()):.2f}x")
    return text


def unfused_optimizer_steps(b: Bench, steps: int = 150) -> dict[str, dict[str, float]]:
    """Median ms of AdamW's step alone, one process, one thread: on the plain module's
    parameters and on autopar's DTensor parameters, for the for-loop and the foreach
    implementations; the for-loop one also with ``runtime/elementwise_fast_path`` uninstalled
    (DTensor's own dispatch of every op), all interleaved step by step: the fast path
    measured before and after in one run."""
    import autopar
    from autopar.runtime import elementwise_fast_path

    torch.set_num_threads(1)
    torch.manual_seed(b.seed)
    share = b.batch // NPROC
    x, y = torch.randn(share, b.width), torch.randn(share, b.width)
    out: dict[str, dict[str, float]] = {}
    for impl in ("for-loop", "foreach"):
        runs = {}
        names = ("plain", "autopar") + (("autopar, DTensor dispatch",) if impl == "for-loop"
                                        else ())
        for name in names:
            torch.manual_seed(b.seed + 1)
            model: nn.Module = MLP(b.config())
            if name != "plain":
                model = autopar.parallelize(model, Mesh((1,), ("dp",), "cpu"),
                                            example_inputs=(x, y))
            runs[name] = (model, b.adamw(model, impl))
        times: dict[str, list[float]] = {n: [] for n in runs}
        for i in range(b.warmup + steps):
            for name, (model, opt) in runs.items():
                loss = (model(x, y) if name != "plain"
                        else nn.functional.mse_loss(model(x), y))
                loss.backward()
                without = name == "autopar, DTensor dispatch"
                if without:
                    elementwise_fast_path.uninstall()
                try:
                    t0 = time.perf_counter()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    t = time.perf_counter() - t0
                finally:
                    if without:
                        elementwise_fast_path.install()
                if i >= b.warmup:
                    times[name].append(t)
        out[impl] = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    return out


def unfused_text(opt: dict[str, dict[str, float]]) -> str:
    parts = []
    for impl, d in opt.items():
        plain = d["plain"]
        text = (f"{impl}: plain {plain:.2f} ms, autopar {d['autopar']:.2f} ms "
                f"({d['autopar'] / plain:.2f}x)")
        without = d.get("autopar, DTensor dispatch")
        if without is not None:
            text += (f", without the elementwise fast path {without:.2f} ms "
                     f"({without / plain:.2f}x)")
        parts.append(text)
    return ("AdamW's step alone, one process, one thread, same model and batch: "
            + "; ".join(parts))


# --- report -----------------------------------------------------------------------------------


def report(b: Bench, res: dict[str, Any]) -> tuple[str, list[str]]:
    med = {n: statistics.median(ts) * 1e3 for n, ts in res["times"].items()}
    low = {n: min(ts) * 1e3 for n, ts in res["times"].items()}
    comms = res["comms"]
    rows: list[list[str]] = []
    slow: list[str] = []
    best_torch = min((n for n in med if n.startswith("torch") and FOR_LOOP_DP not in n
                      and COMPILED_DP not in n and n != DDP_GLOBAL_LOSS), key=med.__getitem__)
    pairs = [(cfg, f"torch {cfg}", f"autopar {cfg}", wrapper) for cfg, wrapper, _, _ in PAIRS]
    pairs.append(("solver plan vs best torch", best_torch, "autopar solver",
                  best_torch.removeprefix("torch ") + " (best torch)"))
    if f"autopar {FOR_LOOP_DP}" in med:
        pairs.append((FOR_LOOP_DP, f"torch {FOR_LOOP_DP}", f"autopar {FOR_LOOP_DP}", "DDP"))
    if f"autopar {COMPILED_DP}" in med:
        pairs.append((COMPILED_DP, f"torch {COMPILED_DP}", f"autopar {COMPILED_DP}",
                      "torch.compile(DDP)"))
    for cfg, t_name, a_name, label in pairs:
        t, a = med.get(t_name), med.get(a_name)
        tl, al = low.get(t_name), low.get(a_name)
        c, tc = comms.get(a_name), comms.get(t_name)
        paired = _paired_ratio(res["times"], a_name, t_name, b.steps)
        band = _median_interval(_round_ratios(res["times"], a_name, t_name, b.steps))
        rows.append([cfg, label, f"{_ms(t)} / {_ms(tl)}", f"{_ms(a)} / {_ms(al)}",
                     f"{a / t:.2f}" if a is not None and t else "n/a",
                     (f"{paired:.2f}" if paired is not None else "n/a")
                     + (f" [{band[0]:.2f}, {band[1]:.2f}]" if band else ""),
                     f"{al / tl:.2f}" if al is not None and tl else "n/a",
                     str(tc[0]) if tc else "?",
                     f"{c[0]} / {c[1] / 2**20:.2f} MiB" if c else "n/a"])
        if a is not None and t and a / t > 1.0:
            slow.append(f"{cfg}: autopar {a:.2f} ms vs {t:.2f} ms")
    losses = res["first_loss"]
    spread = max(losses.values()) - min(losses.values()) if losses else float("nan")
    text = table(["config", "PyTorch", "torch ms/step median / min",
                  "autopar ms/step median / min", "autopar/torch (median)",
                  "autopar/torch (paired) [95% interval]", "autopar/torch (min)", "torch collectives/step",
                  "autopar collectives/step (bytes per rank)"], rows)
    text += (f"\n\nfirst-step loss of all {len(losses)} runs agrees within {spread:.1e} "
             "(same weights, same global batch)")
    if DDP_GLOBAL_LOSS in med and "autopar DP" in med:
        g = med[DDP_GLOBAL_LOSS]
        text += (f"\n\nDDP returning the whole loss as autopar does (its loss all-reduced each "
                 f"step, issued after the forward, waited for at the end): {g:.2f} ms/step, "
                 f"{g / med['torch DP']:.2f}x plain DDP; autopar DP is {med['autopar DP'] / g:.2f}x "
                 "that")
    if f"autopar {COMPILED_DP}" in med:
        c = med[f"autopar {COMPILED_DP}"]
        text += (f"\n\nautopar DP compiled against eager DDP: {c / med['torch DP']:.2f}x; "
                 f"against its own eager run: {c / med['autopar DP']:.2f}x; "
                 f"torch.compile(DDP) against eager DDP: "
                 f"{med[f'torch {COMPILED_DP}'] / med['torch DP']:.2f}x")
    lat = res["latency"]
    text += ("\n\ngloo all-reduce over the 4 ranks, median ms: "
             + "; ".join(f"{k}: {v:.2f}" for k, v in lat.items()))
    return text, slow


def _round_ratios(times: dict[str, list[float]], a_name: str, t_name: str,
                  steps: int) -> list[float]:
    """Per round, autopar's median step over torch's: each round's two blocks of steps ran
    back to back, so load that comes and goes hits both alike."""
    a, t = times.get(a_name), times.get(t_name)
    if not a or not t:
        return []
    return [statistics.median(a[i:i + steps]) / statistics.median(t[i:i + steps])
            for i in range(0, min(len(a), len(t)), steps)]


def _paired_ratio(times: dict[str, list[float]], a_name: str, t_name: str,
                  steps: int) -> float | None:
    """The median over rounds of the per-round ratios."""
    rounds = _round_ratios(times, a_name, t_name, steps)
    return statistics.median(rounds) if rounds else None


def _median_interval(xs: list[float], level: float = 0.95, resamples: int = 4000
                     ) -> tuple[float, float] | None:
    """A bootstrap interval for the median of ``xs`` (percentile method, fixed seed): how
    far the paired ratio could move were the rounds drawn again."""
    import random

    if len(xs) < 4:
        return None
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    lo = meds[int((1 - level) / 2 * resamples)]
    hi = meds[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return lo, hi


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=256, help="MLP in/out width (default 256)")
    p.add_argument("--hidden", type=int, default=1024, help="MLP hidden width (default 1024)")
    p.add_argument("--batch", type=int, default=256, help="global batch (default 256)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per config per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=20.0, help="solver time limit, s")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="fused",
                   help="AdamW's implementation, for every config (default fused)")
    p.add_argument("--no-compiled", dest="compiled", action="store_false",
                   help="leave out the compiled DP pair (it compiles for a minute first)")
    p.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    b = Bench(args.width, args.hidden, args.batch, args.warmup, args.steps, args.rounds,
              args.seed, {}, {}, args.optimizer, args.compiled)
    plans, axes, info = make_plans(b, args.time_limit)
    b = Bench(**{**b.__dict__, "plans": plans, "plan_axes": axes})
    print(f"planned in {info['planning dp']} s (dp mesh) + {info['planning tp']} s (tp mesh); "
          "the solver's plan:")
    print(plan_table(info["solver plan"]))
    t0 = time.perf_counter()
    res = launch(_worker, NPROC, (b,), backend="gloo", timeout_s=1800)[0]
    wall = time.perf_counter() - t0
    text, slow = report(b, res)
    res["load"] = os.getloadavg()[0]
    res["solver_method"] = info["solver plan"].solver.method
    phases = single_process_phases(b)
    text += "\n\n" + phases_text(phases, b.batch // NPROC)
    unfused = unfused_optimizer_steps(b)
    text += "\n\n" + unfused_text(unfused)
    print("\ncollectives autopar executed in one step (kind axis reason: count, bytes per rank):")
    for name, kinds in res["kinds"].items():
        print(f"  {name}: " + "; ".join(f"{k}: {c}, {nb / 2**10:.0f} KiB"
                                       for k, (c, nb) in sorted(kinds.items())))
    print()
    print(text)
    print(f"\n{NPROC} gloo processes, {machine()}; {wall:.0f} s")
    if args.write:
        cmd = "python benchmarks/runtime_vs_torch.py " + " ".join(argv or sys.argv[1:])
        why = notes(res, phases, unfused)
        update_results("Runtime vs PyTorch", _results_body(b, cmd.strip(), text, slow, why))
        print("updated benchmarks/RESULTS.md")
    print(json.dumps({"median_ms": {n: round(statistics.median(ts) * 1e3, 3)
                                    for n, ts in res["times"].items()}}))
    return 0


def _results_body(b: Bench, cmd: str, text: str, slow: list[str], why: str) -> str:
    slower = "; ".join(slow) if slow else "none"
    extra_row = ("" if b.optimizer == "for-loop" else
                 " for every config (the last row: DP with AdamW's for-loop implementation)")
    return f"""`{cmd}`

Machine: {machine()}; {NPROC} gloo processes on 127.0.0.1 (1 intra-op thread each).
Model: MLP {b.width}-{b.hidden}-{b.width}-{b.hidden}-{b.width}, global batch {b.batch};
AdamW, {b.optimizer}{extra_row};
{b.warmup} warm-up steps, then median of {b.rounds} rounds x {b.steps} steps per config,
configs interleaved, each autopar config right after its torch one; a step is forward +
backward + optimizer step of the slowest rank. "paired": the median over rounds of the ratio
of the two back-to-back blocks, which load from other programs hits alike; in brackets a
bootstrap 95% interval for it (rounds drawn again with replacement): a ratio whose interval
holds 1.0 is at parity within this run's noise.
Target: autopar/torch <= 1.0.

{text}

Configs slower than PyTorch (medians): {slower}.

{why}
"""


def notes(res: dict[str, Any], phases: dict[str, dict[str, float]],
          unfused: dict[str, dict[str, float]]) -> str:
    """What limits the ratios, with this run's figures filled in."""
    c = {n: v[0] for n, v in res["comms"].items() if v}
    lat = res["latency"]

    def n(name: str) -> str:
        return str(c.get(name, "?"))

    med = {k: statistics.median(v) for k, v in res["times"].items()}
    fsdp = med.get("autopar FSDP", float("nan")) / med.get("torch FSDP", float("nan"))

    def kinds(name: str) -> str:
        return ", ".join(f"{c} {k}" for k, (c, _) in sorted(res["kinds"].get(name, {}).items()))

    solver_vs_dp = med.get("autopar solver", float("nan")) / med.get("autopar DP", float("nan"))
    same = res["kinds"].get("autopar solver") == res["kinds"].get("autopar DP")
    solver_plan = ("the data_parallel layout, with the same collectives as the DP run" if same
                   else f"a layout of its own ({kinds('autopar solver')})")
    tiny = next(v for k, v in lat.items() if k.startswith("tiny"))
    flat_key = next(k for k in lat if " in 1" in k)
    flat_mib = float(flat_key.split("(")[1].split()[0])
    gbps = flat_mib * 2**20 / (lat[flat_key] / 1e3) / 1e9
    plain, ours = phases["plain"], phases["autopar"]
    cpu = get_profile("cpu")
    extra = {p: ours[p] - plain[p] for p in PHASES}

    g = med.get(DDP_GLOBAL_LOSS)
    loss_cost = (f"DDP made to return the whole loss too (its loss all-reduced each step, "
                 f"issued after the forward, waited for at the end) ran "
                 f"{g / med['torch DP']:.2f}x plain DDP, and autopar DP "
                 f"{med['autopar DP'] / g:.2f}x that" if g else "")
    for_loop = ""
    if f"autopar {FOR_LOOP_DP}" in med:
        ratio = med[f"autopar {FOR_LOOP_DP}"] / med[f"torch {FOR_LOOP_DP}"]
        loop = unfused["for-loop"]
        for_loop = (
            f" With AdamW's for-loop implementation (8 elementwise ops per parameter, each "
            f"entering DTensor's dispatch) the DP ratio was {ratio:.2f}. Each op reaches "
            f"`runtime/elementwise_fast_path.py`'s handler, which runs it on the local pieces "
            f"where its DTensors are placed alike: the step alone, in one process, took "
            f"{loop['autopar'] / loop['plain']:.2f}x the plain step, and "
            f"{loop['autopar, DTensor dispatch'] / loop['plain']:.2f}x without the handler.")

    compiled = ""
    if f"autopar {COMPILED_DP}" in med and "autopar compiled" in phases:
        comp = phases["autopar compiled"]
        fb = (comp["forward"] + comp["backward"]) / (ours["forward"] + ours["backward"])
        compiled = f"""- **Compiled** (`parallelize(..., compile=True)`, `runtime/inductor_segments.py`): the
  per-rank program's runs of plain ops between collectives compiled by Inductor (here the
  whole forward, and the backward after the loss's seed step), the collectives as before.
  In one process its forward and backward take {fb:.2f}x the eager program's; on the 4
  ranks its step is {med[f"autopar {COMPILED_DP}"] / med["autopar DP"]:.2f}x autopar's eager DP
  and {med[f"autopar {COMPILED_DP}"] / med["torch DP"]:.2f}x eager DDP, and
  `torch.compile(DDP(model))` runs {med[f"torch {COMPILED_DP}"] / med["torch DP"]:.2f}x eager DDP
  (dynamo splits DDP's graph at its buckets; the optimizer step is eager in both).
"""

    return f"""What limits the ratios (figures from this run):

- **DP: the same work as DDP, fewer gradient collectives, plus the loss.** DDP issues
  {n("torch DP")} all-reduces (its fixed 1 MiB first bucket, started early to overlap the
  backward, then the rest); autopar issues {n("autopar DP")} ({kinds("autopar DP")}). On the
  `cpu` profile the planner fills one bucket: gloo reduces on the cores the model computes
  on (a 1 MiB all-reduce costs about 2 ms of CPU per rank, the whole 4 MiB hardly more), so
  an early bucket hides nothing and costs a collective (`passes/cost/buckets.first_bucket_bytes`;
  GPU profiles keep DDP's early bucket). The other collective is the loss, which autopar
  returns whole on every rank where DDP returns each rank's own: {loss_cost}. Its all-reduce
  is issued at the end of the forward and waited for only when read
  (`runtime/deferred_loss.py`), so it is no synchronisation point; issuing it still wakes
  gloo's worker threads on cores that are all busy.
- **Execution overhead**, measured with no communication in one process (the line under the
  table): per step autopar spends {extra["forward"]:+.2f} ms in the forward,
  {extra["backward"]:+.2f} ms in the backward and {extra["optimizer"]:+.2f} ms in the
  optimizer step. The optimizer's share is the DTensor parameters (placed as the plan says,
  as the issue asks and as torch's TP and FSDP have them; DDP's are plain): the fused AdamW
  kernel runs on the local pieces (`runtime/optim/fused.py`, a DTensor op handler that skips
  DTensor's sharding of the call where every state is placed as its parameter; torch's TP
  and FSDP runs in these processes take it too, with unchanged results), but the optimizer's
  Python still walks DTensors and the call still enters DTensor's dispatch before the
  handler.{for_loop} The forward and backward share is the per-rank program: Python calling
  one op at a time (as straight-line generated code, `runtime/step_code.py`) where the plain
  module's backward runs in autograd's C++ engine, and each gradient made a DTensor.
  With 4 processes on 2 cores every ms of CPU costs about two.
- **TP** issues {n("autopar TP (tp=4)")} collectives to torch's {n("torch TP (tp=4)")}
  ({kinds("autopar TP (tp=4)")}): the row-parallel layers all-reduce their outputs inside
  the op, once for forward and backward, as Megatron does. The row-parallel biases'
  gradients come from the whole output gradient, with no collective, as in torch: priced as
  members of a full bucket, the solver would sum them over a sharded batch and all-reduce a
  2 KiB bucket; the planner finds that bucket nearly empty, prices it at its fill and solves
  again (`passes/problem/bucket_fill.py`).
- **FSDP** ({fsdp:.2f}x `fully_shard`'s step) issues {n("autopar FSDP")} collectives to
  fully_shard's {n("torch FSDP")}: {kinds("autopar FSDP")}. Parameter gathers go out one
  all-gather per layer, gradient reduce-scatters in buckets (on the `cpu` profile one, once
  the last gradient exists, for the reason given under DP); as
  the solver completes this layout, the gathered weights are kept for the backward where
  fully_shard frees them and gathers again (more memory, fewer collectives).
- **The solver's own plan** here is {solver_plan}, priced by the `cpu` profile
  ({cpu.intra_node_latency * 1e6:.0f} us per ring step, {cpu.collective_overhead * 1e3:g} ms
  per collective, {cpu.intra_node_bandwidth / 1e9:g} GB/s; the loss's all-reduce, which runs
  beside the backward, at most the per-collective cost; gloo here: {tiny:.2f} ms for a tiny
  all-reduce, about {gbps:.2f} GB/s for the gradient buffer). The planner says: "{res.get("solver_method",
  "?")}". Measured, its step is {solver_vs_dp:.2f}x the DP run's.
{compiled}- **Noise.** Other programs shared the 2 cores during the run (load average
  {res.get("load", float("nan")):.1f} at the end); the min columns are the less disturbed
  figure, and repeated runs of the same code move the DP ratio by about 0.05.

What is left between autopar's eager DP and DDP is about that execution overhead (twice its
per-rank figure, on 2 cores) and the loss's collective, against DDP's extra gradient
collective; run to run the ratio moves by about 0.05 either way. Compiling the per-rank
program (`compile=True`) fuses its pointwise ops into the matmuls' neighbours and calls
each run at once, but this MLP's compute is mostly its matmuls (the same kernels either
way) and the step mostly gloo's all-reduce of 4 MiB with 4 processes sharing 2 cores, so
it shows as a few percent at most. For AdamW's for-loop implementation what is left is the
cost of entering DTensor's dispatch and the handler once per op, 64 times a step here; it
is per op, not per byte, so it matters less as the model grows (foreach makes 10 calls a
step, fused one)."""


if __name__ == "__main__":
    raise SystemExit(main())
