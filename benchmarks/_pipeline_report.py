"""The tables and the RESULTS.md section of ``benchmarks/pipeline.py``, and the findings it
computes from a run (what limits the prediction, each with this run's figures)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

from _common import machine, table
from _pipeline_runs import Job
from _pipeline_stats import bootstrap_rho, rank_of, spearman, textbook_share


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def bubble_table(parts: list[tuple[Job, dict]], got: dict) -> str:
    rows = []
    for job, pred in parts:
        r = got[job.name]
        pp, v, m = job.mesh[0], job.virtual, job.microbatches
        step = med(r["steps"])
        busy_p = (1 - pred["bubble"]) * (pred["step_s"] - pred["sync_s"])
        busy_m = med([(1 - b) * sp for b, sp in zip(r["bubbles"], r["spans"])])
        rows.append([str(pp), job.name.split()[-1], str(v), str(m),
                     f"{(pp - 1) / (v * m):.3f}", f"{textbook_share(pp, m, v):.3f}",
                     f"{pred['bubble']:.3f}", f"{med(r['bubbles']):.3f}",
                     f"{min(r['bubbles']):.3f}-{max(r['bubbles']):.3f}",
                     ms(busy_p), ms(busy_m),
                     ms(pred["step_s"]), ms(step), f"{step / pred['step_s']:.2f}"])
    return table(["pp", "schedule", "v", "m", "textbook (p-1)/(v·m)", "textbook share",
                  "predicted bubble", "measured bubble (median)", "measured range",
                  "predicted busy ms/rank", "measured busy ms/rank",
                  "predicted step ms", "measured step ms", "measured/predicted"], rows)


def predicted_stage_times(planned: Any, ranges: Sequence[tuple[int, int]]) -> list[float]:
    """Forward + backward of each stage per microbatch, as the planner adds them up
    (:mod:`autopar.passes.pipeline.stage_profile`'s parts: the first stage also runs the embedding,
    the last the head)."""
    from autopar.passes.pipeline.stage_profile import stage_profile
    from autopar.planning.pipeline import proxy_blocks

    prof = stage_profile(planned.problem, planned.node_choice, proxy_blocks(planned), 1)
    n = ranges[-1][1]
    return [prof.block.time_s * (j - i) + (prof.pre.time_s if i == 0 else 0.0)
            + (prof.post.time_s if j == n else 0.0) for i, j in ranges]


def heavy_table(parts: list[tuple[Job, dict]], got: dict) -> tuple[str, str]:
    rows = []
    for job, pred in parts:
        r = got[job.name]
        stages = predicted_stage_times(pred["planned"], job.split)
        rows.append([job.name.split()[-1], ", ".join(f"{i}-{j}" for i, j in job.split),
                     " / ".join(ms(t) for t in stages), " / ".join(ms(t) for t in r["stage_s"]),
                     ms(pred["step_s"]), f"{pred['bubble']:.3f}",
                     ms(med(r["steps"])), f"{med(r['bubbles']):.3f}",
                     f"{med(r['steps']) / pred['step_s']:.2f}"])
    (pj, pp_), (ej, ep) = parts
    # a block's time from the two splits' first stages and from their last stages (their
    # block counts differ, the embedding or head is the same): equal estimates, if steady
    blocks = [(e[1] - e[0]) - (p[1] - p[0]) for p, e in zip(pj.split, ej.split)]
    est = {side: [(got[ej.name]["stage_s"][k] - got[pj.name]["stage_s"][k]) / blocks[k],
                  (predicted_stage_times(ep["planned"], ej.split)[k]
                   - predicted_stage_times(pp_["planned"], pj.split)[k]) / blocks[k]]
           for side, k in (("first", 0), ("last", -1)) if blocks[k]}
    paired = med([e / p for p, e in zip(got[pj.name]["steps"], got[ej.name]["steps"])])
    note = (f"Equal blocks against the planner's split: predicted "
            f"{ep['step_s'] / pp_['step_s']:.2f}x the step, measured "
            f"{med(got[ej.name]['steps']) / med(got[pj.name]['steps']):.2f}x (medians), "
            f"{paired:.2f}x (median of per-round ratios). One block's forward + backward per "
            f"microbatch, from the difference of the two splits' "
            + "; ".join(f"{side} stages: measured {ms(m)} ms, predicted {ms(p)} ms"
                        for side, (m, p) in est.items())
            + " (the two measured figures agree only where the run was steady).")
    return table(["split", "blocks (first-end per stage)", "predicted ms/microbatch per stage",
                  "measured ms/microbatch per stage", "predicted step ms",
                  "predicted bubble", "measured step ms", "measured bubble",
                  "measured/predicted"], rows), note


def fidelity_table(parts: list[tuple[Job, dict]], got: dict, target: float
                   ) -> tuple[str, str]:
    names = [j.name for j, _ in parts]
    pred = [p["step_s"] for _, p in parts]
    meas = [med(got[n]["steps"]) for n in names]
    pr, mr = rank_of(pred), rank_of(meas)
    rows = []
    for k in sorted(range(len(names)), key=lambda i: pred[i]):
        own = parts[k][1].get("own_step_s")
        note = f" (plan's own stage layout: {ms(own)})" if own is not None else ""
        rows.append([names[k], ms(pred[k]) + note, ms(meas[k]),
                     f"{min(got[names[k]]['steps']) * 1e3:.1f}", f"{meas[k] / pred[k]:.2f}",
                     f"{pr[k]:g}", f"{mr[k]:g}"])
    rho = spearman(pred, meas)
    lo, hi = bootstrap_rho(pred, [got[n]["steps"] for n in names])
    ok = "meets" if rho >= target else "falls short of"
    pipes = [k for k, (j, _) in enumerate(parts) if j.is_pipeline]
    spmd = [k for k in range(len(parts)) if k not in pipes]

    def alone(ks: list[int]) -> float:
        return spearman([pred[k] for k in ks], [meas[k] for k in ks])

    sub = "; ".join(f"over the {len(ks)} {what} alone {alone(ks):.3f}"
                    for what, ks in (("SPMD plans", spmd), ("pipelines", pipes)) if len(ks) > 1)
    syncs = "; ".join(
        f"{j.name}: predicted {ms(p['sync_s'])} ms, measured {ms(med(got[j.name]['syncs']))} ms"
        for j, p in parts if j.is_pipeline and j.mesh[1] > 1)
    summary = (f"Spearman rank correlation over {len(names)} plans: **{rho:.3f}** (bootstrap "
               f"95% interval over rounds {lo:.3f}-{hi:.3f}); it {ok} the target "
               f"{target}. Rank correlation {sub}.\n\nGradient sync of the pp x dp "
               f"pipelines (slowest rank; the plan's own stage layout predicts the same): "
               f"{syncs}.")
    return table(["plan", "predicted ms", "measured ms (median)", "measured min",
                  "measured/predicted", "predicted rank", "measured rank"], rows), summary


def calibration_lines(cal2: dict | None, cal4: dict | None) -> list[str]:
    from autopar.ir.devices import get_profile
    from autopar.passes.cost.cost_model import collective_time

    prof = get_profile("cpu")
    bw, lat, ovh = prof.intra_node_bandwidth, prof.intra_node_latency, prof.collective_overhead
    lines = [f"`cpu` profile: float32 matmul {prof.flops_per_s('float32') / 1e9:.0f} GFLOP/s "
             f"per device (peak {prof.peak_flops['float32'] / 1e9:.0f} x efficiency "
             f"{prof.matmul_efficiency}), memory {prof.bytes_per_s() / 1e9:.0f} GB/s, "
             f"collective {ovh * 1e3:.1f} ms + {lat * 1e6:.0f} us per ring step + "
             f"bytes / {bw / 1e9:.1f} GB/s, point-to-point {lat * 1e6:.0f} us + bytes / "
             f"{bw / 1e9:.1f} GB/s (figures from autopar/ir/devices.py, set from gloo "
             f"collectives measured with 4 ranks on this 2-core machine; not re-fitted here)."]
    for n, cal in ((2, cal2), (4, cal4)):
        if cal is None:
            continue

        def ar(nbytes: float, n: int = n) -> str:
            return f"{collective_time('all_reduce', nbytes, n, bw, lat, ovh) * 1e3:.2f}"

        lines.append(
            f"Measured with {n} processes, all at once (medians over ranks): float32 matmul "
            f"(2048x128 @ 128x512) {cal['matmul_flops'] / 1e9:.1f} GFLOP/s per process; "
            f"all-reduce of 4 B {cal['allreduce_tiny_barrier_s'] * 1e3:.2f} ms right after a "
            f"barrier, {cal['allreduce_tiny_compute_s'] * 1e3:.2f} ms right after 5 ms of "
            f"matmuls (profile {ar(4)}); of 1 MiB {cal['allreduce_1mib_barrier_s'] * 1e3:.2f} / "
            f"{cal['allreduce_1mib_compute_s'] * 1e3:.2f} ms (profile {ar(2**20)}); a 64 KiB "
            f"send {cal['send_64kib_s'] * 1e3:.2f} ms (profile {(lat + 2**16 / bw) * 1e3:.2f}).")
    return lines


def findings(bub: list[tuple[Job, dict]], fid: list[tuple[Job, dict]], got: dict,
             cals: Sequence[dict]) -> list[str]:
    """What limits the predictions, each with this run's figures."""
    from autopar.ir.devices import get_profile

    out = []
    busy = {(j.mesh[0], j.name.split()[-1]): med([(1 - b) * sp for b, sp in
                                                  zip(got[j.name]["bubbles"],
                                                      got[j.name]["spans"])])
            for j, _ in bub}
    pbusy = {(j.mesh[0], j.name.split()[-1]): (1 - p["bubble"]) * (p["step_s"] - p["sync_s"])
             for j, p in bub}
    per_pp = []
    for pp in sorted({k[0] for k in busy}):
        per_pp.append(f"pp={pp}: " + ", ".join(
            f"{s} {busy[(pp, s)] / busy[(pp, '1F1B')]:.2f}x measured, "
            f"{pbusy[(pp, s)] / pbusy[(pp, '1F1B')]:.2f}x predicted"
            for s in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")))
    prof = get_profile("cpu")
    out.append(
        f"**Split backward costs more than a whole one.** Busy time per rank against 1F1B's, "
        f"the same work: {'; '.join(per_pp)}. torch runs the input backward through autograd "
        f"keeping the graph, then the weight backward as a second pass; the replay charges "
        f"{prof.split_backward_node_s * 1e6:.1f} us per autograd node of the stage for it, "
        f"{prof.pipeline_action_s * 1e6:.0f} us per action and "
        f"{prof.p2p_post_s * 1e6:.0f} us per send or receive posted (a split backward is "
        "one action more per microbatch), all from `benchmarks/pipeline_calibration.py`.")
    rate = prof.flops_per_s("float32")
    ratio = {pp: med([busy[(q, s)] / pbusy[(q, s)] for q, s in busy if q == pp])
             for pp in sorted({k[0] for k in busy})}
    out.append(
        f"**Processes share cores.** The `cpu` profile's {rate / 1e9:.0f} GFLOP/s is one of 4 "
        f"processes on its {prof.shared_cores} cores, all computing; the replay runs a rank "
        f"faster while fewer compute (`core_speed`: up to {4 / prof.shared_cores:g}x with 4 "
        f"processes), so a bubble costs less than one device per rank would say. Measured "
        f"here {cals[0]['matmul_flops'] / 1e9:.1f} GFLOP/s per process with 2 processes and "
        f"{cals[1]['matmul_flops'] / 1e9:.1f} with 4 (all multiplying at once). Measured busy "
        f"time per rank over the predicted, median over the schedules: "
        + ", ".join(f"pp={pp} {r:.2f}x" for pp, r in ratio.items()) +
        ": the profile's rate is one figure for every op, and with 2 processes a rank has a "
        "core to itself (the profile's figure assumes 4 share 2).")
    syncs = [(j, p) for j, p in fid if j.is_pipeline and j.mesh[1] > 1]
    if syncs:
        j, p = syncs[0]
        out.append(
            f"**The pp x dp gradient sync** (a stage's buckets at their own fill, "
            f"`bucket_fill.score`): predicted {ms(p['sync_s'])} ms per step for {j.name}, "
            f"measured {ms(med(got[j.name]['syncs']))} ms, which includes waiting for the "
            "other replica to finish its schedule (the measured span of the sync starts when "
            "this rank's last action ends). Before the stage profile priced the sync at its own "
            "buckets' fill it was predicted at 56 ms (every gradient a whole collective).")
    by_name = {j.name: (j, p) for j, p in fid}
    fs = next((n for n in by_name if n.startswith("fsdp (dp=")), None)
    dp = next((n for n in by_name if n.startswith("data_parallel (dp=")), None)
    if fs and dp:
        plan = json.loads(by_name[fs][0].plan)
        # the plan file groups its fields (version 8): the collectives are predicted ones
        gathers = [c for c in plan["predicted"]["collectives"]
                   if c["reason"] == "parameter gather"]
        n = sum(c["count"] for c in gathers)
        t = sum(c["time_s"] for c in gathers)
        out.append(
            f"**FSDP's parameter gathers** (one all-gather per layer and phase, each group "
            f"priced at its real fill by `bucket_fill`): the plan lists {n:g} all-gathers priced "
            f"{ms(t)} ms in all; predicted fsdp / data_parallel "
            f"{by_name[fs][1]['step_s'] / by_name[dp][1]['step_s']:.2f}x, measured "
            f"{med(got[fs]['steps']) / med(got[dp]['steps']):.2f}x (before gathers were priced "
            "at their groups' fill, as shares of a full 25 MiB batch: 1.01x predicted).")
    return out


def results_body(c: dict[str, Any], btab: str, htab: str, hnote: str, ftab: str,
                 fsum: str, cal: list[str], found: list[str]) -> str:
    """The "Pipelines" section of RESULTS.md; ``c`` names the run's setting (command, date,
    rounds, model, ...)."""
    return f"""`{c['cmd']}`

Machine: {machine()}; run {c['date']}, {c['total_s']:.0f} s in all, load average
{c['load_before']:.1f} before the run and {c['load']:.1f} at its end (this run's processes
included; other programs share the 2 cores: every figure is a median over {c['rounds']}
rounds after {c['warmup']} warm-up rounds, and in each round every run of a launch steps
once, so drift hits them alike). gloo processes on 127.0.0.1, 1 intra-op thread
each, `cpu` device profile. Model: GPT-2 (`{c['preset']}` with {c['model']}), global batch
{c['batch']} x {c['seq']} tokens. A step is forward + backward + gradient sync + reading the
loss, slowest rank, from a barrier; fused AdamW runs after it untimed (the cost model has no
optimizer term).

### Bubble per schedule (m={c['m']})

Split, schedule, m and v from `plan_pipeline(..., options=Options.of(schedule=X,
microbatches={c['m']}, virtual=v))` on `Mesh((pp, 1), ("pp", "dp"), "cpu")`; run by `build_pipeline` with that split
(autopar's own GPT-2 stages), pp=2 on 2 processes, pp=4 on 4. **Bubble**, both sides: idle
time over (ranks x span), the span from the first stage action's start to the last one's end
on any rank, the gradient sync after the schedule left out; predicted by the schedule replay
(`passes/pipeline/schedule.simulate`), measured from the runtime's per-action timings
(`runtime/pipeline/events`) on the clock the processes share (a test checks the two
definitions agree on the model's own timelines). The textbook (p-1)/(v·m) is idle over ideal
time; "textbook share" is it as a share of the step, x/(1+x). Busy: compute time per rank.

{btab}

### Heavy head

GPT-2 with vocabulary {c['vocab']} (embedding tied to the head: a copy on each end stage,
their gradients summed), {c['heavy_schedule']}, pp={c['heavy_pp']}, m={c['m']}: the planner's
split against equal block counts, predicted by `plan_pipeline` / `predict_split`, measured by
`build_pipeline` with each split; per stage, forward + backward per microbatch.

{htab}

{hnote}

### Plan fidelity (4 processes)

Predicted: `plan.predicted.cost.step_s`. SPMD plans (reference layouts as the planner completes them,
and the solver's own plan where it is not a kept reference) run by `parallelize(...,
plan=...)`; pipelines by `build_pipeline` with the plan's split and schedule. Its stages are
plain modules replicated over dp, so a pp x dp pipeline is predicted with the planner's
data-parallel stage layout (`predict_split` on the plan's split and schedule); the plan's own
stage layout's prediction in brackets.

{ftab}

{fsum}

### What limits the figures

{chr(10).join('- ' + f for f in found)}

### Calibration of the `cpu` profile

{chr(10).join('- ' + x for x in cal)}

The profile's rates are not refitted to this run. Its pipeline runtime figures (per action,
per send or receive posted, per autograd node of a split backward) come from
`benchmarks/pipeline_calibration.py` (section "Pipeline runtime calibration"), run on its own
tiny stages, never from the plans ranked here.
"""
