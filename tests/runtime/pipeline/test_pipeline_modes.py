"""A plan's precision and recomputation on pipeline stages replicated over ``dp``: computed as
the SPMD runtime computes them (``runtime/pipeline/planned_stage.py``).

No processes: a stage recomputes in the backward exactly the ops the SPMD runtime's rewrite
recomputes (``passes/memory/recompute.py``), per mode, on GPT-2 and Llama-3.

One launch of 2 gloo processes (pp=2) trains, in turn, 3 AdamW steps of

- GPT-2 through ``parallelize`` with ``recompute="full"`` under 1F1B (the embedding tied to
  the head, one checkpointed copy per stage),
- Llama-3 with ``recompute="full"`` under ZBVZeroBubble (a split backward: each block is
  recomputed in the input pass and again in the weight pass),
- Llama-3 with ``recompute="selective"`` under 1F1B,
- Llama-3 with ``recompute=("full", "none")`` under 1F1B: each stage in its own mode,

each checked on every rank against the single device (fp32, eager) it also trains: each
step's loss, the last step's gradients and the parameters, norm-wise relative error below
1e-5 (measured: equal to the bit). Each rank counts its blocks' forwards in the last step, so
a recomputation that silently did not happen fails.

The same launch trains Llama-3 through ``parallelize`` in bf16 under 1F1B, and in bf16 with
full recomputation under ZBV, and returns what it got; this process checks it against
autopar's own single-device run (``parallelize`` on one process, the traced step under the
same policy, gradients accumulated over the same micro-batches): losses within 1e-5,
gradients and parameters within 1e-3 (a quarter of bf16's rounding; measured: equal to the
bit), and at least 5e-3 away from fp32's (measured 2e-2), so precision not applied fails.

What plain stages do not run (fp16, selective recomputation under a split backward, torch's
traced stages) is refused here for ``build_pipeline``, in ``test_pipeline_parallelize.py``
for ``parallelize`` and in ``test_train_pipeline.py`` for ``autopar train``. Stage programs
(pp x tp) in bf16 and recomputing: ``test_pipeline_tp.py``.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from harness.spmd import EPS, LR, fake_world, one_device_run, rel_err, start_method
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.capture.joint import capture
from autopar.ir.precision import Precision
from autopar.models import get_preset
from autopar.passes.memory.recompute import recompute_nodes
from autopar.runtime.pipeline import stages as ps
from autopar.runtime.pipeline.planned_stage import PlannedStage

WORLD = 2
TOL = 1e-5
BF16_TOL, FP32_AWAY = 1e-3, 5e-3
BATCH, SEQ, STEPS = 8, 8, 3
# (name, preset, schedule, microbatches, precision, recompute, through parallelize)
CONFIGS = [
    ("gpt2-full-1f1b", "gpt2-tiny", "1F1B", 2, "fp32", "full", True),
    ("llama-full-zbv", "llama3-tiny", "zbv", 4, "fp32", "full", False),
    ("llama-selective-1f1b", "llama3-tiny", "1f1b", 2, "fp32", "selective", False),
    # one mode per stage, as a pipeline plan may choose them (the first stage holds more
    # microbatches in flight than the last)
    ("llama-full-then-none-1f1b", "llama3-tiny", "1f1b", 2, "fp32", ("full", "none"), False),
    ("llama-bf16-1f1b", "llama3-tiny", "1F1B", 2, "bf16", "none", True),
    ("llama-bf16-full-zbv", "llama3-tiny", "zbv", 4, "bf16", "full", False),
]


def _build(preset_name: str, layers: int = 4):
    preset = get_preset(preset_name)
    preset = (preset.replace(n_layer=layers) if preset.family == "gpt2" else
              preset.replace(n_layers=layers))
    torch.manual_seed(0)
    model = preset.build("cpu")
    torch.manual_seed(1)
    return model, preset.example_inputs(BATCH, SEQ, "cpu")


def _named(module, strip: bool) -> dict[str, torch.Tensor]:
    """Parameters under the model's names (a PipelineModule's ``stages.<s>.`` dropped)."""
    return {(n.split(".", 2)[2] if strip else n): p for n, p in module.named_parameters()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(module, step, strip: bool = False) -> dict:
    """``STEPS`` AdamW steps of ``step()`` (forward and backward, returning the loss): each
    step's loss, the last step's gradients, the parameters after."""
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    losses: list[float] = []
    grads: dict = {}
    for _ in range(STEPS):
        losses.append(float(step()))
        grads = {n: _whole(p.grad) for n, p in _named(module, strip).items()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads,
            "params": {n: _whole(p) for n, p in _named(module, strip).items()}}


def _steps(model, x, y, m: int = 1):
    """One step of the whole batch as ``m`` micro-batches, each loss divided by ``m`` (one
    backward of the whole batch where ``m`` is 1)."""
    def step() -> float:
        total = 0.0
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            part = model(xs, ys) / m
            part.backward()
            total += float(part.detach())
        return total
    return step


def _errors(config: str, got: dict, want: dict, tol: float) -> float:
    """Each step's loss within ``tol`` of ``want``'s; the largest norm-wise relative error of
    ``got``'s gradients and parameters."""
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(a - b) <= tol * abs(b), (config, step, a, b)
    assert got["grads"] and got["params"], f"{config}: no parameters"
    return max(rel_err(t, want[what][n]) for what in ("grads", "params")
               for n, t in got[what].items())


