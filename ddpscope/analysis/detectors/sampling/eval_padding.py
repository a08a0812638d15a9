"""``padded_evaluation`` (info): an evaluation sharded by DistributedSampler sees samples twice.

DistributedSampler gives every rank the same number of indices: with
``drop_last=False`` (the default) it pads a dataset of ``n`` up to the next
multiple of ``num_replicas`` by repeating indices from the start of its order.
Training does not care; an evaluation does: every metric gathered over the
ranks (accuracy all-reduced, predictions gathered) counts the padded samples
twice. PyTorch Lightning warns of it before every multi-device validation;
this says when it actually happens, and how many samples.

How it is seen. A pass over a DistributedSampler with no training step drawn
from it (the pass ledger's evaluation: no step named it as the pass it drew
from, or on older ranks model in eval mode or grad disabled at ``iter()``),
run to its end on every shard (every index of ``len(sampler)``
drawn): the shards' drawn indices (one
rank per ``sampler_rank``, so data-parallel groups of a 2-D layout count once)
add up to more than the loader's dataset holds. Measured, not computed from
the settings: a subclass that does not pad says nothing. More duplicates than
``num_replicas`` - 1 are not padding (repeated sampling: not judged). One
finding per dataset (type, length, ranks), whichever loaders deal it: scripts
often build the evaluation's DataLoader anew every epoch; later passes add to
its count.

Passes come from the pass ledger (sampling/ledger.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddpscope.analysis.detectors.sampling.ledger import (
    PASS_MESSAGES,
    LedgerDetector,
    PassLedger,
    PassRec,
)
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import ranks_phrase
from ddpscope.schema import Message

KIND = "padded_evaluation"
#: Loaders and ranks listed per dataset (the first; a new loader each epoch adds one).
MAX_LOADERS = 16
#: Evaluation passes kept per run, awaiting shards or judged (the oldest dropped).
MAX_OPEN = 64
_FIX = (
    "For exact metrics over a dataset that does not divide by the number of ranks: gather "
    "per-sample results with their dataset indices and count each index once (accelerate's "
    "gather_for_metrics and torchmetrics do this), or evaluate the first "
    "n - n % world_size samples sharded and the rest on one rank. Dropping samples instead "
    "(DistributedSampler(..., drop_last=True)) evaluates fewer than the whole set. Running "
    "uneven shards through the DDP model hangs where its forward broadcasts buffers: "
    "evaluate through model.module then."
)


@dataclass
class _Padded:
    """What evaluations of one dataset drew twice so far (over any of its loaders)."""

    loaders: list[int]
    dataset_len: int
    num_replicas: int
    dataset_type: str
    duplicates: int
    first_step: int
    passes: int = 0
    #: Ranks whose shard held a padded position (sampler_pass.padded).
    ranks: set[int] = field(default_factory=set)


@dataclass
class _Pass:
    """One evaluation pass of one loader, shard by shard."""

    num_replicas: int
    dataset_len: int
    #: sampler_rank -> indices that shard drew.
    drawn: dict[int, int] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)
    first_step: int = -1
    #: Every shard is in: judged (a later rank of a counted shard only adds its name).
    judged: bool = False
    found: _Padded | None = None


@dataclass
class _EvalRun:
    ledger: PassLedger
    open: dict[tuple[int, int], _Pass] = field(default_factory=dict)
    #: (dataset type, length, ranks it is dealt to) -> what its evaluations drew twice.
    padded: dict[tuple[str, int, int], _Padded] = field(default_factory=dict)


def _evaluation(rec: PassRec) -> bool:
    """An evaluation (the ledger's verdict: no step trained on it) that DistributedSampler
    may pad, run to its end."""
    b, e = rec.begin, rec.end
    return (
        b is not None
        and e is not None
        and b.distributed
        and not b.drop_last
        and b.repeats <= 1
        and b.num_replicas > 1
        and b.dataset_len > 0
        and 0 <= b.sampler_rank < b.num_replicas
        # Run to its end: exhausted, or every index drawn (Lightning's fetcher knows the
        # length and iterates no further, so its passes end abandoned, not exhausted).
        and (e.complete or 0 <= b.expected <= e.count)
        and e.count >= 0
    )


class PaddedEvaluationDetector(LedgerDetector[_EvalRun]):
    kinds: tuple[str, ...] = (KIND,)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = PASS_MESSAGES

    new_run = _EvalRun

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, PASS_MESSAGES):
            return
        st = self._run(run.run_id)
        for ev in st.ledger.update(msg):
            if ev.kind == "evaluation" and ev.rec is not None and _evaluation(ev.rec):
                self._ended(st, ev.rec, book)

    def _ended(self, st: _EvalRun, rec: PassRec, book: FindingBook) -> None:
        b, e = rec.begin, rec.end
        assert b is not None and e is not None
        key = (rec.loader, rec.pass_id)
        p = st.open.get(key)
        if p is None:
            if len(st.open) >= MAX_OPEN:
                del st.open[next(iter(st.open))]
            p = st.open[key] = _Pass(b.num_replicas, b.dataset_len, first_step=b.step)
        if (b.num_replicas, b.dataset_len) != (p.num_replicas, p.dataset_len):
            return  # not the same evaluation on this rank
        p.drawn.setdefault(b.sampler_rank, e.count)
        if b.padded:
            p.ranks.add(rec.rank)
        if p.judged:
            if p.found is not None and not p.ranks <= p.found.ranks:
                p.found.ranks |= p.ranks
                self._publish(p.found, book)
            return
        if len(p.drawn) < p.num_replicas:
            return
        p.judged = True
        extra = sum(p.drawn.values()) - p.dataset_len
        if not 0 < extra < p.num_replicas:
            return  # every sample once, or more repeats than padding makes
        # Keyed by the dataset, not the loader: scripts often build the evaluation's
        # DataLoader anew each time, and each is a loader of its own.
        dkey = (b.dataset_type, p.dataset_len, p.num_replicas)
        found = st.padded.get(dkey)
        if found is None:
            found = st.padded[dkey] = _Padded(
                [],
                p.dataset_len,
                p.num_replicas,
                b.dataset_type.rsplit(".", 1)[-1],
                extra,
                p.first_step,
            )
        if rec.loader not in found.loaders and len(found.loaders) < MAX_LOADERS:
            found.loaders.append(rec.loader)
        found.passes += 1
        found.ranks |= p.ranks
        p.found = found
        self._publish(found, book)

    @staticmethod
    def _publish(f: _Padded, book: FindingBook) -> None:
        n, dup = f.dataset_len, f.duplicates
        samples = "sample is" if dup == 1 else "samples are"
        holders = f" (on {ranks_phrase(f.ranks)})" if f.ranks else ""
        loaders = "loader" + ("s " if len(f.loaders) > 1 else " ") + ", ".join(map(str, f.loaders))
        message = (
            f"An evaluation over a {f.dataset_type} of {n} samples ({loaders}, not training) "
            f"is sharded by DistributedSampler over {f.num_replicas} ranks, which pads it to "
            f"{n + dup}: {dup} {samples} evaluated twice{holders}"
            + (f" in each of its {f.passes} passes" if f.passes > 1 else "")
            + f". A metric gathered over the ranks counts {'it' if dup == 1 else 'them'} "
            f"twice ({100 * dup / n:.2g}% of the set)."
        )
        book.raise_or_update(
            f"{f.dataset_type}:{n}:{f.num_replicas}",
            Finding(
                kind=KIND,
                severity="info",
                # About the run's evaluation, not a rank: no rank is marked in the views.
                ranks=[],
                step=f.first_step,
                message=message,
                fix=_FIX,
                evidence={
                    "loaders": list(f.loaders),
                    "dataset_type": f.dataset_type,
                    "dataset_len": n,
                    "num_replicas": f.num_replicas,
                    "evaluated": n + dup,
                    "duplicates": dup,
                    "passes": f.passes,
                    "padded_ranks": sorted(f.ranks)[:MAX_LOADERS],
                },
            ),
        )
