"""The ``autopar`` command line: ``plan``, ``solve`` and ``train``.

Every error a user can cause ends with one line on stderr naming the cause, and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.ir.errors import AutoparError
from autopar.ir.mesh import DATA_PARALLEL_AXES, Mesh
from autopar.report.table import plan_table

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6,
          "mib": 2**20, "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12,
          "tib": 2**40}


class UsageError(AutoparError):
    pass


def parse_bytes(text: str) -> float:
    if text.strip().lower() in ("none", "unlimited", "inf"):
        return float("inf")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"cannot read memory size {text!r}: write e.g. 80GiB, 40GB or 1.5e10")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


@dataclass
class LoadedModel:
    model: nn.Module  # on the meta device
    inputs: tuple  # example inputs, positional
    kwargs: dict  # and by keyword (a Hugging Face model's input_ids and labels)
    name: str
    family: str  # the reference layouts' family (models.reference_plans)


def load_model(spec: str, batch: int, seq: int) -> LoadedModel:
    """The model and example inputs from a preset or module:factory. A factory may return
    ``(model, example_inputs)``, or a model alone with ``config.vocab_size``: a Hugging Face
    causal LM is then called with ``input_ids`` and ``labels`` of ``batch x seq`` random
    tokens, any other model with them as its two positional inputs."""
    from autopar.models import PRESETS, get_preset

    if ":" not in spec:
        preset = get_preset(spec)
        cfg = preset.config
        for fld in ("n_positions", "max_seq_len"):
            if hasattr(cfg, fld) and seq > getattr(cfg, fld):
                preset = preset.replace(**{fld: seq})
        return LoadedModel(preset.build("meta"), preset.example_inputs(batch, seq, "meta"), {},
                           spec, preset.family)
    mod_name, _, fn_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise UsageError(
            f"cannot load model factory {spec!r} ({e}); give a preset ({', '.join(PRESETS)}) "
            "or package.module:function"
        ) from e
    params = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in params}
    with torch.device("meta"):
        made = factory(**kwargs)
    model, inputs = made if isinstance(made, tuple) else (made, None)
    family = "hf" if _is_hugging_face(model) else "custom"
    if inputs is not None:
        return LoadedModel(model, tuple(inputs), {}, spec, family)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        raise UsageError(
            f"{spec} returned a model without example inputs: return (model, example_inputs)"
        )
    tok = torch.randint(0, vocab, (batch, seq), device="meta")
    if {"input_ids", "labels"} <= set(inspect.signature(model.forward).parameters):
        return LoadedModel(model, (), {"input_ids": tok, "labels": tok}, spec, family)
    return LoadedModel(model, (tok, tok), {}, spec, family)


def _is_hugging_face(model: nn.Module) -> bool:
    """The model is, or wraps, a transformers model (its layers take the "hf" layouts)."""
    return any(type(m).__module__.startswith("transformers.") for m in model.modules())


def check_batch(mesh: Mesh, batch: int) -> None:
    dp = mesh.data_parallel_size
    names = [f"{a}={n}" for a, n in zip(mesh.axes, mesh.shape) if a.lower() in DATA_PARALLEL_AXES]
    if dp > 1 and batch % dp:
        raise UsageError(
            f"batch {batch} cannot be split over the data-parallel axes {'x'.join(names)} "
            f"({dp} ways): use a batch that is a multiple of {dp}, or a smaller dp axis"
        )


def cmd_plan(args: argparse.Namespace) -> int:
    from autopar.models.reference_plans import comparison_plans
    from autopar.planning.parallel_map import default_workers
    from autopar.planning.pipeline import pipeline_axis, plan_pipeline, stage_mesh
    from autopar.planning.planner import make_plan

    if args.devices is not None:
        if args.mesh is not None:
            raise UsageError("give --mesh or --devices, not both: --devices N searches the "
                             "mesh shapes of N devices itself")
        return plan_for_devices(args)
    mesh = Mesh.parse(args.mesh or "dp=8", args.device)
    check_batch(mesh, args.batch)
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    loaded = load_model(args.model, args.batch, args.seq)
    pp = pipeline_axis(mesh)
    if pp is None and (args.schedule or args.microbatches or args.virtual):
        raise UsageError("--schedule, --microbatches and --virtual need a pipeline axis: "
                         "add one to the mesh, e.g. --mesh pp=2,dp=4")
    ref_mesh = mesh if pp is None else stage_mesh(mesh, pp)
    refs = comparison_plans(loaded.model, ref_mesh.shape, ref_mesh.axes, loaded.family,
                            batch_size=args.batch) if args.compare else {}
    common = dict(memory_budget=budget, time_limit_s=args.time_limit, references=refs,
                  model_name=loaded.name,
                  max_layers=args.trace_layers if args.trace_layers > 0 else None,
                  precision=args.precision, reduce_dtype=args.reduce_dtype,
                  recompute=args.recompute, zero=args.zero, offload=args.offload,
                  workers=default_workers())
    if pp is None:
        planned = make_plan(loaded.model, mesh, loaded.inputs, loaded.kwargs, **common)
    else:
        planned = plan_pipeline(loaded.model, mesh, loaded.inputs, loaded.kwargs, **common,
                                schedule=args.schedule, microbatches=args.microbatches,
                                virtual=args.virtual)
    return _report(planned, args)


def plan_for_devices(args: argparse.Namespace) -> int:
    """``--devices N``: every pp x dp x tp shape of N devices planned, the best few shown
    side by side, then the winner's plan (:mod:`autopar.planning.shapes`)."""
    from autopar.ir.units import fmt_bytes, fmt_time
    from autopar.planning.parallel_map import default_workers
    from autopar.planning.pipeline import plan_pipeline
    from autopar.planning.planner import make_plan
    from autopar.planning.shapes import search_shapes, shape_mesh

    if args.schedule or args.microbatches or args.virtual or args.compare:
        raise UsageError("--devices picks the mesh shape itself: drop --schedule, "
                         "--microbatches, --virtual and --compare, or give --mesh")
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    loaded = load_model(args.model, args.batch, args.seq)
    options = dict(memory_budget=budget, recompute=args.recompute, zero=args.zero,
                   offload=args.offload)
    results = search_shapes(loaded.model, args.devices, loaded.inputs, loaded.kwargs,
                            args.device, workers=default_workers(), model_name=loaded.name,
                            max_layers=args.trace_layers if args.trace_layers > 0 else None,
                            precision=args.precision, reduce_dtype=args.reduce_dtype,
                            **options)
    fitting = [r for r in results if r.fits]
    print(f"mesh shapes of {args.devices} devices ({args.device}), {len(results)} planned; "
          f"{len(fitting)} fit:")
    rows = [["pp x dp x tp", "step", "vs best", "memory", ""]]
    for r in results[:args.top]:
        rows.append([f"{r.shape.pp} x {r.shape.dp} x {r.shape.tp}",
                     fmt_time(r.step_s) if r.fits else "-",
                     f"{r.step_s / results[0].step_s:.2f}x" if r.fits else "-",
                     fmt_bytes(r.mem_bytes) if r.fits else "-", r.note[:70]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if not fitting:
        raise UsageError(f"no mesh shape of {args.devices} devices fits: "
                         + (results[0].note if results else "no shape splits the batch"))
    best = fitting[0]
    print()
    if not (args.explain or args.timeline):
        print(plan_table(best.plan))
        if args.json:
            best.plan.save(args.json)
            print(f"\nplan written to {args.json}")
        return 0
    mesh = shape_mesh(best.shape, args.device)  # planned again, whole, for its graph
    common = dict(time_limit_s=args.time_limit, model_name=loaded.name, workers=1,
                  max_layers=args.trace_layers if args.trace_layers > 0 else None,
                  precision=args.precision, reduce_dtype=args.reduce_dtype, **options)
    planner = plan_pipeline if best.shape.pp > 1 else make_plan
    return _report(planner(loaded.model, mesh, loaded.inputs, loaded.kwargs, **common), args)


def _report(planned, args: argparse.Namespace) -> int:
    """The plan's table, then what the options ask for: explanations, JSON, timeline."""
    print(plan_table(planned.plan))
    for node in args.explain or []:
        print()
        print(planned.explain(node))
    if args.json:
        planned.plan.save(args.json)
        print(f"\nplan written to {args.json}")
    if args.timeline:
        from autopar.report.timeline import write_timeline

        tl = write_timeline(planned, args.timeline)
        print(f"\npredicted timeline ({tl.step_s * 1e3:.3f} ms) written to {args.timeline}: "
              "open it in https://ui.perfetto.dev")
    return 0


def add_memory_options(p: argparse.ArgumentParser) -> None:
    """The precision and recomputation options ``plan`` and ``train`` share."""
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"),
                   help="compute dtype (default: bf16 on GPU device profiles, fp32 on cpu); "
                   "master weights and optimizer state stay fp32")
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"),
                   help="dtype gradients are summed across ranks in (default fp32)")
    p.add_argument("--recompute", default="auto", choices=("auto", "none", "selective", "full"),
                   help="activation recomputation (default auto: only where the plan would "
                   "not fit otherwise)")
    p.add_argument("--zero", default="auto", choices=("auto", "1", "2", "3"),
                   help="ZeRO stage of the parameters the plan stores split: 3 gathers them "
                   "again in the backward, 2 keeps them gathered from the forward, 1 also "
                   "all-reduces whole gradients (default auto: 2 or 3, the faster that fits)")
    p.add_argument("--offload", default="auto", choices=("auto", "none", "optimizer"),
                   help="optimizer state in host memory (default auto: only where no plan "
                   "fits without; 'optimizer': every parameter's)")


