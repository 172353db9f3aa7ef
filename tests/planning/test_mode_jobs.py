"""The modes after the first planned side by side (autopar.planning.mode_jobs): the same plan
and the same per-mode plans as one process makes, and a mode's run that crossed a pipe scores
and explains as the one made here."""

import math
import pickle

import pytest
import torch

from autopar.ir.mesh import Mesh
from autopar.ir.options import Options
from autopar.models import MLP, MLPConfig
from autopar.passes.problem import bucket_fill
from autopar.planning import parallel_map, planner
from autopar.planning.mode_jobs import per_worker_share, portable, restored

MESH = Mesh((2, 2), ("dp", "tp"), "cpu")


def _mlp():
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_dim=30, hidden=(70, 50), out_dim=6, activation="relu"))
    return model, (torch.randn(16, 30), torch.randn(16, 6))


@pytest.mark.parametrize("fraction,free_needed", [(0.5, False), (0.2, True)])
def test_modes_planned_on_two_workers_equal_those_planned_in_one_process(
        monkeypatch, fraction, free_needed):
    """At 0.2 of its peak the MLP's first mode finds nothing that fits: the plan with no
    limit, planned ahead beside it on the second worker, seeds the other modes."""
    model, inputs = _mlp()
    free = planner.make_plan(model, MESH, inputs, options=Options.of(memory_budget=math.inf))
    budget = fraction * free.plan.predicted.cost.mem_bytes
    forked, waited = [], []
    real, real_get = planner.forked_map, planner.Ahead.get

    def counted(fn, items, workers):
        forked.append((len(items), workers))
        return real(fn, items, workers)

    def get(self, timeout_s=None):
        waited.append(self._proc is not None)  # forked, not computed here
        return real_get(self, timeout_s)

    monkeypatch.setattr(planner, "forked_map", counted)
    monkeypatch.setattr(planner.Ahead, "get", get)
    monkeypatch.setattr(parallel_map, "idle_cores", lambda: 2.0)  # as on an idle machine
    # a long limit: every solve here ends by its work, so both runs do the same work
    one, two = (planner.make_plan(model, MESH, inputs, options=Options.of(
        memory_budget=budget, time_limit_s=120, workers=w)) for w in (1, 2))
    assert any(n >= 2 and w == 2 for n, w in forked), forked  # the modes were forked
    assert waited == ([False, True] if free_needed else [])  # one process, then two
    assert list(one.mode_problems) == list(two.mode_problems)
    assert len(two.mode_problems) >= 3
    assert one.plan.predicted.cost == two.plan.predicted.cost
    assert one.plan.decided.nodes == two.plan.decided.nodes
    assert one.plan.decided.recompute == two.plan.decided.recompute
    for mode, sp in two.mode_problems.items():  # each forked mode's problem is whole here
        assert [n.name for n in sp.nodes] == [n.name for n in one.mode_problems[mode].nodes]
        assert all(n.graph is sp.nodes[0].graph for n in sp.nodes)


def test_a_portable_run_crosses_a_pipe_and_scores_as_before():
    model, inputs = _mlp()
    planned = planner.make_plan(model, MESH, inputs, options=Options.of(
        memory_budget=math.inf, time_limit_s=30))
    run = planner._ModeRun(planner.Mode(), planned.graph, planned.problem, None,
                           planned.solution, planned.node_choice)
    before = bucket_fill.score(planned.problem, planned.node_choice).cost
    back = pickle.loads(pickle.dumps(portable(run)))
    assert back.pg is None and all(isinstance(n, str) for n in back.sp.nodes)
    again = restored(back, planned.graph, MESH, planned.problem)
    assert again.sp.nodes == planned.problem.nodes and again.sp.mesh is MESH
    assert again.sp.spec_ids is planned.problem.spec_ids  # the price caches shared again
    assert again.sp.matrix_cache == {}  # keyed by list identity: never carried over
    assert bucket_fill.score(again.sp, again.choice).cost == before
    assert run.sp.nodes == planned.problem.nodes  # the original is left whole


def test_per_worker_share_counts_the_modes_left_on_one_worker():
    # one process: the modes left, this one counted (make_plan's sequential share)
    assert [per_worker_share(k, 5, 0, 1) for k in range(5)] == [5, 4, 3, 2, 1]
    assert [per_worker_share(k, 5, 0, 2) for k in range(5)] == [3, 2, 2, 1, 1]
    assert per_worker_share(0, 5, 6, 2) == 6  # with the offloading modes still to come


