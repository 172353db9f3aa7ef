"""``pyproject.toml`` names what the code imports: every third-party module the source folders
import (at the top, inside functions, under ``TYPE_CHECKING``) comes from a listed dependency
or is one of the optional imports below, and every listed dependency is imported somewhere;
the test extra covers what the tests import. ``docs/architecture.md`` says why each is there."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ("autopar", "passes", "runtime", "models")
# imported only where a user brings the thing, under try/except ImportError: not required
OPTIONAL = {"transformers": "a user's Hugging Face model (capture/hf_experts.py)"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _third_party(folders: list[Path]) -> set[str]:
    first_party = {"autopar", "harness", "conftest"}
    out = set()
    for folder in folders:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                else:
                    continue
                out |= {n.split(".")[0] for n in names}
    return {m for m in out if m not in sys.stdlib_module_names and m not in first_party}


def _distributions(modules: set[str]) -> dict[str, set[str]]:
    dists = packages_distributions()
    return {m: {d.lower().replace("_", "-") for d in dists.get(m, [m])} for m in modules}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_imported_library_is_a_dependency_and_every_dependency_is_imported() -> None:
    listed = {_name(r) for r in _project()["dependencies"]}
    imported = _distributions(_third_party([ROOT / f for f in SOURCE]))
    missing = {m: d for m, d in imported.items() if m not in OPTIONAL and not d & listed}
    assert not missing, f"imported but not in pyproject's dependencies: {missing}"
    used = set().union(*imported.values())
    assert listed <= used, f"listed but imported nowhere: {sorted(listed - used)}"


def test_the_test_extra_covers_what_the_tests_import() -> None:
    project = _project()
    listed = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    imported = _distributions(_third_party([ROOT / "tests"]))
    missing = {m: d for m, d in imported.items() if not d & listed}
    assert not missing, f"the tests import these, which neither list names: {missing}"
