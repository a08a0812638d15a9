"""Recipe check: ``batchnorm_small_batch`` (info, never more).

BatchNorm layers in training mode (not SyncBatchNorm) while a rank's batch
is below ``SMALL_BATCH`` and the world has more than one rank.

From what the ranks' recipe probe (ddpscope/hooks/recipe.py) reports; no torch here.
"""

from __future__ import annotations

from ddpscope.analysis.detectors.recipe.common import MAX_LISTED
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import (
    BatchInfo,
    Message,
)

#: Per-rank batches below this make BatchNorm's statistics noisy (GroupNorm paper, Wu & He
#: 2018: BatchNorm's error climbs steeply below 16 samples per GPU).
SMALL_BATCH = 16
_FIX_BATCHNORM = (
    "Convert the model before wrapping it in DDP: model = "
    "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model), so that the statistics are computed "
    "over the global batch (SyncBatchNorm needs GPUs). Or raise the per-rank batch, or use "
    "GroupNorm/LayerNorm, which do not depend on the batch."
)


class BatchNormDetector:
    """``batchnorm_small_batch``: BatchNorm normalising over a few samples per rank (info)."""

    kinds: tuple[str, ...] = ("batchnorm_small_batch",)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (BatchInfo,)

    def __init__(self, mode: Mode = LIVE, small_batch: int = SMALL_BATCH) -> None:
        self.mode = mode
        self.small_batch = small_batch

    def reset(self, run_id: str) -> None:
        """Nothing kept per run: judged from the run's state at each batch."""

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if isinstance(msg, BatchInfo):
            self._judge(run, book)

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per message."""

    def _judge(self, run: RunState, book: FindingBook) -> None:
        world = run.world_size or len(run.ranks)
        if world < 2:
            return
        small = {
            r: v.batch
            for r, v in run.ranks.items()
            if v.batch is not None
            and v.batch.batchnorm_count > 0
            and 0 < v.batch.size < self.small_batch
        }
        if not small:
            return
        ranks = sorted(small)
        first = small[ranks[0]]
        names = ", ".join(f"'{n}'" for n in first.batchnorm[:3])
        more = first.batchnorm_count - min(3, len(first.batchnorm))
        if more > 0:
            names += f" and {more} more"
        sizes = sorted({b.size for b in small.values()})
        size_text = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        layers = (
            f"{first.batchnorm_count} BatchNorm layer{'s' if first.batchnorm_count != 1 else ''}"
        )
        message = (
            f"{cap(ranks_phrase(ranks))} train {layers} ({names}) on {size_text} samples per rank. "
            "BatchNorm normalises each rank's batch with that batch's own mean and variance; "
            f"DDP does not share them across the {world} ranks, and below {self.small_batch} "
            "samples they are noisy enough to hurt accuracy."
        )
        book.raise_or_update(
            "run",
            Finding(
                kind="batchnorm_small_batch",
                severity="info",
                ranks=ranks,
                step=min(b.step for b in small.values()),
                message=message,
                fix=_FIX_BATCHNORM,
                evidence={
                    "per_rank_batch": {str(r): small[r].size for r in ranks[:MAX_LISTED]},
                    "threshold": self.small_batch,
                    "batchnorm_layers": first.batchnorm_count,
                    "names": first.batchnorm[:MAX_LISTED],
                    "world_size": world,
                },
            ),
        )
