"""The Plan's groups and its file: decided / predicted / provenance in memory and on disk, a
version 7 file (the same fields, ungrouped) read as it is, any other version refused with what
to do."""

from __future__ import annotations

import json

import pytest

from autopar.ir.errors import PlanError
from autopar.ir.placements import Replicate, Shard
from autopar.ir.plan import (
    _GROUP_OF,
    PLAN_VERSION,
    CollectiveUse,
    Decisions,
    NodePlacement,
    Plan,
    PlanCost,
    Predictions,
    Provenance,
    SolverInfo,
)


def _small_plan() -> Plan:
    spec = (Shard(0),)
    return Plan(
        Decisions(mesh_shape=(2,), mesh_axes=("dp",), device="cpu",
                  params={"w": (Replicate(),)}, inputs={"x": spec},
                  nodes={"mm": NodePlacement((spec, (Replicate(),)), (spec,))},
                  input_shapes={"x": [8, 4]}, merged_sums=(("dp",),)),
        Predictions(PlanCost(1e-3, 8e-4, 2e-4, 1024.0),
                    (CollectiveUse("all_reduce", "dp", 1, 64.0, 2e-4, "gradient sync"),)),
        Provenance(SolverInfo("optimal", 0.1, "ilp"), model="tiny",
                   references={"data_parallel": PlanCost(1e-3, 8e-4, 2e-4, 1024.0)},
                   timings={"solve_s": 0.1}, memory_budget=2.0**30,
                   memory_limit_source="given"),
    )


def test_the_groups_round_trip_through_the_json_file(tmp_path):
    plan = _small_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    doc = json.loads(path.read_text())
    assert doc["version"] == PLAN_VERSION == 8
    assert set(doc) == {"version", "decided", "predicted", "provenance"}
    assert {"mesh", "params", "nodes"} <= set(doc["decided"])
    assert {"cost", "collectives"} == set(doc["predicted"])
    assert {"solver", "references", "memory_budget"} <= set(doc["provenance"])
    back = Plan.load(path)
    assert back == plan
    assert back.decided.params == {"w": (Replicate(),)}
    assert back.predicted.cost.step_s == 1e-3 and back.provenance.model == "tiny"
    assert back.merged_axes() == ((0,),) and back.full_mesh == ((2,), ("dp",))


def _flat(doc: dict) -> dict:
    """The version 7 file of the same plan: its groups' fields in one object."""
    return {"version": 7, **doc["decided"], **doc["predicted"], **doc["provenance"]}


def test_a_version_7_file_is_read_as_the_same_plan(tmp_path):
    plan = _small_plan()
    path = tmp_path / "v7.json"
    path.write_text(json.dumps(_flat(plan.to_json())))
    assert Plan.load(path) == plan
    assert set(_GROUP_OF) >= set(_flat(plan.to_json())) - {"version"}  # every field has a group


def test_a_plan_file_of_another_version_is_refused_saying_which_and_what_to_do(tmp_path):
    doc = _flat(_small_plan().to_json())
    doc["version"] = 6
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError) as e:
        Plan.load(path)
    message = str(e.value)
    assert "plan version 6 is not supported" in message
    assert "this autopar reads versions 7 and 8" in message
    assert "make the plan again with `autopar plan ... --json`" in message


def test_a_field_read_the_old_way_says_which_group_holds_it():
    plan = _small_plan()
    with pytest.raises(AttributeError, match=r"it is plan\.predicted\.cost"):
        plan.cost  # noqa: B018
    with pytest.raises(AttributeError, match=r"it is plan\.decided\.params"):
        plan.params  # noqa: B018
    assert not hasattr(plan, "no_such_field")
