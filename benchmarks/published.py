"""Published training runs as a benchmark: autopar's predictions held against measured throughput.

    python benchmarks/published.py --runs ../shared/bench/published/runs.json --json OUT
        [--only ID ...] [--no-search] [--time-limit S] [--run-timeout S] [--rows OLD] [--write]

Each run of the file (the schema of ``shared/bench/published/README.md``: ``model``, ``gpu``,
``layout``, ``compare.tokens_per_s_per_gpu``) is rebuilt from its architecture numbers on meta
tensors (GPT-style: learned positions, GELU MLP of ``4 x hidden``, tied embeddings; Llama-style
where the run has grouped kv heads or an FFN other than ``4 x hidden``: RoPE, SwiGLU, RMSNorm)
and planned three ways on the device profile of its GPU:

1. **the published layout, pinned**: the mesh ``pp x dp x tp`` as published, its schedule,
   stages per rank and microbatch count, its parameter placements (Megatron tensor parallel,
   data parallel replicated, or sharded for FSDP and a distributed optimizer), its ZeRO stage,
   its recomputation and its precision; the solver only completes what the layout leaves open
   (activation placements), by work rather than by the clock, so the figure is the same at
   any load and any ``--time-limit`` (``PinnedLayout.exact``). Its predicted step gives
   ``predicted_published_layout_tokens_per_s_per_gpu``.
2. **autopar's own plan on the published mesh** (nothing pinned but the precision, the
   published layout scored beside it, as ``autopar plan --compare`` does);
3. **autopar's own mesh shape** for the same devices and global batch (``autopar plan
   --devices N``; ``--no-search`` skips it). ``autopar_tokens_per_s_per_gpu`` is the faster of
   2 and 3, ``plan_s`` the planning time of 2 and 3 together.

A run whose layout autopar cannot express is reported with ``expressible: false`` and the
reason in ``why``; a field the source leaves open that the layout needs is such a reason.
What is expressed only approximately is said in ``notes``. Each run plans in a forked process;
one that takes longer than ``--run-timeout`` is reported as too slow to plan (keeping its
published layout's price where that was done). ``--rows OLD`` takes the rows of an earlier
OUT instead of planning those runs again. ``--write`` replaces the table and its summary
lines in RESULTS.md's "Published runs" and keeps the prose around them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, "benchmarks")
from _common import machine, table, update_results  # noqa: E402

SLOW_PLAN_S = 60.0  # a run planned slower than this is flagged (issue 21: 405B-class < 60 s)


# --- reading a run --------------------------------------------------------------------------


class NotExpressible(Exception):
    """The run's layout (or a field it needs) is outside what autopar can pin; the message
    says which and why."""


@dataclass
class Layout:
    """A published layout as autopar pins it."""

    device: str  # the device profile's name
    tp: int
    pp: int
    dp: int
    batch: int  # global batch, sequences
    seq: int
    micro_batch: int
    microbatches: int | None  # per step, pp > 1 only
    schedule: str | None  # torch's schedule name, pp > 1 only
    virtual: int | None
    zero: str | None  # "1" distributed optimizer, "3" FSDP, None: data parallel (replicated)
    recompute: str  # none | selective | full
    precision: str  # bf16 | fp16 | fp32
    notes: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def mesh_text(self) -> str:
        parts = [(a, n) for a, n in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp)) if n > 1]
        return ",".join(f"{a}={n}" for a, n in parts) or "dp=1"


def device_profile_name(gpu: dict) -> str:
    """The profile of a run's GPU, from its words: A100 40/80 GB, H100 SXM (80 GB HBM3, 700 W)
    or the 96 GB HBM2e H100 capped at 500 W; any other is not expressible."""
    from autopar.ir.devices import PROFILES

    words = str(gpu.get("type", "")).lower()
    if "a100" in words:
        name = "a100-40gb" if re.search(r"\b40\s*gb", words) else "a100"
    elif "h100" in words:
        name = "h100-96gb" if re.search(r"\b96\s*gb", words) else "h100"
    elif "h200" in words:
        name = "h200"
    else:
        raise NotExpressible(f"no device profile for GPU {gpu.get('type')!r}")
    if name not in PROFILES:
        raise NotExpressible(f"no device profile {name!r} for GPU {gpu.get('type')!r}")
    return name


def _int(layout: dict, key: str) -> int:
    v = layout.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise NotExpressible(f"layout.{key} is {v!r}: the source does not give it as a "
                             "whole number, and the layout needs it")
    return v


def _schedule(words: str, pp: int, virtual: int | None) -> str | None:
    if pp == 1:
        return None
    w = words.lower()
    if "zero bubble" in w or "zb" in w.split():
        raise NotExpressible(f"schedule {words!r}: pin it by torch's name")
    if "interleaved" in w and "non-interleaved" not in w:
        return "Interleaved1F1B"
    if "1f1b" in w:
        if virtual and virtual > 1:
            raise NotExpressible(f"schedule {words!r} with {virtual} stages per rank")
        return "1F1B"
    if "gpipe" in w:
        return "GPipe"
    raise NotExpressible(f"schedule {words!r}: not one autopar knows by these words")


def _zero(words: str | None) -> tuple[str | None, str]:
    """(ZeRO stage pinned, how) from the source's words."""
    w = (words or "").lower()
    if not w:
        raise NotExpressible("layout.zero not stated")
    if "fsdp" in w or "fully shard" in w or "stage 3" in w or "zero-3" in w:
        return "3", "FSDP: parameters sharded over dp, gathered again in the backward"
    if "stage 2" in w or "zero-2" in w:
        return "2", "ZeRO-2"
    if "stage 1" in w or "zero-1" in w or "distributed optimizer" in w:
        return "1", ("distributed optimizer (ZeRO-1): parameters stored split over dp, "
                     "gradients reduced whole")
    if w.startswith("none") or "ddp" in w:
        return None, "data parallel: parameters replicated over dp"
    raise NotExpressible(f"layout.zero {words!r}: not a ZeRO stage autopar knows")


