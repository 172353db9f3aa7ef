"""``autopar train``: train a small GPT on the shipped corpus on local processes, then compare.

With no arguments: ``gpt2-tiny`` on 4 CPU processes (mesh ``pp=2,dp=2``, gloo): the planner
cuts the model into 2 pipeline stages (embedding and block 0, block 1 and the head), each
replicated over 2 data-parallel ranks, and picks the schedule and microbatches; rank 0 prints
the plan, then a progress bar, and at the end the loss curve next to the same model trained on
one process (same seed, same initial weights, same batches). Every option a user can get wrong
is checked here, before any process starts, and reported in one line (exit code 2).

Started by torchrun (``torchrun --nproc-per-node 4 -m autopar.cli train ...``) each process
joins torchrun's group instead of spawning its own. With ``--checkpoint-dir`` the run saves
and resumes (:mod:`autopar.cli.resume`), and under ``torchrun --max-restarts`` a group that
lost a rank comes back from its last checkpoint.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from autopar.cli.corpus import VOCAB_SIZE, BatchSampler, decode
from autopar.cli.options import (
    add_memory_options,
    add_pipeline_options,
    check_batch,
    options_from_args,
)
from autopar.cli.progress import Progress, format_rate, loss_report
from autopar.cli.resume import (
    Checkpointer,
    kill_self,
    planned_kill,
    restore_loop,
    start_step,
)
from autopar.ir.errors import AutoparError
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.report.table import plan_table

LM_FAMILIES = ("gpt2", "llama3", "moe")
# The default mesh has a pipeline axis so that the plan shows parallelism: on the cpu profile a
# model this small is fastest replicated (a dp=2,tp=2 plan replicates every parameter, its tp
# axis idle), and a memory limit that forces sharding makes the planner search its modes for
# tens of seconds; the pipeline's stages, schedule and microbatches are planned in about a
# second, the same every time (tests/cli/test_train.py).
DEFAULTS: dict[str, Any] = {
    "model": "gpt2-tiny", "mesh": "pp=2,dp=2", "steps": 150, "batch": 16, "seq": 64,
    "lr": 3e-3, "seed": 0, "time_limit": 10.0, "grad_accum": 1,
}


class TrainUsageError(AutoparError):
    pass


@dataclass(frozen=True, slots=True)
class TrainConfig:
    model: str
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    steps: int
    batch: int
    seq: int
    lr: float
    seed: int
    nproc: int
    baseline: bool
    tty: bool
    timeout_s: float | None
    # parallelize's options: the solver's time limit, precision (None: the cpu profile's,
    # fp32), recomputation, the memory budget per rank (None: the cpu profile's limit), ZeRO
    # stage, offload, and a mesh with a pp axis: the pipeline's choices (None: planned)
    options: Options = Options.of(time_limit_s=DEFAULTS["time_limit"])
    compile: bool = False  # parallelize(..., compile=True)
    grad_accum: int = 1  # micro-batches per optimizer step, their gradients summed
    clip: float | None = None  # clip_grad_norm_'s max_norm before each step; None: no clipping
    profile: str | None = None  # a directory: one step's traces, measured and predicted
    checkpoint_dir: str | None = None  # where checkpoints are saved and resumed from
    checkpoint_every: int | None = None  # steps between saves (None: only at the end)
    checkpoint_sync: bool = False  # block the loop until each save is written
    start_step: int | None = None  # the committed checkpoint this run resumes from
    losses_json: str | None = None  # where rank 0 writes every step's loss
    torchrun: bool = False  # joined the group torchrun started, rather than spawning one

    @property
    def mesh_text(self) -> str:
        return ",".join(f"{a}={n}" for a, n in zip(self.mesh_axes, self.mesh_shape))

    @property
    def run_identity(self) -> dict[str, Any]:
        """What a resumed run must share with the saved one besides the data (resume.py)."""
        return {"model": self.model, "lr": self.lr, "grad_accum": self.grad_accum,
                "clip": self.clip}


@dataclass
class RunResult:
    losses: list[float]
    step_times: list[float]
    setup_s: float
    clipped: int = 0  # steps whose gradient norm was above --clip
    resumed_from: int | None = None  # the checkpoint's step; losses before it are its record


def register(subparsers: Any) -> None:
    d = DEFAULTS
    p = subparsers.add_parser(
        "train", help="train a small GPT on the bundled corpus on local processes",
        description="Train a small GPT from autopar.models on the corpus shipped with autopar, "
                    "on local CPU processes it spawns (gloo), and compare its loss curve with the "
                    "same model trained on one process.",
    )
    p.add_argument("--model", default=d["model"],
                   help=f"model preset (default {d['model']}; gpt2-*, llama3-*, moe-*)")
    p.add_argument("--mesh", default=d["mesh"],
                   help=f"axis=size pairs (default {d['mesh']}); dp axes split the batch")
    p.add_argument("--steps", type=int, default=d["steps"], help=f"default {d['steps']}")
    p.add_argument("--batch", type=int, default=d["batch"],
                   help=f"global batch size (default {d['batch']})")
    p.add_argument("--seq", type=int, default=d["seq"], help=f"sequence length (default {d['seq']})")
    p.add_argument("--lr", type=float, default=d["lr"], help=f"AdamW learning rate (default {d['lr']})")
    p.add_argument("--nproc", type=int, default=None,
                   help="local processes to spawn (default: the mesh size; must equal it)")
    p.add_argument("--seed", type=int, default=d["seed"], help="weights and data seed (default 0)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the one-process run the loss curve is compared with")
    p.add_argument("--time-limit", type=float, default=d["time_limit"],
                   help=f"plan solver time limit in seconds (default {d['time_limit']:g})")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop everything after this many seconds (default: no limit)")
    p.add_argument("--compile", action="store_true",
                   help="compile each rank's program with Inductor between its collectives "
                        "(faster steps after a compile of some seconds)")
    p.add_argument("--grad-accum", type=int, default=d["grad_accum"], metavar="N",
                   help="split each step's batch into N micro-batches and add up their "
                        "gradients before the optimizer step (default 1)")
    p.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                   help="clip the gradients' total norm to MAX_NORM before each optimizer "
                        "step (torch.nn.utils.clip_grad_norm_; default: no clipping)")
    p.add_argument("--memory-budget",
                   help="per-process memory limit of the plan, e.g. 2GiB (default: the cpu "
                        "profile's capacity less a reserve; 'none' for no limit)")
    p.add_argument("--profile", metavar="DIR",
                   help="profile one step (the second) with torch.profiler: each rank's trace "
                        "in DIR/trace_rank{r}.json, the plan's predicted one in "
                        "DIR/predicted.json, with the same event names (docs/timeline.md)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save checkpoints in DIR (model, optimizer, data position, RNG: "
                        "autopar.checkpoint), at the end and every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="save every N steps (default: only at the end)")
    p.add_argument("--checkpoint-sync", action="store_true",
                   help="block the loop until each save is written (default: the loop waits "
                        "only for the copy of the state)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --checkpoint-dir from its last committed "
                        "checkpoint (on any mesh); under torchrun a restarted group does so "
                        "by itself")
    p.add_argument("--losses-json", metavar="FILE",
                   help="write every step's loss to FILE (JSON), the steps before a resume's "
                        "checkpoint included")
    add_memory_options(p)
    add_pipeline_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = validate(args)
    from autopar.runtime.launch import launch

    tokens_per_step = cfg.batch * cfg.seq
    where = (f"{cfg.nproc} processes started by torchrun" if cfg.torchrun
             else f"{cfg.nproc} local CPU processes")
    if not cfg.torchrun or int(os.environ["RANK"]) == 0:
        print(f"autopar train: {cfg.model} on {where}, mesh {cfg.mesh_text}, "
              f"batch {cfg.batch} x seq {cfg.seq} ({tokens_per_step} tokens/step), {cfg.steps} "
              f"steps, AdamW lr {cfg.lr:g}{_loop_text(cfg)}, seed {cfg.seed}"
              f"{_checkpoint_text(cfg)}", flush=True)
    if cfg.torchrun:
        _exit_now(_report(cfg, _join_torchrun(cfg)))
    try:
        results = launch(_parallel_worker, cfg.nproc, (cfg,), backend="gloo",
                         timeout_s=cfg.timeout_s, collective_timeout_s=120.0)
    except KeyboardInterrupt:  # the launcher has already stopped the ranks
        print("\ninterrupted", file=sys.stderr)
        return 130
    return _report(cfg, results)


def _join_torchrun(cfg: TrainConfig) -> list[RunResult] | None:
    """Under torchrun: this process's rank of the run, in torchrun's group; every rank's
    result on rank 0 (None on the others)."""
    import torch.distributed as dist

    from autopar.runtime.launch import cleanup, init_from_env

    init_from_env("gloo", collective_timeout_s=120.0)
    result = _parallel_worker(cfg)
    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    rank = dist.get_rank()
    cleanup()
    return results if rank == 0 else None


def _exit_now(code: int) -> None:
    """End a torchrun rank once its output is out, skipping the interpreter's exit: gloo's
    threads can abort there ("terminate called without an active exception", see
    ``launch.cleanup``), which torchrun would count as a failed rank and restart the group
    for (``launch``'s own children end the same way)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report(cfg: TrainConfig, results: list[RunResult] | None) -> int:
    """What rank 0 (or the launching process) prints and writes at the end; the exit code."""
    if results is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    tokens_per_step = cfg.batch * cfg.seq
    par: RunResult = results[0]
    if cfg.losses_json:
        _write_losses(cfg, par)
    if cfg.profile:
        _side_by_side(cfg.profile, cfg.nproc)
    spread = max(max((abs(a - b) for a, b in zip(r.losses, par.losses)), default=0.0)
                 for r in results)
    _summary("autopar", par, tokens_per_step, cfg.clip)
    if spread > 0:
        print(f"ranks disagree on the loss by up to {spread:.2e}")
    if not cfg.baseline:
        return 0 if all(math.isfinite(v) for v in par.losses) else 1
    print("\nthe same model on 1 process (same seed, weights and batches):", flush=True)
    base, model = _baseline(cfg)
    _summary("1 process", base, tokens_per_step, cfg.clip)
    print()
    print(loss_report({f"autopar {cfg.mesh_text}": par.losses, "1 process": base.losses}))
    print(_CHAOS_NOTE)
    sample = _sample(model, cfg)
    if sample:
        print(f"\nthe trained 1-process model, sampled after {_PROMPT!r}: {sample!r}")
    return 0 if all(math.isfinite(v) for v in par.losses) else 1


def validate(args: argparse.Namespace) -> TrainConfig:
    """The run's config, or :class:`TrainUsageError` naming the bad option and the fix."""
    from autopar.models import get_preset

    preset = get_preset(args.model)  # UnknownPresetError is an AutoparError: one line
    if preset.family not in LM_FAMILIES:
        raise TrainUsageError(
            f"autopar train trains language models; {args.model!r} is a {preset.family} model. "
            "Pick a gpt2-*, llama3-* or moe-* preset")
    mesh = Mesh.parse(args.mesh, "cpu")
    torchrun = _under_torchrun()
    if torchrun:
        nproc = _check_torchrun(mesh, args)
    else:
        nproc = mesh.size if args.nproc is None else args.nproc
    if nproc != mesh.size:
        raise TrainUsageError(
            f"--nproc {nproc} does not match mesh {args.mesh} of {mesh.size} devices: "
            f"use --nproc {mesh.size} or a mesh of {nproc} devices")
    for name in ("steps", "batch", "seq"):
        if getattr(args, name) < 1:
            raise TrainUsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.seq < 2:
        raise TrainUsageError("--seq must be at least 2 (the model predicts the next byte)")
    if not args.lr > 0:
        raise TrainUsageError(f"--lr must be positive, got {args.lr}")
    if args.timeout is not None and args.timeout <= 0:
        raise TrainUsageError(f"--timeout must be positive, got {args.timeout}")
    if not args.time_limit > 0:
        raise TrainUsageError(f"--time-limit must be positive, got {args.time_limit}")
    check_batch(mesh, args.batch)
    _check_loop(mesh, args)
    start = _check_checkpointing(args)
    _check_pipeline(mesh, args, preset)
    options = options_from_args(args)
    if args.reduce_dtype not in (None, "fp32") and args.reduce_dtype != args.precision:
        raise TrainUsageError(
            f"--reduce-dtype {args.reduce_dtype} goes with --precision {args.reduce_dtype}: "
            "gradients are summed in fp32 or in the compute dtype")
    if nproc > 4 * (os.cpu_count() or 1):
        print(f"note: {nproc} processes on {os.cpu_count()} CPU cores will be slow",
              file=sys.stderr)
    return TrainConfig(args.model, mesh.shape, mesh.axes, args.steps, args.batch, args.seq,
                       args.lr, args.seed, nproc, not args.no_baseline, sys.stdout.isatty(),
                       args.timeout, options, args.compile, args.grad_accum, args.clip,
                       args.profile, args.checkpoint_dir, args.checkpoint_every,
                       args.checkpoint_sync, start, args.losses_json, torchrun)


def _under_torchrun() -> bool:
    """Started by torchrun (or a launcher like it): the group's variables are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _check_torchrun(mesh: Mesh, args: argparse.Namespace) -> int:
    """Under torchrun: the processes are torchrun's; their number must be the mesh's."""
    world = int(os.environ["WORLD_SIZE"])
    if args.nproc is not None and args.nproc != world:
        raise TrainUsageError(f"--nproc {args.nproc} under torchrun, which started {world} "
                              "processes: leave --nproc out (torchrun's --nproc-per-node sets it)")
    if world != mesh.size:
        raise TrainUsageError(
            f"torchrun started {world} processes but mesh {args.mesh} has {mesh.size} "
            f"devices: use torchrun --nproc-per-node {mesh.size}, or a mesh of {world} devices")
    if args.timeout is not None:
        raise TrainUsageError("--timeout stops the processes autopar train spawns; under "
                              "torchrun leave it out (torchrun owns the processes)")
    return world


def _check_checkpointing(args: argparse.Namespace) -> int | None:
    """--checkpoint-dir, --checkpoint-every, --resume: the step the run resumes from, if any."""
    if args.checkpoint_dir is None:
        for flag, given in (("--checkpoint-every", args.checkpoint_every is not None),
                            ("--checkpoint-sync", args.checkpoint_sync),
                            ("--resume", args.resume)):
            if given:
                raise TrainUsageError(f"{flag} needs --checkpoint-dir DIR (where the run's "
                                      "checkpoints are saved and resumed from)")
        return None
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise TrainUsageError(f"--checkpoint-every must be at least 1, got "
                              f"{args.checkpoint_every}")
    return start_step(args.checkpoint_dir, args.resume, args.steps)


def _check_loop(mesh: Mesh, args: argparse.Namespace) -> None:
    """--grad-accum and --clip: each micro-batch must still split over the dp axes."""
    n = args.grad_accum
    if n < 1:
        raise TrainUsageError(f"--grad-accum must be at least 1, got {n}")
    if args.batch % n:
        raise TrainUsageError(
            f"--batch {args.batch} does not split into {n} equal micro-batches: use a "
            f"--grad-accum that divides {args.batch}, or a --batch that is a multiple of {n}")
    dp = mesh.data_parallel_size
    micro = args.batch // n
    if micro % dp:
        raise TrainUsageError(
            f"--grad-accum {n} leaves micro-batches of {micro}, which cannot be split over the "
            f"data-parallel axes ({dp} ways): use a --batch that is a multiple of {n * dp}, "
            "or a smaller --grad-accum")
    if args.clip is not None and not (args.clip > 0 and math.isfinite(args.clip)):
        raise TrainUsageError(f"--clip must be a positive max norm, got {args.clip}")


def _check_pipeline(mesh: Mesh, args: argparse.Namespace, preset: Any) -> None:
    """A mesh with a ``pp`` axis: what can be checked before any process starts (the stages
    against the model's blocks, the micro-batches against the batch, the options pipelines
    do not run), with the planner's own messages where it has them."""
    from autopar.ir.schedules import canonical_name, splits_backward
    from autopar.planning.pipeline import (
        microbatch_counts,
        pipeline_axis,
        stage_mesh,
    )
    from autopar.runtime.pipeline.module import check_mesh

    axis = pipeline_axis(mesh)
    if axis is None:
        if args.schedule or args.microbatches or args.virtual:
            raise TrainUsageError("--schedule, --microbatches and --virtual need a pipeline "
                                  "axis: add one to the mesh, e.g. --mesh pp=2,dp=2")
        return
    check_mesh(mesh)
    if args.compile:
        raise TrainUsageError("--compile does not apply to pipelines yet: leave it out, or "
                              "use a mesh without a pp axis")
    if args.offload not in ("auto", "none"):
        raise TrainUsageError(f"--offload {args.offload}: pipeline stages do not offload "
                              "optimizer state; leave it out, or use a mesh without a pp axis")
    if args.precision == "fp16":
        raise TrainUsageError("--precision fp16: pipeline stages do not do fp16's dynamic loss "
                              "scaling yet; use --precision bf16 or fp32, or a mesh without a "
                              "pp axis")
    tp = any(a == "tp" and n > 1 for a, n in zip(mesh.axes, mesh.shape))
    if args.schedule:
        schedule = canonical_name(args.schedule)  # an unknown name: one line naming them
        # stage programs (a tp axis) recompute inside their one lowered backward
        if args.recompute == "selective" and splits_backward(schedule) and not tp:
            raise TrainUsageError(f"--recompute selective: schedule {schedule} runs two "
                                  "backward passes over every block (input, then weight "
                                  "gradients) and selective checkpointing keeps each saved "
                                  "result for one pass only; use --recompute full, or a "
                                  "--schedule with a whole backward (1F1B, GPipe, ...)")
    c = preset.config
    blocks = getattr(c, "n_layer", None) or getattr(c, "n_layers", 0)
    stages = mesh.shape[axis] * (args.virtual or 1)
    if args.virtual is not None and args.virtual < 1:
        raise TrainUsageError(f"--virtual must be at least 1, got {args.virtual}")
    if stages > blocks:
        raise TrainUsageError(
            f"{stages} pipeline stages (pp={mesh.shape[axis]} x {args.virtual or 1} per rank) "
            f"but {args.model} has {blocks} blocks: every stage needs one; use pp x --virtual "
            f"<= {blocks}, or a deeper model")
    micro = args.batch // args.grad_accum  # each call of the model is one pipeline step
    microbatch_counts(micro, stage_mesh(mesh, axis).data_parallel_size, mesh.shape[axis],
                      args.microbatches)


def _loop_text(cfg: TrainConfig) -> str:
    out = ""
    mem, prec, pipe = cfg.options.memory, cfg.options.precision, cfg.options.pipeline
    if prec.compute not in (None, "fp32"):
        out += f", {prec.compute} (the baseline runs fp32)"
    if mem.recompute != "auto":
        out += f", recompute {mem.recompute}"
    if mem.zero != "auto":
        out += f", ZeRO-{mem.zero}"
    if mem.offload != "auto":
        out += f", offload {mem.offload}"
    if cfg.grad_accum > 1:
        out += f", {cfg.grad_accum} micro-batches of {cfg.batch // cfg.grad_accum} per step"
    if cfg.clip is not None:
        out += f", gradient norm clipped to {cfg.clip:g}"
    asked = [f"{k} {v}" for k, v in (("schedule", pipe.schedule),
                                     ("microbatches", pipe.microbatches),
                                     ("stages per rank", pipe.virtual)) if v is not None]
    if asked:
        out += ", pipeline " + ", ".join(asked)
    return out


def build_model(cfg: TrainConfig) -> nn.Module:
    """The preset, widened to the byte vocabulary and the sequence length, seeded weights."""
    from autopar.models import get_preset

    preset = get_preset(cfg.model)
    c = preset.config
    changes: dict[str, Any] = {}
    if c.vocab_size < VOCAB_SIZE:
        changes["vocab_size"] = VOCAB_SIZE
    pos = "n_positions" if preset.family == "gpt2" else "max_seq_len"
    if getattr(c, pos) < cfg.seq:
        changes[pos] = cfg.seq
    if changes:
        preset = preset.replace(**changes)
    torch.manual_seed(cfg.seed)
    return preset.build("cpu")


def _parallel_worker(cfg: TrainConfig) -> RunResult:
    """One rank: build the same model as every other rank, parallelize it, train it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    t0 = time.perf_counter()
    rank = dist.get_rank()
    if rank != 0:
        warnings.simplefilter("ignore")  # one copy of each warning (rank 0's) is enough
    sampler = BatchSampler.from_corpus(cfg.batch, cfg.seq, cfg.seed)
    model = build_model(cfg)
    mesh = init_device_mesh("cpu", cfg.mesh_shape, mesh_dim_names=cfg.mesh_axes)
    example = _micro_batches(sampler.batch(0), cfg)[0]  # the shapes every call will have
    pm = autopar.parallelize(model, mesh, example_inputs=example, options=cfg.options,
                             compile=cfg.compile)
    if rank == 0:
        plan = getattr(pm, "plan", None)
        if plan is not None:
            print(plan_table(plan), flush=True)
        print(flush=True)
        if cfg.profile and hasattr(pm, "_comm"):
            _write_predicted(pm, cfg.profile)
    if cfg.profile and not hasattr(pm, "_comm"):  # a pipeline: its second step, per action
        pm.profile = cfg.profile
    opt = _adamw(pm, cfg)
    start, losses = 0, []
    if cfg.start_step is not None:
        start, losses = _resume(pm, opt, sampler, cfg)
    saver = None
    if cfg.checkpoint_dir is not None:
        saver = Checkpointer(cfg.checkpoint_dir, cfg.checkpoint_every, pm, opt, sampler,
                             cfg.run_identity, getattr(pm, "loss_scale", None),
                             blocking=cfg.checkpoint_sync)
    setup_s = time.perf_counter() - t0
    bar = Progress(cfg.steps, cfg.batch * cfg.seq, label="autopar", tty=cfg.tty,
                   start=start) if rank == 0 else None
    return _train(pm, opt, sampler, cfg, bar, setup_s, start, losses, saver,
                  planned_kill(rank))


def _resume(model: nn.Module, opt: torch.optim.Optimizer, sampler: BatchSampler,
            cfg: TrainConfig) -> tuple[int, list[float]]:
    """The model, optimizer and RNG as the checkpoint has them (resharded to this plan); the
    step to run next and the losses before it."""
    from autopar import checkpoint

    assert cfg.checkpoint_dir is not None
    resumed = checkpoint.load(cfg.checkpoint_dir, model, opt, step=cfg.start_step)
    losses = restore_loop(resumed.data_state, cfg.checkpoint_dir, sampler, cfg.run_identity,
                          getattr(model, "loss_scale", None))
    return resumed.step, losses


def _adamw(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW's fused kernel, on both runs: one kernel per step, where the default on CPU
    runs about 7 ops per parameter (on DTensors, each through DTensor's dispatch). The
    parallel model's keeps the state the plan offloads in host memory."""
    from autopar.runtime.parallel_module import ParallelModule

    if isinstance(model, ParallelModule):
        return model.make_optimizer(torch.optim.AdamW, lr=cfg.lr, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)


def _baseline(cfg: TrainConfig) -> tuple[RunResult, nn.Module]:
    """The one-process run, on one intra-op thread (as each rank of the parallel run on this
    machine has). Measured on the shared 2-core machine, the default model's step took 14 ms
    on one thread and 58 ms to 1.1 s on two, whose every op waits for the thread the
    scheduler has put aside; the thread count is set back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        sampler = BatchSampler.from_corpus(cfg.batch, cfg.seq, cfg.seed)
        model = build_model(cfg)
        opt = _adamw(model, cfg)
        setup_s = time.perf_counter() - t0
        bar = Progress(cfg.steps, cfg.batch * cfg.seq, label="1 proc ", tty=cfg.tty)
        return _train(model, opt, sampler, cfg, bar, setup_s), model
    finally:
        torch.set_num_threads(threads)


def _train(model: nn.Module, opt: torch.optim.Optimizer, sampler: BatchSampler,
           cfg: TrainConfig, bar: Progress | None, setup_s: float, start: int = 0,
           losses: list[float] | None = None, saver: Checkpointer | None = None,
           kill_at: int | None = None) -> RunResult:
    """The same loop for both runs, so their curves compare: each step's loss is the mean of
    its micro-batches' (each scaled by 1/N before its backward, so the summed gradients are
    the whole batch's), clipped before the optimizer step. A resumed run starts at ``start``
    with the losses before it; ``saver`` checkpoints after the steps it is due;
    ``kill_at``: the test hook's step (resume.py)."""
    out = RunResult(list(losses or []), [], setup_s,
                    resumed_from=start if cfg.start_step is not None else None)
    for step in range(start, cfg.steps):
        if step == kill_at:
            kill_self()
        t = time.perf_counter()
        profiler = _start_profile(model, cfg, step)
        value = 0.0
        for tokens, targets in _micro_batches(sampler.batch(step), cfg):
            loss = model(tokens, targets)
            if cfg.grad_accum > 1:
                loss = loss / cfg.grad_accum
            loss.backward()
            value += _scalar(loss)
        if cfg.clip is not None:
            out.clipped += int(float(_clip(model, cfg.clip)) > cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if profiler is not None:
            profiler.stop()
        out.step_times.append(time.perf_counter() - t)
        out.losses.append(value)
        if saver is not None:
            saver.after_step(step + 1, out.losses, last=step + 1 == cfg.steps)
        if bar is not None:
            bar.update(step + 1, value)
    if saver is not None:
        saver.wait()
    if bar is not None:
        bar.close()
    return out


def _clip(model: nn.Module, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over the whole model: a pipeline's own (torch's would see this
    rank's stages only), else torch's (on DTensor gradients it reduces over the mesh)."""
    own = getattr(model, "clip_grad_norm_", None)
    if own is not None:
        return own(max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _start_profile(model: nn.Module, cfg: TrainConfig, step: int) -> Any:
    """With --profile, the parallel run's profile of this step, started, if it is the one
    profiled (:mod:`autopar.runtime.observe.profiling`): the second, since the first pays one-off
    costs; with --compile the third, the second compiling the profiled program's runs."""
    if not cfg.profile or not hasattr(model, "_comm"):
        return None
    from autopar.runtime.observe.profiling import ProgramWarmUp, profile_step

    target = min(2 if cfg.compile else 1, cfg.steps - 1)
    profiler: Any = None
    if step == target:
        profiler = profile_step(model, cfg.profile)
    elif cfg.compile and step == target - 1:
        profiler = ProgramWarmUp()
    if profiler is not None:
        profiler.start()
    return profiler


def _side_by_side(out_dir: str, nproc: int) -> None:
    """The predicted and measured traces in one file, and where they are."""
    from pathlib import Path

    from autopar.report.timeline import merge_traces

    d = Path(out_dir)
    measured = [d / f"trace_rank{r}.json" for r in range(nproc)]
    merge_traces(d / "predicted.json", measured, d / "side_by_side.json")
    print(f"profiled step: predicted {d / 'predicted.json'}, measured {d}/trace_rank*.json, "
          f"both in {d / 'side_by_side.json'} (open in https://ui.perfetto.dev)", flush=True)


def _write_predicted(pm: Any, out_dir: str) -> None:
    """The plan's predicted timeline of the step, beside the measured traces."""
    from autopar.runtime.observe.profiling import write_predicted

    write_predicted(pm, out_dir, Mesh.from_device_mesh(pm.device_mesh))


def _micro_batches(batch: tuple[torch.Tensor, ...], cfg: TrainConfig
                   ) -> list[tuple[torch.Tensor, ...]]:
    """The step's batch as --grad-accum equal micro-batches (rows in order)."""
    return list(zip(*(t.chunk(cfg.grad_accum) for t in batch)))


def _scalar(loss: torch.Tensor) -> float:
    full = getattr(loss, "full_tensor", None)  # a DTensor loss is reduced before reading
    return float((full() if full is not None else loss).detach())


def _summary(name: str, r: RunResult, tokens_per_step: int, clip: float | None = None) -> None:
    # The first step pays one-off costs (allocations, first collectives): leave it out.
    steady = r.step_times[1:] or r.step_times
    clipped = "" if clip is None else f", gradients clipped on {r.clipped} steps"
    resumed = "" if r.resumed_from is None else \
        f" (resumed after step {r.resumed_from}, {len(r.step_times)} run now)"
    speed = ""
    if steady:
        med = sorted(steady)[len(steady) // 2]
        speed = f"{med * 1e3:.1f} ms/step (median), {format_rate(tokens_per_step / med)} tok/s, "
    print(f"{name}: {len(r.losses)} steps{resumed}, loss {r.losses[0]:.4f} -> "
          f"{r.losses[-1]:.4f}, {speed}set-up {r.setup_s:.1f}s{clipped}", flush=True)


def _checkpoint_text(cfg: TrainConfig) -> str:
    """Where the run saves, and where it resumed from (a torchrun restart says which)."""
    from autopar.runtime.launch import restart_count

    again = f" (torchrun restart {restart_count()})" if restart_count() else ""
    if cfg.checkpoint_dir is None:
        return f"; from step 0 again{again}: no --checkpoint-dir to resume from" if again else ""
    every = "at the end" if cfg.checkpoint_every is None else \
        f"every {cfg.checkpoint_every} steps and at the end"
    out = f"; checkpoints in {cfg.checkpoint_dir} {every}"
    if cfg.start_step is not None:
        out += f", resumed from step {cfg.start_step}{again}"
    elif again:
        out += f", from step 0 again{again}: no checkpoint was committed"
    return out


def _write_losses(cfg: TrainConfig, r: RunResult) -> None:
    """Every step's loss as JSON (the steps before a resume's checkpoint from its record),
    written whole or not at all."""
    import json
    from pathlib import Path

    path = Path(cfg.losses_json)  # type: ignore[arg-type]
    doc = {"mesh": cfg.mesh_text, "steps": cfg.steps, "resumed_from": r.resumed_from,
           "losses": r.losses}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


# Measured: nudging the 1-process run's weights by a relative 1e-7 moves its loss by ~1e-2 after
# 20 steps and up to ~0.1 within 60 (Adam normalises tiny gradient differences into full-size
# updates), so only the first steps can show agreement to rounding; after that the curves
# should track each other, not coincide.
_CHAOS_NOTE = (
    "(the runs differ first by fp32 rounding, since the sums are split differently across ranks; "
    "training amplifies\n such differences, so later steps agree in trend, not digit for digit)")

_PROMPT = "It was the "


@torch.no_grad()
def _sample(model: nn.Module, cfg: TrainConfig, n: int = 80, temperature: float = 0.7) -> str:
    """A seeded sampled continuation of a prompt by the one-process model: what "it learned"
    looks like. Sampled, not greedy: a small greedy model falls into "the the the" at once."""
    try:
        g = torch.Generator().manual_seed(cfg.seed)
        ids = torch.tensor([list(_PROMPT.encode())], dtype=torch.int64)
        for _ in range(n):
            logits = model(ids[:, -cfg.seq:])[:, -1] / temperature
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)
            ids = torch.cat([ids, nxt], dim=1)
        return decode(ids[0, len(_PROMPT):])
    except Exception:  # a model whose forward needs targets: the sample is only a nicety
        return ""
