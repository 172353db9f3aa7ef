"""Errors a user can cause. Each message names the cause and the fix."""

from __future__ import annotations


class AutoparError(Exception):
    """Base of every error autopar raises on purpose."""


class CaptureError(AutoparError):
    """The model could not be traced into a joint graph."""


class PlanError(AutoparError, ValueError):
    """No plan can be made or loaded as asked (infeasible budget, mismatched plan...)."""


class MeshError(AutoparError, ValueError):
    """The mesh does not fit the model, the inputs or the process group."""


class CheckpointError(AutoparError, ValueError):
    """A checkpoint cannot be saved or loaded as asked (none committed, damaged, another
    model's); nothing of the model, the optimizer or the last committed checkpoint is lost."""


def first_line(e: BaseException, *, kind: bool = True) -> str:
    """An exception's message in one line for a one-line error: its first line, led by the
    exception's type name unless ``kind=False``, at most 200 characters."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    if kind or not text:
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text[:200]
