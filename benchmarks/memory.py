"""Memory fidelity: the planner's predicted peak memory per device against real runs on gloo.

For each combination (model preset, plan, precision, recompute, mesh) this runs real AdamW
training steps with ``autopar.parallelize`` on local gloo processes (``cpu`` device profile)
and measures, on every rank, the peak of the bytes held by live tensors during one training
step (forward, backward, optimizer step), after a warm-up step:

* **What is measured** (:class:`autopar.runtime.observe.live_memory.LiveBytes`): every storage a
  tensor of this rank holds, counted once however many tensors view it, from the op that made
  it until it is freed: parameters (their local pieces), gradients, the optimizer's state
  (exp_avg, exp_avg_sq, step), activations, gathered parameters, resharded copies, gradient
  buckets, the loss. Kernels' private scratch memory and gloo's own buffers are not tensors
  and are not seen. torch's ``MemTracker`` counts the same way (it also works with these
  DTensor parameters); this tracker keeps a timeline, to find what makes a peak.
* **Why it is comparable with the prediction** (``plan.predicted.cost.mem_bytes``, from
  ``passes/memory/peak.py``): the model counts the same things per device: parameters and Adam
  state throughout, gradients from the backward op that makes them, activations from their op
  to their last reader, views as their base. The warm-up step makes the optimizer state
  exist (AdamW creates it lazily at its first step), as it does in every step after the
  first. The training loop is the usual one: ``zero_grad()`` (gradients set to None) after
  each step, and the previous step's loss dropped before the next forward.
* **The input batch**: every rank is handed the whole global batch, which the training loop
  (the data loader) holds whatever the plan; it is excluded from the count. What the step
  makes of it (this rank's slice, a copy) is counted, as the model counts the graph's inputs
  in their planned layout. Where the plan keeps an input whole on every rank the step reads
  the loop's tensor itself, so the measurement lacks those bytes the model counts (a few KiB
  of token ids here).

Printed per combination: the plan's prediction, the measured peak (max over ranks), their
ratio, whether it is within 10%, and the op at which the measured peak was reached. The
optimizer is AdamW with ``fused=True`` (one kernel, no per-parameter temporaries).

The combination list (``COMBOS``) is data: precision ("fp32" or "bf16", as
``parallelize(..., precision=...)`` accepts them) and recompute ("none", "selective" or
"full") are passed explicitly to the capture, the planner and ``parallelize`` for every
combination (the ``cpu`` profile's precision default is fp32, ``parallelize``'s recompute
default "auto"; a combination names its own). The name shows those that are not fp32/none.

    python benchmarks/memory.py                 # prints the table
    python benchmarks/memory.py --write         # and updates benchmarks/RESULTS.md
    python benchmarks/memory.py --only gpt2     # the combinations whose name contains it
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, table, update_results  # noqa: E402

from autopar.ir.mesh import Mesh  # noqa: E402
from autopar.ir.options import Options
from autopar.runtime.launch import launch  # noqa: E402

TOLERANCE = 0.10
DEFAULTS = {"precision": "fp32", "recompute": "none"}
AXES = {1: ("dp",), 2: ("dp", "tp")}


@dataclass(frozen=True)
class Combo:
    model: str  # an autopar.models preset
    plan: str  # "solver" or a reference layout (autopar.models.reference_plans)
    precision: str = "fp32"
    recompute: str = "none"
    mesh: tuple[int, ...] = (2,)
    batch: int = 8
    seq: int = 64

    @property
    def name(self) -> str:
        mesh = "x".join(map(str, self.mesh))
        extra = "".join(f", {getattr(self, k)}" for k in DEFAULTS
                        if getattr(self, k) != DEFAULTS[k])
        return f"{self.model} {self.plan} on {mesh} (b{self.batch} s{self.seq}{extra})"

    def extra(self) -> dict[str, str]:
        """The keywords to pass, always both: parallelize's recompute default is "auto"."""
        return {k: getattr(self, k) for k in DEFAULTS}

    def amesh(self) -> Mesh:
        return Mesh(self.mesh, AXES[len(self.mesh)], "cpu")

    def capture(self, model, inputs):
        """The step traced as this combination runs it: under its precision policy, with its
        recomputation applied (what the plan was made on)."""
        from autopar.capture.joint import capture
        from autopar.ir.precision import resolve
        from autopar.planning.planner import mode_graph

        graph = capture(model, inputs, precision=resolve(self.precision, self.amesh().device))
        return mode_graph(graph, self.recompute)