# --- no processes ---------------------------------------------------------------------------


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ran: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ran[str(func)] += 1
        return func(*args, **(kwargs or {}))


# views and the checkpoint's own detaches cost nothing and are not the rewrite's business
_FREE = ("detach", "view", "_unsafe_view", "t.", "transpose", "unsqueeze", "expand", "split",
         "clone")


def _compute(ops: Counter) -> Counter:
    return Counter({k: v for k, v in ops.items()
                    if not any(k.startswith(f"aten.{f}") for f in _FREE)
                    and k.startswith("aten.")})


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama3-tiny"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_a_stage_recomputes_what_the_spmd_rewrite_recomputes(preset: str, mode: str) -> None:
    model, (x, y) = _build(preset, layers=2)
    pg = capture(model, (x[:2], y[:2]))
    by_name = {n.name: n for n in pg.graph.nodes}
    spmd = _compute(Counter(str(by_name[n].target) for n in recompute_nodes(pg, mode)))
    ran = {}
    for m in ("none", mode):
        stage = ps.module_stages(model, ps.find_blocks(model)[0], ((0, 2),), [0])[0]
        loss = ps.loss_fn_for(model)(PlannedStage(stage, Precision(), m)(x[:2]), y[:2])
        with _Ops() as ops:
            loss.backward()
        ran[m] = ops.ran
    again = _compute(ran[mode] - ran["none"])
    assert again and again == spmd, (preset, mode, dict(again), dict(spmd))


