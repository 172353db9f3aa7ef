"""``parallelize(..., profile=DIR)``: the second step measured under torch.profiler, its ranges
named as the plan's predicted timeline; simulated ranks (LocalTensorMode), one process."""

from __future__ import annotations

import json
from collections import Counter

import torch
from harness.spmd import fake_world, mesh_for

import autopar
from autopar.models import get_preset
from autopar.runtime.observe import profiling


def test_parallelize_profile_traces_the_second_step(tmp_path) -> None:
    preset = get_preset("gpt2-tiny").replace(n_positions=16)
    torch.manual_seed(0)
    model = preset.build("cpu")
    tokens, targets = preset.example_inputs(2, 16, "cpu")
    with fake_world(2):
        pm = autopar.parallelize(model, mesh_for((2,)), (tokens, targets), time_limit_s=1.0,
                                 profile=tmp_path)
        for _ in range(3):
            pm(tokens, targets).backward()
        lowered = pm._active[1]
        assert pm._profile is None and not profiling.ACTIVE  # off again after the step
        assert pm._comm.__class__ is not profiling.ProfiledComm
        # the profiled program is a second copy; the usual one is the one that runs
        assert (id(lowered.fwd), False) in lowered._compiled
        assert "M(" not in lowered._compiled[(id(lowered.fwd), False)].source
        assert "M('forward layer 0')" in lowered._compiled[(id(lowered.fwd), False,
                                                            "profiled")].source
    measured = json.loads((tmp_path / "trace_rank0.json").read_text())
    ranges = Counter(e["name"] for e in measured["traceEvents"]
                     if e.get("cat") == "user_annotation")
    predicted = json.loads((tmp_path / "predicted.json").read_text())
    names = {e["name"] for e in predicted["traceEvents"] if e["ph"] == "X"}
    want = {"forward layer 0", "forward layer 1", "backward layer 1", "backward layer 0",
            "all_reduce[dp] gradient sync", "all_reduce[dp] loss"}
    assert want <= names and want <= set(ranges), sorted(ranges)
    assert ranges["forward layer 0"] == 1  # one step, not three
