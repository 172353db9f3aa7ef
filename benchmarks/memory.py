"""Memory fidelity: the planner's predicted peak memory per device against real runs on gloo.

For each combination (model preset, plan, precision, recompute, mesh) this runs real AdamW
training steps with ``autopar.parallelize`` on local gloo processes (``cpu`` device profile)
and measures, on every rank, the peak of the bytes held by live tensors during one training
step (forward, backward, optimizer step), after a warm-up step:

* **What is measured** (:class:`autopar.runtime.live_memory.LiveBytes`): every storage a
  tensor of this rank holds, counted once however many tensors view it, from the op that made
  it until it is freed: parameters (their local pieces), gradients, the optimizer's state
  (exp_avg, exp_avg_sq, step), activations, gathered parameters, resharded copies, gradient
  buckets, the loss. Kernels' private scratch memory and gloo's own buffers are not tensors
  and are not seen. torch's ``MemTracker`` counts the same way (it also works with these
  DTensor parameters); this tracker keeps a timeline, to find what makes a peak.
* **Why it is comparable with the prediction** (``plan.cost.mem_bytes``, from
  ``passes/memory.py``): the model counts the same things per device: parameters and Adam
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

The combination list (``COMBOS``) is data: precision ("fp32", or "bf16"/"fp16" as
``parallelize(..., precision=...)`` accepts them) and recompute ("none", or
"full"/"selective"/"auto") are passed to ``parallelize`` and to the planner only where they
are not the defaults, so entries can be appended as those options land.

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

from autopar.mesh import Mesh  # noqa: E402
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
        """The keywords to pass: only those that are not the defaults."""
        return {k: getattr(self, k) for k in DEFAULTS if getattr(self, k) != DEFAULTS[k]}


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
]
# (a budget sweep, planning each combination under a range of memory budgets and measuring
# the plan it picks, goes here: it reuses make_plan(..., memory_budget=...) and measure())


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
    from autopar.capture import capture
    from autopar.models.reference_plans import REFERENCE_PLANS

    preset, model, inputs = build(c)
    mesh = Mesh(c.mesh, AXES[len(c.mesh)], "cpu")
    ref = REFERENCE_PLANS[c.plan](model, mesh.shape, mesh.axes, preset.family,
                                  batch_size=c.batch)
    if ref is None:
        raise SystemExit(f"{c.plan} does not apply to {c.model} on {c.mesh}")
    plan = complete_plan(capture(model, inputs), mesh, ref.params, ref.inputs,
                         memory_budget=memory_budget, time_limit_s=10.0, **c.extra())
    return json.dumps(plan.to_json())


def measure(c: Combo, plan_json: str | None) -> dict:
    """One rank: a warm-up step, then one measured step. Runs in a launched process."""
    import autopar
    from autopar.plan import Plan
    from autopar.runtime.live_memory import LiveBytes

    _, model, inputs = build(c)
    plan = Plan.from_json(json.loads(plan_json)) if plan_json else None
    pm = autopar.parallelize(model, Mesh(c.mesh, AXES[len(c.mesh)], "cpu"), inputs, plan=plan,
                             time_limit_s=10.0, **c.extra())
    opt = torch.optim.AdamW(pm.parameters(), fused=True)

    def step() -> None:
        loss = pm(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # AdamW makes its state at its first step; every later step starts with it
    tracker = LiveBytes(exclude=inputs)
    tracker.track(list(pm.parameters()), list(pm.buffers()), opt.state)
    start = tracker.current
    with tracker:
        step()
    return {"predicted": pm.plan.cost.mem_bytes, "peak": tracker.peak, "at": tracker.peak_op,
            "start": start, "plan": json.dumps(pm.plan.to_json())}


def with_buffers(c: Combo, plan_json: str) -> float:
    """The memory model's peak with the buffers a per-node usage cannot see (reshard copies,
    gathered weights kept by views, gradient buckets: ``passes.memory.step_usage``)."""
    from autopar.capture import capture
    from autopar.passes import sharding_problem
    from autopar.passes.memory import peak_memory, plan_choice, step_usage
    from autopar.plan import Plan

    _, model, inputs = build(c)
    plan = Plan.from_json(json.loads(plan_json))
    sp = sharding_problem.build(capture(model, inputs), Mesh(c.mesh, AXES[len(c.mesh)], "cpu"))
    return peak_memory(*step_usage(sp, plan_choice(sp, plan.nodes)))[0]


def run(c: Combo) -> dict:
    plan_json = make_plan(c)
    nproc = math.prod(c.mesh)
    ranks = launch(measure, nproc, (c, plan_json), timeout_s=600)
    worst = max(ranks, key=lambda r: r["peak"])
    pred = ranks[0]["predicted"]
    buffers = with_buffers(c, ranks[0]["plan"])
    return {"combo": c, "predicted": pred, "measured": worst["peak"], "at": worst["at"],
            "ratio": worst["peak"] / pred, "state": worst["start"], "buffers": buffers}


def fmt_kib(b: float) -> str:
    return f"{b / 1024:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    ap.add_argument("--only", default="", help="combinations whose name contains this")
    args = ap.parse_args()
    torch.set_num_threads(1)
    combos = [c for c in COMBOS if args.only in c.name]
    results = []
    t0 = time.time()
    for c in combos:
        r = run(c)
        results.append(r)
        print(f"{c.name}: predicted {fmt_kib(r['predicted'])} KiB, measured "
              f"{fmt_kib(r['measured'])} KiB ({r['ratio']:.3f}), peak at {r['at']}; with "
              f"buffers {fmt_kib(r['buffers'])} KiB", flush=True)
    headers = ["combination", "predicted KiB", "measured KiB (max over ranks)",
               "measured/predicted", "within 10%", "measured peak at op",
               "params+Adam state KiB", "model with buffers KiB (measured/it)"]
    rows = [[r["combo"].name, fmt_kib(r["predicted"]), fmt_kib(r["measured"]),
             f"{r['ratio']:.3f}", "yes" if abs(r["ratio"] - 1) <= TOLERANCE else "NO", r["at"],
             fmt_kib(r["state"]),
             f"{fmt_kib(r['buffers'])} ({r['measured'] / r['buffers']:.3f})"] for r in results]
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


_EXPLAIN = """Predicted: `plan.cost.mem_bytes`, the planner's peak bytes per device over the
step (`passes/memory.py`). Measured: the peak of bytes held by live tensors on each rank during
one training step (forward, backward, fused AdamW step, `zero_grad`) after a warm-up step, every
storage counted once (`runtime/live_memory.py`: a dispatch mode that watches each op's output
storages until they are freed; parameters, gradients and Adam state counted from the start);
the global batch every rank is handed is the training loop's and is not counted, the slices the
step makes of it are. Last column: the parameters' local pieces and AdamW state at the start of
the step, which both sides count."""


if __name__ == "__main__":
    main()
