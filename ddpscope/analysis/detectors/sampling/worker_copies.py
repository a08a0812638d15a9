"""``worker_duplicates``: DataLoader workers that each yield the whole stream.

With ``num_workers=k`` a DataLoader runs ``k`` copies of an
``IterableDataset``'s ``__iter__``, one per worker process. A dataset that
does not keep only its worker's part (``torch.utils.data.get_worker_info()``)
yields every item in every worker, so each epoch trains on every sample ``k``
times and is ``k`` times as long. Nothing fails and the loss still falls; the
PyTorch documentation's ``IterableDataset`` section warns of it.

The rank sees it (hooks/loaderwait.py): the loader takes its workers' batches
in turn, so worker copies make the first round of ``k`` batches of a pass all
equal and the second round all equal and different from the first. The step
that completes the check says how many workers' batches were compared
(``Step.worker_copies``, at most 8). Content digests of the first tensor
(hooks/batchdigest.py) can meet by chance only where that tensor holds a few
values (a batch of binary labels); two rounds of equal batches twice over
(two passes, or two ranks) is not chance, so a finding needs
:data:`MIN_SEEN` such passes. A stream that splits by worker, a map-style
dataset (workers get disjoint indices from the sampler) and a constant
batch (every round alike) never show the pattern.

Passes come from the pass ledger (sampling/ledger.py), for the loader's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddpscope.analysis.detectors.sampling.ledger import (
    PASS_MESSAGES,
    LedgerDetector,
    PassLedger,
)
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import Message, Step

KIND = "worker_duplicates"
#: Passes (over all ranks) whose workers were seen yielding the same batches before
#: the finding is raised.
MIN_SEEN = 2
FIX = (
    "Split the stream by DataLoader worker as well as by rank: in the IterableDataset's "
    "__iter__, info = torch.utils.data.get_worker_info(); when it is not None keep every "
    "info.num_workers-th item from offset info.id (itertools.islice(stream, info.id, None, "
    "info.num_workers)), or give each worker its own files. datasets' IterableDataset and "
    "webdataset (its default workersplitter) split by worker themselves."
)


@dataclass
class _CopiesRun:
    ledger: PassLedger
    #: Passes seen with worker copies, and the first step that saw one.
    seen: int = 0
    first_step: int = -1
    #: rank -> workers compared and found alike (the largest seen).
    ranks: dict[int, int] = field(default_factory=dict)
    loader: int = -1
    dataset_type: str = ""


class WorkerCopiesDetector(LedgerDetector[_CopiesRun]):
    kinds: tuple[str, ...] = (KIND,)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = PASS_MESSAGES

    new_run = _CopiesRun

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, PASS_MESSAGES):
            return
        st = self._run(run.run_id)
        events = st.ledger.update(msg)
        if not isinstance(msg, Step) or msg.worker_copies < 2:
            return
        st.seen += 1
        st.ranks[msg.rank] = max(st.ranks.get(msg.rank, 0), msg.worker_copies)
        if st.first_step < 0:
            st.first_step = msg.step
            rec = next((ev.rec for ev in events if ev.kind == "step"), None)
            b = rec.begin if rec is not None else None
            if rec is not None:
                st.loader = rec.loader
            if b is not None:
                st.dataset_type = b.dataset_type.rsplit(".", 1)[-1]
        if st.seen >= MIN_SEEN:
            self._publish(st, book)

    @staticmethod
    def _publish(st: _CopiesRun, book: FindingBook) -> None:
        ranks = sorted(st.ranks)
        copies = max(st.ranks.values())
        loader = f"loader {st.loader}" if st.loader >= 0 else "a DataLoader"
        dataset = f" ({st.dataset_type})" if st.dataset_type else ""
        message = (
            f"{cap(ranks_phrase(ranks))} draw{'s' if len(ranks) == 1 else ''} every batch of "
            f"{loader}{dataset} {copies} times: its DataLoader workers each yield the whole "
            f"stream (the first {copies} batches of a pass were the same, and the next "
            f"{copies} the same again; {st.seen} passes seen). Each epoch trains on every "
            f"sample {copies} times over and takes {copies} times as long."
        )
        book.raise_or_update(
            "workers",
            Finding(
                kind=KIND,
                severity="warning",
                ranks=ranks,
                step=st.first_step,
                message=message,
                fix=FIX,
                evidence={
                    "loader": st.loader,
                    "dataset_type": st.dataset_type,
                    "workers_alike": copies,
                    "passes_seen": st.seen,
                },
            ),
        )
