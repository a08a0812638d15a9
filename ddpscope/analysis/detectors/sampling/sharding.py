"""``unsharded_data`` / ``shard_overlap``: ranks that train on the same samples.

(b) At ``iter()``, from the DistributedSampler settings alone: ``num_replicas``
not the world size, seeds or ``shuffle`` that differ across ranks, two ranks
passing the same sampler rank. Judged at ``iter()`` for a pass begun in
training mode while that mode can be believed (the ledger's ``mode_tells``),
else at the pass's first step: ignite begins each evaluation in train mode.
(a) At the first step of a pass over a non-distributed sampler that draws all
``len(dataset)`` indices of an unwrapped dataset on two or more ranks, through
the stock BatchSampler only: a batch sampler of its own may shard above the
sampler (accelerate's BatchSamplerShard keeps each rank's own batches of one
shared order), so what such a loader
yields is left to (c). (c) At each pass end, measured: the sketches of
corresponding passes are put in one table at a common power-of-two modulus (an
index in two ranks' sketches was drawn by both), and a rank's overlap is the
share of its sketch points also held by another rank, after removing what
DistributedSampler's padding explains (each rank draws at most two padded
duplicates). Flagged at 1 % and at least 3 sketch points: any shared point is
a real duplicate, the thresholds only keep negligible overlaps quiet. A
limitation of index-based evidence: ranks that each load *different* data of
the same length are indistinguishable from ranks that load the same data.
A sampler that deals each sample to several ranks on purpose (repeated
augmentation: ``SamplerPass.repeats`` above 1) is not measured: its overlap
is its design; a sampler drawing with replacement is flagged only where ranks
drew the very same order (random draws share samples by chance, across
ranks as within one). Under DDP over subgroups (a 2-D layout) ranks are judged
within their DDP group: ``num_replicas`` should be the group's size, and
ranks of different groups (a tensor-parallel pair) draw alike by design.

Passes and their sketches come from the pass ledger (sampling/ledger.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ddpscope.analysis.detectors.sampling.ledger import (
    KEEP_ORDINALS,
    PASS_MESSAGES,
    STOCK_BATCH_SAMPLERS,
    LedgerDetector,
    PassLedger,
    PassRec,
)
from ddpscope.analysis.detectors.sampling.overlap import MIN_OVERLAP, SketchUnion
from ddpscope.analysis.dpgroups import dp_group, dp_size
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import by_value, nth, ranks_phrase
from ddpscope.schema import HEAD_LEN, Message, SamplerPass

#: Non-distributed samplers overlapping this much are "unsharded", not "overlapping".
UNSHARDED_OVERLAP = 0.9


def _short(qualname: str) -> str:
    return qualname.rsplit(".", 1)[-1] or "?"


def _minority(values: dict[int, Any]) -> list[int]:
    """Ranks whose value is not the most common one; every rank on a tie at the top."""
    counts = Counter(values.values())
    if len(counts) <= 1:
        return []
    (top, n), (_, m) = counts.most_common(2)
    if n == m:
        return sorted(values)
    return sorted(r for r, v in values.items() if v != top)


def _world(run: RunState) -> int:
    return max(run.world_size, len(run.ranks))


def _dp_noun(run: RunState) -> str:
    """What num_replicas should equal: the world size, or DDP's group size."""
    return "DDP's process group size" if dp_size(run) != run.world_size else "the world size"


