"""The plans the solver finds for the classic situations, and the plan's own contracts."""

import json
import re

import pytest
import torch

from autopar.ir.errors import PlanError
from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.ir.placements import R, S, Shard
from autopar.ir.plan import Plan
from autopar.models import get_preset
from autopar.passes.cost.cost_model import BUCKET_BYTES
from autopar.planning.planner import make_plan
from autopar.report.table import plan_table


def _plan(name, mesh, batch, seq, budget=None, precision=None, recompute="auto", **changes):
    preset = get_preset(name)
    changes.setdefault("n_positions" if preset.family == "gpt2" else "max_seq_len", seq)
    preset = preset.replace(**changes)
    return make_plan(preset.build("meta"), mesh, preset.example_inputs(batch, seq),
                     model_name=name,
                     options=Options.of(memory_budget=budget, time_limit_s=20, precision=precision,
                                        recompute=recompute))


GPT_COLUMN = ("attn.qkv.weight", "mlp.fc.weight")
GPT_ROW = ("attn.proj.weight", "mlp.proj.weight")
LLAMA_COLUMN = ("attention.wq.weight", "feed_forward.w1.weight", "feed_forward.w3.weight")
LLAMA_ROW = ("attention.wo.weight", "feed_forward.w2.weight")


@pytest.mark.parametrize(
    "name,changes,column,row",
    [
        ("gpt2-tiny", dict(n_layer=2, d_model=4096, n_head=32), GPT_COLUMN, GPT_ROW),
        ("llama3-tiny", dict(n_layers=2, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336),
         LLAMA_COLUMN, LLAMA_ROW),
    ],
)
def test_small_batch_on_a_tp_mesh_gives_megatron_column_then_row(name, changes, column, row):
    # one sequence of 1024 tokens through layers of GPT-2 XL / Llama-3 8B width
    planned = _plan(name, Mesh((8,), ("tp",)), batch=1, seq=1024, **changes)
    params = planned.plan.decided.params
    for pname, spec in params.items():
        if pname.endswith(column):
            assert spec == (S(0),), f"{pname} should be column-parallel, got {spec}"
        if pname.endswith(row):
            assert spec == (S(1),), f"{pname} should be row-parallel, got {spec}"


def test_large_batch_gives_data_parallelism():
    # in fp32: in bf16 an FSDP layout moves as many bytes (bf16 gathers, fp32 reduce-scatter)
    planned = _plan("gpt2-tiny", Mesh((8,), ("dp",)), batch=256, seq=128, precision="fp32",
                    n_layer=2, d_model=256, n_head=8)
    plan = planned.plan
    # the batch may arrive whole and be sliced locally (free): what matters is that the
    # matmuls run on batch shards
    mms = [n for n in planned.graph.nodes() if n.target is torch.ops.aten.addmm.default]
    assert mms and all(plan.decided.nodes[n.name].ins[1] == (S(0),) for n in mms)
    replicated = sum(spec == (R,) for spec in plan.decided.params.values())
    assert replicated >= 0.9 * len(plan.decided.params)
    assert any(c.kind == "all_reduce" and c.reason == "gradient sync" for c in plan.predicted.collectives)


def test_memory_budget_below_replicated_state_shards_parameters():
    mesh = Mesh((8,), ("dp",))
    # parameters and Adam state (16 B a parameter) dominate: few tokens, wide layers
    free = _plan("gpt2-tiny", mesh, batch=8, seq=32, n_layer=4, d_model=1024, n_head=8)
    state = sum(free.problem.usage[i][0] for i, n in enumerate(free.problem.nodes)
                if n.meta["autopar"].role == "param")
    budget = 0.5 * state
    tight = _plan("gpt2-tiny", mesh, batch=8, seq=32, budget=budget,
                  n_layer=4, d_model=1024, n_head=8)
    assert tight.plan.predicted.cost.mem_bytes <= budget
    sizes = {n.meta["autopar"].param_name: n.meta["autopar"].out.nbytes
             for n in tight.graph.nodes() if n.meta["autopar"].role == "param"}
    sharded = sum(sizes[n] for n, s in tight.plan.decided.params.items()
                  if any(isinstance(p, Shard) for p in s))
    assert sharded >= 0.5 * sum(sizes.values())  # at least half the state is split
    assert tight.plan.predicted.cost.step_s >= free.plan.predicted.cost.step_s


