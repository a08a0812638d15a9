"""The problem strip: what is wrong, pinned under the view bar, whatever is scrolled or filtered.

One line per kind of problem (a finding's kind on the ranks it singles out,
or a badge such as ``silent``), worst first: the ranks and their hosts, then
the finding's own first words. At 4,096 ranks the straggler and the hung
rank are read here without scrolling, sorting or filtering. A run with no
problem rank shows no strip at all.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import Static

from ddpscope.analysis.snapshot import ERROR, WARNING, FindingView, RankRow
from ddpscope.ui import format as fmt

STYLE = {ERROR: "bold red", WARNING: "bold yellow"}
ICON = {ERROR: "✖", WARNING: "▲"}
#: What a badge means when no finding explains it.
BADGE_TEXT = {
    "silent": "nothing heard for 5 s",
    "no data": "never heard from",
    "disabled": "ddpscope turned itself off there after an internal error",
}


def _where(rows: Sequence[RankRow]) -> str:
    hosts = list(dict.fromkeys(r.host for r in rows))
    if len(rows) == 1:
        return f"rank {rows[0].rank} on {rows[0].host}"
    on = f"{len(hosts)} hosts ({fmt.ranks(hosts, 3)})" if len(hosts) > 1 else hosts[0]
    return f"ranks {fmt.ranks([r.rank for r in rows], 4)} on {on}"


def _said(message: str) -> str:
    """A finding's first line without its subject ("rank 3 is a straggler: ..." ->
    "..."): the strip has named the ranks already."""
    first = message.splitlines()[0] if message else ""
    head, sep, rest = first.partition(": ")
    if sep and head.startswith("rank") and len(head) < 60:
        return rest
    return first


def problem_lines(
    rows: Sequence[RankRow], findings: Sequence[FindingView], limit: int = 3
) -> list[Text]:
    """The strip's lines: one per badge above ``info``, worst level then most ranks first."""
    by_status: dict[str, list[RankRow]] = {}
    for row in rows:
        if row.level >= WARNING:
            by_status.setdefault(row.status, []).append(row)
    if not by_status:
        return []
    message = {}
    for f in findings:
        if f.active and f.kind not in message and f.message:
            message[f.kind] = _said(f.message)
    order = sorted(by_status.items(), key=lambda kv: (-kv[1][0].level, -len(kv[1]), kv[0]))
    lines = []
    for status, members in order[:limit]:
        level = max(r.level for r in members)
        what = message.get(status) or BADGE_TEXT.get(status, "")
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f"{ICON[level]} {status} ", STYLE[level])
        line.append(_where(members), "bold")
        if what:
            line.append(f": {what}")
        lines.append(line)
    if len(order) > limit:
        lines[-1].append(f"  (+{len(order) - limit} more kinds: 4 Findings)", "dim")
    return lines


class ProblemStrip(Static):
    DEFAULT_CSS = """
    ProblemStrip { height: auto; max-height: 3; padding: 0 1; background: $error 15%;
        text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.display = False
        self.limit = 3
        self.plain = ""

    def show(self, rows: Sequence[RankRow], findings: Sequence[FindingView]) -> None:
        lines = problem_lines(rows, findings, self.limit)
        plain = "\n".join(line.plain for line in lines)
        if plain == self.plain:
            return
        self.plain = plain
        self.display = bool(lines)
        if lines:
            self.update(Text("\n").join(lines))
