"""Which ranks DDP keeps equal: the whole world, or its data-parallel subgroup.

DDP built over a subgroup (``process_group=``: the data-parallel group of a
tensor- or pipeline-parallel layout) averages gradients within that group
only. Ranks of different groups hold different weights and may draw the
same samples by design; the rank side names the group's ranks in the run
info (``ddp["dp_ranks"]``, absent for the whole world). No torch here.
"""

from __future__ import annotations

from ddpscope.analysis.state import RunState


def dp_group(run: RunState, rank: int) -> tuple[int, ...]:
    """The ranks of ``rank``'s DDP group (first model), or () when it spans the world."""
    view = run.ranks.get(rank)
    info = view.infos.get(0) if view is not None else None
    ranks = info.ddp.get("dp_ranks") if info is not None else None
    if not isinstance(ranks, list) or not ranks:
        return ()
    return tuple(int(r) for r in ranks)


def dp_size(run: RunState) -> int:
    """Ranks one DDP group holds: the world size unless DDP runs over subgroups.

    Read from the first rank that sent its run info: every rank of a job
    builds its DDP the same way, and this runs per pass end at any scale.
    """
    for r, view in run.ranks.items():
        if view.infos.get(0) is not None:
            group = dp_group(run, r)
            return len(group) if group else run.world_size
    return run.world_size


def by_group(run: RunState, ranks: list[int]) -> list[list[int]]:
    """``ranks`` split by DDP group, each group's ranks in order; one list without groups."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in sorted(ranks):
        groups.setdefault(dp_group(run, r), []).append(r)
    return list(groups.values())
