"""DTensor's op handler table as autopar's fast paths use it (``runtime/dtensor_handlers``)."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime import dtensor_handlers, elementwise_fast_path
from autopar.runtime.optim import fused as fused_optim

aten = torch.ops.aten


def test_install_keeps_a_handler_already_there_and_uninstall_removes_only_its_own() -> None:
    table = dtensor_handlers.handler_table()
    assert table is not None
    op, other = aten.lgamma.default, aten.digamma.default  # no DTensor handler of their own

    def mine(op, args, kwargs):  # pragma: no cover - never called
        raise AssertionError

    def theirs(op, args, kwargs):  # pragma: no cover - never called
        raise AssertionError

    assert op not in table and other not in table
    table[other] = theirs
    try:
        dtensor_handlers.install([op, other], mine)
        assert table[op] is mine and table[other] is theirs
        assert not dtensor_handlers.installed([op, other], mine)
        assert dtensor_handlers.installed([op], mine)
        dtensor_handlers.uninstall([op, other], mine)
        assert op not in table and table[other] is theirs
    finally:
        table.pop(op, None)
        table.pop(other, None)


@pytest.mark.parametrize("module", [fused_optim, elementwise_fast_path],
                         ids=["fused_optim", "elementwise_fast_path"])
def test_each_fast_path_installs_idempotently_and_reversibly(module) -> None:
    module.install()
    module.install()
    assert module.installed()
    module.uninstall()
    assert not module.installed()
    module.install()
    assert module.installed()