def test_what_plain_stages_do_not_run_is_refused() -> None:
    """Before any stage is built, one line naming the cause and the fix (on torch's fake
    process group where a mesh is needed: nothing is sent)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.ir.errors import PlanError
    from autopar.runtime.pipeline.runner import build_pipeline

    model, inputs = _build("gpt2-tiny", layers=4)
    with pytest.raises(PlanError, match=r"fp16 needs dynamic loss scaling, which pipeline "
                                        r"stages do not do yet: use bf16"):
        build_pipeline(model, inputs, None, precision="fp16")
    with pytest.raises(PlanError, match=r"schedule zbv runs two over every block \(input, then "
                                        r"weight gradients\): recompute 'full'"):
        build_pipeline(model, inputs, None, schedule="zbv", recompute="selective")
    with pytest.raises(PlanError, match=r"recompute in a fixed mode.*not 'auto'"):
        build_pipeline(model, inputs, None, recompute="auto")
    # one mode per stage: each is checked (a selective stage under a split backward)
    with pytest.raises(PlanError, match=r"schedule zbv runs two over every block"):
        build_pipeline(model, inputs, None, schedule="zbv", recompute=("full", "selective"))
    with pytest.raises(PlanError, match=r"recompute in a fixed mode.*not 'auto'"):
        build_pipeline(model, inputs, None, recompute=("none", "auto"))
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                  n_head=4)
    hf = transformers.GPT2LMHeadModel(cfg)  # no autopar stages: torch's splitter cuts it
    ids = inputs[0] % 64
    with fake_world(4):
        pp = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        with pytest.raises(PlanError, match=r"pipeline stages run bf16 with recompute='none' in "
                                            r"autopar's stage modules.*not GPT2LMHeadModel.*use "
                                            r"precision='fp32' and recompute='none'"):
            build_pipeline(hf, (ids, ids), pp, precision="bf16")
        with pytest.raises(PlanError, match=r"torch's traced stages run their ATen ops as traced"
                                            r".*not fp32 with recompute='full': use "
                                            r"frontend='module'"):
            build_pipeline(model, inputs, pp, frontend="trace", recompute="full")


# --- 2 gloo processes -----------------------------------------------------------------------


def _worker(configs: list) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.pipeline.runner import build_pipeline

    report = {}
    for name, preset, schedule, m, precision, recompute, via_api in configs:
        model, (x, y) = _build(preset)
        kind = type(ps.find_blocks(model)[1][0])
        # fp32: the single device's eager run; bf16: checked in the parent, against autopar's
        want = None
        if precision == "fp32":
            ref = copy.deepcopy(model)
            want = _train(ref, _steps(ref, x, y))
        if via_api:
            pm = autopar.parallelize(model, autopar.Mesh((WORLD,), ("pp",), "cpu"),
                                     example_inputs=(x, y), time_limit_s=2.0,
                                     precision=precision, recompute=recompute,
                                     schedule=schedule, microbatches=m)
            assert (pm.plan.decided.precision.name, pm.plan.decided.recompute.mode) == (precision, recompute)
            runner, module = pm.runner, pm
            step = _steps(pm, x, y)
        else:
            mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("pp",))
            runner = module = build_pipeline(model, (x, y), mesh, None, schedule, m,
                                             precision=precision, recompute=recompute)
            step = functools.partial(runner.step, x, y)
        assert (runner.precision.name, runner.recompute, runner.frontend) == \
            (precision, recompute, "module"), name
        forwards = _count_block_forwards(runner.stage_modules, kind)
        got = _train(module, _counted(step, forwards), strip=via_api)
        assert all(p.dtype == torch.float32 for p in got["params"].values()), name  # masters
        if want is not None:
            err = _errors(name, got, want, TOL)
            assert err < TOL, f"{name}: relative error {err:.2e} from one device"
        report[name] = {"got": got if want is None else None, "forwards": dict(forwards),
                        "first": {st.stage_index: st.is_first for st in runner.stages},
                        "ranges": runner.ranges,
                        "kinds": dict(Counter(e.kind for e in runner.last_step_events))}
        del runner, module, step
        dist.barrier()
    return report


def _count_block_forwards(stage_modules: dict, kind: type) -> Counter:
    """Forwards of each stage's blocks (``kind``: the model's block type; a recomputation
    runs a block's forward again)."""
    counts: Counter = Counter()
    for s, mod in stage_modules.items():
        for blk in mod.modules():
            if type(blk) is kind:
                blk.register_forward_pre_hook(lambda *_, s=s: counts.update([s]))
    return counts


def _counted(step, counts: Counter):
    """``step``, the counts cleared before each (the last step's are kept: the first also
    infers the stages' shapes)."""
    def run():
        counts.clear()
        return step()
    return run


def test_pipelines_recompute_and_compute_in_bf16_as_one_device() -> None:
    from autopar.runtime.launch import launch

    reports = launch(_worker, WORLD, (CONFIGS,), timeout_s=240,
                     start_method=start_method())
    split = {"zbv"}
    for name, preset, schedule, m, precision, recompute, _ in CONFIGS:
        for rep in reports:
            r = rep[name]
            # each block's forwards in the last step: once per micro-batch, again in each
            # backward pass that recomputes it (a split backward's first stage runs one: its
            # input, token ids, has no gradient)
            for s, first in r["first"].items():
                a, b = r["ranges"][s]
                mode = recompute if isinstance(recompute, str) else recompute[s]
                passes = 0 if mode == "none" else (
                    2 if schedule in split and not first else 1)
                assert r["forwards"][s] == (b - a) * m * (1 + passes), (name, s, r)
            if schedule in split:
                assert r["kinds"].get("W", 0) > 0, (name, r["kinds"])
        if precision == "fp32":
            continue
        got = {what: {n: t for rep in reports for n, t in rep[name]["got"][what].items()}
               for what in ("grads", "params")}
        got["losses"] = reports[0][name]["got"]["losses"]
        model, (x, y) = _build(preset)
        same = one_device_run(model, x, y, m, precision, STEPS)
        model, (x, y) = _build(preset)
        fp32 = _train(model, _steps(model, x, y, m))
        assert set(got["params"]) == set(same["params"]), name  # every parameter, once
        near = _errors(name, got, same, TOL)
        assert near < BF16_TOL, f"{name}: {near:.2e} from one device in {precision}"
        away = max(rel_err(t, fp32[what][n]) for what in ("grads", "params")
                   for n, t in got[what].items())
        assert away > FP32_AWAY, f"{name}: only {away:.2e} from fp32: {precision} not applied?"
