"""Shared helpers for the benchmark scripts: machine description and table printing."""

from __future__ import annotations

import os
import platform
import re


def machine() -> str:
    import torch

    return (f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(out)


def update_results(section: str, body: str, path: str = "benchmarks/RESULTS.md") -> None:
    """Replace (or append) the text of RESULTS.md's ``## section`` up to its first heading
    of any level: its subsections (the measurements before, and why they moved) and the other
    sections stay as they are."""
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    head = f"## {section}\n"
    start = text.find(head)
    new = head + "\n" + body.strip() + "\n\n"
    if start < 0:
        text = text.rstrip() + "\n\n" + new
    else:
        nxt = re.compile(r"^#{1,6} ", re.M).search(text, start + len(head))
        text = text[:start] + new + (text[nxt.start():] if nxt else "")
    with open(path, "w") as f:
        f.write(text.rstrip() + "\n")
