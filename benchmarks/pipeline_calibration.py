"""Calibrates the pipeline runtime's figures of the `cpu` device profile: what torch's
pipeline runtime costs the host beside the stages' own work.

Three measurements, each on work small enough that the step is the runtime's own cost:

a. **Per action** (``pipeline_action_s``): every multi-stage schedule with all its stages on
   one process (p=1, v=2, so nothing is sent), stages of one 16x16 Linear, m=32: the step
   over the actions it runs.
b. **Per send or receive posted** (``p2p_post_s``): every schedule on 2 processes, the same
   stages, m=8 and m=32; the schedule replay (``passes/pipeline/schedule.simulate``: each
   action ``pipeline_action_s`` plus ``post_s`` per send or receive it posts to the other
   rank, each boundary the profile's point-to-point latency) is fitted to all of them by one
   ``post_s`` (least squares of the log ratio over a grid).
c. **Split backward** (``split_backward_node_s``): one process, one GPT-2 block at a few
   widths; forward with a whole backward against forward with torch's split backward
   (``stage_backward_input`` then ``stage_backward_weight``), the difference over the
   autograd nodes the forward records.

The fidelity benchmark (``benchmarks/pipeline.py``) then uses these figures as the profile
holds them; they are set in ``autopar/ir/devices.py`` from this script's output, never from the
plans it ranks. About a minute on 2 cores.

    python benchmarks/pipeline_calibration.py            # prints the table
    python benchmarks/pipeline_calibration.py --write    # and updates benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, table, update_results  # noqa: E402

from autopar.ir.devices import get_profile  # noqa: E402
from autopar.passes.pipeline.schedule import (  # noqa: E402
    SCHEDULES,
    SINGLE_STAGE,
    PipelineSchedule,
    StageTime,
    simulate,
)

MULTI = tuple(s for s in SCHEDULES if s not in SINGLE_STAGE)
WIDTH = 16  # the tiny stages' Linear
MICROBATCHES = (8, 32)
ROUNDS, WARMUP = 30, 5
BLOCK_WIDTHS = (64, 128, 256)
POST_GRID_S = [k * 10e-6 for k in range(101)]  # 0 .. 1 ms


def _virtual(name: str) -> int:
    return 1 if name in SINGLE_STAGE else 2


def tiny_steps(names: tuple[str, ...], ms: tuple[int, ...]) -> dict[tuple[str, int], float]:
    """In each rank of a launched group: the median step of each schedule on tiny stages."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in names:
        v = _virtual(name)
        sched = PipelineSchedule(name, p, v, max(ms))
        ids = sched.rank_stages(rank)
        n = p * v
        for m in ms:
            torch.manual_seed(0)
            stages = [PipelineStage(torch.nn.Linear(WIDTH, WIDTH), s, n, torch.device("cpu"))
                      for s in ids]
            cls = get_schedule_class(name)
            runner = cls(stages[0] if name in SINGLE_STAGE else stages, m,
                         loss_fn=lambda y, _t: y.sum())
            # the first stage takes the inputs, the last the targets
            args = (torch.randn(m, WIDTH),) if 0 in ids else ()
            kw = {"target": torch.zeros(m), "losses": []} if n - 1 in ids else {}
            times = []
            for k in range(WARMUP + ROUNDS):
                dist.barrier()
                t0 = time.perf_counter()
                runner.step(*args, **kw)
                if k >= WARMUP:
                    times.append(time.perf_counter() - t0)
            dist.barrier()
            out[(name, m)] = statistics.median(times)
    return out


def actions_per_rank(sched: PipelineSchedule) -> int:
    per_microbatch = 3 if sched.splits_backward else 2
    return sched.m * sched.v * per_microbatch


def action_cost() -> tuple[float, list[list[str]]]:
    from autopar.runtime.launch import launch

    got = launch(tiny_steps, 1, (MULTI, (32,)), threads_per_proc=1)[0]
    rows, per = [], []
    for name in MULTI:
        sched = PipelineSchedule(name, 1, 2, 32)
        a = got[(name, 32)] / actions_per_rank(sched)
        per.append(a)
        rows.append([name, "1", "32", f"{got[(name, 32)] * 1e3:.2f}",
                     str(actions_per_rank(sched)), f"{a * 1e6:.0f}"])
    return statistics.median(per), rows


def post_cost(action_s: float) -> tuple[float, list[list[str]]]:
    from autopar.runtime.launch import launch

    ranks = launch(tiny_steps, 2, (SCHEDULES, MICROBATCHES), threads_per_proc=1)
    got = {k: max(r[k] for r in ranks) for k in ranks[0]}
    cpu = get_profile("cpu")
    send_s = cpu.intra_node_latency + WIDTH * 4 / cpu.intra_node_bandwidth

    def predict(name: str, m: int, post: float) -> float:
        sched = PipelineSchedule(name, 2, _virtual(name), m)
        return simulate(sched, StageTime(0.0, 0.0, 0.0, send_s, action_s=action_s,
                                         post_s=post)).step_s

    def loss(post: float) -> float:
        return sum(math.log(predict(n, m, post) / got[(n, m)]) ** 2 for n, m in got)

    best = min(POST_GRID_S, key=loss)
    rows = [[n, "2", str(m), f"{got[(n, m)] * 1e3:.2f}", f"{predict(n, m, 0.0) * 1e3:.2f}",
             f"{predict(n, m, best) * 1e3:.2f}"] for n, m in sorted(got)]
    return best, rows