COMBOS = [
    Combo("gpt2-tiny", "data_parallel"),
    Combo("gpt2-tiny", "fsdp"),
    Combo("gpt2-tiny", "megatron_tp"),
    Combo("gpt2-tiny", "dp_tp_2d", mesh=(2, 2)),
    Combo("gpt2-tiny", "solver", mesh=(2, 2)),
    Combo("llama3-tiny", "data_parallel"),
    Combo("llama3-tiny", "fsdp", mesh=(2, 2)),
    Combo("llama3-tiny", "megatron_tp"),
    Combo("moe-tiny", "data_parallel", mesh=(2, 2)),
    Combo("mlp-tiny", "data_parallel", batch=256),
    Combo("mlp-tiny", "fsdp", batch=256),
    # mixed precision (fp32 master weights and Adam state, bf16 casts and activations) and
    # recomputation (the backward's copies of forward nodes), on several models and layouts
    Combo("gpt2-tiny", "data_parallel", precision="bf16"),
    Combo("gpt2-tiny", "megatron_tp", precision="bf16"),
    Combo("gpt2-tiny", "fsdp", recompute="full"),
    Combo("gpt2-tiny", "megatron_tp", recompute="selective"),
    Combo("gpt2-tiny", "dp_tp_2d", precision="bf16", recompute="full", mesh=(2, 2)),
    Combo("gpt2-tiny", "solver", precision="bf16", recompute="selective", mesh=(2, 2)),
    Combo("llama3-tiny", "data_parallel", recompute="selective"),
    Combo("llama3-tiny", "megatron_tp", precision="bf16", recompute="selective"),
    Combo("llama3-tiny", "fsdp", precision="bf16", recompute="full", mesh=(2, 2)),
    Combo("moe-tiny", "data_parallel", precision="bf16", recompute="full", mesh=(2, 2)),
    # ZeRO stages (passes/memory/zero.py): FSDP's layout with the weights gathered again in the
    # backward (ZeRO-3; "full+zero3" is FSDP with per-block checkpointing, as the planner
    # and the fixed policies run it), and with whole-gradient all-reduces (ZeRO-1)
    Combo("llama3-tiny", "fsdp", precision="bf16", recompute="none+zero3"),
    Combo("gpt2-tiny", "fsdp", recompute="full+zero3"),
    Combo("gpt2-tiny", "fsdp", recompute="full+zero3", mesh=(2, 2)),
    Combo("llama3-tiny", "fsdp", recompute="none+zero1"),
]


def build(c: Combo):
    from autopar.models import get_preset

    preset = get_preset(c.model)
    torch.manual_seed(0)
    model = preset.build("cpu")
    torch.manual_seed(1)
    return preset, model, preset.example_inputs(c.batch, c.seq, "cpu")


def make_plan(c: Combo, memory_budget: float | None = None) -> str | None:
    """The combination's plan as JSON, made here (planning needs no processes); None for
    "solver", which parallelize makes on rank 0 and shares."""
    if c.plan == "solver":
        return None
    from autopar.api import complete_plan
    from autopar.capture.joint import capture
    from autopar.ir.precision import resolve
    from autopar.models.reference_plans import REFERENCE_PLANS

    preset, model, inputs = build(c)
    mesh = c.amesh()
    ref = REFERENCE_PLANS[c.plan](model, mesh.shape, mesh.axes, preset.family,
                                  batch_size=c.batch)
    if ref is None:
        raise SystemExit(f"{c.plan} does not apply to {c.model} on {c.mesh}")
    # complete_plan applies the recomputation itself, on the step traced in this precision
    graph = capture(model, inputs, precision=resolve(c.precision, mesh.device))
    plan = complete_plan(graph, mesh, ref.params, ref.inputs,
                         Options.of(memory_budget=memory_budget, time_limit_s=10.0),
                         mode=c.recompute)
    return json.dumps(plan.to_json())