FIX_DISTRIBUTED = (
    "Shard with `DistributedSampler(dataset, shuffle=True, seed=S)` passed as the DataLoader's "
    "`sampler=` (shuffle goes to the sampler, not to the DataLoader), built the same way on "
    "every rank, and call `sampler.set_epoch(epoch)` every epoch. For manual sharding give "
    "each rank a disjoint Subset, e.g. `Subset(ds, range(rank, len(ds), world_size))`."
)
FIX_SEED = (
    "Pass the same `seed` to DistributedSampler on every rank (the default 0 is fine): the "
    "ranks must shuffle one shared permutation to take disjoint slices of it. Seed per-rank "
    "randomness (augmentation, dropout) elsewhere."
)
FIX_REPLICAS = (
    "Let DistributedSampler take `num_replicas` and `rank` from the process group (leave both "
    "out), or pass `dist.get_world_size()` and `dist.get_rank()`: the global rank, not "
    "LOCAL_RANK."
)
FIX_SHUFFLE = "Pass the same `shuffle` to DistributedSampler on every rank."
FIX_RANDOM_SPLIT = (
    "Split the dataset the same way on every rank: `random_split(ds, lengths, "
    "generator=torch.Generator().manual_seed(S))` with one S for all ranks (or split once and "
    "share the indices). Without a fixed generator each rank draws its own split, so the "
    "ranks' training sets differ, their DistributedSampler shards overlap, and held-out samples "
    "leak into training."
)
FIX_SHARED_ORDER = (
    "Give the sampler under accelerate's batch sharding a generator seeded the same on every "
    "rank (`torch.Generator().manual_seed(S)`): every rank must draw one order and keep its "
    "own batches of it. A sampler that draws from the global RNG drifts apart across ranks as "
    "soon as their other random draws differ (dropout over batches of different lengths). The "
    'Hugging Face Trainer\'s `train_sampling_strategy="group_by_length"` builds its '
    "LengthGroupedSampler that way: override `Trainer._get_train_sampler` to pass it a seeded "
    '`generator`, or use the default `"random"` strategy.'
)
FIX_SAME_DATASET = (
    "Build the same dataset on every rank before DistributedSampler shards it: it partitions "
    "the indices 0..N-1, which only works when N and the data are the same everywhere."
)


@dataclass
class _Issue:
    """One sharding finding (a kind and a loader): its causes, each with its fix."""

    kind: str
    loader: int
    step: int
    epoch: int
    causes: dict[str, tuple[list[int], str, str]] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)
    signature: Any = None


class _Tally:
    """The DistributedSampler settings of one loader's ranks, counted so that a healthy
    run checks each begin in O(1) and only a suspicious one looks at every rank."""

    def __init__(self) -> None:
        self.of: dict[int, tuple[int, bool, int, int]] = {}
        self.seeds: Counter[int] = Counter()
        self.shuffles: Counter[bool] = Counter()
        self.replicas: Counter[int] = Counter()
        self.slots: Counter[tuple[int, int]] = Counter()
        #: Sampler ranks (of num_replicas > 1) given by two ranks or more.
        self.crowded = 0

    def put(self, b: SamplerPass) -> bool:
        """Record a rank's settings; False when they are the ones it had."""
        key = (b.seed, b.shuffle, b.num_replicas, b.sampler_rank)
        old = self.of.get(b.rank)
        if old == key:
            return False
        if old is not None:
            self._count(old, -1)
        self.of[b.rank] = key
        self._count(key, 1)
        return True

    def _count(self, key: tuple[int, bool, int, int], n: int) -> None:
        seed, shuffle, replicas, slot = key
        counters: list[tuple[Counter[Any], Any]] = [
            (self.shuffles, shuffle),
            (self.replicas, replicas),
            (self.slots, (replicas, slot)),
        ]
        if shuffle:
            counters.append((self.seeds, seed))
        for counter, value in counters:
            counter[value] += n
            if counter[value] <= 0:
                del counter[value]
        if replicas > 1:
            now = self.slots.get((replicas, slot), 0)
            if n > 0 and now == 2:
                self.crowded += 1
            elif n < 0 and now == 1:
                self.crowded -= 1

    def suspicious(self, world: int) -> bool:
        return (
            len(self.seeds) > 1
            or len(self.shuffles) > 1
            or len(self.replicas) > 1
            or (world > 1 and world not in self.replicas)
            or self.crowded > 0
        )


@dataclass
class _ShardRun:
    ledger: PassLedger
    #: loader -> rank -> latest training-mode pass begin.
    begins: dict[int, dict[int, SamplerPass]] = field(default_factory=dict)
    tallies: dict[int, _Tally] = field(default_factory=dict)
    #: loader -> rank -> trained pass over a whole unwrapped dataset, non-distributed.
    plain: dict[int, dict[int, SamplerPass]] = field(default_factory=dict)
    unions: dict[tuple[int, int, int, tuple[int, ...]], SketchUnion] = field(default_factory=dict)
    issues: dict[tuple[str, int], _Issue] = field(default_factory=dict)


