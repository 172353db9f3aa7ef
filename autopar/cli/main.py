"""The ``autopar`` command line: ``plan``, ``solve`` and ``train``.

Every error a user can cause ends with one line on stderr naming the cause, and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.cli.options import (
    UsageError,
    add_memory_options,
    add_pipeline_options,
    check_batch,
    options_from_args,
    parse_bytes,
)
from autopar.ir.errors import AutoparError
from autopar.ir.mesh import Mesh
from autopar.ir.options import SHAPE_LIMIT_S, TIME_LIMIT_S
from autopar.report.plan_progress import plan_progress
from autopar.report.table import plan_table, text_table

__all__ = ["UsageError", "build_parser", "load_model", "main", "parse_bytes"]


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
    # a module in the folder the command runs in is found, as ``python -m`` finds it (the
    # console script's own folder heads sys.path, not the caller's)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
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
    if args.time_limit is None:
        args.time_limit = TIME_LIMIT_S
    progress = plan_progress(args.time_limit, force=args.progress)
    options = options_from_args(args, workers=default_workers()).with_deadline(progress)
    loaded = load_model(args.model, args.batch, args.seq)
    pp = pipeline_axis(mesh)
    if pp is None and (args.schedule or args.microbatches or args.virtual):
        raise UsageError("--schedule, --microbatches and --virtual need a pipeline axis: "
                         "add one to the mesh, e.g. --mesh pp=2,dp=4")
    ref_mesh = mesh if pp is None else stage_mesh(mesh, pp)
    refs = comparison_plans(loaded.model, ref_mesh.shape, ref_mesh.axes, loaded.family,
                            batch_size=args.batch, pipeline=pp is not None
                            ) if args.compare else {}
    planner = make_plan if pp is None else plan_pipeline
    planned = planner(loaded.model, mesh, loaded.inputs, loaded.kwargs, options=options,
                      references=refs, model_name=loaded.name)
    if progress is not None:
        progress.close()
    return _report(planned, args)


def plan_for_devices(args: argparse.Namespace) -> int:
    """``--devices N``: every pp x dp x tp shape of N devices planned, the best few shown
    side by side, then the winner's plan (:mod:`autopar.planning.shapes`)."""
    from autopar.ir.units import fmt_bytes, fmt_time
    from autopar.planning.parallel_map import default_workers
    from autopar.planning.pipeline import plan_pipeline, stage_mesh
    from autopar.planning.planner import make_plan
    from autopar.planning.shapes import QUICK_S, search_shapes, shape_mesh

    if args.schedule or args.microbatches or args.virtual:
        raise UsageError("--devices picks the mesh shape itself: drop --schedule, "
                         "--microbatches and --virtual, or give --mesh")
    # --time-limit bounds the whole search (each shape an equal share); without it, each
    # shape's planning has its own limit (shapes.SHAPE_LIMIT_S)
    whole = args.time_limit is not None
    progress = plan_progress(args.time_limit if whole else SHAPE_LIMIT_S, force=args.progress)
    options = options_from_args(args, workers=1, time_limit_s=args.time_limit or SHAPE_LIMIT_S)
    options = options.with_deadline(progress) if whole else options
    loaded = load_model(args.model, args.batch, args.seq)

    def references_for(shape):  # --compare: the fixed layouts, on the shape's stage submesh
        from autopar.models.reference_plans import comparison_plans

        mesh = shape_mesh(shape, args.device)
        pp = "pp" in mesh.axes
        sub = stage_mesh(mesh, mesh.axes.index("pp")) if pp else mesh
        return comparison_plans(loaded.model, sub.shape, sub.axes, loaded.family,
                                batch_size=args.batch, pipeline=pp)

    # each shape with the search's short solver limit, the shapes over every core
    results = search_shapes(loaded.model, args.devices, loaded.inputs, loaded.kwargs,
                            args.device,
                            options.replace(time_limit_s=QUICK_S, workers=default_workers()),
                            model_name=loaded.name,
                            references_for=references_for if args.compare else None)
    if progress is not None:
        progress.close()
    fitting = [r for r in results if r.fits]
    print(f"mesh shapes of {args.devices} devices ({args.device}), {len(results)} planned; "
          f"{len(fitting)} fit:")
    rows = [[f"{r.shape.pp} x {r.shape.dp} x {r.shape.tp}",
             fmt_time(r.step_s) if r.fits else "-",
             f"{r.step_s / results[0].step_s:.2f}x" if r.fits else "-",
             fmt_bytes(r.mem_bytes) if r.fits else "-", r.note[:70]]
            for r in results[:args.top]]
    print("\n".join(text_table(["pp x dp x tp", "step", "vs best", "memory", "note"], rows)))
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
    planner = plan_pipeline if best.shape.pp > 1 else make_plan
    return _report(planner(loaded.model, mesh, loaded.inputs, loaded.kwargs, options=options,
                           model_name=loaded.name), args)


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
    pl.add_argument("--device", default="h100",
                    help="device profile: h100, h100-96gb, h200, a100, a100-40gb, cpu; a GPU's "
                         "name with +async-tp (h100+async-tp) prices sequence-parallel TP's "
                         "collectives as torch's async TP hides them")
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
    pl.add_argument("--time-limit", type=float, default=None,
                    help="seconds the whole planning may take (every mode, reference, pipeline "
                    "and mesh-shape search); at the limit the best plan so far is kept "
                    f"(default {TIME_LIMIT_S:g}; with --devices, each shape's planning is "
                    f"limited to {SHAPE_LIMIT_S:g} s instead of the whole search)")
    pl.add_argument("--progress", action="store_true",
                    help="show the planner's progress on stderr even when it is not a "
                    "terminal (on a terminal it shows after 2 s)")
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