def split_cost() -> tuple[float, list[list[str]]]:
    from autopar.models.gpt2 import Block, GPT2Config

    torch.set_num_threads(1)
    rows, per = [], []
    for d in BLOCK_WIDTHS:
        torch.manual_seed(0)
        block = Block(GPT2Config(vocab_size=256, n_layer=1, n_head=4, d_model=d,
                                 n_positions=64))
        x0 = torch.randn(2, 64, d)
        nodes = _autograd_nodes(block(x0.clone().requires_grad_()))
        med = {}
        for label, split in (("whole", False), ("split", True)):
            for _ in range(WARMUP):
                _backward(block, x0, split)
            ts = []
            for _ in range(3 * ROUNDS):
                t0 = time.perf_counter()
                _backward(block, x0, split)
                ts.append(time.perf_counter() - t0)
            med[label] = statistics.median(ts)
        extra = med["split"] - med["whole"]
        per.append(extra / nodes)
        rows.append([str(d), str(nodes), f"{med['whole'] * 1e3:.2f}",
                     f"{med['split'] * 1e3:.2f}", f"{extra * 1e3:.2f}",
                     f"{extra / nodes * 1e6:.1f}"])
    return statistics.median(per), rows


def _backward(block: torch.nn.Module, x0: torch.Tensor, split: bool) -> None:
    """Forward, then a whole backward or torch's split one (input, then weights)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    x = x0.clone().requires_grad_()
    y = block(x)
    if not split:
        y.backward(torch.ones_like(y))
        return
    _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], block.parameters())
    stage_backward_weight(block.parameters(), groups)


def _autograd_nodes(y: torch.Tensor) -> int:
    seen, todo = set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return len(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = ap.parse_args()
    t0 = time.time()
    load_before = os.getloadavg()[0]
    action_s, arows = action_cost()
    post_s, prows = post_cost(action_s)
    node_s, srows = split_cost()
    cpu = get_profile("cpu")
    atab = table(["schedule", "processes", "m", "step ms", "actions/rank", "us per action"],
                 arows)
    ptab = table(["schedule", "processes", "m", "measured step ms",
                  "replay, no post cost, ms", "replay at the fit, ms"], prows)
    stab = table(["d_model", "autograd nodes", "whole backward ms", "split backward ms",
                  "extra ms", "us per node"], srows)
    summary = table(
        ["figure", "measured here", "profile (autopar/ir/devices.py)"],
        [["pipeline_action_s", f"{action_s * 1e6:.0f} us (median)",
          f"{cpu.pipeline_action_s * 1e6:.0f} us"],
         ["p2p_post_s", f"{post_s * 1e6:.0f} us (fit)", f"{cpu.p2p_post_s * 1e6:.0f} us"],
         ["split_backward_node_s", f"{node_s * 1e6:.1f} us (median)",
          f"{cpu.split_backward_node_s * 1e6:.1f} us"]])
    total = time.time() - t0
    load = os.getloadavg()[0]
    print("Per action\n\n" + atab + "\n\nPer send or receive posted\n\n" + ptab +
          "\n\nSplit backward\n\n" + stab + "\n\n" + summary +
          f"\n\n{total:.0f} s; load average {load_before:.1f} before, {load:.1f} after")
    if args.write:
        body = (f"`python benchmarks/pipeline_calibration.py --write`\n\nMachine: {machine()}; "
                f"run {datetime.date.today().isoformat()}, {total:.0f} s, load average "
                f"{load_before:.1f} before and {load:.1f} after. 1 intra-op thread per "
                "process; medians over "
                f"{ROUNDS} rounds after {WARMUP} warm-up rounds.\n\n"
                "What torch's pipeline runtime costs beside the stages' work, which the "
                "`cpu` profile charges in the schedule replay (`passes/pipeline/cost."
                "Overheads`); GPU profiles leave these 0 (the host queues ahead of the "
                "device). The profile's figures were set from a run of this script.\n\n"
                + summary + "\n\n**Per action**: multi-stage schedules with every stage on "
                "one process (stages of one 16x16 Linear, nothing sent).\n\n" + atab +
                "\n\n**Per send or receive posted**: 2 processes; one `post_s` fitted to "
                "every row by the schedule replay.\n\n" + ptab + "\n\n**Split backward**: one "
                "GPT-2 block, microbatch 2 x 64 tokens, whole against torch's split "
                "backward.\n\n" + stab)
        update_results("Pipeline runtime calibration", body)


if __name__ == "__main__":
    main()
