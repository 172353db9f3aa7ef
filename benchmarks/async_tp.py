"""Async TP's hidden share, fitted to published runs, with its leave-one-out error.

    python benchmarks/async_tp.py [--runs ../shared/bench/published/runs.json]

torch's async tensor parallelism (micro-pipelined all-gather-matmul and matmul-reduce-scatter)
hides part of sequence-parallel TP's collectives behind the matmuls they feed. No public
measurement says how much per collective, so the share the profiles use
(:data:`autopar.ir.devices.ASYNC_TP_HIDDEN`) is fitted here to the runs of a file that come
in pairs: the same model, GPUs and layout, one with async TP (``published.async_tp``) and one
without. Per pair, the published layout is pinned and priced once (as
``benchmarks/published.py`` prices it) and the share found at which its predicted gain
(vanilla step over async step) equals the measured one (bisection: the step falls as the
share grows). Fitting the gain, not the throughput, keeps the profile's other errors out of
it. Leave-one-out: each async run predicted with the mean share of the other pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, "benchmarks")
from _common import table  # noqa: E402
from published import Pinned, async_tp, build_model, load_runs, read_layout  # noqa: E402

from autopar.ir.devices import ASYNC_TP_HIDDEN  # noqa: E402
from autopar.ir.mesh import Mesh  # noqa: E402
from autopar.passes.problem.scoring import score_assignment  # noqa: E402


def pairs(runs: list[dict]) -> list[tuple[dict, dict]]:
    """(vanilla, async) runs alike in model, GPUs and layout."""

    def key(run: dict) -> str:
        return json.dumps([run["model"], run["gpu"], run["layout"]], sort_keys=True)

    vanilla = {key(r): r for r in runs if not async_tp(r)}
    return [(vanilla[key(r)], r) for r in runs if async_tp(r) and key(r) in vanilla]


def step_at(sp, choice, share: float) -> float:
    """The pinned layout's step with ``share`` of its in-node TP collectives hidden."""
    mesh = sp.mesh
    sp.mesh = Mesh(mesh.shape, mesh.axes, replace(mesh.device, async_tp=share),
                   mesh.bandwidth, mesh.latency)
    try:
        return score_assignment(sp, choice).cost.step_s
    finally:
        sp.mesh = mesh


def fitted_share(sp, choice, gain: float) -> float:
    """The share at which the vanilla step over the async one is ``gain`` (1.0 where even
    hiding all of it gains less)."""
    vanilla = step_at(sp, choice, 0.0)
    if vanilla / step_at(sp, choice, 1.0) <= gain:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if vanilla / step_at(sp, choice, mid) < gain else (lo, mid)
    return (lo + hi) / 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="../shared/bench/published/runs.json")
    args = ap.parse_args(argv)
    found = pairs(load_runs(args.runs))
    if not found:
        print(f"{args.runs}: no pair of runs alike but for async TP")
        return 1
    priced = []
    for plain, fast in found:
        layout = read_layout(plain)
        if layout.pp > 1:
            print(f"{fast['id']}: a pipeline's stages are priced by its replay; not fitted")
            continue
        got = Pinned.of(layout, build_model(plain["model"]), 5.0).priced(plain["id"])
        sp, choice = got.reference_problems["published"]
        tokens_per_gpu = layout.batch * layout.seq / layout.gpus
        measured = (plain["compare"]["tokens_per_s_per_gpu"],
                    fast["compare"]["tokens_per_s_per_gpu"])
        share = fitted_share(sp, choice, measured[1] / measured[0])
        priced.append((fast["id"], sp, choice, tokens_per_gpu, measured, share))
    rows = []
    for k, (rid, sp, choice, tokens_per_gpu, measured, share) in enumerate(priced):
        others = [p[5] for j, p in enumerate(priced) if j != k]
        row = [rid, f"{measured[1] / measured[0]:.3f}", f"{share:.3f}"]
        for h in (statistics.mean(others) if others else None, ASYNC_TP_HIDDEN):
            if h is None:
                row += ["-", "-"]
                continue
            predicted = tokens_per_gpu / step_at(sp, choice, h)
            row += [f"{predicted:,.0f} (h={h:.3f})", f"{predicted / measured[1] - 1:+.1%}"]
        rows.append(row)
    print(table(["async run", "measured gain", "fitted share", "leave-one-out prediction",
                 "error", "with ASYNC_TP_HIDDEN", "error"], rows))
    shares = [p[5] for p in priced]
    print(f"mean fitted share {statistics.mean(shares):.3f} over {len(shares)} pairs; "
          f"autopar.ir.devices.ASYNC_TP_HIDDEN = {ASYNC_TP_HIDDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
