"""``autopar.parallelize`` on a mesh with a ``pp`` axis: planned, run as planned, equal to one
device; a given plan run without replanning; bad input refused in one line.

One launch of 4 gloo processes (process start-up dominates on 2 cores) runs, in turn: GPT-2
on an ``autopar.Mesh`` pp=2 x dp=2, planned, trained in the ordinary loop with gradient
clipping; the same from the plan's JSON on a torch DeviceMesh, the planner switched off; and
Hugging Face Llama (autopar's stages for it: torch's splitter cannot cut it) called with
``input_ids=`` and ``labels=``. Every rank checks, against the single-device run it also does
itself, each step's loss, the clipped norm, and its stages' parameters after 3 AdamW steps:
norm-wise relative error below 1e-5 in fp32. The rest needs no processes: the schedule names,
the Hugging Face stages chained in one process, and what a user can get wrong (on torch's
fake process group: planning runs, nothing is sent).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from harness.spmd import EPS, LR, fake_world, rel_err, start_method
from torch import nn
from torch.distributed.tensor import DTensor

import autopar
from autopar.ir.errors import MeshError, PlanError
from autopar.ir.options import Options
from autopar.ir.schedules import schedule as schedule_info
from autopar.models import get_preset
from autopar.runtime.pipeline.module import PipelineModule

WORLD = 4
TOL = 1e-5
BATCH, SEQ = 8, 8
STEPS = 3
CLIP = 0.5  # low enough that an untrained model's gradients are clipped


def _gpt2(layers: int = 4) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    preset = get_preset("gpt2-tiny").replace(n_layer=layers)
    torch.manual_seed(0)
    model = preset.build("cpu")
    torch.manual_seed(1)
    return model, preset.example_inputs(BATCH, SEQ, "cpu")


def _hf_llama(kind: str = "Llama", layers: int = 4, **extra) -> nn.Module:
    import transformers

    cfg = getattr(transformers, f"{kind}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, **extra)
    torch.manual_seed(0)
    return getattr(transformers, f"{kind}ForCausalLM")(cfg)


def _reference(model: nn.Module, call, clip: float | None) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = call(model)
        loss.backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "norms": norms,
            "params": dict(model.named_parameters(remove_duplicate=False))}


def _train(pm: nn.Module, call, clip: float | None, want: dict, what: str) -> None:
    """The user's loop on the pipeline, checked step by step against one device's."""
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    for step in range(STEPS):
        loss = call(pm)
        loss.backward()
        ref = want["losses"][step]
        assert abs(loss.item() - ref) <= TOL * abs(ref), (what, step, loss.item(), ref)
        if clip is not None:
            norm, ref = float(pm.clip_grad_norm_(clip)), want["norms"][step]
            assert abs(norm - ref) <= TOL * ref, (what, step, norm, ref)
        opt.step()
        opt.zero_grad()
    _check_params(pm, want["params"], what)


def _check_params(pm: nn.Module, want: dict, what: str) -> None:
    got = dict(pm.named_parameters())
    piped = isinstance(pm, PipelineModule)  # a device count may also pick a mesh without pp
    assert got and all(n.startswith("stages.") == piped for n in got), what
    for name, p in got.items():
        model_name = name.split(".", 2)[2] if piped else name  # stages.<s>.<model's name>
        whole = p.full_tensor() if isinstance(p, DTensor) else p  # a stage program's
        err = rel_err(whole.detach(), want[model_name].detach())
        assert err < TOL, f"{what}: {model_name} relative error {err:.2e}"


def _worker(plan_path: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar.planning.pipeline as planner

    report: dict = {}
    # 1. GPT-2, planned on an autopar.Mesh, clipped
    model, (x, y) = _gpt2()
    want = _reference(copy.deepcopy(model), lambda m: m(x, y), CLIP)
    mesh = autopar.Mesh((2, 2), ("pp", "dp"), "cpu")
    pm = autopar.parallelize(model, mesh, example_inputs=(x, y), time_limit_s=5.0)
    assert isinstance(pm, PipelineModule) and pm.plan.decided.pipeline is not None
    _train(pm, lambda m: m(x, y), CLIP, want, "gpt2 planned")
    pipe = pm.plan.decided.pipeline
    report["gpt2"] = {"schedule": pipe.schedule, "runtime": pm.runner.schedule_name,
                      "microbatches": pm.runner.n_microbatches,
                      "ranges": [list(r) for r in pm.runner.ranges],
                      "plan_ranges": [[st.first_block, st.end_block] for st in pipe.stages]}
    if dist.get_rank() == 0:
        pm.plan.save(plan_path)
    dist.barrier()

    # 2. the same plan from its JSON on torch's DeviceMesh: run as made, never replanned
    def no_planning(*args, **kwargs):
        raise AssertionError("a given plan was planned again")

    real_planner, planner.plan_pipeline = planner.plan_pipeline, no_planning
    model, (x, y) = _gpt2()
    want = _reference(copy.deepcopy(model), lambda m: m(x, y), None)
    dmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pm = autopar.parallelize(model, dmesh, example_inputs=(x, y), plan=plan_path)
    _train(pm, lambda m: m(x, y), None, want, "gpt2 from JSON")
    try:  # other shapes than the plan's: refused on every rank before anything is sent
        pm(x[:, :4], y[:, :4])
        raise AssertionError("a call of other shapes ran")
    except PlanError as e:
        assert "parallelize again for these" in str(e), e

    # 3. pp=2 x tp=2: each stage runs its own plan (the planner's ZBV cannot split a stage
    # program's backward: the fastest schedule weighed that can), clipped
    planner.plan_pipeline = real_planner
    model, (x, y) = _gpt2()
    want = _reference(copy.deepcopy(model), lambda m: m(x, y), CLIP)
    pm = autopar.parallelize(model, autopar.Mesh((2, 2), ("pp", "tp"), "cpu"),
                             example_inputs=(x, y), time_limit_s=5.0)
    _train(pm, lambda m: m(x, y), CLIP, want, "gpt2 pp x tp")
    report["tp"] = {"schedule": pm.plan.decided.pipeline.schedule, "runtime": pm.runner.schedule_name,
                    "programs": pm.runner.programs,
                    "stages": len(pm.plan.decided.pipeline.stages), "stage_plans": len(pm.runner.plans)}

    # 4. Hugging Face Llama
    model = _hf_llama()
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (BATCH, SEQ))

    def hf_call(m):
        out = m(input_ids=ids, labels=ids)
        return out if isinstance(out, torch.Tensor) else out.loss

    want = _reference(copy.deepcopy(model), hf_call, None)
    pm = autopar.parallelize(model, mesh, example_kwargs={"input_ids": ids, "labels": ids},
                             time_limit_s=5.0, schedule="1f1b", microbatches=4)
    _train(pm, hf_call, None, want, "hf llama")
    report["hf"] = {"frontend": pm.runner.frontend, "runtime": pm.runner.schedule_name,
                    "microbatches": pm.runner.n_microbatches}

    # 5. a device count: every shape of 4 devices planned, the fastest that runs taken
    model, (x, y) = _gpt2()
    want = _reference(copy.deepcopy(model), lambda m: m(x, y), None)
    pm = autopar.parallelize(model, WORLD, example_inputs=(x, y), time_limit_s=2.0)
    _train(pm, lambda m: m(x, y), None, want, "gpt2 on 4 devices")
    report["devices"] = {"mesh": [list(a) for a in pm.plan.full_mesh]}
    return report


def test_parallelize_pipelines_equal_one_device(tmp_path) -> None:
    from autopar.runtime.launch import launch

    plan_path = str(tmp_path / "plan.json")
    reports = launch(_worker, WORLD, (plan_path,), timeout_s=240,
                     start_method=start_method())
    for rep in reports:
        g = rep["gpt2"]
        assert g["runtime"] == schedule_info(g["schedule"]).key
        assert g["ranges"] == g["plan_ranges"]
        assert rep["tp"]["programs"] and rep["tp"]["stage_plans"] == rep["tp"]["stages"]
        # stage programs run whatever schedule the planner chose (a split backward whole
        # in its input action): the runtime's schedule is the plan's
        assert rep["tp"]["runtime"] == schedule_info(rep["tp"]["schedule"]).key
        # autopar's stages for Hugging Face Llama, with the schedule and micro-batches asked
        assert rep["hf"] == {"frontend": "module", "runtime": "1f1b", "microbatches": 4}
        shape, _ = rep["devices"]["mesh"]
        assert math.prod(shape) == WORLD
    assert len({json.dumps(rep["devices"]) for rep in reports}) == 1  # one shape on every rank
    saved = json.loads(open(plan_path).read())
    assert saved["decided"]["schedule"]["schedule"] == reports[0]["gpt2"]["schedule"]


# --- no processes ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind, extra", [("Llama", {}), ("Qwen2", {}), ("Qwen3", {}),
                                         ("Mistral", {"sliding_window": None})])
def test_hf_stages_chained_equal_the_model(kind: str, extra: dict) -> None:
    """Three stages of a Hugging Face decoder, run one after the other in one process, give
    the model's own loss (SDPA's implicit causal mask and eager's explicit one)."""
    pytest.importorskip("transformers")
    from autopar.runtime.pipeline import stages as ps

    model = _hf_llama(kind, **extra)
    assert ps.module_family(model) == "hf"
    ids = torch.randint(0, 64, (2, 8))
    for impl in ("sdpa", "eager"):
        model.config._attn_implementation = impl
        want = model(input_ids=ids, labels=ids).loss
        stages = ps.module_stages(model, "model.layers", ((0, 1), (1, 3), (3, 4)), [0, 1, 2])
        h = ids
        for s in range(3):
            h = stages[s](h)
        got = ps.loss_fn_for(model)(h, ids)
        got, want = float(got.detach()), float(want.detach())
        assert abs(got - want) <= 1e-6 * want, (kind, impl, got, want)
    names = {n for s in stages.values() for n, _ in s.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}  # the model's own names


