"""Planning time end to end (trace + strategies + solve) on this machine.

    python benchmarks/planning_time.py [--write]

Targets (issue 2): Llama-3 8B on an 8x8 mesh under 10 s (meta-pytorch/autoparallel reports
about 47 s end to end for this case); Llama-3 70B on 16x8 and 405B on 8x16x8 each under 30 s.
"""

from __future__ import annotations

import argparse
import sys
import time

sys.path.insert(0, "benchmarks")
from _common import machine, table, update_results  # noqa: E402

from autopar.mesh import Mesh  # noqa: E402
from autopar.models import get_preset  # noqa: E402
from autopar.planner import make_plan  # noqa: E402

CASES = [
    ("llama3-8b", "dp=8,tp=8", 8, 2048, 10.0),
    ("llama3-70b", "dp=16,tp=8", 16, 2048, 30.0),
    ("llama3-405b", "pp=8,dp=16,tp=8", 16, 2048, 30.0),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    ap.add_argument("--full-trace", action="store_true",
                    help="also plan each case tracing every layer (no depth proxy)")
    args = ap.parse_args()
    rows = []
    for (name, mesh_s, batch, seq, target), traced in (
        [(c, 4) for c in CASES] + ([(c, None) for c in CASES] if args.full_trace else [])
    ):
        preset = get_preset(name)
        t0 = time.perf_counter()
        model = preset.build("meta")
        planned = make_plan(model, Mesh.parse(mesh_s, "h100"), preset.example_inputs(batch, seq),
                            time_limit_s=target / 2, model_name=name, max_layers=traced)
        total = time.perf_counter() - t0
        t = planned.plan.timings
        s = planned.plan.solver
        layers = f"{traced} of {planned.graph.proxy.total}" if planned.graph.proxy else "all"
        rows.append([name, mesh_s.replace(",", " x "), f"{batch}x{seq}", layers, str(s.nodes),
                     str(s.variables), f"{t['trace_s']:.1f}", f"{t['build_s']:.1f}",
                     f"{t['solve_s']:.1f}", f"{total:.1f}", f"{target:.0f}",
                     "yes" if total < target else "NO", s.status])
        print(rows[-1], flush=True)
    out = table(["model", "mesh", "batch x seq", "layers traced", "graph nodes", "variables", "trace s", "build s",
                 "solve s", "total s", "target s", "met", "solver status"], rows)
    print(out)
    if args.write:
        update_results(
            "Planning time",
            "Command: `python benchmarks/planning_time.py --full-trace --write`. End to end: "
            "building the model on meta, tracing the joint graph, strategies and cost model, "
            "solving. `layers traced` = 4 uses the depth proxy (`autopar plan`'s default); "
            f"`all` traces every layer.\n\nMachine: {machine()}\n\n{out}")


if __name__ == "__main__":
    main()
