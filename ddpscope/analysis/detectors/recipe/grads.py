"""The model's gradients by size, and a step's all-reduces that carry them by hand.

Shared by ``gradients_reduced_twice`` (manual_allreduce.py: a hand-written
average on top of DDP's) and ``forward_bypasses_ddp`` (bypass.py: a loop that
skips DDP's forward but averages by hand trains correctly, DDP or not).
Not a detector; no torch here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ddpscope.analysis.state import RunState
from ddpscope.schema import RunInfo, Step

#: One call holding this share of the gradients' bytes is a flat buffer of them.
FLAT_SHARE = 0.9
#: Share of the trainable parameters a per-parameter loop must reach (a loop
#: that skips parameters whose gradient is None misses the unused ones).
COUNT_SHARE = 0.9
#: Where torch's own collectives run (comm hooks, model averaging): not the script's.
TORCH_SITE = "/torch/distributed/"

_DTYPE_BYTES = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8,
    "double": 8, "complex64": 8, "complex128": 16,
}  # fmt: skip


@dataclass(slots=True)
class Gradients:
    """What one rank's trainable parameters weigh, from its run info."""

    sizes: Counter[int]
    count: int
    total: int


def gradients_of(info: RunInfo) -> Gradients | None:
    """Bytes of each trainable parameter's gradient (None if a dtype is not known)."""
    sizes: Counter[int] = Counter()
    for p in info.params:
        if len(p) < 4 or not p[3]:
            continue
        width = _DTYPE_BYTES.get(str(p[2]))
        if width is None:
            return None
        n = 1
        for d in p[1]:
            n *= int(d)
        sizes[n * width] += 1
    count = sum(sizes.values())
    return Gradients(sizes, count, sum(b * c for b, c in sizes.items())) if count else None


def by_hand(s: Step, grads: Gradients) -> tuple[int, int, int, str] | None:
    """(calls, bytes, blocked ns, site) of the step's own all-reduces of its gradients.

    Judged call site by call site (the loss all-reduced beside them is another
    site): one flat buffer of them, one call per parameter, or buffers of the
    script's own packing (the listed calls of the site together carry their
    bytes). Bytes -1: one call per parameter (calls beyond the step's list have
    no size; they are counted for the site of the last listed call).
    """
    by_site: dict[str, list[tuple[int, int]]] = {}
    for op, cls, nbytes, dur, site in zip(
        s.c_op, s.c_class, s.c_nbytes, s.c_dur_ns, s.c_site, strict=False
    ):
        if op == "all_reduce" and cls == "user" and TORCH_SITE not in site:
            by_site.setdefault(site, []).append((nbytes, max(0, dur)))
    last = s.c_site[-1] if s.c_site else ""
    for site, calls in by_site.items():
        blocked = sum(d for _, d in calls)
        carried = sum(b for b, _ in calls)
        if max(b for b, _ in calls) >= FLAT_SHARE * grads.total:
            return len(calls), carried, blocked, site  # a flat buffer
        seen = Counter(b for b, _ in calls)
        # Every call the size of a parameter's gradient, as many as there are parameters.
        if all(seen[b] <= grads.sizes.get(b, 0) for b in seen):
            count = len(calls) + (s.c_more if site == last else 0)
            if count >= COUNT_SHARE * grads.count:
                return count, -1, blocked, site  # one call per parameter
        if carried >= FLAT_SHARE * grads.total:
            # Buffers the script packs itself (by size or by dtype, as apex did).
            return len(calls), carried, blocked, site
    return None


class GradientsByRank:
    """Each rank's model-0 gradients, read from its run info once it has come."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, int], Gradients | None] = {}

    def reset(self, run_id: str) -> None:
        self._known = {k: v for k, v in self._known.items() if k[0] != run_id}

    def of(self, run: RunState, rank: int) -> Gradients | None:
        """None before the rank's run info, or where a dtype is not known."""
        key = (run.run_id, rank)
        if key in self._known:
            return self._known[key]
        view = run.ranks.get(rank)
        info = view.infos.get(0) if view is not None else None
        if info is None:
            return None  # no run info yet: asked again at the next step
        grads = self._known[key] = gradients_of(info)
        return grads


__all__ = [
    "COUNT_SHARE", "FLAT_SHARE", "TORCH_SITE", "Gradients", "GradientsByRank", "by_hand",
    "gradients_of",
]  # fmt: skip
