"""Printing benchmark results: rows the way docs/benchmarks.md shows them, or JSON."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def print_rows(rows: Sequence[Mapping[str, Any]], load_note: str = "load average") -> None:
    """The machine, then the rows as a Markdown table (columns: the first row's keys)."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"cores: {os.cpu_count()}, python {sys.version.split()[0]}, {load_note}: {load}")
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


def print_json(result: Mapping[str, Any], path: str = "") -> None:
    """The result as indented JSON on stdout, and into ``path`` too when one is given."""
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        Path(path).write_text(text)
