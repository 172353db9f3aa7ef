"""Train a GPT on several processes with autopar: the script a user writes.

The training loop is the single-device one: besides joining the process group, the only autopar
line is ``autopar.parallelize``. Every rank passes the whole global batch; autopar gives each
rank its share.

Run it on one machine, 4 processes (CPU: gloo; one GPU per process: NCCL)::

    torchrun --nproc-per-node 4 examples/train_gpt.py
    python examples/train_gpt.py --nproc 4          # the same, spawned by the script itself

on several machines (run this on each, with its own --node-rank; HOST is node 0's address)::

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr HOST --master-port 29500 \\
        examples/train_gpt.py --mesh dp=4,tp=4 --model gpt2-small --seq 1024

(or ``--rdzv-backend c10d --rdzv-endpoint HOST:29500`` instead of the node rank and master).
Two "nodes" on one machine, ``--nnodes 2 --nproc-per-node 2`` with node ranks 0 and 1 on
127.0.0.1, train exactly as ``--nproc 4`` does (same losses;
``tests/runtime/test_torchrun_example.py`` runs one node and two nodes of one process each
against ``--nproc 2``).

On one process, ``python examples/train_gpt.py``. The mesh defaults to ``dp=N/2,tp=2`` for
an even N >= 4 processes and ``dp=N`` otherwise. A ``pp`` axis trains the model as a pipeline,
with the same script (``parallelize`` plans the stages, the schedule and the micro-batches)::

    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh pp=2,dp=2

Data: the byte-level corpus shipped with autopar (``autopar.cli.corpus``); every rank
draws the same batch for a step from the seed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.cli.corpus import BatchSampler
from autopar.models import get_preset
from autopar.report.table import plan_table
from autopar.runtime.launch import cleanup, init_from_env, launch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-tiny", help="autopar.models preset")
    p.add_argument("--mesh", default=None,
                   help="axis=size pairs, e.g. dp=2,tp=2 (pp=2,dp=2: a pipeline)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=16, help="global batch")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=None,
                   help="spawn this many local processes (not needed under torchrun)")
    return p.parse_args(argv)


def default_mesh(world: int) -> str:
    return f"dp={world // 2},tp=2" if world >= 4 and world % 2 == 0 else f"dp={world}"


def train(args: argparse.Namespace) -> float:
    """One rank's job. Returns the last loss."""
    dist_info = init_from_env()  # reads torchrun's RANK, WORLD_SIZE, ... (or makes a 1-rank group)
    mesh_text = args.mesh or default_mesh(dist_info.world_size)
    shape = autopar.Mesh.parse(mesh_text)
    mesh = init_device_mesh(dist_info.device.type, shape.shape, mesh_dim_names=shape.axes)

    preset = get_preset(args.model)
    if preset.family == "gpt2" and preset.config.n_positions < args.seq:
        preset = preset.replace(n_positions=args.seq)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = preset.build(dist_info.device)
    data = BatchSampler.from_corpus(args.batch, args.seq, seed=args.seed)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t.to(dist_info.device) for t in data.batch(step))  # type: ignore[return-value]

    model = autopar.parallelize(model, mesh, example_inputs=batch(0))
    if dist_info.is_main:
        print(plan_table(model.plan), flush=True)
    # the fused kernel: one per step, run on each rank's pieces (runtime/optim/fused.py)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)

    loss_value = float("nan")
    t0 = time.perf_counter()
    for step in range(args.steps):
        tokens, targets = batch(step)
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dist_info.is_main and (step % 10 == 0 or step == args.steps - 1):
            loss_value = loss.item()
            tok_s = (step + 1) * args.batch * args.seq / (time.perf_counter() - t0)
            print(f"step {step:4d}  loss {loss_value:.4f}  {tok_s:,.0f} tok/s", flush=True)
    cleanup()
    return loss_value


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.nproc and "RANK" not in os.environ:  # not under torchrun: spawn the ranks here
        launch(train, args.nproc, (args,))
    else:
        train(args)


if __name__ == "__main__":
    main()