def test_infeasible_budget_is_a_clear_error():
    with pytest.raises(PlanError, match="memory budget") as err:
        _plan("gpt2-tiny", Mesh((2,), ("dp",)), batch=4, seq=32, budget=1000)
    text = str(err.value)
    # the leanest need, in units that read (KiB, not "0.00 GiB"), and the options sized
    assert "leanest it needs about" in text and "KiB" in text and "0.00 GiB" not in text
    assert "devices or more" in text and "raise --memory-budget to" in text


def test_activations_over_the_limit_suggest_a_batch_that_fits():
    from autopar.capture.joint import capture
    from autopar.ir.precision import Precision
    from autopar.passes.memory import recompute
    from autopar.passes.problem import sharding_problem
    from autopar.planning.memory_fit import leanest

    preset = get_preset("gpt2-tiny").replace(n_positions=128)
    model, inputs = preset.build("meta"), preset.example_inputs(64, 128)
    mesh = Mesh((2,), ("dp",))
    graph = capture(model, inputs, precision=Precision("bf16"))
    full = recompute.apply_recompute(graph, recompute.recompute_nodes(graph, "full"))
    need, state = leanest(sharding_problem.build(full, mesh))
    budget = state + (need - state) / 2  # half the leanest activations: about half the batch
    with pytest.raises(PlanError, match=r"Most helpful: a batch of (\d+)") as err:
        make_plan(model, mesh, inputs, options=Options.of(memory_budget=budget, time_limit_s=5))
    fit = int(re.search(r"a batch of (\d+)", str(err.value)).group(1))
    assert 16 <= fit <= 40, str(err.value)


def test_default_limit_is_the_devices_memory_less_its_reserve():
    planned = _plan("gpt2-tiny", Mesh((2,), ("dp",), "cpu"), batch=4, seq=32)
    assert planned.plan.provenance.memory_budget == 14 * 2**30  # cpu profile: 16 GiB less 2 GiB
    assert "cpu's 16.00 GiB less a 2.00 GiB reserve" in plan_table(planned.plan)
    assert planned.plan.decided.precision.name == "fp32"  # the cpu profile's default


def test_plan_round_trips_through_json(tmp_path):
    planned = _plan("llama3-tiny", Mesh((2, 2), ("dp", "tp")), batch=4, seq=32)
    path = tmp_path / "plan.json"
    planned.plan.save(path)
    doc = json.loads(path.read_text())
    assert doc["version"] == 8
    doc = {**doc["decided"], **doc["predicted"], **doc["provenance"]}  # the groups' fields
    assert set(doc["param_state"]) >= {"stages", "axes", "offloaded", "regathered"}
    assert set(doc["param_state"]["stages"]) <= set(doc["params"])
    assert doc["precision"] == {"name": "bf16", "reduce": "fp32"}  # h100: bf16 by default
    assert doc["recompute"]["asked"] == "auto" and doc["memory_budget"] > 0
    assert doc["mesh"] == {"shape": [2, 2], "axes": ["dp", "tp"], "device": "h100"}
    assert doc["first_bucket_bytes"] == 2**20  # NCCL overlaps an early small bucket
    assert set(doc["cost"]) >= {"step_s", "compute_s", "comm_s", "mem_bytes"}
    assert set(doc["solver"]) >= {"status", "time_s"}
    assert all(isinstance(v, list) and len(v) == 2 for v in doc["params"].values())
    loaded = Plan.load(path)
    assert loaded == planned.plan
    assert "predicted step" in plan_table(loaded)
    # gloo on CPU cores: one bucket size, also after a JSON round trip
    on_cpu = _plan("llama3-tiny", Mesh((2,), ("dp",), "cpu"), batch=4, seq=32).plan
    assert on_cpu.decided.first_bucket_bytes == BUCKET_BYTES
    assert Plan.from_json(json.loads(json.dumps(on_cpu.to_json()))) == on_cpu