def test_hf_models_the_stages_do_not_reproduce_are_left_to_the_splitter() -> None:
    """Sliding-window attention (Mistral's default) and Gemma's scaled embeddings would be
    computed otherwise: no autopar stages for them."""
    pytest.importorskip("transformers")
    from autopar.runtime.pipeline import stages as ps

    assert ps.module_family(_hf_llama("Mistral")) is None
    assert ps.module_family(_hf_llama("Gemma")) is None
    with pytest.raises(PlanError, match="Hugging Face Llama-style decoders, not "
                                        "GemmaForCausalLM.*frontend='trace'"):
        ps.module_stages(_hf_llama("Gemma"), "model.layers", ((0, 2), (2, 4)), [0])


def _refused(error: type, pattern: str, mesh: tuple, axes: tuple = ("pp", "dp"),
             layers: int = 2, hf: bool = False, **kwargs) -> None:
    """parallelize on torch's fake process group (planning runs, nothing is sent) raises
    ``error`` in one line matching ``pattern``."""
    model, inputs = _gpt2(layers)
    given: dict = {"example_inputs": inputs}
    if hf:
        model, ids = _hf_llama(layers=layers), inputs[0] % 64
        given = {"example_kwargs": {"input_ids": ids, "labels": ids}}
    with fake_world(int(torch.tensor(mesh).prod())), pytest.raises(error) as info:
        autopar.parallelize(model, autopar.Mesh(mesh, axes, "cpu"), time_limit_s=2.0,
                            **given, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    assert info.match(pattern), message


def test_more_stages_than_blocks() -> None:
    _refused(PlanError, r"4 pipeline stages but the model has 2 blocks: use pp <= 2", (4,),
             ("pp",))


def test_microbatches_that_do_not_divide_the_batch() -> None:
    _refused(PlanError, r"3 microbatches do not divide the batch of 8: use a divisor of it "
             r"\(1, 2, 4, 8\)", (2, 2), microbatches=3)
    _refused(PlanError, r"8 microbatches of 1 samples do not split over the 2 data-parallel "
             r"ranks", (2, 2), microbatches=8)


def test_a_schedule_whose_activations_cannot_fit() -> None:
    _refused(PlanError, r"no pipeline plan of 2 blocks on 2 stages fits .* per device.*Try",
             (2, 2), schedule="GPipe", memory_budget=64 * 2**10)


def test_what_the_pipeline_runtime_cannot_run_is_refused() -> None:
    _refused(MeshError, r"pipelines run on mesh axes 'pp', 'dp' and 'tp'; ep=2 is not one of "
             r"them", (2, 2), ("pp", "ep"))
    _refused(PlanError, r"which pipelines do for autopar's GPT-2 and Llama-3 models only, not "
             r"LlamaForCausalLM: use a mesh of axes \('pp', 'dp'\)", (2, 2), ("pp", "tp"),
             hf=True, schedule="1F1B")
    _refused(PlanError, r"the plan computes in fp16, whose dynamic loss scaling pipeline stages "
             r"do not do yet: plan it with precision='bf16'", (2, 2), precision="fp16")
    _refused(PlanError, r"the plan recomputes selectively under ZBVZeroBubble, whose backward "
             r"runs twice over every block .*: plan with recompute='full', or with schedule "
             r"1F1B", (2, 2), layers=4, recompute="selective", schedule="ZBVZeroBubble")
    _refused(PlanError, r"the plan keeps the optimizer state of \d+ parameters on the host, "
             r"which pipeline stages do not do: plan with offload='none'", (2, 2),
             offload="optimizer")
    _refused(PlanError, r"compile= does not apply to pipelines yet", (2, 2), compile=True)
    _refused(PlanError, r"schedule=, microbatches= and virtual= choose a pipeline: give a mesh "
             r"with a 'pp' axis", (4,), ("dp",), schedule="1F1B")


def test_a_given_plan_must_match(tmp_path) -> None:
    from autopar.planning.pipeline import plan_pipeline
    from autopar.planning.planner import make_plan

    model, inputs = _gpt2(2)
    planned = plan_pipeline(model, autopar.Mesh((2, 2), ("pp", "dp"), "cpu"), inputs,
                            options=Options.of(time_limit_s=2.0, schedule="1F1B")).plan
    _refused(PlanError, r"made for mesh pp=2,dp=2 but runs on pp=4", (4,), ("pp",),
             plan=planned)
    _refused(PlanError, r"schedule='GPipe' was asked but the given plan has schedule='1F1B'",
             (2, 2), plan=planned, schedule="GPipe")
    _refused(PlanError, r"made for another model .*2 blocks; this one has 4", (2, 2),
             layers=4, plan=planned)
    flat = make_plan(model, autopar.Mesh((4,), ("dp",), "cpu"), inputs,
                     options=Options.of(time_limit_s=2.0)).plan
    _refused(PlanError, r"the plan has no pipeline section", (2, 2), plan=flat)


def test_stage_programs_are_built_in_the_plans_precision_and_recompute_mode() -> None:
    """A pp x tp pipeline plan in bf16 that recomputes runs as stage programs in its
    precision and recompute mode (no refusal), and one under a split backward keeps its
    schedule: a program recomputes inside its lowered backward, whichever half runs it."""
    from autopar.planning.pipeline import plan_pipeline
    from autopar.runtime.pipeline import module as pm

    model, inputs = _gpt2(4)
    mesh = autopar.Mesh((2, 2), ("pp", "tp"), "cpu")
    for recompute, schedule in (("full", "1F1B"), ("selective", "ZBVZeroBubble")):
        plan = plan_pipeline(model, mesh, inputs, options=Options.of(
            time_limit_s=2.0, precision="bf16", recompute=recompute, schedule=schedule)).plan
        _, options = pm.build_options(model, plan, inputs, None)
        mode = plan.decided.recompute.mode
        assert mode != "none"
        assert (options["precision"].name, options["recompute"]) == ("bf16", mode)
        assert options["schedule"] == schedule_info(schedule).key
        assert pm.runnable_option(plan) is None  # no other schedule forced on it
