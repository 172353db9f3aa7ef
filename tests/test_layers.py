"""The order of layers in ``docs/architecture.md`` holds for every import in the source tree,
those inside functions and under ``TYPE_CHECKING`` included: a module imports only from its own
package and from the layers above it in the doc's ``layers`` block, never across one line or
back down, and never a pair the doc's ``forbidden`` lines name. The doc is the one home of the
order; this test reads it from there."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
# pyproject's package-dir: the four source folders install under one namespace
FOLDERS = {"autopar": "autopar", "passes": "autopar.passes", "runtime": "autopar.runtime",
           "models": "autopar.models"}


@dataclass(frozen=True)
class Rules:
    layers: list[list[str]]  # top of the doc first: the lowest layer
    forbidden: list[tuple[str, str]]  # (importer, imported) package pairs

    def layer_of(self, module: str) -> tuple[int, str] | None:
        """The line and the package of ``module``: the longest package name it falls under."""
        best = None
        for i, line in enumerate(self.layers):
            for pkg in line:
                if module == pkg or module.startswith(pkg + "."):
                    if best is None or len(pkg) > len(best[1]):
                        best = (i, pkg)
        return best


def read_rules(doc: Path = DOC) -> Rules:
    text = doc.read_text()
    m = re.search(r"```layers\n(.*?)```", text, flags=re.S)
    assert m, f"{doc} has no ```layers block"
    layers, forbidden = [], []
    for raw in m.group(1).splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if " -/-> " in line:
            a, bs = line.split(" -/-> ")
            forbidden += [(a.strip(), b) for b in bs.split()]
        else:
            layers.append(line.split())
    return Rules(layers, forbidden)


def source_modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for folder, pkg in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg, *parts])] = path
    return out


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """Every first-party module ``module`` imports, wherever the import stands, with its line."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: None if is_pkg else -1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        else:
            continue
        out += [(n, node.lineno) for n in names if n == "autopar" or n.startswith("autopar.")]
    return out


def violations(root: Path = ROOT, rules: Rules | None = None) -> list[str]:
    rules = rules or read_rules()
    mods = source_modules(root)
    bad = []
    for mod, path in mods.items():
        here = rules.layer_of(mod)
        if here is None:
            bad.append(f"{mod}: in no layer of {DOC.name}; add its package to the layers block")
            continue
        for target, line in imports_of(mod, path, set(mods)):
            there = rules.layer_of(target)
            where = f"{path.relative_to(root)}:{line}: {mod} imports {target}"
            if there is None:
                bad.append(f"{where}, which is in no layer")
            elif there[1] != here[1] and there[0] >= here[0]:
                what = "on the same line" if there[0] == here[0] else "a later layer"
                bad.append(f"{where}: {there[1]} is {what} (layers may import only earlier lines)")
            for a, b in rules.forbidden:
                if rules.layer_of(mod)[1] == a and (target == b or target.startswith(b + ".")):
                    bad.append(f"{where}: {a} must not import {b} (forbidden in {DOC.name})")
    return bad


def test_every_import_goes_up_the_layers() -> None:
    bad = violations()
    assert not bad, "imports against the order of docs/architecture.md:\n" + "\n".join(bad)


def test_every_layer_is_a_package_that_exists() -> None:
    mods = source_modules()
    rules = read_rules()
    for line in rules.layers:
        for pkg in line:
            assert pkg in mods, f"{pkg} is named in the layers block but is no module"


@pytest.mark.parametrize("planted, where", [
    ("def f():\n    from autopar.runtime import lower\n", "autopar/ir/planted.py"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autopar.api import parallelize\n",
     "passes/planted.py"),
    ("import autopar.planning.planner\n", "runtime/planted.py"),
])
def test_a_planted_back_import_fails(tmp_path: Path, planted: str, where: str) -> None:
    """A copy of the tree with one module added that imports against the order: the check
    names that module (and nothing else)."""
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            dst = tmp_path / path.relative_to(ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(path.read_text())
    (tmp_path / where).write_text(planted)
    bad = violations(tmp_path)
    assert bad and all(b.startswith(where) for b in bad), bad


# --- import cycles --------------------------------------------------------------------------


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the first-party modules it imports, wherever the import stands (inside a
    function or under ``TYPE_CHECKING`` too: such imports were how cycles were hidden), each
    name taken to the longest module it falls under. A module's import of a package that
    contains it is left out: that package's ``__init__`` has run first either way."""
    mods = source_modules(root)
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        out = set()
        for target, _ in imports_of(mod, path, known):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != mod and not mod.startswith(target + "."):
                out.add(target)
        graph[mod] = out
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each
    sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda c: (-len(c), c))


def test_import_cycles_finds_a_cycle_and_only_it() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": set(), "f": {"f"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_no_module_import_cycles() -> None:
    cycles = import_cycles(import_graph())
    assert not cycles, "module import cycles (imports inside functions count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


# --- the solver knows no torch --------------------------------------------------------------


def test_the_solver_imports_no_torch() -> None:
    """No module of ``autopar.solver`` imports torch, wherever the import stands, and a fresh
    interpreter that loads every one of them (with ``autopar`` an empty package, so that its
    ``__init__`` brings in nothing) has not loaded torch: the solver runs without it."""
    solver = ROOT / "autopar" / "solver"
    for path in sorted(solver.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            torch = [n for n in names if n == "torch" or n.startswith("torch.")]
            assert not torch, f"{path.relative_to(ROOT)}:{node.lineno} imports {torch[0]}"
    code = (
        "import importlib, pkgutil, sys, types\n"
        f"pkg = types.ModuleType('autopar'); pkg.__path__ = [{str(ROOT / 'autopar')!r}]\n"
        "sys.modules['autopar'] = pkg\n"
        "import autopar.solver as s\n"
        "for m in pkgutil.walk_packages(s.__path__, 'autopar.solver.'):\n"
        "    importlib.import_module(m.name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded[:5]\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
