"""Options: one frozen value, built from the flat keywords, validated with the fix named."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest

from autopar.ir.errors import PlanError
from autopar.ir.options import FLAT, MemoryOptions, Options, PipelineOptions


def test_flat_keywords_build_the_groups_and_come_back():
    opts = Options.of(memory_budget=2**30, recompute="full", zero=3, precision="bfloat16",
                      time_limit_s=2, workers=2, max_layers=4, schedule="1F1B", microbatches=8)
    assert opts.memory == MemoryOptions(2.0**30, "full", "3", "auto")
    assert opts.precision.compute == "bf16" and opts.precision.reduce is None
    assert (opts.search.time_limit_s, opts.search.workers, opts.search.max_layers) == (2.0, 2, 4)
    assert opts.pipeline == PipelineOptions("1F1B", 8, None) and opts.pipeline.fixed
    assert Options.of(**opts.flat()) == opts
    assert set(opts.flat()) == set(FLAT)
    assert Options() == Options.of() and not Options().pipeline.fixed


def test_options_are_frozen_values():
    opts = Options.of(recompute="selective")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.memory = MemoryOptions()  # type: ignore[misc]
    changed = opts.replace(recompute="none", memory_budget=math.inf)
    assert opts.memory.recompute == "selective"  # the original is untouched
    assert changed.memory.recompute == "none" and changed.memory.budget == math.inf
    assert Options.of(opts, workers=3).memory == opts.memory
    assert pickle.loads(pickle.dumps(opts)) == opts and hash(opts) == hash(Options.of(**opts.flat()))


@pytest.mark.parametrize("flat, message", [
    (dict(recompute="some"), r"unknown recompute mode 'some': use one of auto, none, "
                             r"selective, full"),
    (dict(zero=0), r"unknown ZeRO stage 0: use auto, 1, 2 or 3"),
    (dict(offload="disk"), r"unknown offload mode 'disk': use one of auto, none, optimizer"),
    (dict(precision="fp8"), r"unknown precision 'fp8': use one of fp32, bf16, fp16"),
    (dict(reduce_dtype="int8"), r"unknown reduce dtype 'int8': use one of fp32, bf16, fp16"),
    (dict(memory_budget=0), r"memory budget 0 bytes: give a positive size"),
    (dict(time_limit_s=-1), r"time limit -1: give a positive number of seconds"),
    (dict(workers=0), r"workers must be a whole number of at least 1"),
    (dict(microbatches=0), r"microbatches must be a whole number of at least 1"),
    (dict(schedule="2F2B"), r"unknown pipeline schedule '2F2B': use one of GPipe, 1F1B"),
])
def test_a_bad_value_is_refused_naming_it_and_the_valid_ones(flat, message):
    with pytest.raises(PlanError, match=message):
        Options.of(**flat)


def test_an_unknown_keyword_lists_the_valid_ones():
    with pytest.raises(TypeError, match=r"unknown option memory: autopar's options are "
                                        r"memory_budget, recompute, zero, offload"):
        Options.of(memory=1)