def _recompute(words: str | None) -> str:
    w = (words or "").lower()
    for mode in ("selective", "full", "none"):
        if w.startswith(mode):
            return mode
    if "checkpoint-activations" in w:
        return "full"
    raise NotExpressible(f"layout.recompute {words!r}: the source does not say which "
                         "activations were recomputed")


def _precision(words: str | None) -> str:
    w = (words or "").lower()
    if "bf16" in w or "bfloat16" in w:
        return "bf16"
    if "fp16" in w or "float16" in w:
        return "fp16"
    if "fp32" in w or "float32" in w:
        return "fp32"
    raise NotExpressible(f"layout.precision {words!r}: not a precision autopar knows")


def read_layout(run: dict) -> Layout:
    """The run's layout as autopar pins it, or :class:`NotExpressible` naming why not."""
    lay, gpu, model = run["layout"], run["gpu"], run["model"]
    device = device_profile_name(gpu)
    tp, pp = _int(lay, "tp"), _int(lay, "pp")
    count = gpu.get("count")
    if not isinstance(count, int) or count < 1:
        raise NotExpressible(f"gpu.count is {count!r}")
    dp = lay.get("dp")
    if dp is None:
        if count % (tp * pp):
            raise NotExpressible(f"layout.dp not stated and {count} GPUs do not split into "
                                 f"tp={tp} x pp={pp}")
        dp = count // (tp * pp)
    if tp * pp * dp != count:
        raise NotExpressible(f"tp={tp} x pp={pp} x dp={dp} is not the {count} GPUs")
    cp = lay.get("cp") or 1
    if cp != 1:
        raise NotExpressible(f"context parallel (cp={cp}) is not in autopar's space")
    batch = _int(lay, "global_batch_seqs")
    micro = _int(lay, "micro_batch")
    seq = model.get("seq")
    if not isinstance(seq, int):
        raise NotExpressible(f"model.seq is {seq!r}")
    if batch % (dp * micro):
        raise NotExpressible(f"a global batch of {batch} does not split into microbatches of "
                             f"{micro} over dp={dp}")
    virtual = lay.get("virtual")
    sched = _schedule(str(lay.get("schedule") or ""), pp, virtual)
    zero, zero_how = _zero(lay.get("zero"))
    notes = [zero_how]
    steps = batch // (dp * micro)
    microbatches = steps if pp > 1 else None
    if pp == 1 and steps > 1:
        notes.append(f"{steps} gradient-accumulation steps priced as one step of the rank's "
                     f"{batch // dp} sequences (the same work; one gradient sync either way)")
    if pp > 1 and sched == "Interleaved1F1B" and steps % pp:
        raise NotExpressible(f"interleaved 1F1B with {steps} microbatches on {pp} stages: "
                             "torch's schedule needs a multiple of the stages")
    sp = lay.get("sequence_parallel")
    if sp:
        notes.append("sequence parallel is not pinned: the solver places the activations")
    if async_tp(run):
        from autopar.ir.devices import ASYNC_TP_SUFFIX, get_profile

        device = get_profile(device + ASYNC_TP_SUFFIX).name
        notes.append("async TP: its share of sequence-parallel TP's collectives hidden "
                     "(autopar.ir.devices.ASYNC_TP_HIDDEN)")
    return Layout(device, tp, pp, dp, batch, seq, micro, microbatches, sched,
                  virtual if sched == "Interleaved1F1B" else None, zero,
                  _recompute(lay.get("recompute")), _precision(lay.get("precision")), notes)


