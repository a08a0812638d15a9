"""Words and units every finding uses: rank lists, ordinals, error lines.

One place, so that "ranks 0-3, 7" reads the same in a hang, a sampler finding
and a report, whatever wrote it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

# Re-exported: findings that print seconds take the unit with the words.
from ddpscope.analysis.state import NS as NS


def ranks_text(ranks: Iterable[int]) -> str:
    """``[0, 1, 3, 4, 5, 9]`` -> ``"0, 1, 3-5, 9"``: 1,024 ranks stay readable."""
    out: list[str] = []
    items = sorted(set(ranks))
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{items[i]}-{items[j]}")
        else:
            out += [str(x) for x in items[i : j + 1]]
        i = j + 1
    return ", ".join(out)


def first_few(items: Sequence[object], limit: int = 8) -> str:
    """``["a", "b", "c", "d"]``, 2 -> ``"a, b and 2 more"``: a long list quoted in a line."""
    text = ", ".join(str(x) for x in items[:limit])
    return text + (f" and {len(items) - limit} more" if len(items) > limit else "")


def tensor_labels(names: Sequence[str], attr: str, indices: Iterable[int]) -> list[str]:
    """``indices`` into a model's ``attr`` ("params", "buffers") by name (``names``, from
    ``RunState.tensor_names``), ``attr[i]`` where none is known."""
    return [names[i] if 0 <= i < len(names) else f"{attr}[{i}]" for i in indices]


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``[3]`` -> ``"rank 3"``, ``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``."""
    items = sorted(set(ranks))
    return f"rank {items[0]}" if len(items) == 1 else f"ranks {ranks_text(items)}"


def cap(text: str) -> str:
    """The text with its first letter upper-case (``str.capitalize`` lowers the rest)."""
    return text[:1].upper() + text[1:]


def nth(ordinal: int) -> str:
    """0 -> "1st": an ordinal counted from zero, the way people count epochs."""
    n = ordinal + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def by_value(values: dict[int, Any]) -> str:
    """``{0: 0, 1: 1}`` -> ``"0 on rank 0, 1 on rank 1"``."""
    groups: dict[Any, list[int]] = {}
    for r, v in sorted(values.items()):
        groups.setdefault(v, []).append(r)
    return ", ".join(f"{v} on {ranks_phrase(rs)}" for v, rs in groups.items())


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b")


def error_line(text: str) -> str:
    """The exception line of a traceback (``RuntimeError: ...``), not its last line.

    Some torch errors append an ``At:`` list of frames after the message, and
    chained exceptions repeat blocks; the line after the last block's frames
    is the one that names the error. A line that ends in a colon introduces
    its detail on the next, indented line (``Error(s) in loading state_dict
    for Net:`` then ``Missing key(s) ...``): the two are joined.
    """
    lines = text.rstrip().splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call")]
    if starts:
        for i in range(starts[-1] + 1, len(lines)):
            ln = lines[i]
            if ln.strip() and not ln.startswith((" ", "\t")):
                return _with_detail(lines, i)
    named = [i for i, ln in enumerate(lines) if _EXC_LINE.match(ln)]
    if named:
        return _with_detail(lines, named[-1])
    rest = [ln.strip() for ln in lines if ln.strip()]
    return rest[-1][:300] if rest else ""


def _with_detail(lines: list[str], i: int) -> str:
    line = lines[i].strip()
    if line.endswith(":") and i + 1 < len(lines) and lines[i + 1].startswith("\t"):
        line = f"{line} {lines[i + 1].strip()}"
    return line if len(line) <= 300 else line[:296] + " ..."