def add_pipeline_options(p: argparse.ArgumentParser) -> None:
    """The pipeline choices ``plan`` and ``train`` share (a mesh with a ``pp`` axis)."""
    from autopar.ir.schedules import SCHEDULE_TABLE

    p.add_argument("--schedule", help="pipeline schedule: "
                   + ", ".join(f"{s.name} ({s.key})" for s in SCHEDULE_TABLE)
                   + " (default: the planner's choice)")
    p.add_argument("--microbatches", type=int, metavar="M",
                   help="microbatches per step (default: the planner's choice)")
    p.add_argument("--virtual", type=int, metavar="V",
                   help="pipeline stages per rank (default: the planner's choice)")


def cmd_diff(args: argparse.Namespace) -> int:
    from autopar.ir.plan import Plan
    from autopar.report.table import plan_diff

    print(plan_diff(Plan.load(args.a), Plan.load(args.b), args.a, args.b))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="print the sharding plan autopar picks for a model and mesh")
    pl.add_argument("model", help="a preset (e.g. llama3-8b, gpt2-small) or package.module:factory")
    pl.add_argument("--mesh", help="axis=size pairs, e.g. dp=8,tp=8 or pp=4,dp=8,tp=8 "
                    "(default dp=8)")
    pl.add_argument("--devices", type=int, metavar="N",
                    help="search the pp x dp x tp shapes of N devices instead of a given mesh "
                    "(tp within a node) and plan the best")
    pl.add_argument("--top", type=int, default=6, metavar="K",
                    help="with --devices: how many shapes to list (default 6)")
    pl.add_argument("--batch", type=int, default=8, help="global batch size (default 8)")
    pl.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    pl.add_argument("--device", default="h100", help="device profile: h100, h200, a100, cpu")
    pl.add_argument("--memory-budget",
                    help="per-device memory limit, e.g. 80GiB (default: the device's capacity "
                    "less a reserve; 'none' for no limit)")
    add_memory_options(pl)
    pl.add_argument("--compare", action="store_true", help="score the reference plans beside it")
    add_pipeline_options(pl)
    pl.add_argument("--json", help="also write the plan as JSON to this path")
    pl.add_argument("--timeline", metavar="FILE",
                    help="also write the predicted timeline of one step as a Chrome/Perfetto "
                    "trace (JSON) to this path")
    pl.add_argument("--time-limit", type=float, default=30.0, help="solver time limit, seconds")
    pl.add_argument("--trace-layers", type=int, default=4, metavar="N",
                    help="trace a deeper model as a proxy of N of its layers, the middle ones "
                    "weighted to stand for the rest (default 4; 0 traces every layer)")
    pl.add_argument("--explain", action="append", metavar="NODE",
                    help="explain the choice for a graph node or parameter name (repeatable)")
    pl.set_defaults(func=cmd_plan)
    df = sub.add_parser("diff", help="show how two plan JSON files differ")
    df.add_argument("a")
    df.add_argument("b")
    df.set_defaults(func=cmd_diff)
    from autopar.solver import command as solve_command

    solve_command.register(sub)
    try:
        from autopar.cli import train as train_command
    except ImportError:  # the runtime is optional for planning-only installs
        train_command = None
    if train_command is not None:
        train_command.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (AutoparError, FileNotFoundError) as e:
        if os.environ.get("AUTOPAR_DEBUG"):
            raise
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
