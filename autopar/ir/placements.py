"""Placements of a tensor on one mesh axis, and specs over all axes.

These mirror DTensor's ``Replicate``, ``Shard(d)`` and ``Partial`` so a plan means the same to the
user, to ``torch.distributed.checkpoint`` and to the runtime. They are plain frozen values (no
torch import) so planning code can hash, compare and serialise them cheaply. Their reprs read
back: ``R``, ``S(0)``, ``P(sum)``; :func:`parse_placement` is the inverse.

A *spec* is a tuple with one placement per mesh axis, e.g. ``(S(0), R)`` on a ``dp x tp`` mesh
means "batch split over dp, whole on each tp rank". Several axes may shard the same tensor dim:
the shards nest in mesh-axis order, exactly as DTensor does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Replicate:
    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Partial:
    """Each rank holds a partial value; the full value is their reduction (``sum`` or ``max``...)."""

    reduce: str = "sum"

    def __repr__(self) -> str:
        return f"P({self.reduce})"


Placement = Replicate | Shard | Partial
Spec = tuple[Placement, ...]

R = Replicate()
P = Partial("sum")


def S(dim: int) -> Shard:  # noqa: N802 - reads like the repr
    return Shard(dim)


_PLACEMENT_RE = re.compile(r"^\s*(?:(R)|S\((-?\d+)\)|P\((\w+)\))\s*$")


def parse_placement(text: str) -> Placement:
    """Inverse of ``repr``: ``"R"``, ``"S(1)"``, ``"P(sum)"``."""
    m = _PLACEMENT_RE.match(text)
    if not m:
        raise ValueError(
            f"cannot read placement {text!r}: write 'R', 'S(<dim>)' or 'P(<reduce>)', e.g. 'S(0)'"
        )
    if m.group(1):
        return R
    if m.group(2) is not None:
        return Shard(int(m.group(2)))
    return Partial(m.group(3))


def parse_spec(items: list[str] | tuple[str, ...]) -> Spec:
    return tuple(parse_placement(t) for t in items)


def format_spec(spec: Spec) -> list[str]:
    return [repr(p) for p in spec]


def spec_str(spec: Spec) -> str:
    return "(" + ", ".join(repr(p) for p in spec) + ")" if len(spec) != 1 else repr(spec[0])


def shard_factor(spec: Spec, dim: int, mesh_shape: tuple[int, ...]) -> int:
    """How many pieces tensor dim ``dim`` is cut into under ``spec``."""
    f = 1
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, Shard) and p.dim == dim:
            f *= n
    return f


def num_shards(spec: Spec, mesh_shape: tuple[int, ...]) -> int:
    """By how much the per-device element count shrinks (product of sharded axis sizes)."""
    f = 1
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, Shard):
            f *= n
    return f


def local_shape(
    shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...]
) -> tuple[int, ...]:
    """Per-device shape (ceil division: the largest shard when a dim does not divide evenly)."""
    out = list(shape)
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, Shard):
            out[p.dim] = -(-out[p.dim] // n)
    return tuple(out)


def evenly_divides(shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...]) -> bool:
    """True when every sharded dim splits into equal pieces (nested shards included)."""
    sizes = list(shape)
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, Shard):
            if p.dim >= len(sizes) or sizes[p.dim] % n:
                return False
            sizes[p.dim] //= n
    return True


def normalize_spec(spec: Spec, ndim: int) -> Spec:
    """Negative shard dims made positive, so equal specs compare equal."""
    return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in spec)


def to_torch(p: Placement):
    """The DTensor placement object for ``p`` (imports torch lazily)."""
    from torch.distributed.tensor import Partial as TP
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS

    if isinstance(p, Replicate):
        return TR()
    if isinstance(p, Shard):
        return TS(p.dim)
    return TP(p.reduce)


def from_torch(p) -> Placement:
    from torch.distributed.tensor import Partial as TP
    from torch.distributed.tensor import Shard as TS

    if isinstance(p, TS):
        return Shard(p.dim)
    if isinstance(p, TP):
        return Partial(p.reduce_op)
    return R