def measure(jobs: list[tuple[Combo, str | None]]) -> list[dict]:
    """One rank, every combination of one mesh size in turn (one launch for all: spawning
    processes costs more than a tiny model's steps): a warm-up step, then one measured step."""
    import gc

    import autopar
    from autopar.ir.plan import Plan
    from autopar.runtime.observe.live_memory import LiveBytes

    out = []
    for c, plan_json in jobs:
        _, model, inputs = build(c)
        plan = Plan.from_json(json.loads(plan_json)) if plan_json else None
        pm = autopar.parallelize(model, c.amesh(), inputs, plan=plan, time_limit_s=10.0,
                                 **c.extra())
        opt = torch.optim.AdamW(pm.parameters(), fused=True)

        _step(pm, opt, inputs)  # AdamW makes its state at its first step, as every later has
        tracker = LiveBytes(exclude=inputs)
        tracker.track(list(pm.parameters()), list(pm.buffers()), opt.state)
        start = tracker.current
        with tracker:
            _step(pm, opt, inputs)
        out.append({"predicted": pm.plan.predicted.cost.mem_bytes, "peak": tracker.peak,
                    "at": tracker.peak_op, "start": start,
                    "plan": json.dumps(pm.plan.to_json())})
        del pm, opt, model, tracker
        gc.collect()
    return out


def _step(pm, opt, inputs) -> None:
    loss = pm(*inputs)
    loss.backward()
    opt.step()
    opt.zero_grad()  # gradients set to None, as a training loop does


def per_node(c: Combo, plan_json: str) -> float:
    """The peak a per-node usage gives (each node's output from its op to its last reader,
    views as their base: what scoring reported before it counted the whole step's buffers
    with ``passes.problem.step_memory.step_usage``), on the graph the plan was made on."""
    from autopar.capture.joint import capture
    from autopar.ir.plan import Plan
    from autopar.passes.memory.peak import peak_memory
    from autopar.passes.memory.recompute import apply_recompute
    from autopar.passes.problem import sharding_problem
    from autopar.passes.problem.step_memory import plan_choice

    _, model, inputs = build(c)
    plan = Plan.from_json(json.loads(plan_json))
    graph = apply_recompute(capture(model, inputs, precision=plan.decided.precision),
                            plan.decided.recompute.nodes)
    sp = sharding_problem.build(graph, c.amesh())
    choice = plan_choice(sp, plan.decided.nodes)
    return peak_memory([float(sp.usage[i][s]) for i, s in enumerate(choice)], sp.live)[0]


def run_all(combos: list[Combo]) -> list[dict]:
    """Every combination measured, one launch per process count."""
    by_size: dict[int, list[Combo]] = {}
    for c in combos:
        by_size.setdefault(math.prod(c.mesh), []).append(c)
    got: dict[Combo, dict] = {}
    for nproc, group in by_size.items():
        jobs = [(c, make_plan(c)) for c in group]
        ranks = launch(measure, nproc, (jobs,), timeout_s=1200)
        for k, c in enumerate(group):
            per_rank = [r[k] for r in ranks]
            worst = max(per_rank, key=lambda r: r["peak"])
            pred = per_rank[0]["predicted"]
            got[c] = {"combo": c, "predicted": pred, "measured": worst["peak"],
                      "at": worst["at"], "ratio": worst["peak"] / pred,
                      "state": worst["start"],
                      "per_node": per_node(c, per_rank[0]["plan"])}
            r = got[c]
            print(f"{c.name}: predicted {fmt_kib(r['predicted'])} KiB, measured "
                  f"{fmt_kib(r['measured'])} KiB ({r['ratio']:.3f}), peak at {r['at']}; "
                  f"per-node model {fmt_kib(r['per_node'])} KiB", flush=True)
    return [got[c] for c in combos]


# --- the budget sweep: autopar against the fixed memory policies, planned on meta tensors ---

GiB = 2**30
SWEEP_MODEL = "llama3-8b"
SWEEP_BATCH, SWEEP_SEQ = 8, 8192  # one sequence per data-parallel rank: activations bind
SWEEP_MESHES = ("dp=8",)  # FSDP's 8 GPUs (--sweep-mesh adds others: dp=2,tp=4 has fsdp_tp_2d)
SWEEP_BUDGETS_GIB = tuple(range(20, 95, 5))
SWEEP_TIME_LIMIT_S = 5.0


