"""A plan as a readable table: placements, collectives, predicted cost, solver, references."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from autopar.ir.placements import spec_str
from autopar.ir.units import fmt_bytes, fmt_time

if TYPE_CHECKING:
    from autopar.ir.plan import Plan

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _grouped_params(plan: Plan) -> list[tuple[str, str, int]]:
    """Parameters whose names differ only by a layer index and share a layout, folded."""
    groups: dict[tuple[str, str], int] = {}
    for name, spec in plan.decided.params.items():
        key = (_LAYER_INDEX.sub(".*.", name), spec_str(spec))
        groups[key] = groups.get(key, 0) + 1
    return [(name, spec, n) for (name, spec), n in groups.items()]


def text_table(headers: list[str], rows: list[list[str]], justify: str = "left",
               indent: str = "  ") -> list[str]:
    """``rows`` under ``headers`` as plain text lines, laid out by ``rich``: columns two spaces
    apart, a rule of dashes under the header, no colour or control codes (the lines go to logs
    and to tests as they go to a terminal), cells taken literally (no markup), never wrapped.
    ``justify``: ``"left"`` or ``"right"``, for every column."""
    import io

    from rich.box import Box
    from rich.console import Console
    from rich.table import Table

    # rich's box drawing, reduced to one line of "-" under the header (ASCII: any stream takes it)
    rule = Box("    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True)
    table = Table(box=rule, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                  header_style="", highlight=False)
    for h in headers:
        table.add_column(h, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(*r)
    buf = io.StringIO()
    Console(file=buf, width=100_000, color_system=None, force_terminal=False, markup=False,
            emoji=False, highlight=False, legacy_windows=False).print(table)
    return [indent + line.rstrip() for line in buf.getvalue().splitlines()]


def plan_table(plan: Plan, max_params: int = 40) -> str:
    """``plan`` as the text ``autopar plan`` prints.

    Args:
        plan: any plan (made, loaded from JSON, or a parallel module's ``.plan``).
        max_params: how many parameter rows to list (repeated layers are folded as ``*``).

    Returns:
        The table: the predicted step, memory and solver lines, precision, recomputation and
        parameter state, the pipeline's stages where it has any, and every input's and
        parameter's placement per mesh axis, the collectives per step and the references.

    Example:
        >>> import autopar
        >>> print(autopar.plan_table(autopar.Plan.load("plan.json")))  # doctest: +SKIP
    """
    mesh = " x ".join(f"{a}={n}" for a, n in zip(*reversed(plan.full_mesh)))
    shapes = ", ".join(f"{k} {v}" for k, v in plan.decided.input_shapes.items())
    c = plan.predicted.cost
    budget = _limit(plan)
    s = plan.provenance.solver
    lines = [
        f"autopar plan: {plan.provenance.model or 'model'} on {mesh} ({plan.decided.device}); "
        f"inputs {shapes}",
        f"predicted step {fmt_time(c.step_s)} = compute {fmt_time(c.compute_s)} + "
        f"communication {fmt_time(c.comm_s)}; memory {fmt_bytes(c.mem_bytes)} per device{budget}",
        f"solver: {s.status} ({s.method}) in {s.time_s:.2f} s; {s.variables} variables for "
        f"{s.nodes} graph nodes, {s.shared_layers} layers sharing variables",
        "precision: " + precision_line(plan),
        "recompute: " + recompute_line(plan),
        "parameter state: " + param_state_line(plan),
    ]
    if s.limit_cut:
        lines.insert(3, f"time limit: {s.limit_cut}")
    if plan.provenance.timings:
        t = plan.provenance.timings
        lines.append(
            "planning time: " + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in t.items())
        )
    if plan.decided.pipeline is not None:
        lines += [""] + pipeline_lines(plan)
    lines += ["", "inputs:"]
    lines += text_table(["input", "shape", "placement"],
                        [[k, str(plan.decided.input_shapes.get(k, "")), spec_str(v)]
                         for k, v in plan.decided.inputs.items()])
    grouped = _grouped_params(plan)
    lines += ["", f"parameters ({len(plan.decided.params)}; layers folded as *):"]
    rows = [[name + (f"  (x{n})" if n > 1 else ""), spec] for name, spec, n in grouped[:max_params]]
    axes = "per stage-mesh axis" if plan.decided.pipeline is not None else "per mesh axis"
    lines += text_table(["parameter", f"placement {axes}"], rows)
    if len(grouped) > max_params:
        lines.append(f"  ... {len(grouped) - max_params} more")
    piped = plan.decided.pipeline is not None
    lines += ["", "collectives per step" + (" of one stage, one microbatch (gradient syncs once "
                                             "per step):" if piped else ":")]
    if plan.predicted.collectives:
        lines += text_table(
            ["collective", "axis", "count", "bytes/device", "time", "why"],
            [[x.kind, x.axis, str(x.count), fmt_bytes(x.bytes), fmt_time(x.time_s), x.reason]
             for x in plan.predicted.collectives],
        )
    else:
        lines.append("  none")
    if any(x.reason == "gradient sync" for x in plan.predicted.collectives):
        from autopar.passes.cost.cost_model import BUCKET_BYTES

        first, rest = fmt_bytes(plan.decided.first_bucket_bytes), fmt_bytes(BUCKET_BYTES)
        lines.append("  gradient buckets, filled in reverse parameter order: " + (
            f"{rest} each (communication does not overlap compute on this device)"
            if plan.decided.first_bucket_bytes >= BUCKET_BYTES else
            f"the first closes at {first}, so its collective starts early, the others at "
            f"{rest}"))
    if plan.provenance.missing_rules:
        ops = ", ".join(f"{k} (x{v})" for k, v in sorted(plan.provenance.missing_rules.items()))
        lines += ["", f"ops with no sharding rule, planned replicated: {ops}"]
    if plan.provenance.references:
        lines += ["", "reference plans, scored by the same cost model:"]
        rows = []
        limit = plan.provenance.memory_budget

        def fits(mem: float) -> str:
            return "yes" if limit is None or mem <= limit * (1 + 1e-9) else "no"

        for name, rc in sorted(plan.provenance.references.items(), key=lambda kv: kv[1].step_s):
            ratio = rc.step_s / c.step_s if c.step_s else float("nan")
            rows.append([name, fmt_time(rc.step_s), fmt_time(rc.compute_s), fmt_time(rc.comm_s),
                         fmt_bytes(rc.mem_bytes), fits(rc.mem_bytes), f"{ratio:.2f}x"])
        rows.insert(0, ["autopar", fmt_time(c.step_s), fmt_time(c.compute_s), fmt_time(c.comm_s),
                        fmt_bytes(c.mem_bytes), fits(c.mem_bytes), "1.00x"])
        lines += text_table(
            ["plan", "step", "compute", "comm", "memory", "fits", "step vs autopar"], rows)
    return "\n".join(lines)


def _limit(plan: Plan) -> str:
    if plan.provenance.memory_budget is None:
        return " (no memory limit)"
    src = plan.provenance.memory_limit_source
    why = "" if src in ("", "given") else f": {src}"
    return f" (limit {fmt_bytes(plan.provenance.memory_budget)}{why})"


def precision_line(plan: Plan) -> str:
    p = plan.decided.precision
    if not p.mixed:
        return "fp32"
    line = (f"{p.name} compute; fp32 master weights and optimizer state; softmax, norms and the "
            f"loss in fp32; gradients reduced in {p.reduce}")
    return line + ("; dynamic loss scaling" if p.loss_scaling else "")


def recompute_line(plan: Plan) -> str:
    r = plan.decided.recompute
    asked = f" (asked: {r.asked})" if r.asked != r.mode else ""
    if r.mode == "none" or not r.nodes:
        return "none" + asked
    counts = sorted(set(r.per_layer.values()))
    each = f"{counts[0]} ops in each of" if len(counts) == 1 else f"{len(r.nodes)} ops over"
    step = plan.predicted.cost.step_s
    share = f" ({r.time_s / step:.1%} of the step)" if step else ""
    return (f"{r.mode}{asked}: {each} {len(r.per_layer)} traced layers "
            f"({_ranges(sorted(r.per_layer))}); costs {fmt_time(r.time_s)}{share}, saves "
            f"{fmt_bytes(r.saved_bytes)} at the peak")


def param_state_line(plan: Plan) -> str:
    """ZeRO stages, counted over parameters (with the axes the state is split over), and the
    optimizer state offloaded to the host."""
    from autopar.ir.param_state import STAGE_NAMES

    ps = plan.decided.param_state
    groups: dict[tuple[int, tuple[str, ...]], int] = {}
    for name, stage in ps.stages.items():
        key = (stage, ps.axes.get(name, ()))
        groups[key] = groups.get(key, 0) + 1
    total = len(plan.decided.params)
    parts = [f"{STAGE_NAMES[stage]} over {','.join(axes)} for {n} of {total}"
             for (stage, axes), n in sorted(groups.items())]
    rest = total - sum(groups.values())
    if rest:
        parts.append(f"split for compute on every axis (no state repeated) for {rest}")
    line = "; ".join(parts) or "none"
    if ps.offloaded:
        step = plan.predicted.cost.step_s
        share = f" ({ps.offload_s / step:.1%} of the step)" if step else ""
        line += (f"; optimizer state of {len(ps.offloaded)} parameters offloaded to host memory "
                 f"({fmt_bytes(ps.offload_bytes)} per device; costs {fmt_time(ps.offload_s)}"
                 f"{share})")
    return line


def _ranges(xs: list[int]) -> str:
    out, start = [], None
    for k, x in enumerate(xs):
        if start is None:
            start = x
        if k + 1 == len(xs) or xs[k + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def plan_diff(a: Plan, b: Plan, name_a: str = "A", name_b: str = "B") -> str:
    """What differs between two plans of one model: placements and predicted cost."""
    ca, cb = a.predicted.cost, b.predicted.cost
    lines = [f"{name_a}: step {fmt_time(ca.step_s)}, memory {fmt_bytes(ca.mem_bytes)}",
             f"{name_b}: step {fmt_time(cb.step_s)}, memory {fmt_bytes(cb.mem_bytes)}"]
    if a.decided.mesh_shape != b.decided.mesh_shape:
        lines.append(f"meshes differ: {a.decided.mesh_shape} vs {b.decided.mesh_shape}")
    rows = []
    for key in sorted(set(a.decided.inputs) | set(b.decided.inputs)):
        pa, pb = a.decided.inputs.get(key), b.decided.inputs.get(key)
        if pa != pb:
            rows.append([f"input {key}", spec_str(pa) if pa else "-", spec_str(pb) if pb else "-"])
    folded: dict[tuple[str, str, str], int] = {}
    for key in sorted(set(a.decided.params) | set(b.decided.params)):
        pa, pb = a.decided.params.get(key), b.decided.params.get(key)
        if pa != pb:
            k = (_LAYER_INDEX.sub(".*.", key), spec_str(pa) if pa else "-",
                 spec_str(pb) if pb else "-")
            folded[k] = folded.get(k, 0) + 1
    rows += [[name + (f"  (x{n})" if n > 1 else ""), sa, sb] for (name, sa, sb), n in folded.items()]
    if not rows:
        return "\n".join(lines + ["the plans place every parameter and input alike"])
    return "\n".join(lines + [""] + text_table(["tensor", name_a, name_b], rows))


def pipeline_lines(plan: Plan) -> list[str]:
    """The stages, schedule, microbatches and bubble of a pipeline plan."""
    pp = plan.decided.pipeline
    assert pp is not None
    stage_axes = " x ".join(f"{a}={n}"
                            for a, n in zip(plan.decided.mesh_axes, plan.decided.mesh_shape))
    lines = [
        f"pipeline: {pp.size} ranks on axis {pp.axis}, schedule {pp.schedule} with "
        f"{pp.virtual} stage(s) per rank, {pp.microbatches} microbatches; each stage on a "
        f"{stage_axes} submesh",
        f"  predicted bubble {pp.bubble:.1%} of the step (textbook (p-1)/(v*m) = "
        f"{pp.textbook_bubble:.3f} of ideal time); boundary send {fmt_time(pp.send_s)} per "
        f"microbatch; gradient sync {fmt_time(pp.sync_s)} per step on the slowest rank",
        f"  why: {pp.reason}",
    ]
    rows = []
    for st in pp.stages:
        what = [f"blocks {st.first_block}-{st.end_block - 1}" if st.blocks > 1
                else f"block {st.first_block}"]
        if st.first:
            what.insert(0, "embedding")
        if st.last:
            what.append("head")
        rows.append([str(st.index), str(st.rank), " + ".join(what), fmt_time(st.time_s),
                     str(st.in_flight), st.recompute_mode(plan.decided.recompute.mode),
                     fmt_bytes(st.memory_bytes)])
    lines += text_table(["stage", "rank", "holds", "time/microbatch", "in flight", "recompute",
                         "memory"], rows)
    modes = list(pp.stage_recompute(plan.decided.recompute.mode))
    if set(modes) != {plan.decided.recompute.mode}:
        counts = {m: modes.count(m) for m in dict.fromkeys(modes)}
        lines.append("  recomputation per stage (each the fastest that fits its microbatches in "
                     "flight): " + ", ".join(f"{m} on {n} stage(s)" for m, n in counts.items()))
    per_rank = ", ".join(fmt_bytes(b) for b in pp.rank_memory_bytes)
    lines.append(f"  memory per pipeline rank: {per_rank}")
    finite = [o for o in pp.options if math.isfinite(o.step_s)]
    shown = finite[:6]
    if len(pp.options) > 1:
        lines.append("  schedules weighed (fastest first):")
        lines += text_table(
            ["schedule", "v", "m", "step", "bubble", "memory"],
            [[o.schedule, str(o.virtual), str(o.microbatches), fmt_time(o.step_s),
              f"{o.bubble:.1%}", fmt_bytes(o.mem_bytes)] for o in shown], indent="    ")
        if len(finite) > len(shown):
            lines.append(f"    ... {len(finite) - len(shown)} slower ones that fit")
        failed = len(pp.options) - len(finite)
        if failed:
            notes = sorted({o.note for o in pp.options if o.note})[:2]
            lines.append(f"    ... {failed} that do not fit or cannot be cut: " + "; ".join(notes))
    return lines
