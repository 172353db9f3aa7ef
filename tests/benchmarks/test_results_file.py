"""``benchmarks/_common.update_results``: a benchmark's ``--write`` replaces its section's own
text and keeps the subsections under it (the measurements before, and why they moved)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "bench_common", Path(__file__).resolve().parents[2] / "benchmarks" / "_common.py")
_common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_common)
update_results = _common.update_results


def test_a_write_keeps_the_subsections_and_the_other_sections(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## A\n\nold table\n\n### A, the session before\n\n"
                    "why it moved\n\n#### a helper's runs\n\nkept too\n\n## B\n\nb's table\n")
    update_results("A", "new table", str(path))
    text = path.read_text()
    assert "old table" not in text and "## A\n\nnew table\n\n### A, the session before" in text
    assert "why it moved" in text and "kept too" in text and text.endswith("## B\n\nb's table\n")


def test_a_section_not_there_is_added_at_the_end(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## B\n\nb\n")
    update_results("C", "c", str(path))
    assert path.read_text() == "# Benchmark results\n\n## B\n\nb\n\n## C\n\nc\n"
