"""The planner's modes are values; their labels are the strings tables and messages show."""

from __future__ import annotations

import pytest

from autopar.ir.errors import PlanError
from autopar.planning.modes import Mode, candidate_modes


def test_the_planner_modes_read_as_their_labels():
    for label in ("none", "none+zero3", "full+zero3+offload", "selective+zero1"):
        assert Mode.parse(label).label == label
    assert Mode("full", regather=True).offloaded().base == Mode.parse("full+zero3")
    assert Mode.parse("full+zero3").plain == Mode.parse("none+zero3")
    assert [m.label for m in candidate_modes("full", "auto")] == ["full+zero3"]
    with pytest.raises(PlanError, match=r"unknown part 'zero4' of planner mode 'none\+zero4'"):
        Mode.parse("none+zero4")


def _graph_text(pg):
    return [(n.name, n.op, str(n.target), str(n.args), n.meta["autopar"].phase)
            for n in pg.graph.nodes if n.op != "output"]


@pytest.mark.parametrize("label", ["selective", "full+zero3", "none+zero3"])
def test_a_mode_graph_is_made_once_per_trace_and_is_what_rewriting_makes(label):
    import copy
    from dataclasses import replace

    from autopar.capture.joint import capture
    from autopar.models import get_preset
    from autopar.passes.memory.recompute import apply_recompute
    from autopar.planning.modes import mode_graph

    preset = get_preset("llama3-tiny")
    pg = capture(preset.build("meta"), preset.example_inputs(4, 16, "meta"))
    first = mode_graph(pg, label)
    assert first.recomputed, label  # each of these modes copies nodes on this model
    # the same trace again (a mesh-shape search's stand-in: a copy with its own proxy)
    other = copy.copy(pg)
    other.proxy = "another stand-in's proxy"
    again = mode_graph(other, label)
    assert again.gm is first.gm and again.recomputed == first.recomputed
    assert again.proxy == "another stand-in's proxy" and first.proxy is pg.proxy
    # what the rewrite makes afresh, node for node
    fresh = apply_recompute(pg, list(first.recomputed.values()))
    assert fresh.gm is not first.gm
    assert _graph_text(fresh) == _graph_text(first) and fresh.recomputed == first.recomputed
    assert replace(fresh, gm=first.gm) == first
    # another trace of the same model is another key
    assert mode_graph(capture(preset.build("meta"), preset.example_inputs(4, 16, "meta")),
                      label).gm is not first.gm