def test_work_planned_ahead_is_read_or_stopped_unread():
    import os

    from autopar.planning.parallel_map import Ahead

    ahead = Ahead(os.getpid, 2)  # forked: another process computed it
    assert ahead.get() != os.getpid() and ahead._proc is None
    assert Ahead(os.getpid, 1).get() == os.getpid()  # one worker: computed here, when read
    stopped = Ahead(lambda: __import__("time").sleep(60), 2)
    stopped.cancel()  # returns at once, the child ended
    assert stopped._proc is None
    box: list[int | None] = [None]
    lost = Ahead(lambda: __import__("time").sleep(60) if box[0] is None else box[0], 2)
    box[0] = os.getpid()  # the child forked before this was set: it sleeps, this process not
    assert lost.get(timeout_s=0.5) == os.getpid()  # not sent in time: computed here
    # a child that dies without a word: computed here; an error it raises: raised here
    parent = os.getpid()
    died = Ahead(lambda: os._exit(3) if os.getpid() != parent else box[0], 2)
    box[0] = 7
    assert died.get(timeout_s=30) == 7 and died._proc is None
    failed = Ahead(lambda: 1 / 0, 2)
    with pytest.raises(ZeroDivisionError):
        failed.get(timeout_s=30)
    # stopped again and again at once (a pool's terminate once waited for ever here)
    for _ in range(20):
        Ahead(lambda: __import__("time").sleep(60), 2).cancel()


def test_the_heap_is_left_out_of_garbage_collection_only_while_forked_children_live():
    """gc.freeze while a fork's children live (a full collection would write to every page
    the parent and children share, and each write copies one): the children see the
    inherited objects frozen, and the parent's are collectable again once they end, read or
    stopped, nested or not."""
    import gc

    from autopar.planning.parallel_map import Ahead, forked_map

    assert gc.get_freeze_count() == 0
    ahead = Ahead(gc.get_freeze_count, 2)
    assert gc.get_freeze_count() > 0  # this process's, while the child lives
    inner = forked_map(lambda _: gc.get_freeze_count(), [0, 1], 2)
    assert min(inner) > 0 and gc.get_freeze_count() > 0  # still: the ahead child lives
    assert ahead.get() > 0
    assert gc.get_freeze_count() == 0
    stopped = Ahead(lambda: __import__("time").sleep(60), 2)
    stopped.cancel()
    assert gc.get_freeze_count() == 0
    assert min(forked_map(lambda _: gc.get_freeze_count(), [0, 1], 2)) > 0
    assert gc.get_freeze_count() == 0
    assert Ahead(gc.get_freeze_count, 1).get() == 0  # nothing forked: nothing frozen
    gc.freeze()  # the caller's own: left frozen
    try:
        assert min(forked_map(lambda _: gc.get_freeze_count(), [0, 1], 2)) > 0
        assert gc.get_freeze_count() > 0  # not unfrozen by the fork's end
    finally:
        gc.unfreeze()


def test_modes_are_planned_in_one_process_where_no_core_is_idle(monkeypatch):
    forked = []
    real = planner.forked_map
    monkeypatch.setattr(planner, "forked_map",
                        lambda fn, items, w: forked.append((len(items), w)) or real(fn, items, w))
    monkeypatch.setattr(parallel_map, "idle_cores", lambda: 0.3)
    monkeypatch.delenv("AUTOPAR_PLAN_WORKERS", raising=False)
    assert parallel_map.usable_workers(2) == 1
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "2")  # a count the user set is taken as given
    assert parallel_map.usable_workers(2) == 2
    monkeypatch.delenv("AUTOPAR_PLAN_WORKERS")
    model, inputs = _mlp()
    free = planner.make_plan(model, MESH, inputs, options=Options.of(memory_budget=math.inf))
    planned = planner.make_plan(model, MESH, inputs, options=Options.of(
        memory_budget=0.5 * free.plan.predicted.cost.mem_bytes, workers=2))
    assert len(planned.mode_problems) >= 3
    assert not [n for n, w in forked if n >= 2 and w >= 2], forked


def test_idle_cores_reads_the_machine():
    idle = parallel_map.idle_cores(0.02)
    assert idle is None or 0.0 <= idle <= parallel_map._cores() + 1e-9
    assert parallel_map.usable_workers(1) == 1  # one worker asked: no sample taken


def test_a_forked_job_maps_in_its_own_process():
    """A pool's worker may not fork one of its own: a job that maps again (a mode planned
    on a worker completing its reference layouts) maps in its own process."""
    inner = parallel_map.forked_map
    assert inner(lambda x: inner(lambda y: y + 1, [x, x], 2), [1, 2], 2) == [[2, 2], [3, 3]]
