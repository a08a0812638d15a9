"""Recipe check: ``dataparallel`` (warning).

``nn.DataParallel`` constructed in a DDP process, or wrapped inside DDP.

From what the ranks' recipe probe (ddpscope/hooks/recipe.py) reports; no torch here.
"""

from __future__ import annotations

from ddpscope.analysis.detectors.recipe.common import MAX_LISTED, short_site
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import (
    DataParallelSeen,
    Message,
)

_FIX_DATAPARALLEL = (
    "Use DistributedDataParallel alone, one process per GPU: launch with torchrun "
    "--nproc_per_node=NUM_GPUS, move the model to cuda:LOCAL_RANK, wrap it with "
    "DistributedDataParallel(model, device_ids=[local_rank]), and drop nn.DataParallel (unwrap "
    "an existing one with model = model.module)."
)


class DataParallelDetector:
    """``dataparallel``: nn.DataParallel in a DDP job."""

    kinds: tuple[str, ...] = ("dataparallel",)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (DataParallelSeen,)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        self._seen: dict[str, dict[int, list[DataParallelSeen]]] = {}

    def reset(self, run_id: str) -> None:
        self._seen.pop(run_id, None)

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, DataParallelSeen):
            return
        seen = self._seen.setdefault(run.run_id, {})
        seen.setdefault(msg.rank, []).append(msg)
        ranks = sorted(seen)
        first = seen[ranks[0]][0]
        wrapped = first.module.rsplit(".", 1)[-1] or "a module"
        gpus = f" over GPUs {first.device_ids}" if first.device_ids else ""
        if first.inside_ddp:
            what = f"wrap nn.DataParallel (around {wrapped}){gpus} inside their DDP model"
        else:
            what = (
                f"construct nn.DataParallel (around {wrapped}){gpus} at "
                f"{short_site(first.site)} in a DDP job"
            )
        message = (
            f"{cap(ranks_phrase(ranks))} {what}. DataParallel runs one process "
            "over several GPUs: every forward copies the module to each GPU, scatters the batch "
            "and gathers the outputs under one Python interpreter, slower than DDP's one process "
            "per GPU; inside a DDP job each rank drives every GPU it lists, on top of the others."
        )
        if not first.device_ids:
            message += " (Here it sees no GPU and only calls the module: harmless, but dead code.)"
        book.raise_or_update(
            "run",
            Finding(
                kind="dataparallel",
                severity="warning",
                ranks=ranks,
                step=min(m.step for ms in seen.values() for m in ms),
                message=message,
                fix=_FIX_DATAPARALLEL,
                evidence={
                    "module": first.module,
                    "inside_ddp": first.inside_ddp,
                    "device_ids": first.device_ids,
                    "sites": {
                        str(r): sorted({m.site for m in seen[r] if m.site})[:MAX_LISTED]
                        for r in ranks[:MAX_LISTED]
                    },
                },
            ),
        )

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per message."""
