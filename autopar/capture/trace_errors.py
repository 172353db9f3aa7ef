"""Where tracing could not follow the model, and what to do: one line.

Capture runs the model on fake tensors, which have shapes but no values. A forward that reads
a value in Python (``if x.sum() > 0:``, ``.item()``), makes a shape from values (``nonzero``,
a boolean mask), or calls an op with no fake-tensor implementation (a custom op) cannot be
traced. :func:`explain` names the place in the model's own code (its file and line, and the
module whose forward it is, by its name in the model) and the fix for each of these.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from types import FrameType
from typing import Any

import torch
import torch.nn as nn

from autopar.ir.errors import first_line

# frames in these trees are the tracer's, not the model's
_TORCH = os.path.dirname(torch.__file__)
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # autopar/
_SOURCE_ROOT = os.path.dirname(_OURS)
_INTERNAL = (_TORCH, _OURS, os.path.join(_SOURCE_ROOT, "passes"),
             os.path.join(_SOURCE_ROOT, "runtime"), sysconfig.get_paths()["stdlib"])

_VALUE_READ = ("DataDependentOutputException", "GuardOnDataDependentSymNode")
_VALUE_SHAPE = ("DynamicOutputShapeException",)
_NO_FAKE = ("UnsupportedOperatorException",)


def explain(e: BaseException, model: nn.Module) -> str:
    """One line: where the trace of ``model`` failed with ``e``, why, and what to do."""
    kind = type(e).__name__
    where = _place(e, model)
    if kind in _VALUE_READ:
        return (f"the forward reads a tensor's value in Python{where} (a branch such as `if "
                "x.sum() > 0:`, .item(), .tolist()): autopar traces on fake tensors, which have "
                "shapes but no values. Compute both branches and pick with torch.where, or make "
                "the choice a non-tensor input (a bool or int argument, a constant of the trace)")
    if kind in _VALUE_SHAPE:
        return (f"an op's output shape is data-dependent{where} (nonzero, a boolean "
                f"mask, unique: {first_line(e, kind=False)}): autopar traces on fake tensors, which have "
                "shapes but no values. Keep shapes static (multiply by the mask instead of "
                "indexing with it) or pass the sizes in as inputs")
    if kind in _NO_FAKE:
        op = first_line(e, kind=False)
        name = op.rsplit(".", 1)[0].replace(".", "::", 1)
        return (f"the op {op} has no fake-tensor implementation, so it cannot be traced"
                f"{where}: register one that returns an empty tensor of the output's shape "
                f"and dtype with @torch.library.register_fake({name!r})")
    return (f"tracing the training step failed with {kind}{where}: {first_line(e, kind=False)}. autopar "
            "traces on fake tensors: data-dependent shapes (nonzero, boolean masks) and .item() "
            "calls cannot be traced; make the shapes static or pass them in as inputs")


def _place(e: BaseException, model: nn.Module) -> str:
    """`` at file.py:12 in layers.0.attn (`code`)``: the innermost frame of the model's own
    code the error passed through ('' where there is none)."""
    frame: FrameType | None = None
    lineno = 0
    for f, line in traceback.walk_tb(e.__traceback__):
        if not os.path.abspath(f.f_code.co_filename).startswith(_INTERNAL):
            frame, lineno = f, line
    if frame is None:
        return ""
    filename = frame.f_code.co_filename
    code = traceback.FrameSummary(filename, lineno, frame.f_code.co_name).line or ""
    text = f" at {os.path.relpath(filename) if _under_cwd(filename) else filename}:{lineno}"
    module = _module_name(frame.f_locals.get("self"), model)
    if module is not None:
        text += f" in {module}"
    return text + (f" (`{code.strip()}`)" if code.strip() else "")


def _module_name(obj: Any, model: nn.Module) -> str | None:
    if not isinstance(obj, nn.Module):
        return None
    for name, mod in model.named_modules():
        if mod is obj:
            return name or type(model).__name__
    return type(obj).__name__


def _under_cwd(path: str) -> bool:
    return os.path.abspath(path).startswith(os.getcwd() + os.sep)


