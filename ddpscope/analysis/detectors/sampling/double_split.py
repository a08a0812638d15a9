"""``double_sharded``: a loader that splits its data by rank twice over.

Each rank is meant to train on its share of the dataset: ``1/N`` of it, ``N``
ranks. A loader with two layers that each keep one rank's share gives each
rank ``1/N`` of its ``1/N``, and the ranks together train on ``1/N`` of the
dataset every epoch. Nothing fails, the loss curve looks normal, and the
epochs are ``N`` times short. The recurring way in: a DataLoader built with a
``DistributedSampler`` handed to accelerate's ``prepare()`` (directly, or by
the Hugging Face Trainer with a sampler of the script's own), which shards it
again by process (accelerate issues #3520, #4062, #4075, #4199; transformers
#34365); or a rank-aware sampler of the script's own that Lightning wraps in
its ``DistributedSamplerWrapper``.

The rank reads the layers at each ``iter(loader)`` (hooks/ranksplits.py):
``SamplerPass.split_types`` and ``split_ways``, outermost first. Named for a
pass that trained (the pass ledger's first step on it) with two or more
layers, each splitting more than one way. Evaluation loaders are left out:
they train nothing (their metrics cover the fraction too, but that is the
evaluation's own concern).

Passes come from the pass ledger (sampling/ledger.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ddpscope.analysis.detectors.sampling.ledger import (
    PASS_MESSAGES,
    LedgerDetector,
    PassLedger,
    PassRec,
)
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import Message, SamplerPass

KIND = "double_sharded"
#: The layer a per-rank Subset makes, as the finding names it.
SUBSET_LAYER = "torch.utils.data.Subset"
FIX_ACCELERATE = (
    "Hand accelerate's prepare() (and the Hugging Face Trainer) a DataLoader that does not "
    "shard by rank: build it with shuffle=True or a plain sampler instead of a "
    "DistributedSampler, and prepare() gives each process its share. Keeping a rank-aware "
    "sampler of your own means not passing that loader through prepare() (move the batches "
    "to the device yourself)."
)
FIX_LIGHTNING = (
    "A sampler of your own that already deals by rank must not be wrapped again: build the "
    "Trainer with use_distributed_sampler=False (call its set_epoch yourself, or from a "
    "callback), or give the loader a plain sampler and let Lightning shard it."
)
FIX = (
    "Keep one layer that splits by rank: a DistributedSampler over the whole dataset, or a "
    "rank-aware sampler of your own without a DistributedSampler (or Lightning's "
    "use_distributed_sampler) around it, or each rank's own Subset with a plain "
    "RandomSampler instead of a DistributedSampler."
)


@dataclass
class _Split:
    step: int
    loader: int
    types: list[str]
    ways: list[int]
    dataset_len: int


@dataclass
class _SplitRun:
    ledger: PassLedger
    ranks: dict[int, _Split] = field(default_factory=dict)
    #: (loader, ordinal) -> rank -> (subset digest, the split it would be): passes over
    #: a Subset of 1/num_replicas of its dataset under a DistributedSampler, until the
    #: ranks' subsets are known to differ.
    shards: dict[tuple[int, int], dict[int, tuple[int, _Split]]] = field(default_factory=dict)


def _own_shard(b: SamplerPass) -> bool:
    """A distributed sampler over a Subset holding 1/num_replicas of its dataset."""
    ways = b.num_replicas
    return (
        b.distributed
        and ways > 1
        and b.subset_depth > 0
        and b.subset_digest != 0
        and b.base_len > 0
        and abs(b.dataset_len * ways - b.base_len) <= ways
    )


def _short(qualname: str) -> str:
    """``accelerate.data_loader.BatchSamplerShard`` -> ``accelerate's BatchSamplerShard``."""
    module, _, name = qualname.rpartition(".")
    top = module.split(".", 1)[0]
    if top == "__main__":
        return f"the script's {name}"
    return f"{top}'s {name}" if top else name