def test_a_plan_records_which_sums_run_as_one_collective():
    """On the cpu profile's 2x2 mesh a sum over both axes is one all-reduce (one ring over 4
    ranks beats two over 2 at any size); the plan records it, keeps it through JSON, lists
    such collectives on ``dp+tp``, and a plan JSON without the record sums axis by axis."""
    plan = _plan("llama3-tiny", Mesh((2, 2), ("dp", "tp"), "cpu"), batch=4, seq=32).plan
    assert plan.decided.merged_sums == (("dp", "tp"),) and plan.merged_axes() == ((0, 1),)
    assert {c.axis for c in plan.predicted.collectives} <= {"dp", "tp", "dp+tp"}
    doc = plan.to_json()
    assert Plan.from_json(json.loads(json.dumps(doc))) == plan
    del doc["decided"]["merged_sums"]
    assert Plan.from_json(doc).merged_axes() == ()
    doc["decided"]["merged_sums"] = [["dp", "pp"]]
    with pytest.raises(PlanError, match="merges sums over axis 'pp'.*make the plan again"):
        Plan.from_json(doc).merged_axes()
    # NVLink: the extra ring steps of one ring over 8 cost more than the overheads saved
    assert _plan("llama3-tiny", Mesh((2, 4), ("dp", "tp")), batch=4, seq=32
                 ).plan.decided.merged_sums == ()