def sweep_references(model, mesh: Mesh, family: str) -> dict:
    """The reference layouts and fixed memory policies ``autopar plan --compare`` scores."""
    from autopar.models.reference_plans import comparison_plans

    return comparison_plans(model, mesh.shape, mesh.axes, family, batch_size=SWEEP_BATCH)


def budget_sweep(mesh_text: str) -> dict:
    """``make_plan`` at every budget of :data:`SWEEP_BUDGETS_GIB` (depth proxy of 4 layers,
    the step traced once in the device's default precision, bf16 on the h100)."""
    from autopar.capture.joint import capture
    from autopar.ir.errors import PlanError
    from autopar.ir.precision import resolve
    from autopar.models import get_preset
    from autopar.planning.planner import make_plan

    preset = get_preset(SWEEP_MODEL)
    preset = preset.replace(max_seq_len=max(SWEEP_SEQ, preset.config.max_seq_len))
    model = preset.build("meta")
    mesh = Mesh.parse(mesh_text, "h100")
    inputs = preset.example_inputs(SWEEP_BATCH, SWEEP_SEQ)
    refs = sweep_references(model, mesh, preset.family)
    graph = capture(model, inputs, max_layers=4, precision=resolve(None, mesh.device))
    rows = []
    t0 = time.time()
    for gib in SWEEP_BUDGETS_GIB:
        try:
            plan = make_plan(model, mesh, inputs, graph=graph, references=refs,
                             options=Options.of(memory_budget=gib * GiB, max_layers=4,
                                                time_limit_s=SWEEP_TIME_LIMIT_S)).plan
        except PlanError as err:
            rows.append({"gib": gib, "plan": None, "error": str(err)})
            continue
        fit = {n: c for n, c in plan.provenance.references.items() if c.mem_bytes <= gib * GiB}
        slower = {n: c.step_s for n, c in fit.items() if plan.predicted.cost.step_s > c.step_s * (1 + 1e-9)}
        rows.append({"gib": gib, "plan": plan, "fit": fit, "slower": slower})
    return {"mesh": mesh_text, "refs": list(refs), "rows": rows, "s": time.time() - t0,
            "precision": str(resolve(None, mesh.device))}


def sweep_table(sw: dict) -> tuple[str, list[str]]:
    """The sweep as a table (step time in ms, mode and peak per budget; each reference's
    step time where it fits) and one line per reference: the budget below which it stops
    fitting."""
    names = sw["refs"]
    headers = ["budget GiB", "autopar ms", "mode", "peak GiB", *names, "autopar <= every fit"]
    rows, notes = [], []
    for r in sw["rows"]:
        if r["plan"] is None:
            rows.append([str(r["gib"]), "no plan fits", "", "", *["-"] * len(names), ""])
            continue
        p = r["plan"]
        cells = [f"{r['fit'][n].step_s * 1e3:.1f}" if n in r["fit"] else "-" for n in names]
        ok = "yes" if not r["slower"] else "NO: slower than " + ", ".join(sorted(r["slower"]))
        rows.append([str(r["gib"]), f"{p.predicted.cost.step_s * 1e3:.1f}",
                     p.decided.recompute.mode, f"{p.predicted.cost.mem_bytes / GiB:.1f}",
                     *cells, ok])
    for n in ["autopar", *names]:
        fits = [r["gib"] for r in sw["rows"] if r["plan"] is not None
                and (n == "autopar" or n in r["fit"])]
        if not fits:
            notes.append(f"{n}: fits at no swept budget")
            continue
        low = min(fits)
        below = [g for g in SWEEP_BUDGETS_GIB if g < low]
        at = next(r for r in sw["rows"] if r["gib"] == low)
        peak = (at["plan"].predicted.cost if n == "autopar" else at["fit"][n]).mem_bytes / GiB
        notes.append(f"{n}: fits from {low} GiB (peak {peak:.1f} GiB there)"
                     + (f", not at {max(below)} GiB" if below else
                        ", at every swept budget"))
    return table(headers, rows), notes