def _times(n: int) -> str:
    return "twice" if n == 2 else f"{n} times over"


class DoubleShardedDetector(LedgerDetector[_SplitRun]):
    kinds: tuple[str, ...] = (KIND,)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = PASS_MESSAGES

    new_run = _SplitRun

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, PASS_MESSAGES):
            return
        st = self._run(run.run_id)
        for ev in st.ledger.update(msg):
            if ev.kind != "first_step" or ev.rec is None or ev.rank in st.ranks:
                continue
            b: SamplerPass | None = ev.rec.begin
            if b is None:
                continue
            if sum(1 for w in b.split_ways if w > 1) >= 2:
                st.ranks[ev.rank] = _Split(
                    step=ev.rec.first_step,
                    loader=b.loader,
                    types=list(b.split_types),
                    ways=list(b.split_ways),
                    dataset_len=b.dataset_len,
                )
            elif not (_own_shard(b) and self._shard(st, ev.rank, ev.rec, b)):
                continue
            self._publish(st, book, run.world_size or len(run.ranks))

    @staticmethod
    def _shard(st: _SplitRun, rank: int, rec: PassRec, b: SamplerPass) -> bool:
        """Note a rank's pass over its own 1/N Subset; True once two or more ranks hold
        such Subsets and all differ (each rank's own shard), which names them all."""
        split = _Split(
            step=rec.first_step,
            loader=b.loader,
            # The sampler's own layer, where the rank did not list its layers.
            types=[*(b.split_types or [b.sampler_type]), SUBSET_LAYER],
            ways=[*(b.split_ways or [b.num_replicas]), b.num_replicas],
            dataset_len=b.base_len,
        )
        seen = st.shards.setdefault((b.loader, rec.ordinal), {})
        seen[rank] = (b.subset_digest, split)
        if len(seen) < 2 or len({digest for digest, _ in seen.values()}) < len(seen):
            return False
        for r, (_, each) in seen.items():
            st.ranks.setdefault(r, each)
        return True

    @staticmethod
    def _publish(st: _SplitRun, book: FindingBook, world: int) -> None:
        ranks = sorted(st.ranks)
        first = st.ranks[ranks[0]]
        layers = [
            f"each rank's own Subset (1/{w} of the dataset)"
            if t == SUBSET_LAYER
            else f"{_short(t)} ({w} ways)"
            for t, w in zip(first.types, first.ways, strict=False)
        ]
        kept = math.prod(w for w in first.ways if w > 1)
        common = math.gcd(world, kept)
        together = f"{world // common}/{kept // common}"
        size = f" ({first.dataset_len:,} samples)" if first.dataset_len > 0 else ""
        s = "s" if len(ranks) == 1 else ""
        message = (
            f"{cap(ranks_phrase(ranks))} split{s} loader {first.loader}'s data by rank "
            f"{_times(len(layers))}: {' over '.join(layers)}. Each layer keeps one rank's "
            f"share, so each rank trains on 1/{kept} of the dataset{size} an epoch and the "
            f"{world} ranks together on {together} of it. Nothing fails; every epoch "
            "is that much shorter than it should be."
        )
        if any(t.startswith("accelerate.") for t in first.types):
            fix = FIX_ACCELERATE
        elif any(t.startswith(("lightning", "pytorch_lightning")) for t in first.types):
            fix = FIX_LIGHTNING
        else:
            fix = FIX
        book.raise_or_update(
            "double",
            Finding(
                kind=KIND,
                severity="warning",
                ranks=ranks,
                step=min(v.step for v in st.ranks.values()),
                message=message,
                fix=fix,
                evidence={
                    "loader": first.loader,
                    "layers": first.types,
                    "ways": first.ways,
                    "share_per_rank": f"1/{kept}",
                    "share_together": together,
                    "dataset_len": first.dataset_len,
                },
            ),
        )