class ShardingDetector(LedgerDetector[_ShardRun]):
    kinds: tuple[str, ...] = ("unsharded_data", "shard_overlap")
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = PASS_MESSAGES

    new_run = _ShardRun

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, PASS_MESSAGES):
            return
        st = self._run(run.run_id)
        for ev in st.ledger.update(msg):
            rec = ev.rec
            if rec is None:
                continue
            if ev.kind == "begin":
                if rec.begin is not None and rec.begin.training and st.ledger.mode_tells(rec):
                    self._begun(run, st, rec, book)
            elif ev.kind == "first_step":
                self._begun(run, st, rec, book)  # the same settings again cost a lookup
                self._plain(run, st, rec, book)
                if rec.end is not None:
                    self._measure(run, st, rec, book)
            elif ev.kind == "end" and rec.steps > 0:
                self._measure(run, st, rec, book)

    # (b) settings, at iter() or the first step --------------------------------------

    def _begun(self, run: RunState, st: _ShardRun, rec: PassRec, book: FindingBook) -> None:
        b = rec.begin
        if b is None:
            return
        begins = st.begins.setdefault(b.loader, {})
        begins[b.rank] = b
        if not b.distributed:
            return
        tally = st.tallies.setdefault(b.loader, _Tally())
        if not tally.put(b) or not tally.suspicious(dp_size(run)):
            return
        dist = {r: x for r, x in begins.items() if x.distributed}
        self._settings(run, st, b, dist, book)

    def _settings(
        self,
        run: RunState,
        st: _ShardRun,
        b: SamplerPass,
        dist: dict[int, SamplerPass],
        book: FindingBook,
    ) -> None:
        world = dp_size(run)  # the ranks DDP shards over: a subgroup under 2-D layouts
        replicas = {r: x.num_replicas for r, x in dist.items()}
        found: dict[str, tuple[str, list[int], str, str]] = {}
        if world > 1:
            ones = sorted(r for r, n in replicas.items() if n == 1)
            off = {r: n for r, n in replicas.items() if n not in (1, world)}
            if ones:
                found["replicas_one"] = (
                    "unsharded_data",
                    ones,
                    f"its DistributedSampler on {ranks_phrase(ones)} has num_replicas=1 in a world "
                    f"of {world}, so each of those ranks draws the whole dataset",
                    FIX_REPLICAS,
                )
            if off:
                found["replicas"] = (
                    "shard_overlap",
                    sorted(off),
                    f"DistributedSampler num_replicas is {by_value(off)} but {_dp_noun(run)} is "
                    f"{world}: shards are cut for the wrong number of ranks, so ranks share "
                    f"shards or some shards are never drawn",
                    FIX_REPLICAS,
                )
        elif len(set(replicas.values())) > 1:
            found["replicas"] = (
                "shard_overlap",
                _minority(replicas),
                f"DistributedSampler num_replicas differs across ranks ({by_value(replicas)})",
                FIX_REPLICAS,
            )
        seeds = {r: x.seed for r, x in dist.items() if x.shuffle}
        odd = _minority(seeds)
        if odd:
            found["seed"] = (
                "shard_overlap",
                odd,
                f"DistributedSampler seeds differ across ranks ({by_value(seeds)}): each rank "
                f"slices a different permutation, so shards overlap and some samples are "
                f"never drawn in an epoch",
                FIX_SEED,
            )
        shuffles = {r: x.shuffle for r, x in dist.items()}
        odd = _minority(shuffles)
        if odd:
            found["shuffle"] = (
                "shard_overlap",
                odd,
                f"DistributedSampler shuffle differs across ranks ({by_value(shuffles)}): "
                f"shuffled and unshuffled slices overlap",
                FIX_SHUFFLE,
            )
        # Ranks of different DDP groups (a tensor-parallel pair) share a shard by design.
        slots: dict[tuple[tuple[int, ...], int, int], list[int]] = {}
        for r, x in dist.items():
            if x.num_replicas > 1 and (world <= 1 or x.num_replicas == world):
                slots.setdefault((dp_group(run, r), x.num_replicas, x.sampler_rank), []).append(r)
        twins = sorted(r for rs in slots.values() if len(rs) > 1 for r in rs)
        if twins:
            given = {r: dist[r].sampler_rank for r in twins}
            found["sampler_rank"] = (
                "shard_overlap",
                twins,
                f"{ranks_phrase(twins)} give DistributedSampler the same rank ({by_value(given)}), "
                f"so they draw identical shards (a local rank used as the global rank?)",
                FIX_REPLICAS,
            )
        for cause, (kind, ranks, text, fix) in found.items():
            self._cause(st, kind, b, cause, ranks, text, fix, book)

    # (a) a plain sampler over the whole dataset, at the first step ----------------

    def _plain(self, run: RunState, st: _ShardRun, rec: PassRec, book: FindingBook) -> None:
        b = rec.begin
        if b is None or _world(run) <= 1 or b.repeats > 1:
            return
        if b.distributed or b.subset_depth or b.expected <= 0 or b.expected != b.dataset_len:
            return
        if b.batch_sampler_type not in STOCK_BATCH_SAMPLERS:
            # A batch sampler of its own may shard above the sampler (accelerate's
            # BatchSamplerShard: each rank keeps its own batches of one shared
            # order). What the loader yields is measured at the pass end instead.
            return
        if not rec.tagged:
            # The rank trained before its sampler yielded a batch of this pass: the
            # batches come from elsewhere (accelerate's dispatch_batches: rank 0 alone
            # draws and scatters slices). Measured at the pass end instead.
            return
        plain = st.plain.setdefault(b.loader, {})
        plain[b.rank] = b
        group = dp_group(run, b.rank)
        ranks = sorted(
            r
            for r, x in plain.items()
            if x.dataset_len == b.dataset_len and dp_group(run, r) == group
        )
        if len(ranks) < 2:
            return
        text = (
            f"its {_short(b.sampler_type)} is not distributed and draws all {b.dataset_len} "
            f"samples of the {_short(b.dataset_type)} on {ranks_phrase(ranks)}: unless each rank "
            f"built different data of the same length, every rank trains on every sample"
        )
        self._cause(st, "unsharded_data", b, "plain", ranks, text, FIX_DISTRIBUTED, book)

    # (c) measured overlap, at each pass end ----------------------------------------

    def _measure(self, run: RunState, st: _ShardRun, rec: PassRec, book: FindingBook) -> None:
        b, end = rec.begin, rec.end
        if b is None or end is None or end.count <= 0 or not end.sketch or _world(run) <= 1:
            return
        if b.repeats > 1:
            # Repeated augmentation deals each sample to several ranks on purpose.
            return
        # DistributedSampler passes of different epochs are different permutations; DDP
        # groups (2-D layouts) shard apart, and their ranks may draw alike by design.
        key = (rec.loader, rec.ordinal, b.epoch if b.distributed else -1, dp_group(run, rec.rank))
        union = st.unions.get(key)
        if union is None:
            union = st.unions[key] = SketchUnion(dp_size(run) or _world(run))
            old = sorted(k for k in st.unions if k[0] == rec.loader and k[3] == key[3])
            for k in old[:-KEEP_ORDINALS]:
                del st.unions[k]
        if not union.add(rec) or not union.flagged:
            return  # healthy shards cost O(sketch) here, never O(ranks)
        if (_with_replacement(union) or _over_its_dataset(union)) and not _same_orders(union):
            # Draws with replacement share samples by chance, across ranks as within
            # one, and a pass longer than its dataset (an infinite sampler, detectron2's
            # TrainingSampler: each rank's share of a stream of permutations, one pass a
            # run) holds every sample itself; only ranks that drew the very same order
            # (one seed, no sharding) are a mistake.
            return
        flagged = sorted(union.flagged)
        excess = union.excess()
        kind = self._measured_kind(union, flagged, excess)
        text, evidence = self._overlap_text(union, flagged, excess, rec.ordinal)
        fix = FIX_DISTRIBUTED
        if len({x.begin.dataset_len for x in union.recs.values() if x.begin is not None}) > 1:
            fix = FIX_SAME_DATASET + " " + FIX_DISTRIBUTED
        split = _split_differs(union)
        if split:
            text += (
                f"; the ranks' Subsets hold different indices ({split} distinct index lists "
                f"among {len(union.recs)} ranks): a random_split without a fixed generator "
                f"splits differently on every rank"
            )
            evidence["subset_index_lists"] = split
            fix = FIX_RANDOM_SPLIT
        elif _batch_sharded(union):
            text += (
                "; the loader deals the batches of one order out to the ranks (accelerate's "
                "BatchSamplerShard), which needs every rank's sampler to draw that same order, "
                "and theirs differ"
            )
            fix = FIX_SHARED_ORDER
        issue = st.issues.get((kind, rec.loader))
        seen = issue.causes.get("measured") if issue is not None else None
        if (
            issue is not None
            and seen is not None
            and set(flagged) <= set(seen[0])
            and issue.evidence.get("overlap", {}).get("pass") != rec.ordinal
        ):
            return  # already told for an earlier pass: no update per pass and rank
        self._cause(st, kind, b, "measured", flagged, text, fix, book, evidence)

    @staticmethod
    def _measured_kind(
        union: SketchUnion, flagged: list[int], excess: dict[int, tuple[int, float]]
    ) -> str:
        begins = [rec.begin for rec in union.recs.values() if rec.begin is not None]
        if any(x.distributed and x.num_replicas == 1 for x in begins):
            return "unsharded_data"
        plain = all(not x.distributed for x in begins)
        if plain and min(excess[r][1] for r in flagged) >= UNSHARDED_OVERLAP:
            return "unsharded_data"
        return "shard_overlap"

    @staticmethod
    def _overlap_text(
        union: SketchUnion, flagged: list[int], excess: dict[int, tuple[int, float]], ordinal: int
    ) -> tuple[str, dict[str, Any]]:
        worst = max(flagged, key=lambda r: excess[r][1])
        share = excess[worst][1]
        text = (
            f"in the {nth(ordinal)} training pass {share:.0%} of the samples "
            f"{ranks_phrase([worst])} drew were also drawn by another rank"
            + (f" (over {MIN_OVERLAP:.0%} on {ranks_phrase(flagged)})" if len(flagged) > 1 else "")
            + " (measured on value sketches, DistributedSampler padding excluded)"
        )
        lengths = {
            r: rec.begin.dataset_len for r, rec in union.recs.items() if rec.begin is not None
        }
        if len(set(lengths.values())) > 1:
            text += f"; the ranks' datasets differ in length ({by_value(lengths)})"
        same = _same_orders(union)
        if same:
            text += "; " + "; ".join(f"{ranks_phrase(rs)} drew the very same order" for rs in same)
        evidence = {
            "pass": ordinal,
            "overlap_max": round(share, 4),
            "overlap_by_rank": {str(r): round(s, 4) for r, (_, s) in sorted(excess.items())},
            "duplicated_samples_est": sum(p for p, _ in excess.values()) * union.rate // 2,
            "samples_per_point": union.rate,
            "ranks_compared": sorted(union.recs),
            "identical_order_ranks": same,
        }
        return text, evidence

    # publishing ----------------------------------------------------------------------

    def _cause(
        self,
        st: _ShardRun,
        kind: str,
        b: SamplerPass,
        cause: str,
        ranks: list[int],
        text: str,
        fix: str,
        book: FindingBook,
        evidence: dict[str, Any] | None = None,
    ) -> _Issue:
        issue = st.issues.get((kind, b.loader))
        if issue is None:
            issue = st.issues[(kind, b.loader)] = _Issue(kind, b.loader, b.step, b.epoch)
        issue.causes[cause] = (ranks, text, fix)
        if evidence is not None:
            issue.evidence["overlap"] = evidence
        signature = (tuple((c, tuple(r), t) for c, (r, t, _) in issue.causes.items()),)
        if signature == issue.signature:
            return issue
        issue.signature = signature
        book.raise_or_update(f"loader{b.loader}", self._finding(st, issue))
        return issue

    @staticmethod
    def _finding(st: _ShardRun, issue: _Issue) -> Finding:
        ranks = sorted({r for rs, _, _ in issue.causes.values() for r in rs})
        head = (
            f"Loader {issue.loader}: every rank trains on the whole dataset"
            if issue.kind == "unsharded_data"
            else f"Loader {issue.loader}: ranks train on overlapping shards"
        )
        causes = "; ".join(text for _, text, _ in issue.causes.values())
        fixes = list(dict.fromkeys(fix for _, _, fix in issue.causes.values()))
        begins = st.begins.get(issue.loader, {})
        return Finding(
            kind=issue.kind,
            severity="warning",
            ranks=ranks,
            step=issue.step,
            epoch=issue.epoch,
            message=f"{head}: {causes}.",
            fix=" ".join(fixes),
            evidence={
                "loader": issue.loader,
                "causes": list(issue.causes),
                "samplers": _sampler_groups(begins),
                **issue.evidence,
            },
        )