def fmt_kib(b: float) -> str:
    return f"{b / 1024:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    ap.add_argument("--only", default="", help="combinations whose name contains this")
    ap.add_argument("--no-sweep", action="store_true", help="skip the budget sweep")
    ap.add_argument("--sweep-only", action="store_true", help="only the budget sweep")
    ap.add_argument("--sweep-mesh", action="append", default=[],
                    help="another mesh to sweep, e.g. dp=2,tp=4 (about 4 min on 2 cores)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    meshes = [*SWEEP_MESHES, *args.sweep_mesh]
    sweeps = [] if args.no_sweep else [budget_sweep(m) for m in meshes]
    sweep_out = []
    for sw in sweeps:
        tab, notes = sweep_table(sw)
        sweep_out.append(
            f"{SWEEP_MODEL}, batch {SWEEP_BATCH}, seq {SWEEP_SEQ}, mesh {sw['mesh']} on the "
            f"h100 profile, {sw['precision']}; `make_plan(..., options=Options.of("
            f"memory_budget=B, max_layers=4, time_limit_s={SWEEP_TIME_LIMIT_S:g}), "
            f"references=...)` per budget "
            f"({sw['s']:.0f} s for {len(sw['rows'])} budgets). Step times in ms; a reference "
            f"is shown where it fits (`mem_bytes` <= budget), `-` where it does not.\n\n"
            + tab + "\n\n" + "\n".join(f"- {n}" for n in notes))
        print(sweep_out[-1] + "\n", flush=True)
    if args.sweep_only:
        if args.write:
            update_results("Memory budget sweep", _sweep_body(sweep_out))
        return
    combos = [c for c in COMBOS if args.only in c.name]
    t0 = time.time()
    results = run_all(combos)
    headers = ["combination", "predicted KiB", "measured KiB (max over ranks)",
               "measured/predicted", "within 10%", "measured peak at op",
               "params+Adam state KiB", "per-node model KiB (measured/it)"]
    rows = [[r["combo"].name, fmt_kib(r["predicted"]), fmt_kib(r["measured"]),
             f"{r['ratio']:.3f}", "yes" if abs(r["ratio"] - 1) <= TOLERANCE else "NO", r["at"],
             fmt_kib(r["state"]),
             f"{fmt_kib(r['per_node'])} ({r['measured'] / r['per_node']:.3f})"] for r in results]
    out = table(headers, rows)
    print()
    print(out)
    inside = sum(abs(r["ratio"] - 1) <= TOLERANCE for r in results)
    print(f"\n{inside} of {len(results)} within 10%; {time.time() - t0:.0f} s")
    if args.write:
        body = (f"`python benchmarks/memory.py --write`\n\n"
                f"Machine: {machine()}; gloo processes on 127.0.0.1, `cpu` device profile, "
                f"1 intra-op thread each.\n{_EXPLAIN}\n\n{out}\n\n"
                f"{inside} of {len(results)} combinations within 10%.\n")
        update_results("Memory fidelity", body)
        if sweep_out:
            update_results("Memory budget sweep", _sweep_body(sweep_out))


def _sweep_body(parts: list[str]) -> str:
    return ("`python benchmarks/memory.py --write` (or `--sweep-only`); planned on meta "
            f"tensors on this machine ({machine()}), no run.\n\n" + "\n\n".join(parts))


_EXPLAIN = """Predicted: `plan.predicted.cost.mem_bytes`, the planner's peak bytes per device over the
step (`passes/problem/scoring.py` with `passes/problem/step_memory.step_usage`: every node's output from its op to
its last reader, and the buffers two layouts make: reshard copies, a layer's gathered
parameters until its last reader or the views that keep them, gradient-bucket copies).
Measured: the peak of bytes held by live tensors on each rank during one training step
(forward, backward, fused AdamW step, `zero_grad`) after a warm-up step, every storage counted
once (`runtime/observe/live_memory.py`: a dispatch mode that watches each op's output storages until
they are freed; parameters, gradients and Adam state counted from the start); the global batch
every rank is handed is the training loop's and is not counted, the slices the step makes of it
are. Each combination passes its precision and recompute mode explicitly (bf16: fp32 master
weights and Adam state, bf16 casts and activations). "params+Adam state": the parameters'
local pieces and AdamW state at the start of the step, which both sides count. Last column:
the peak of the per-node usage alone (what the plan reported before it counted the step's
buffers), for comparison."""


if __name__ == "__main__":
    main()