def test_plan_json_errors_name_the_fix(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(PlanError, match="autopar plan"):
        Plan.load(bad)
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")
    old = tmp_path / "old.json"  # a plan from before in-op reductions and grouped gathers
    old.write_text(json.dumps({"version": 1}))
    with pytest.raises(PlanError, match="version 1 is not supported.*make the plan again"):
        Plan.load(old)


def test_explain_lists_the_alternatives():
    planned = _plan("gpt2-tiny", Mesh((4,), ("tp",)), batch=2, seq=32)
    text = planned.explain("blocks.0.attn.qkv.weight")
    assert "chosen" in text and "<- chosen" in text
    with pytest.raises(KeyError):
        planned.explain("no.such.node")


def test_a_reference_that_places_repeated_layers_differently_is_still_scored():
    # Megatron on an MLP alternates column and row layers: their shared solver variable cannot
    # hold both, so the reference is completed without shared layer variables
    from autopar.models import REFERENCE_PLANS

    preset = get_preset("mlp-tiny")
    model = preset.build("meta")
    mesh = Mesh((2,), ("tp",))
    ref = REFERENCE_PLANS["megatron_tp"](model, mesh.shape, mesh.axes, "mlp")
    planned = make_plan(model, mesh, preset.example_inputs(8, 1), references={"megatron_tp": ref},
                        options=Options.of(time_limit_s=5))
    assert "megatron_tp" in planned.plan.provenance.references
    choice = planned.reference_choices["megatron_tp"]
    for name, spec in ref.params.items():
        node = planned.graph.param_node(name)
        i = [n.name for n in planned.problem.nodes].index(node.name)
        assert planned.problem.strategies[i][choice[i]].outs[0] == spec
    assert planned.plan.predicted.cost.step_s <= planned.plan.provenance.references["megatron_tp"].step_s * (1 + 1e-9)


def test_a_reference_layout_is_kept_unless_the_solver_clearly_beats_it():
    """On this MLP the solver's own plan (data parallelism) is predicted a little faster than
    FSDP (FSDP gathers each weight, DP all-reduces its gradients in the same buckets). Under a
    margin for cost-model error larger than that gap the plan is FSDP, and says why; with no
    margin it is the solver's own. Either way it is never worse than the reference."""
    from autopar.ir.options import MIN_GAIN
    from autopar.models import MLP, REFERENCE_PLANS, MLPConfig

    with torch.device("meta"):
        model = MLP(MLPConfig(in_dim=256, hidden=(1024, 256, 1024), out_dim=256))
    x = torch.empty(256, 256, device="meta")
    mesh = Mesh((4,), ("dp",), "cpu")
    refs = {"fsdp": REFERENCE_PLANS["fsdp"](model, mesh.shape, mesh.axes, "mlp", batch_size=256)}
    own = make_plan(model, mesh, (x, x), references=refs,
                    options=Options.of(time_limit_s=5, min_gain=0.0))
    ref_cost = own.plan.provenance.references["fsdp"].step_s
    gap = ref_cost / own.plan.predicted.cost.step_s - 1
    assert 0 < gap < 5 * MIN_GAIN  # close, so the margin decides
    kept = make_plan(model, mesh, (x, x), references=refs,
                     options=Options.of(time_limit_s=5, min_gain=2 * gap))
    assert kept.plan.predicted.cost.step_s == pytest.approx(ref_cost)
    assert "kept fsdp" in kept.plan.provenance.solver.method
    assert kept.plan.decided.params["layers.0.weight"] != (R,)
    assert own.plan.decided.params["layers.0.weight"] == (R,)


def test_a_sweep_answer_the_exact_solve_cannot_beat_is_reported_optimal(monkeypatch):
    """The axis sweep finds the plan, CP-SAT proves nothing beats it: the plan says optimal
    (and says who proved it); an unproven exact answer of the same cost proves nothing."""
    from autopar.planning import solving
    from autopar.solver.problem import Solution

    sweep = Solution((0, 1), 2.0, True, "feasible", 0.1, "axis-sweep")
    for exact_status, want in (("optimal", "optimal"), ("feasible", "feasible")):
        exact = Solution((1, 1), 2.0, True, exact_status, 0.2, "auto/ilp")
        monkeypatch.setattr(solving, "cannot_fit", lambda p: False)  # no problem here
        monkeypatch.setattr(solving, "solve_axiswise", lambda *a, **k: sweep)
        monkeypatch.setattr(solving, "solve", lambda *a, _e=exact, **k: _e)
        got = solving.planner_solve(None, None, time_limit_s=10.0)
        assert got.assignment == sweep.assignment and got.status == want
        if want == "optimal":
            assert got.method == "axis-sweep, proven optimal by auto/ilp"
            assert got.lower_bound == 2.0


def test_a_reference_completion_is_polished_by_local_moves_where_the_sweep_was_exact(
        monkeypatch):
    """Reference completions (local_polish) take the solver's local moves after an exact
    sweep, and its exact polish after a sweep with inexact steps (too wide to eliminate, or
    Lagrangian under a memory limit); a polish that finds nothing cheaper keeps the sweep's."""
    from autopar.passes.problem.axis_search import SWEEP, SWEEP_INEXACT
    from autopar.planning import solving
    from autopar.solver.problem import Solution

    for method, want in ((SWEEP, "heuristic"), (SWEEP_INEXACT, "auto")):
        calls = []
        sweep = Solution((0, 1), 2.0, True, "feasible", 0.1, method)

        def fake_solve(problem, timeout_s, hint=None, method="auto", _c=calls):
            _c.append((method, hint))
            return Solution((1, 1), 1.5, True, "feasible", 0.1, method)

        monkeypatch.setattr(solving, "cannot_fit", lambda p: False)  # no problem here
        monkeypatch.setattr(solving, "solve_axiswise", lambda *a, _s=sweep, **k: _s)
        monkeypatch.setattr(solving, "solve", fake_solve)
        got = solving.planner_solve(None, None, time_limit_s=10.0, local_polish=True)
        assert calls == [(want, sweep.assignment)] and got.cost == 1.5
    monkeypatch.setattr(solving, "solve", lambda *a, **k: Solution((1, 0), 2.0, True, "feasible",
                                                                     0.1, "heuristic"))
    monkeypatch.setattr(solving, "cannot_fit", lambda p: False)  # no problem here
    monkeypatch.setattr(solving, "solve_axiswise", lambda *a, **k: Solution(
        (0, 1), 2.0, True, "feasible", 0.1, SWEEP))
    assert solving.planner_solve(None, None, 10.0, local_polish=True).assignment == (0, 1)


def test_references_completed_on_forked_processes_equal_the_sequential_ones():
    """autopar.planning.parallel_map: --compare completes its reference layouts side by side; each
    completion is the one this process would make."""
    from autopar.models import get_preset
    from autopar.models.reference_plans import comparison_plans
    from autopar.planning.parallel_map import forked_map
    from autopar.planning.planner import make_plan

    preset = get_preset("llama3-tiny")
    model = preset.build("meta")
    mesh = Mesh((2,), ("dp",))
    refs = comparison_plans(model, mesh.shape, mesh.axes, "llama3", batch_size=4)
    refs = {k: refs[k] for k in ("data_parallel", "fsdp", "megatron_tp")}
    inputs = preset.example_inputs(4, 32)
    one = make_plan(model, mesh, inputs, references=refs, options=Options.of(time_limit_s=2.0)).plan
    two = make_plan(model, mesh, inputs, references=refs,
                    options=Options.of(time_limit_s=2.0, workers=2)).plan
    assert one.provenance.references == two.provenance.references and one.predicted.cost == two.predicted.cost
    assert forked_map(lambda x: x * x, [1, 2, 3], 2) == [1, 4, 9]


def test_zero_auto_weighs_zero1_beside_the_first_mode():
    from autopar.planning.modes import candidate_modes

    modes = [m.label for m in candidate_modes("auto", "auto")]
    assert modes[:3] == ["none", "none+zero3", "none+zero1"]
    assert "full+zero3" in modes and not any(m.endswith("+zero1") for m in modes[3:])
    assert [m.label for m in candidate_modes("none", "1")] == ["none+zero1"]


def _mlp_tiny_graph():
    from autopar.capture.joint import capture

    preset = get_preset("mlp-tiny")
    model, inputs = preset.build("meta"), preset.example_inputs(8, 0)
    return model, inputs, capture(model, inputs)


def test_modes_with_the_same_problem_are_planned_once(monkeypatch):
    """A mode that copies no node its predecessor did not (nothing more to recompute or
    re-gather) is the same problem: planned once, and the plan is as good as planning all."""
    import math

    from autopar.planning import planner
    from autopar.planning.modes import candidate_modes, mode_graph

    model, inputs, graph = _mlp_tiny_graph()
    mesh = Mesh((2, 2), ("dp", "tp"), "cpu")
    peak = make_plan(model, mesh, inputs, graph=graph, options=Options.of(
        memory_budget=math.inf, recompute="none")).plan.predicted.cost.mem_bytes
    planned: list = []
    real = planner._plan_mode

    def counting(pg, mesh_, mode, *a, **k):
        planned.append(mode)
        return real(pg, mesh_, mode, *a, **k)

    monkeypatch.setattr(planner, "_plan_mode", counting)
    make_plan(model, mesh, inputs, graph=graph,
              options=Options.of(memory_budget=0.7 * peak, time_limit_s=60))
    keys = {(frozenset(mode_graph(graph, m).recomputed.items()), m.whole_grads, m.offload)
            for m in planned}
    assert len(planned) > 1 and len(keys) == len(planned)  # no problem planned twice
    distinct = {(frozenset(mode_graph(graph, m).recomputed.items()), m.whole_grads)
                for m in candidate_modes("auto", "auto")}
    assert len(distinct) < len(candidate_modes("auto", "auto"))  # the case is a real one


def test_a_fit_that_overshoots_falls_back_to_the_leanest_layout_where_that_fits():
    from autopar.passes.memory.peak import peak_memory
    from autopar.passes.problem import sharding_problem
    from autopar.passes.problem.step_memory import step_usage
    from autopar.planning import solving
    from autopar.solver import Solution

    _, _, graph = _mlp_tiny_graph()
    sp = sharding_problem.build(graph, Mesh((2, 2), ("dp", "tp"), "cpu"), None)
    lean = tuple(int(u.argmin()) for u in sp.problem.usages)
    need = peak_memory(*step_usage(sp, sp.expand(lean)))[0]
    replicated = Solution((0,) * sp.problem.num_nodes, 1.0, True, "feasible", 0.0, "sweep")
    assert peak_memory(*step_usage(sp, sp.expand(replicated.assignment)))[0] > need
    got = solving._leanest_if_fits(sp, replicated, need)
    assert got.method == "leanest layout" and got.assignment == lean
    # where the leanest layout does not fit either, the solution is returned as it was
    assert solving._leanest_if_fits(sp, replicated, need * 0.99) is replicated


def _fit_case():
    """mlp-tiny on 2 x 2 at 0.6 of its peak: a limit whose first solve overshoots (the
    reduced problem does not count the step's reshard copies and gathers)."""
    import math

    from autopar.passes.problem import sharding_problem

    model, inputs, graph = _mlp_tiny_graph()
    mesh = Mesh((2, 2), ("dp", "tp"), "cpu")
    peak = make_plan(model, mesh, inputs, graph=graph, options=Options.of(
        memory_budget=math.inf, recompute="none")).plan.predicted.cost.mem_bytes
    budget = 0.6 * peak
    return sharding_problem.build(graph, mesh, budget), budget


def test_the_limit_binds_check_stops_at_the_first_cheaper_point(monkeypatch):
    """Whether the memory limit binds a plan: the sweeps from the plan (no random starts)
    that find a cheaper point without the limit settle it; only where they find none do the
    random starts run, and the answer is the full search's."""
    from autopar.passes.problem.axis_search import solve_axiswise
    from autopar.planning import planner, solving
    from autopar.planning.modes import Mode

    sp, budget = _fit_case()
    sol = solving.solve_within_budget(sp, budget, 20.0)
    run = planner._ModeRun(Mode("none"), None, sp, None, sol=sol)
    calls: list[int] = []
    real = planner.solve_axiswise

    def counting(*a, restarts=16, **k):
        calls.append(restarts)
        return real(*a, restarts=restarts, **k)

    monkeypatch.setattr(planner, "solve_axiswise", counting)
    free = solving.with_limit(sp.problem, None)
    full = solve_axiswise(sp, free, 20.0, [sol.assignment], restarts=16)
    own = planner.evaluate(free, sol.assignment)[0]
    binds = full.cost < own * (1 - 1e-9)
    assert binds  # at 0.6 of the peak the limit binds this plan
    assert planner._limit_not_binding(run, 20.0) is False
    assert calls == [0]  # the random starts were not needed
    # a plan the limit does not bind (the unconstrained one) runs the full check, True
    calls.clear()
    run.sol = solve_axiswise(sp, free, 20.0, restarts=16)
    calls.clear()
    assert planner._limit_not_binding(run, 20.0) is True
    assert calls == [0, 16]


def test_while_nothing_fits_the_offloading_modes_share_the_time_left(monkeypatch):
    """Offload is tried only where no mode fits with the state on the device; until one
    does, each device mode's share of the time left counts the offloading modes too, so the
    modes before them cannot take it all (MoE at 0.35 of its peak, under load: no plan)."""
    import math

    from autopar.planning import planner
    from autopar.planning.modes import candidate_modes

    model, inputs, graph = _mlp_tiny_graph()
    mesh = Mesh((2, 2), ("dp", "tp"), "cpu")
    peak = make_plan(model, mesh, inputs, graph=graph, options=Options.of(
        memory_budget=math.inf, recompute="none")).plan.predicted.cost.mem_bytes
    shares: list[tuple[str, float, float]] = []
    real = planner._plan_mode

    def nothing_fits_on_the_device(pg, mesh_, mode, lim, refs, search, own, *a, **k):
        left = search.deadline.left()
        run = real(pg, mesh_, mode, lim, refs, search, own, *a, **k)
        if lim is not None and own and not mode.offload:
            shares.append((mode.label, search.time_limit_s, left))
            run.fits = False  # as if its plan overflowed the step
        return run

    monkeypatch.setattr(planner, "_plan_mode", nothing_fits_on_the_device)
    try:
        make_plan(model, mesh, inputs, graph=graph,
                  options=Options.of(memory_budget=0.7 * peak, time_limit_s=20.0))
    except PlanError:
        pass  # whether an offloading mode fits is not what is tested
    labels = [m.label for m in candidate_modes("auto", "auto")]
    assert len(shares) > 2  # (a mode whose problem another's was is not planned again)
    for label, share, left in shares[1:]:
        # the device modes from this one on, and as many offloading ones
        waiting = len(labels) - labels.index(label) + len(labels)
        assert share <= max(planner.MIN_MODE_S, left / waiting) + 0.01, (label, share, left)


def test_a_solve_no_assignment_can_fit_is_answered_at_once():
    """A problem whose limit lies below its least peak (every node at its smallest usage at
    some instant; a memory fit's tightened limit) is answered "infeasible" without spending
    the time limit, and so is a reference completed under it; one just above is solved."""
    from autopar.capture.joint import capture
    from autopar.passes.problem import sharding_problem
    from autopar.planning.solving import planner_solve, with_limit
    from autopar.solver import evaluate
    from autopar.solver.problem import cannot_fit, least_peak_usage

    preset = get_preset("gpt2-tiny")
    sp = sharding_problem.build(capture(preset.build("meta"), preset.example_inputs(4, 32)),
                                Mesh((2, 2), ("dp", "tp")), 1e12)
    least = least_peak_usage(sp.problem)
    under = with_limit(sp.problem, least * 0.99)
    assert cannot_fit(under)
    sol = planner_solve(sp, under, 30.0)
    assert not sol.feasible and sol.status == "infeasible" and sol.time_s < 1.0
    lean = tuple(int(u.argmin()) for u in sp.problem.usages)
    over = with_limit(sp.problem, max(least, evaluate(sp.problem, lean)[2]))
    assert not cannot_fit(over)
    got = planner_solve(sp, over, 5.0)
    assert got.feasible and evaluate(over, got.assignment)[1]
