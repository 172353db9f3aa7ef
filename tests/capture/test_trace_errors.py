"""Where tracing cannot follow the model: one line naming the place (this file and line, the
module by its name in the model, the code) and what to do."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn

from autopar.capture.joint import capture
from autopar.ir.errors import CaptureError


class Gate(nn.Module):
    def __init__(self, read_value: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.read_value = read_value

    def forward(self, x):
        h = self.proj(x)
        if self.read_value:
            if h.sum() > 0:  # a branch on a value
                h = h * 2
            return h
        return h[h > 0].sum() + h  # a shape from values


class Net(nn.Module):
    def __init__(self, read_value: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), Gate(read_value)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def _line_of(text: str) -> int:
    source, start = inspect.getsourcelines(Gate.forward)
    return start + next(i for i, line in enumerate(source) if text in line)


def _error(model: nn.Module) -> str:
    with pytest.raises(CaptureError) as info:
        capture(model, (torch.randn(4, 8),))
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_a_branch_on_a_value_names_the_line_and_module() -> None:
    message = _error(Net(read_value=True))
    assert f"test_trace_errors.py:{_line_of('if h.sum() > 0')} in layers.1 " in message, message
    assert "(`if h.sum() > 0:  # a branch on a value`)" in message
    assert "torch.where" in message and "non-tensor input" in message


def test_a_shape_from_values_names_the_line() -> None:
    message = _error(Net(read_value=False))
    assert "data-dependent" in message
    assert f"test_trace_errors.py:{_line_of('h[h > 0]')} in layers.1" in message, message


def test_an_op_without_a_fake_implementation_says_how_to_register_one() -> None:
    lib = torch.library.Library("autopar_test_trace_errors", "FRAGMENT")
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: x * 2, "CPU")

    class UsesCustomOp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return torch.ops.autopar_test_trace_errors.double(self.proj(x)).mean()

    message = _error(UsesCustomOp())
    assert "autopar_test_trace_errors.double.default has no fake-tensor implementation" in message
    assert "in UsesCustomOp (`return torch.ops.autopar_test_trace_errors.double(" in message
    assert "@torch.library.register_fake('autopar_test_trace_errors::double')" in message
