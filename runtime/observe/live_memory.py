"""Measured memory of a run: the bytes held by live tensors on this rank, op by op.

:class:`LiveBytes` is a ``TorchDispatchMode`` that, after every ATen op this process runs,
registers the storages of the op's outputs (each storage once, however many tensors view it)
and watches them with a weak reference; a storage's bytes count from the op that made it until
it is freed. Tensors made before the mode was entered are counted from the start where they are
handed to :meth:`LiveBytes.track` (parameters, gradients, optimizer state), and never where they
are handed to ``exclude`` (the global batch a training loop holds whatever the plan). DTensors
count their local pieces: the mode lets DTensor's dispatch run first (``NotImplemented``) and
sees the ops it runs on local tensors, as torch's ``MemTracker`` does. Wrapper tensors
(``AsyncCollectiveTensor``, DTensor) are walked down to the plain tensors inside.

What it does not see: memory a kernel allocates for itself and frees before returning, and
buffers a communication backend allocates in its own threads (gloo's). It is the counterpart of
the planner's memory model (``passes/memory/peak.py``), which also counts tensors, not allocator
blocks.

``torch.utils._python_dispatch`` is private; this module is its one user here, and
``tests/passes/memory/test_memory_fidelity.py`` fails loudly if torch changes it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors whose storages ``t`` holds (itself, or those inside a wrapper)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = (getattr(t, a) for a in attrs)  # DTensor's also name its mesh
        return [x for v in inner if isinstance(v, torch.Tensor) for x in _plain_tensors(v)]
    return [t]


class LiveBytes(TorchDispatchMode):
    """Bytes held by live tensors on this process, and their peak (see the module docstring).

    ``peak`` and ``peak_op`` (the op after which the peak was reached) cover the time since
    the mode was entered or :meth:`reset_peak`; ``timeline`` (with ``record=True``) holds
    ``(op, bytes live after it)`` per op, for finding what makes a peak."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (), record: bool = False) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.peak_op = "start"
        self.record = record
        self.timeline: list[tuple[str, int]] = []
        self._refs: dict[int, weakref.ref] = {}  # id(storage) -> weak ref (keeps the id unique)
        self._excluded: set[int] = set()
        self._exclude_keep: list[Any] = []  # the excluded storages stay alive, so ids stay theirs
        for t in exclude:
            for p in _plain_tensors(t):
                st = p.untyped_storage()
                self._excluded.add(id(st))
                self._exclude_keep.append(st)

    def track(self, *tensors: Any) -> None:
        """Count these tensors (and any inside lists, dicts, optimizer state) from now on."""
        for t in tree_flatten(list(tensors))[0]:
            if isinstance(t, torch.Tensor):
                for p in _plain_tensors(t):
                    self._add(p)
        self._note("track")

    def reset_peak(self) -> None:
        self.peak, self.peak_op = self.current, "reset"
        self.timeline = []

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or t.is_sparse:
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self._excluded:
            return
        ref = self._refs.get(key)
        if ref is not None and ref() is st:
            return
        nbytes = st.nbytes()
        self._refs[key] = weakref.ref(st, lambda _r, key=key, n=nbytes: self._free(key, n))
        self.current += nbytes

    def _free(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.current -= nbytes

    def _note(self, op: str) -> None:
        if self.current > self.peak:
            self.peak, self.peak_op = self.current, op
        if self.record:
            self.timeline.append((op, self.current))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs first; its local ops come back through here
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for p in _plain_tensors(t):
                    self._add(p)
        self._note(str(func.__name__ if hasattr(func, "__name__") else func))
        return out
