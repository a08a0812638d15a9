"""Which samples corresponding passes of two ranks both drew, from their sketches.

Not a detector: the measuring table behind ``shard_overlap`` (sharding.py).
Each pass end carries a value-based sketch of the dataset indices it drew
(``mix64(i) % sketch_mod == 0``, the same rule on every rank); put at one
power-of-two modulus, an index in two ranks' sketches was drawn by both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ddpscope.analysis.detectors.sampling.ledger import PassRec
from ddpscope.sketch import M64, keep

#: Overlap beyond padding that makes a finding: share of a rank's sketch points...
MIN_OVERLAP = 0.01
#: ...and at least this many shared sketch points.
MIN_OVERLAP_POINTS = 3
#: Sketch points kept per compared pass (all ranks together): bounds memory.
UNION_BUDGET = 1 << 16
_M64 = M64


class SketchUnion:
    """Sketch points of corresponding passes of all ranks, under one sampling rule.

    A point is kept when ``mix64(i) % base == 0`` (the coarsest sketch modulus seen,
    so every rank's sketch can be reduced to it) and the top ``thin`` bits of the
    Fibonacci hash ``i * K mod 2**64`` are zero. The same rule on every rank keeps
    intersections exact: a point held twice is a sample drawn twice. ``thin`` grows
    until all points, counted with multiplicity, fit in ``UNION_BUDGET``; the
    Fibonacci hash costs a multiply where mix64 costs a dozen operations, which
    matters when a thousand ranks end a pass at once.
    """

    def __init__(self, world: int = 0) -> None:
        #: Ranks in the job: how many equal shares a batch-level sharder pads to.
        self.world = world
        self.base = 1
        self.thin = 0
        self.recs: dict[int, PassRec] = {}
        #: rank -> its points under the current rule.
        self.points: dict[int, list[int]] = {}
        #: index -> the first rank holding it; indices held by two ranks or more.
        self.first: dict[int, int] = {}
        self.multi: set[int] = set()
        #: rank -> its points also held by another rank.
        self.shared: Counter[int] = Counter()
        self.total = 0
        #: Ranks whose overlap beyond padding passes the thresholds.
        self.flagged: set[int] = set()

    @property
    def rate(self) -> int:
        """One point kept per this many drawn samples, on average."""
        return self.base << self.thin

    def add(self, rec: PassRec) -> bool:
        """Take a rank's pass; True when the set of flagged ranks changed."""
        end = rec.end
        assert end is not None
        if rec.rank in self.recs:
            return False
        self.recs[rec.rank] = rec
        before = set(self.flagged)
        changed: set[int] = set()
        if end.sketch_mod > self.base:
            self.base = end.sketch_mod
            changed |= self._rebuild(lambda pts: _keep(pts, self.base - 1))
        pts = end.sketch if end.sketch_mod == self.base else _keep(end.sketch, self.base - 1)
        pts = _thin(pts, self.thin)
        while self.total + len(pts) > UNION_BUDGET and self.thin < 63:
            self.thin += 1
            changed |= self._rebuild(lambda pts: _thin(pts, self.thin))
            pts = _thin(pts, self.thin)
        changed |= self._take(rec.rank, pts)
        for r in changed:
            extra, share = self.excess_of(r)
            if extra >= MIN_OVERLAP_POINTS and share >= MIN_OVERLAP:
                self.flagged.add(r)
            else:
                self.flagged.discard(r)
        return self.flagged != before

    def _take(self, rank: int, pts: list[int]) -> set[int]:
        """Add a rank's points; the ranks whose shared count changed."""
        self.points[rank] = pts
        self.total += len(pts)
        changed: set[int] = set()
        first, multi, shared = self.first, self.multi, self.shared
        for i in pts:
            other = first.get(i)
            if other is None:
                first[i] = rank
                continue
            if i not in multi:
                multi.add(i)
                shared[other] += 1
                changed.add(other)
            shared[rank] += 1
            changed.add(rank)
        return changed

    def _rebuild(self, narrow: Callable[[list[int]], list[int]]) -> set[int]:
        # Each rule implies the previous one: the new points are a subset of the old.
        kept = {r: narrow(pts) for r, pts in self.points.items()}
        self.points, self.first, self.multi, self.shared = {}, {}, set(), Counter()
        self.total = 0
        for r, pts in kept.items():
            self._take(r, pts)
        return set(kept)

    def excess_of(self, rank: int) -> tuple[int, float]:
        """Shared points beyond what DistributedSampler padding explains, and their share."""
        pts = len(self.points.get(rank, ()))
        if not pts:
            return 0, 0.0
        rec = self.recs[rank]
        allowed = max(_padding_allowance(rec), _share_padding(rec, self.world, self.rate))
        extra = max(0, self.shared[rank] - allowed)
        return extra, extra / pts

    def excess(self) -> dict[int, tuple[int, float]]:
        return {r: self.excess_of(r) for r in self.recs if self.points.get(r)}


_keep = keep  # the rank side's rule: a point stays when mix64(i) & mask == 0


def _thin(pts: list[int], bits: int) -> list[int]:
    """The points whose Fibonacci hash has its top ``bits`` bits zero."""
    if bits <= 0:
        return pts
    limit = 1 << (64 - bits)
    return [i for i in pts if (i * 0x9E3779B97F4A7C15) & _M64 < limit]


def _padding_allowance(rec: PassRec) -> int:
    """Duplicates DistributedSampler padding gives this rank: its own padded slot, and
    its first index when that index was repeated to fill another rank's slot."""
    b = rec.begin
    if b is None or not b.distributed or b.drop_last or b.num_replicas <= 0:
        return 0
    pad = -b.dataset_len % b.num_replicas
    return b.padded + (1 if 0 <= b.sampler_rank < pad else 0)


def _share_padding(rec: PassRec, world: int, rate: int) -> int:
    """Sketch points a batch-level sharder's padding may share, for a pass it sharded.

    accelerate's ``BatchSamplerShard`` (``even_batches``, its default) gives every
    rank the same number of batches by starting over at the dataset's first
    batches: with 512 samples in batches of 16 on 3 ranks each rank draws 176,
    and the 16 beyond the dataset are drawn twice. Equal shares that cover the
    dataset with less than one share to spare are a padded partition; more is
    not padding (every rank drawing the whole dataset spares W - 1 shares).
    """
    b = rec.begin
    if b is None or b.distributed or world <= 1 or b.dataset_len <= 0:
        return 0
    drawn = rec.drawn
    pad = drawn * world - b.dataset_len
    if not 0 < pad < drawn:
        return 0
    return pad // max(1, rate) + 1
