"""Plan quality: autopar's predicted step time against the best hand-written reference plan.

    python benchmarks/plan_quality.py [--quick] [--write]

Every reference (data parallel, FSDP, Megatron tensor parallel, 2-D data x tensor, FSDP x
tensor) is scored by the same cost model, its parameter and input placements pinned and the
rest completed by the solver at its best. "gain" is best reference / autopar: 1.00 means equal,
above 1 means autopar's plan is that much faster; below 1 would be a failure.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

sys.path.insert(0, "benchmarks")
from _common import machine, table, update_results  # noqa: E402

from autopar.capture.joint import capture  # noqa: E402
from autopar.ir.mesh import Mesh  # noqa: E402
from autopar.ir.options import Options
from autopar.models import get_preset  # noqa: E402
from autopar.models.reference_plans import REFERENCE_PLANS  # noqa: E402
from autopar.planning.planner import make_plan  # noqa: E402

MODELS = ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama3-1b", "llama3-8b",
          "llama3-70b", "mixtral-8x7b"]
MESHES = {"8": "tp=8", "2x4": "dp=2,tp=4", "8x8": "dp=8,tp=8", "16x8": "dp=16,tp=8"}
BATCHES = {"8": (8, 64), "2x4": (8, 64), "8x8": (8, 64), "16x8": (16, 128)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="two models, two meshes")
    ap.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--models", help="comma-separated subset of the models (A/B runs)")
    ap.add_argument("--meshes", help="comma-separated subset of the meshes: 8, 2x4, 8x8, 16x8")
    args = ap.parse_args()
    models = MODELS[:1] + MODELS[4:5] if args.quick else MODELS
    meshes = dict(list(MESHES.items())[:2]) if args.quick else MESHES
    if args.models:
        models = [m for m in args.models.split(",") if m]
    if args.meshes:
        meshes = {k: MESHES[k] for k in args.meshes.split(",")}
    rows, worse = [], 0
    t_start = time.perf_counter()
    for name in models:
        preset = get_preset(name)
        seq = 1024 if name.startswith("gpt2") else 2048
        model = preset.build("meta")
        for mesh_key, mesh_s in meshes.items():
            mesh = Mesh.parse(mesh_s, "h100")
            for batch in BATCHES[mesh_key]:
                graph = capture(model, preset.example_inputs(batch, seq), max_layers=4)
                refs = {}
                for rname, fn in REFERENCE_PLANS.items():
                    ref = fn(model, mesh.shape, mesh.axes, preset.family, batch_size=batch)
                    if ref is not None:
                        refs[rname] = ref
                # no memory limit (math.inf; None would be the device's): plan quality
                # compares layouts, including those that need more than one device holds
                planned = make_plan(model, mesh, graph=graph, references=refs, model_name=name,
                                    options=Options.of(memory_budget=math.inf,
                                                       time_limit_s=args.time_limit))
                plan = planned.plan
                best_name, best = min(plan.provenance.references.items(), key=lambda kv: kv[1].step_s)
                gain = best.step_s / plan.predicted.cost.step_s
                worse += gain < 1 - 1e-9
                rows.append([name, mesh_key, str(batch), f"{plan.predicted.cost.step_s * 1e3:.2f}",
                             best_name, f"{best.step_s * 1e3:.2f}", f"{gain:.3f}",
                             f"{plan.predicted.cost.mem_bytes / 2**30:.1f}", plan.provenance.solver.status])
                print(" | ".join(rows[-1]), flush=True)
    out = table(["model", "mesh", "batch", "autopar ms", "best reference", "reference ms",
                 "gain", "autopar GiB/dev", "solver"], rows)
    summary = (f"{len(rows)} cases; autopar worse than the best reference in {worse}; "
               f"{time.perf_counter() - t_start:.0f} s in all")
    print(out)
    print(summary)
    if args.write:
        update_results(
            "Plan quality (predicted step time vs the best reference plan)",
            f"Command: `python benchmarks/plan_quality.py --write` (H100 profile, depth proxy of 4 traced layers, sequence 1024 "
            f"for GPT-2 and 2048 otherwise, no memory budget)\n\nMachine: {machine()}\n\n"
            f"{out}\n\n{summary}",
        )


if __name__ == "__main__":
    main()