def async_tp(run: dict) -> bool:
    """Whether the run used torch's async tensor parallelism, from its words (the layout's
    fields or the figure ``as_published``): the schema has no field of its own for it."""
    words = " ".join(str(v) for v in run["layout"].values())
    words += " " + str((run.get("measured") or {}).get("as_published", ""))
    return run["layout"].get("tp", 1) > 1 and bool(
        re.search(r"\basync(hronous)?[ -]?(tp|tensor[ -]parallel)", words.lower()))


# Megatron-LM's default dropout (0.1) is not modelled: autopar draws a dropout mask whole on
# every rank (so that a run matches one device's numbers), which would price each rank's
# draw at the global batch; a run's file may set model.dropout
DROPOUT = 0.0


def fused_attention(model: dict, llama: bool) -> bool:
    """Whether the run's attention is one fused kernel: ``model.attention`` (``"fused"`` or
    ``"unfused"``) where the file says; otherwise GPT-style models are Megatron-LM's GPT of
    the schema (Megatron-LM, Megatron-DeepSpeed and metaseq as the SC'21, BLOOM and OPT runs
    used them), whose attention materializes the scores (fused kernels came to them after
    FlashAttention, 2022); Llama-style models run torch's SDPA."""
    words = str(model.get("attention") or "").lower()
    if words:
        if words not in ("fused", "unfused", "flash", "sdpa"):
            raise NotExpressible(f"model.attention {words!r}: give fused or unfused")
        return words != "unfused"
    return llama


def build_model(model: dict):
    """The run's model on meta tensors and its example inputs (tokens, targets)."""
    from autopar.models import ModelPreset
    from autopar.models.gpt2 import GPT2Config
    from autopar.models.llama3 import LlamaConfig

    h, layers, heads, seq = model["hidden"], model["layers"], model["heads"], model["seq"]
    vocab = model.get("vocab")
    if not isinstance(vocab, int):
        raise NotExpressible(f"model.vocab is {vocab!r}: the embedding and head need it")
    ffn = model.get("ffn") or 4 * h
    kv = model.get("kv_heads")
    style = str(model.get("style") or model.get("family") or "").lower()
    llama = style.startswith("llama") or (not style and (
        (kv is not None and kv != heads) or ffn != 4 * h))
    try:
        if llama:
            cfg = LlamaConfig(vocab_size=vocab, dim=h, n_layers=layers, n_heads=heads,
                              n_kv_heads=kv or heads, ffn_dim=ffn, max_seq_len=seq)
            preset = ModelPreset(model.get("name", "llama"), "llama3", cfg)
        else:
            if ffn != 4 * h:
                raise NotExpressible(f"a GPT-style model with ffn={ffn}, not 4 x hidden")
            cfg = GPT2Config(vocab_size=vocab, n_layer=layers, n_head=heads, d_model=h,
                             n_positions=seq, fused_attention=fused_attention(model, llama),
                             dropout=float(model.get("dropout", DROPOUT)))
            preset = ModelPreset(model.get("name", "gpt"), "gpt2", cfg)
    except ValueError as e:
        raise NotExpressible(f"the architecture cannot be built: {e}") from None
    return preset