def _same_orders(union: SketchUnion) -> list[list[int]]:
    """Groups of ranks that drew the very same order: equal digests of complete passes,
    or the same first HEAD_LEN indices of passes left open (an infinite sampler's)."""
    orders: dict[tuple[bool, Any], list[int]] = {}
    for r, rec in union.recs.items():
        end = rec.end
        if end is not None and end.complete:
            orders.setdefault((True, end.digest), []).append(r)
        elif end is not None and len(end.head) >= HEAD_LEN:
            orders.setdefault((False, tuple(end.head)), []).append(r)
    return [sorted(rs) for rs in orders.values() if len(rs) > 1]


def _with_replacement(union: SketchUnion) -> bool:
    return any(rec.begin is not None and rec.begin.replacement for rec in union.recs.values())


def _over_its_dataset(union: SketchUnion) -> bool:
    """A pass's sketch covers more draws than its dataset holds: it repeats samples by
    itself (ranks sketch a pass of unknown length over its first share only)."""
    for rec in union.recs.values():
        b, end = rec.begin, rec.end
        if b is None or end is None:
            continue
        covered = end.sketch_count if end.sketch_count >= 0 else end.count
        if covered > b.dataset_len > 0:
            return True
    return False


def _split_differs(union: SketchUnion) -> int:
    """How many different Subset index lists the compared ranks' datasets hold (0: one, or
    unknown). Ranks whose DistributedSampler shards a Subset must all hold the same one."""
    digests = {
        rec.begin.subset_digest
        for rec in union.recs.values()
        if rec.begin is not None and rec.begin.subset_depth > 0 and rec.begin.subset_digest
    }
    return len(digests) if len(digests) > 1 else 0


def _batch_sharded(union: SketchUnion) -> bool:
    """The compared passes keep each rank's batches of one order (accelerate's
    BatchSamplerShard over a sampler that is not distributed)."""
    begins = [rec.begin for rec in union.recs.values() if rec.begin is not None]
    return bool(begins) and all(
        not b.distributed and any(t.endswith(".BatchSamplerShard") for t in b.split_types)
        for b in begins
    )


def _sampler_groups(begins: dict[int, SamplerPass]) -> list[dict[str, Any]]:
    """The ranks' sampler settings, one entry per distinct setting."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r, b in sorted(begins.items()):
        key = (
            _short(b.sampler_type),
            b.distributed,
            b.shuffle,
            b.seed,
            b.num_replicas,
            b.dataset_len,
            b.expected,
            b.subset_depth,
        )
        groups.setdefault(key, []).append(r)
    names = (
        "sampler",
        "distributed",
        "shuffle",
        "seed",
        "num_replicas",
        "dataset_len",
        "expected",
        "subset_depth",
    )
    return [{**dict(zip(names, k, strict=True)), "ranks": rs} for k, rs in groups.items()]
