"""Recipe check: ``no_destroy_process_group`` (info).

A rank exited normally with its default process group still initialised.
A rank that exits with an exception while others wait is the
``rank_exit`` finding's (error, with the full traceback in its evidence);
this detector does not repeat it.

From what the ranks' recipe probe (ddpscope/hooks/recipe.py) reports; no torch here.
"""

from __future__ import annotations

from ddpscope.analysis.detectors.recipe.common import MAX_LISTED
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import (
    End,
    Message,
)

_FIX_DESTROY = (
    "Call torch.distributed.destroy_process_group() when training is done, in a `finally:` "
    "block so that it also runs after an error."
)


class ProcessGroupDetector:
    """``no_destroy_process_group``: a rank exited with its process group alive (info)."""

    kinds: tuple[str, ...] = ("no_destroy_process_group",)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (End,)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode

    def reset(self, run_id: str) -> None:
        """Nothing kept per run: judged from the run's state at each end."""

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, End) or msg.reason != "exit":
            return
        alive = {
            r: v.end.step
            for r, v in run.ranks.items()
            if v.end is not None
            and v.end.reason == "exit"
            and v.shutdown is not None
            and v.shutdown.pg_initialized
        }
        if not alive:
            return
        ranks = sorted(alive)
        steps = list(alive.values())
        backend = next(
            (v.info.backend for v in run.ranks.values() if v.info is not None), "unknown"
        )
        message = (
            f"{cap(ranks_phrase(ranks))} exited without calling "
            "torch.distributed.destroy_process_group(). The process group is then torn down by "
            "the interpreter's exit in no set order: NCCL warns that the group was not "
            "destroyed and can hang or crash at exit, and code that initialises again in the "
            "same process (tests, notebooks, sweeps) fails."
        )
        book.raise_or_update(
            "run",
            Finding(
                kind="no_destroy_process_group",
                severity="info",
                ranks=ranks,
                step=max(steps, default=-1),
                message=message,
                fix=_FIX_DESTROY,
                evidence={"ranks": ranks[:MAX_LISTED], "backend": backend},
            ),
        )

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per message."""
