"""A call's inputs as a trace sees them: the tensors, which become the traced program's inputs,
and everything else (bools, ints, floats, strings, None, dtypes, any object, at any depth of
lists, tuples and dicts), which the trace takes as constants.

Capture traces a function of the tensors alone, the constants put back in their places
(:func:`split_inputs`, :meth:`CallInputs.rebuild`); the parallel module feeds the tensors of each
call in the same order and checks that its constants are the traced ones
(:func:`constants_mismatch`), since the program computes with the traced values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, keystr, tree_flatten_with_path, tree_unflatten

# values compared by value between the trace and a call; any other object by its type only
# (a config object or a cache built afresh for each call is not a different program)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.layout, torch.memory_format, enum.Enum, slice)


@dataclass(frozen=True)
class CallInputs:
    """One call's inputs flattened: the tree's structure, and its non-tensor leaves by index
    (the tensors' places are the other indices)."""

    spec: TreeSpec
    constants: dict[int, Any]  # leaf index -> value
    names: dict[int, str]  # leaf index -> where it sits in the call ("return_loss", "arg1[0]")
    kw_order: tuple[str, ...]  # the keyword inputs, in the order their tensors come

    def rebuild(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` with these tensors in the tensors' places, in order."""
        it = iter(tensors)
        n = self.spec.num_leaves
        leaves = [self.constants[i] if i in self.constants else next(it) for i in range(n)]
        args, kw_values = tree_unflatten(leaves, self.spec)
        return tuple(args), dict(zip(self.kw_order, kw_values))


def split_inputs(args: tuple, kwargs: dict[str, Any], kw_order: list[str] | None = None
                 ) -> tuple[list[torch.Tensor], CallInputs]:
    """The call's tensors (positional inputs first, then the keyword ones in ``kw_order``,
    default the call's own order; each depth-first) and the rest of it."""
    order = list(kwargs) if kw_order is None else kw_order
    with_paths, spec = tree_flatten_with_path((list(args), [kwargs[k] for k in order]))
    tensors, constants, names = [], {}, {}
    for i, (path, leaf) in enumerate(with_paths):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        else:
            constants[i] = leaf
            names[i] = _name(path, order)
    return tensors, CallInputs(spec, constants, names, tuple(order))


def constants_mismatch(traced: CallInputs, call: CallInputs) -> str | None:
    """Where a call's non-tensor inputs differ from the traced ones (``None``: nowhere), as
    "return_loss is False, traced with True"."""
    got = {call.names[i]: v for i, v in call.constants.items()}
    want = {traced.names[i]: v for i, v in traced.constants.items()}
    for name, value in want.items():
        if name not in got:
            return f"{name} is a tensor or missing, traced as the constant {value!r}"
        if not _same(value, got[name]):
            return f"{name} is {got[name]!r}, traced with {value!r}"
    extra = sorted(set(got) - set(want))
    if extra:
        return f"{extra[0]} is {got[extra[0]]!r}, traced as a tensor or absent"
    return None


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, _PLAIN):
        return a is b or bool(a == b)
    return True


def _name(path: tuple, kw_order: list[str]) -> str:
    """A leaf's place as the user wrote it: ``arg1['mask']``, ``return_loss``."""
    group, index, rest = path[0].idx, path[1].idx, keystr(path[2:])
    return (f"arg{index}" if group == 0 else kw_order[index]) + rest