# --- planning -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PinnedLayout:
    """A reference layout with its ZeRO stage (read by the planner's ``reference_mode``).
    ``exact``: completed by work, not by the clock (``planning.references.exact_completion``), so the
    published layout's price is the same at any load, and autopar's own plan, which it
    seeds, is never slower than it."""

    name: str
    params: dict
    inputs: dict
    recompute: str
    zero: str | None
    exact: bool = True
    # mesh axes on which each parameter is multiplied where it is stored (tensor parallel as
    # Megatron-LM and torchtitan run it: no weight gathered, no weight gradient reduced
    # there; autopar.planning.used_in_place), rather than only stored so
    used_in_place: tuple[str, ...] = ()


def pinned_reference(model, layout: Layout, stage_shape, stage_axes, family: str,
                     fused_attention: bool = True) -> PinnedLayout:
    """The published layout as a reference. Tensor parallelism is pinned as run (each weight
    multiplied on its own shard: ``used_in_place``) where the attention is one fused kernel.
    An unfused attention's batched GEMMs fold batch and heads into one dim, which cannot
    carry a batch split over dp and a head split over tp at once (the heads' shard is strided
    there, not a ``Shard``: ``passes/strategies/_layout.view_dim_map``), so in place the
    completion would gather the attention's inputs over tp, which Megatron does not: there the
    completion places the weights' uses itself, as before."""
    from autopar.models.reference_plans import REFERENCE_PLANS

    sharded = layout.zero is not None
    if layout.tp > 1:
        name = "fsdp_tp_2d" if sharded else "dp_tp_2d"
        if layout.dp == 1:
            name = "megatron_tp"
    else:
        name = "fsdp" if sharded else "data_parallel"
    ref = REFERENCE_PLANS[name](model, stage_shape, stage_axes, family,
                                batch_size=layout.batch // (layout.microbatches or 1))
    if ref is None:
        raise NotExpressible(f"the {name} layout does not apply to mesh {stage_axes}")
    return PinnedLayout("published", ref.params, ref.inputs, layout.recompute, layout.zero,
                        used_in_place=("tp",) if layout.tp > 1 and fused_attention else ())


@dataclass
class Pinned:
    """A run's model (meta tensors), inputs and mesh, its published layout as a reference,
    and the planner and options that price it."""

    layout: Layout
    model: Any
    inputs: Any
    mesh: Any
    reference: PinnedLayout
    common: dict
    planner: Callable

    @classmethod
    def of(cls, layout: Layout, preset, time_limit_s: float) -> Pinned:
        from autopar.ir.mesh import Mesh
        from autopar.ir.pipeline_mesh import stage_mesh
        from autopar.planning.parallel_map import default_workers
        from autopar.planning.pipeline import plan_pipeline
        from autopar.planning.planner import make_plan

        model = preset.build("meta")
        inputs = preset.example_inputs(layout.batch, layout.seq, "meta")
        mesh = Mesh.parse(layout.mesh_text, layout.device)
        pp = layout.pp > 1
        sub = stage_mesh(mesh, mesh.axes.index("pp")) if pp else mesh
        reference = pinned_reference(model, layout, sub.shape, sub.axes, preset.family,
                                     getattr(preset.config, "fused_attention", True))
        common = dict(precision=layout.precision, max_layers=4, time_limit_s=time_limit_s,
                      workers=default_workers())
        return cls(layout, model, inputs, mesh, reference, common,
                   plan_pipeline if pp else make_plan)

    def priced(self, model_name: str):
        """The published layout planned as a reference (``Planned``; its price is
        ``plan.provenance.references["published"]``). It carries its own recomputation and
        ZeRO stage (``reference_mode``); no memory limit: the layout ran, so its time is what
        is asked (its memory against the device's limit is reported beside it)."""
        from autopar.ir.options import Options

        lay = self.layout
        opts = Options.of(memory_budget=math.inf, **self.common, **(
            dict(schedule=lay.schedule, microbatches=lay.microbatches, virtual=lay.virtual)
            if lay.pp > 1 else {}))
        return self.planner(self.model, self.mesh, self.inputs, options=opts,
                            references={"published": self.reference}, model_name=model_name)


def plan_run(run: dict, search: bool, time_limit_s: float,
             priced: Callable[[dict], None] | None = None) -> dict:
    """One run's row. ``priced``: told the row once the published layout is priced, before
    autopar's own plan (a run too slow to plan keeps its published layout's price)."""
    from autopar.ir.options import Options
    from autopar.passes.pipeline.cost import LOOPED_SEARCH_V

    out: dict[str, Any] = {
        "id": run.get("id", "?"), "expressible": False, "why": "",
        "measured_tokens_per_s_per_gpu": (run.get("compare") or {}).get("tokens_per_s_per_gpu"),
        "predicted_published_layout_tokens_per_s_per_gpu": None,
        "autopar_tokens_per_s_per_gpu": None, "autopar_layout": None, "plan_s": None,
    }
    try:
        layout = read_layout(run)
        preset = build_model(run["model"])
    except NotExpressible as e:
        out["why"] = str(e)
        return out
    except (KeyError, TypeError) as e:
        out["why"] = f"the run lacks a field the benchmark reads: {e}"
        return out
    out["expressible"] = True
    out["device"] = layout.device
    out["notes"] = layout.notes + [
        "attention: " + ("one fused kernel (SDPA)" if getattr(preset.config, "fused_attention",
                                                              True)
                         else "unfused (scores materialized, softmax and dropout apart)")]
    tokens = layout.batch * layout.seq

    def per_gpu(step_s: float) -> float:
        return tokens / step_s / layout.gpus

    pin = Pinned.of(layout, preset, time_limit_s)
    model, inputs, mesh, pinned, common, planner = (
        pin.model, pin.inputs, pin.mesh, pin.reference, pin.common, pin.planner)
    pp = layout.pp > 1
    t0 = time.perf_counter()
    try:
        got = pin.priced(out["id"])
    except Exception as e:  # noqa: BLE001 - reported, never skipped
        out["expressible"] = False
        out["why"] = f"planning the published layout failed: {type(e).__name__}: {e}"
        return out
    out["published_plan_s"] = round(time.perf_counter() - t0, 2)
    cost = got.plan.provenance.references.get("published")
    if cost is None:
        out["expressible"] = False
        out["why"] = "the solver could not complete the published layout's placements"
        return out
    from autopar.planning.memory_fit import memory_limit

    limit, _ = memory_limit(None, mesh.device)
    out["predicted_published_layout_tokens_per_s_per_gpu"] = round(per_gpu(cost.step_s), 1)
    out["published_step_s"] = round(cost.step_s, 4)
    out["published_mem_gib"] = round(cost.mem_bytes / 2**30, 1)
    out["published_fits"] = bool(limit is None or cost.mem_bytes <= limit)
    if priced is not None:
        priced(dict(out))

    # autopar's own: on the published mesh (the published layout beside it), then the shapes
    t1 = time.perf_counter()
    own_opts = Options.of(**common)
    best = None
    tries = [own_opts]
    if pp:  # the planner's own microbatch counts, and the published one (--microbatches)
        tries.append(own_opts.replace(microbatches=layout.microbatches))
    if pp and layout.virtual not in (None, *LOOPED_SEARCH_V):
        # stages per rank the planner does not try unasked: its own layouts under the
        # published schedule too, so that the published layout is among what it weighs
        tries.append(own_opts.replace(microbatches=layout.microbatches,
                                      schedule=layout.schedule, virtual=layout.virtual))
    for k, opts in enumerate(tries):
        try:
            mine = planner(model, mesh, inputs, options=opts,
                           references={"published": pinned}, model_name=out["id"])
        except Exception as e:  # noqa: BLE001
            out["notes"].append(f"autopar on the published mesh: {str(e)[:300]}")
            continue
        step = mine.plan.predicted.cost.step_s
        if best is None or step < best[0]:
            best = (step, layout.mesh_text, mine.plan)
            if k:
                out["notes"].append("autopar's plan: best at the published microbatch count"
                                    + (" and schedule" if k == 2 else ""))
    if search:
        from autopar.planning.shapes import search_shapes

        try:
            shapes = search_shapes(model, layout.gpus, inputs, None, layout.device,
                                   own_opts.replace(time_limit_s=1.0), model_name=out["id"])
            fit = [r for r in shapes if r.fits]
            if fit and (best is None or fit[0].step_s < best[0]):
                s = fit[0].shape
                text = ",".join(f"{a}={n}" for a, n in (("pp", s.pp), ("dp", s.dp),
                                                         ("tp", s.tp)) if n > 1)
                best = (fit[0].step_s, text, fit[0].plan)
        except Exception as e:  # noqa: BLE001
            out["notes"].append(f"autopar's shape search: {e}")
    out["plan_s"] = round(time.perf_counter() - t1, 2)
    if out["plan_s"] > SLOW_PLAN_S:
        out["notes"].append(f"autopar planned slower than {SLOW_PLAN_S:.0f} s")
    if best is not None:
        step, mesh_text, plan = best
        out["autopar_tokens_per_s_per_gpu"] = round(per_gpu(step), 1)
        out["autopar_layout"] = describe(plan, mesh_text)
    return out


def describe(plan, mesh_text: str) -> dict:
    """The layout of a plan: mesh, schedule, ZeRO stage, recomputation, precision."""
    d = plan.decided
    pipe = d.pipeline
    ps = d.param_state
    stages = ps.count()  # ZeRO stage -> parameters
    zero = "1" if ps.zero1 and stages else (str(max(stages, key=stages.get)) if stages
                                            else "0 (replicated)")
    return {
        "mesh": mesh_text,
        "schedule": (f"{pipe.schedule} v={pipe.virtual} m={pipe.microbatches}"
                     if pipe is not None else None),
        "zero": zero,
        "recompute": d.recompute.mode,
        "precision": d.precision.name,
        "method": plan.provenance.solver.method,
    }


# --- output ---------------------------------------------------------------------------------


def error_of(row: dict) -> float | None:
    m, p = row.get("measured_tokens_per_s_per_gpu"), row.get(
        "predicted_published_layout_tokens_per_s_per_gpu")
    if not row.get("expressible") or not m or not p:
        return None
    return p / m - 1


def report(rows: list[dict]) -> str:
    lines = []
    head = ["run", "device", "measured", "predicted (published)", "error", "fits",
            "autopar", "autopar layout", "plan s"]
    body = []
    for r in rows:
        err = error_of(r)
        lay = r.get("autopar_layout") or {}
        body.append([
            r["id"], r.get("device", "-"), _num(r["measured_tokens_per_s_per_gpu"]),
            _num(r["predicted_published_layout_tokens_per_s_per_gpu"])
            if r["expressible"] and not r["why"] else
            ("not expressible" if not r["expressible"] else "too slow to plan"),
            f"{err:+.0%}" if err is not None else "-",
            {True: "yes", False: f"no ({r.get('published_mem_gib')} GiB)"}.get(
                r.get("published_fits"), "-"),
            "too slow to plan" if r.get("autopar_too_slow") else
            _num(r["autopar_tokens_per_s_per_gpu"]),
            " ".join(str(x) for x in (lay.get("mesh"), lay.get("schedule") or "",
                                       f"zero={lay.get('zero')}", lay.get("recompute"),
                                       lay.get("precision")) if x) if lay else "-",
            _num(r["plan_s"]),
        ])
    lines.append(table(head, body))
    errs = [abs(e) for e in map(error_of, rows) if e is not None]
    if errs:
        within = sum(e <= 0.2 for e in errs)
        lines.append(f"\nexpressible runs: {len(errs)} of {len(rows)}; median absolute error "
                     f"{statistics.median(errs):.1%}; within 20%: {within} of {len(errs)}")
    fitted = [r["id"] for r in rows if str(r.get("device", "")).endswith("+async-tp")]
    lines.append("device-profile figures fitted to these runs: "
                 + (f"async TP's hidden share only, for {len(fitted)} rows ({', '.join(fitted)}): "
                    "its leave-one-out error by `python benchmarks/async_tp.py`; every other "
                    if fitted else "none: every ")
                 + "figure has its public source in docs/device_profiles.md")
    slower = [r for r in rows if r.get("autopar_tokens_per_s_per_gpu") is not None
              and r["predicted_published_layout_tokens_per_s_per_gpu"] is not None
              and r["autopar_tokens_per_s_per_gpu"]
              < r["predicted_published_layout_tokens_per_s_per_gpu"] * 0.999]
    lines.append("autopar's plan predicted slower than the published layout where that fits "
                 "the device's memory as autopar models it: "
                 + (", ".join(r["id"] for r in slower if r.get("published_fits")) or "none"))
    over = [r["id"] for r in slower if not r.get("published_fits")]
    if over:
        lines.append("slower, the published layout not fitting autopar's memory model (autopar "
                     "must plan within it): " + ", ".join(over))
    for r in rows:
        if not r["expressible"]:
            lines.append(f"- {r['id']}: not expressible: {r['why']}")
        elif r["why"]:
            lines.append(f"- {r['id']}: {r['why']}")
        elif r.get("autopar_too_slow"):
            lines.append(f"- {r['id']}: the published layout priced in {r.get('published_plan_s')}"
                         f" s; autopar's own plan: too slow to plan, no answer within "
                         f"{r['plan_s']:.0f} s")
    return "\n".join(lines)


def _num(x) -> str:
    if x is None:
        return "-"
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def plan_in_child(run: dict, search: bool, time_limit_s: float, timeout_s: float) -> dict:
    """:func:`plan_run` in a forked process, given ``timeout_s``: a run that plans longer is
    reported as too slow to plan (its row says so), never left out."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            send.send({"done": plan_run(run, search, time_limit_s,
                                        priced=lambda row: send.send({"priced": row}))})
        except BaseException as e:  # noqa: BLE001 - reported in the row
            send.send({"error": f"{type(e).__name__}: {e}"})

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    until = time.monotonic() + timeout_s
    got, partial = None, None
    while got is None and recv.poll(max(0.0, until - time.monotonic())):
        msg = recv.recv()
        if "priced" in msg:
            partial = msg["priced"]
        else:
            got = msg.get("done", msg)
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    row = {"id": run.get("id", "?"), "expressible": True, "why": "",
           "measured_tokens_per_s_per_gpu": (run.get("compare") or {}).get(
               "tokens_per_s_per_gpu"),
           "predicted_published_layout_tokens_per_s_per_gpu": None,
           "autopar_tokens_per_s_per_gpu": None, "autopar_layout": None, "plan_s": None}
    if got is None and partial is not None:  # the published layout priced, autopar not
        partial["autopar_too_slow"] = True
        partial["plan_s"] = float(f"{timeout_s:.0f}")
        partial.setdefault("notes", []).append(
            f"autopar's own plan: too slow to plan, no answer within {timeout_s:.0f} s")
        return partial
    if got is None:
        row["why"] = f"too slow to plan: no answer within {timeout_s:.0f} s"
        row["plan_s"] = float(f"{timeout_s:.0f}")
        return row
    if "error" in got:
        row["expressible"] = False
        row["why"] = f"the benchmark failed on this run: {got['error']}"
        return row
    return got


def load_runs(path: str) -> list[dict]:
    try:
        with open(path) as f:
            runs = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"published.py: cannot read runs from {path}: {e}; give the JSON list of "
                 "runs (shared/bench/published/runs.json has the schema)")
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        sys.exit(f"published.py: {path} is not a JSON list of runs (objects)")
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help="the JSON list of published runs")
    ap.add_argument("--json", help="write the rows as a JSON list to this path")
    ap.add_argument("--only", nargs="*", help="the ids of the runs to plan (default: all)")
    ap.add_argument("--no-search", action="store_true",
                    help="autopar's own plan on the published mesh only (no --devices search)")
    ap.add_argument("--time-limit", type=float, default=5.0, help="solver limit per solve, s")
    ap.add_argument("--run-timeout", type=float, default=900.0,
                    help="seconds one run may plan before it is reported too slow to plan")
    ap.add_argument("--write", action="store_true",
                    help="write the table into benchmarks/RESULTS.md (## Published runs)")
    ap.add_argument("--rows", help="print (and --write) the rows of an earlier --json OUT, "
                    "merged over the planned ones by id, instead of planning them again")
    args = ap.parse_args(argv)
    runs = load_runs(args.runs)
    if args.only:
        runs = [r for r in runs if r.get("id") in set(args.only)]
    earlier = {r["id"]: r for r in load_runs(args.rows)} if args.rows else {}
    rows = []
    for run in runs:
        if run.get("id") in earlier:
            rows.append(earlier[run["id"]])
            continue
        t = time.perf_counter()
        row = plan_in_child(run, not args.no_search, args.time_limit, args.run_timeout)
        rows.append(row)
        print(f"{row['id']}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    text = report(rows)
    print(text)
    if args.write:
        cmd = ("python benchmarks/published.py --runs ../shared/bench/published/runs.json "
               "--json published.json --write")
        write_results(text, f"`{cmd}` on {machine()}")
    return 0


SECTION = "Published runs"
# the lines report() writes below its table, besides "- <run id>: ..." (hand-written prose
# bullets start "- **")
_SUMMARY = ("expressible runs:", "no device-profile figure", "device-profile figures fitted", "autopar's plan predicted slower",
            "slower, the published layout")
_RUN_LINE = re.compile(r"^- [A-Za-z0-9_.\-]+: ")


def replace_report(section: str, text: str) -> str | None:
    """``section`` (RESULTS.md's "## Published runs", its heading included) with the table
    and the summary lines :func:`report` wrote replaced by ``text``, the prose around them
    kept; None where the section holds no such table."""
    lines = section.split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.startswith("| run ")), None)
    if start is None:
        return None
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    k = end  # then blank lines and the summary lines, up to the first line of prose
    while k < len(lines) and (not lines[k].strip() or lines[k].startswith(_SUMMARY)
                              or _RUN_LINE.match(lines[k])):
        if lines[k].strip():
            end = k + 1
        k += 1
    return "\n".join(lines[:start] + text.strip().split("\n") + lines[end:])


def write_results(text: str, stamp: str, path: str = "benchmarks/RESULTS.md") -> None:
    """The report into RESULTS.md's "## Published runs": only its table and summary lines
    where the section has them (the prose around them, which says how the figures were
    taken and what limits them, is kept); the whole section where it has none."""
    try:
        with open(path) as f:
            doc = f.read()
    except OSError:
        doc = ""
    head = f"## {SECTION}\n"
    start = doc.find(head)
    if start >= 0:
        end = doc.find("\n## ", start + len(head))
        end = len(doc) if end < 0 else end + 1
        new = replace_report(doc[start:end], text)
        if new is not None:
            with open(path, "w") as f:
                f.write(doc[:start] + new + doc[end:])
            return
    update_results(SECTION, f"{stamp}\n\n{text}", path)


if __name__ == "__main__":
    sys.exit(main())
