"""Ranks grouped by host: the grouped view that keeps a cluster readable.

At thousands of ranks a row per rank hides the few that matter; a row per
host (8 ranks each, typically) with the worst figure of its ranks keeps the
problem host on the first screen.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ddpscope.analysis.snapshot import OK, RankRow


@dataclass(frozen=True, slots=True)
class HostGroup:
    """One host's ranks summed up for the grouped view: the worst of each figure.

    At thousands of ranks a row per rank hides the few that matter; a row
    per host (8 ranks each, typically) with the worst figure of its ranks
    keeps the problem host on the first screen.
    """

    host: str
    #: In rank order.
    ranks: tuple[int, ...]
    #: The worst rank's level and badge, the number of ranks above OK and
    #: their badges (worst first, each once).
    level: int
    status: str
    problems: int
    kinds: tuple[str, ...]
    #: The rank to look at first: worst level, then the most own work.
    worst_rank: int
    #: Lowest and highest step count (a rank behind shows as a range).
    step_min: int
    step_max: int
    #: Worst over the host's ranks, in ms (-1: no rank has stepped): step time,
    #: own work (the step less every collective wait), collective waits, data.
    step_ms: float
    busy_ms: float
    wait_ms: float
    data_ms: float
    cpu_pct: float
    rss_bytes: int
    hb_age_s: float


def busy_of(row: RankRow) -> float:
    """A row's own work in ms: its step less the three collective waits (-1: no step)."""
    if row.step_ms < 0:
        return -1.0
    return row.step_ms - max(row.wait_ms, 0.0) - max(row.sync_ms, 0.0) - max(row.coll_ms, 0.0)


def wait_of(row: RankRow) -> float:
    """All the collective waits of a row, in ms (-1: no step)."""
    if row.step_ms < 0:
        return -1.0
    return max(row.wait_ms, 0.0) + max(row.sync_ms, 0.0) + max(row.coll_ms, 0.0)


def group_rows(rows: Iterable[RankRow]) -> tuple[HostGroup, ...]:
    """The rows by host, problem hosts first (worst level, then most problem ranks),
    then by host name. One pass to group and one per host to sum: ~4,096 rows
    in a few ms, done once per snapshot."""
    by_host: dict[str, list[RankRow]] = {}
    for row in rows:
        members = by_host.get(row.host)
        if members is None:
            members = by_host[row.host] = []
        members.append(row)
    groups = [_group(host, members) for host, members in by_host.items()]
    groups.sort(key=lambda g: (-g.level, -g.problems, g.host))
    return tuple(groups)


def _group(host: str, members: list[RankRow]) -> HostGroup:
    members.sort(key=lambda r: r.rank)
    worst = max(members, key=lambda r: (r.level, busy_of(r), -r.rank))
    problem = sorted((r for r in members if r.level > OK), key=lambda r: (-r.level, r.rank))
    kinds = tuple(dict.fromkeys(r.status for r in problem))
    steps = [r.step for r in members]
    return HostGroup(
        host=host,
        ranks=tuple(r.rank for r in members),
        level=worst.level,
        status=worst.status,
        problems=len(problem),
        kinds=kinds,
        worst_rank=worst.rank,
        step_min=min(steps),
        step_max=max(steps),
        step_ms=max(r.step_ms for r in members),
        busy_ms=max(busy_of(r) for r in members),
        wait_ms=max(wait_of(r) for r in members),
        data_ms=max(r.data_ms for r in members),
        cpu_pct=max(r.cpu_pct for r in members),
        rss_bytes=max(r.rss_bytes for r in members),
        hb_age_s=max(r.hb_age_s for r in members),
    )
