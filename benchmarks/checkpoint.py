"""Checkpoint save and load: time and bytes for a GPT-2-small-sized model on 4 gloo processes,
synchronous against asynchronous saving (how long the training loop is blocked).

Each rank holds its pieces of GPT-2 small (124M parameters) and of its AdamW state (two
moments per parameter, made by one step on zero gradients), as DTensors on a dp=2 x tp=2 mesh:
every weight matrix split over ``tp`` along its rows, the rest replicated (the placement
``autopar.parallelize`` gives a Megatron-style plan's parameters; no plan is solved here, so
that the figures time the checkpoint alone). Then, ``--repeats`` times each, median reported:

- synchronous ``save``: the loop is blocked for all of it;
- asynchronous ``save(blocking=False)``: blocked for the copy into host memory; written and
  committed in the background (``wait()``);
- ``load`` into the same layout, and resharded into another (every weight split over all 4
  ranks along its columns: FSDP-like).

    python benchmarks/checkpoint.py [--preset gpt2-small] [--repeats 3] [--dir DIR] [--write]

``--write`` puts the table into benchmarks/RESULTS.md under "Checkpoint".
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

WORLD = 4


def _distribute(model, mesh, layout: str) -> None:
    """Parameters as DTensors: ``tp``: matrices split over the mesh's last axis along rows, the
    rest replicated; ``fsdp``: matrices split over every rank along columns."""
    import torch
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for mod in model.modules():
        for key, p in list(mod._parameters.items()):
            if p is None:
                continue
            if p.dim() == 2 and layout == "tp":
                placements = [Replicate(), Shard(0)]
            elif p.dim() == 2:
                placements = [Shard(1)]
            else:
                placements = [Replicate()] * mesh.ndim
            mod._parameters[key] = nn.Parameter(distribute_tensor(p.detach(), mesh, placements,
                                                                  src_data_rank=None))
    del torch


def _build(preset_name: str, layout: str, seed: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.models import get_preset

    mesh = (init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")) if layout == "tp"
            else init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",)))
    torch.manual_seed(seed)
    model = get_preset(preset_name).build("cpu")
    _distribute(model, mesh, layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # the moments exist after a step
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    return model, opt


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _worker(preset_name: str, repeats: int, root: str) -> dict:
    import torch.distributed as dist

    from autopar import checkpoint

    model, opt = _build(preset_name, "tp", seed=0)
    rank = dist.get_rank()
    n_params = sum(p.numel() for p in model.parameters())
    timings: dict[str, list[float]] = {k: [] for k in
                                       ("sync", "async_blocked", "async_total", "load",
                                        "load_resharded")}
    step = 0
    for _ in range(repeats):
        for mode in ("sync", "async"):
            step += 1
            dist.barrier()
            t0 = time.perf_counter()
            handle = checkpoint.save(root, model, opt, step=step, blocking=mode == "sync",
                                     data_state={"offset": step})
            t1 = time.perf_counter()
            handle.wait()
            t2 = time.perf_counter()
            if mode == "sync":
                timings["sync"].append(t1 - t0)
            else:
                timings["async_blocked"].append(t1 - t0)
                timings["async_total"].append(t2 - t0)
            dist.barrier()
            if rank == 0:  # keep the disk to the newest
                for old in Path(root).glob("step-*"):
                    if old.name != f"step-{step:09d}":
                        shutil.rmtree(old, ignore_errors=True)
    size = _bytes(Path(root) / f"step-{step:09d}")
    fresh, fresh_opt = _build(preset_name, "tp", seed=1)
    other, other_opt = _build(preset_name, "fsdp", seed=1)
    for _ in range(repeats):
        for key, (m, o) in (("load", (fresh, fresh_opt)), ("load_resharded", (other, other_opt))):
            dist.barrier()
            t0 = time.perf_counter()
            checkpoint.load(root, m, o)
            timings[key].append(time.perf_counter() - t0)
    return {"timings": timings, "bytes": size, "params": n_params}


def main(argv: list[str] | None = None) -> None:
    from _common import machine, table, update_results

    from autopar.runtime.launch import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary one)")
    ap.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="autopar-ckpt-")
    try:
        reports = launch(_worker, WORLD, (args.preset, args.repeats, root), timeout_s=3000)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    # the loop waits for the slowest rank: per repeat the maximum over ranks, then the median
    med = {k: statistics.median(max(r["timings"][k][i] for r in reports)
                                for i in range(args.repeats)) for k in reports[0]["timings"]}
    size = reports[0]["bytes"]
    rows = [["save, synchronous", f"{med['sync']:.2f}", f"{med['sync']:.2f}"],
            ["save, asynchronous", f"{med['async_blocked']:.2f}", f"{med['async_total']:.2f}"],
            ["load, same layout (dp=2 x tp=2)", f"{med['load']:.2f}", f"{med['load']:.2f}"],
            ["load, resharded (4-way FSDP)", f"{med['load_resharded']:.2f}",
             f"{med['load_resharded']:.2f}"]]
    out = table(["operation", "loop blocked (s)", "until committed / loaded (s)"], rows)
    params = sum(r["params"] for r in reports[:1])
    gb = size / 1e9
    summary = (f"{args.preset}: {params / 1e6:.0f}M parameters + AdamW state, "
               f"{gb:.2f} GB on disk ({size / max(params, 1):.1f} bytes per parameter); "
               f"{WORLD} gloo processes; median of {args.repeats} (each the slowest rank); "
               f"asynchronous saving blocks the loop "
               f"{med['async_blocked'] / max(med['sync'], 1e-9):.2f}x as long as synchronous")
    print(out)
    print(summary)
    if args.write:
        body = (f"`python benchmarks/checkpoint.py --repeats {args.repeats} --write` on "
                f"{machine()}, taken under load (other sessions running on the same cores).\n\n"
                f"{out}\n\n{summary}.")
        update_results("Checkpoint", body)


if __name__ == "__main__":
    main()
