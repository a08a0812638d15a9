"""Recipe check: ``checkpoint_all_ranks`` (warning; info when only ranks on different
hosts share a path, and for the wrapper's ``state_dict()``).

Two or more ranks ``torch.save`` to one path, or a rank saves the DDP
wrapper's ``state_dict()`` (``module.``-prefixed keys) or the wrapper itself.

The wrapper's ``state_dict()`` is info, not a warning: PyTorch's own DDP
tutorial and its ImageNet example save it and load it back into the wrapper,
which works. It only fails where the file is loaded into the plain model
(inference, fine-tuning, another script); when that happens in a watched
rank, ``rank_exit`` names the prefix in its fix. Pickling the wrapper itself
stays a warning: the file then needs DDP's classes and a process group.

From what the ranks' recipe probe (ddpscope/hooks/recipe.py) reports; no torch here.
"""

from __future__ import annotations

from collections import Counter

from ddpscope.analysis.detectors.recipe.common import MAX_LISTED, short_site
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase
from ddpscope.schema import (
    Message,
    SaveCall,
)

_FIX_SHARED_PATH = (
    "Save on one rank only: `if dist.get_rank() == 0: torch.save(model.module.state_dict(), "
    "path)`, then `dist.barrier()` before any rank reads the file back. When every rank must "
    "save its own state (a sharded optimizer), put the rank in the file name."
)
_FIX_WRAPPER = (
    "Save the wrapped model's weights, model.module.state_dict(), and load them into the plain "
    "model before wrapping it in DDP again. To read a checkpoint that has the prefix already: "
    "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, 'module.')."
)
#: Checkpoint paths remembered per run (a job saving a new file every epoch,
#: or a peer flooding paths, must not grow the watcher without bound).
MAX_SAVE_PATHS = 256


class CheckpointDetector:
    """``checkpoint_all_ranks``: one checkpoint file written by several ranks, or DDP's keys."""

    kinds: tuple[str, ...] = ("checkpoint_all_ranks",)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (SaveCall,)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        self._paths: dict[str, dict[str, dict[int, SaveCall]]] = {}
        self._wrapper: dict[str, dict[int, SaveCall]] = {}

    def reset(self, run_id: str) -> None:
        self._paths.pop(run_id, None)
        self._wrapper.pop(run_id, None)

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, SaveCall):
            return
        paths = self._paths.setdefault(run.run_id, {})
        writers = paths.pop(msg.path, None) or {}
        paths[msg.path] = writers  # newest last: the oldest path goes first
        if len(paths) > MAX_SAVE_PATHS:
            # Ranks sharing a file save it at about the same moment; a path
            # not seen for this many saves will not be shared any more.
            del paths[next(iter(paths))]
        writers.setdefault(msg.rank, msg)
        if len(writers) >= 2:
            book.raise_or_update(f"path:{msg.path}", self._shared(run, msg.path, writers))
        if msg.what in ("ddp_state_dict", "ddp_module"):
            saves = self._wrapper.setdefault(run.run_id, {})
            saves.setdefault(msg.rank, msg)
            book.raise_or_update("wrapper", self._wrapped(saves))

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per message."""

    @staticmethod
    def _shared(run: RunState, path: str, writers: dict[int, SaveCall]) -> Finding:
        ranks = sorted(writers)
        hosts = {r: _host(run, r) for r in ranks}
        by_host = Counter(h for h in hosts.values() if h)
        same_host = any(n > 1 for n in by_host.values()) or any(not h for h in hosts.values())
        sites = sorted({short_site(s.site) for s in writers.values() if s.site})
        where_text = f" (torch.save at {', '.join(sites[:3])})" if sites else ""
        if same_host:
            why = (
                "several processes writing one file at once can leave it torn or mixed, and "
                "every rank pays for the I/O of a copy nobody needs"
            )
        else:
            why = (
                "the ranks run on different hosts; if that path is on a shared filesystem they "
                "overwrite each other's copy, and every rank pays for the I/O"
            )
        first = min(s.step for s in writers.values())
        return Finding(
            kind="checkpoint_all_ranks",
            severity="warning" if same_host else "info",
            ranks=ranks,
            step=first,
            message=(
                f"{cap(ranks_phrase(ranks))} all write the checkpoint {path}{where_text}: {why}."
            ),
            fix=_FIX_SHARED_PATH,
            evidence={
                "path": path,
                "ranks": ranks[:MAX_LISTED],
                "writers": len(ranks),
                "sites": {str(r): writers[r].site for r in ranks[:MAX_LISTED]},
                "hosts": {str(r): hosts[r] for r in ranks[:MAX_LISTED]},
                "same_host": same_host,
            },
        )

    @staticmethod
    def _wrapped(saves: dict[int, SaveCall]) -> Finding:
        ranks = sorted(saves)
        first = saves[ranks[0]]
        where_parts = [f"under key '{first.key}'"] if first.key else []
        if first.site:
            where_parts.append(f"torch.save at {short_site(first.site)}")
        where_text = f" ({', '.join(where_parts)})" if where_parts else ""
        if first.what == "ddp_module":
            what = (
                f"the DistributedDataParallel wrapper itself to {first.path}{where_text}: the "
                "pickle holds DDP's internals and process group, and loads only where the same "
                "classes and a process group exist"
            )
        else:
            what = (
                f"the DDP wrapper's state_dict() to {first.path}{where_text}: its keys carry the "
                "'module.' prefix ('module.0.weight'). It loads back into a DDP-wrapped model "
                "(resuming this script); loading it into the plain model (inference, "
                "fine-tuning, another script) fails with missing and unexpected keys"
            )
        pickled = any(s.what == "ddp_module" for s in saves.values())
        return Finding(
            kind="checkpoint_all_ranks",
            severity="warning" if pickled else "info",
            ranks=ranks,
            step=min(s.step for s in saves.values()),
            message=f"{cap(ranks_phrase(ranks))} saved {what}.",
            fix=_FIX_WRAPPER,
            evidence={
                "what": first.what,
                "key": first.key,
                "paths": {str(r): saves[r].path for r in ranks[:MAX_LISTED]},
                "sites": {str(r): saves[r].site for r in ranks[:MAX_LISTED]},
            },
        )


def _host(run: RunState, rank: int) -> str:
    view = run.ranks.get(rank)
    return view.info.host if view is not None and view.info is not None else ""
