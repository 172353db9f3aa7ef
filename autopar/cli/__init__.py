"""The ``autopar`` command line: ``plan``, ``solve``, ``diff`` and ``train``.

``main`` is the ``autopar`` command's entry point. ``autopar solve`` runs under a wall-clock
limit counted from the process start (a contest runner's clock), so it goes straight to the
solver, which knows no torch, without importing the rest of the command line (torch's import
alone is seconds of that limit on a loaded machine).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["solve"]:
        from autopar.solver import command

        return command.main(args)
    from autopar.cli.main import main as full_main

    return full_main(args)
