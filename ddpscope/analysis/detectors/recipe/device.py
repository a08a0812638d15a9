"""Recipe check: ``device_mismatch`` (error when two ranks share a GPU, warning otherwise).

A rank's model on a GPU other than the one its LOCAL_RANK selects, or two
ranks of one host on the same GPU (same device UUID).

From what the ranks' recipe probe (ddpscope/hooks/recipe.py) reports; no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddpscope.analysis.detectors.recipe.common import MAX_LISTED
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import cap, ranks_phrase, ranks_text
from ddpscope.schema import (
    Message,
    RunInfo,
)

_FIX_DEVICE = (
    "Give each rank its own GPU: torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before "
    "building the model, model.to(f'cuda:{local_rank}'), and "
    "DistributedDataParallel(model, device_ids=[local_rank]). Check that CUDA_VISIBLE_DEVICES "
    "does not hide the other GPUs and that --nproc_per_node is at most the number of GPUs."
)


@dataclass
class _Devices:
    #: (host, GPU UUID) -> ranks whose model is on it.
    gpus: dict[tuple[str, str], set[int]] = field(default_factory=dict)
    #: rank -> its (host, UUID), for ranks on a GPU with a known UUID.
    placed: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: rank -> the last placement seen: (host, device, expected, UUID).
    seen: dict[int, tuple[str, str, str, str]] = field(default_factory=dict)
    #: Ranks whose model is off the GPU their LOCAL_RANK selects.
    off: set[int] = field(default_factory=set)


class DeviceDetector:
    """``device_mismatch``: a rank's model off its LOCAL_RANK's GPU, or ranks sharing one.

    Kept incrementally, per rank: run info is re-sent every few seconds by every
    rank, and a look across all ranks per message would be quadratic in them.
    """

    kinds: tuple[str, ...] = ("device_mismatch",)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = (RunInfo,)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        self._runs: dict[str, _Devices] = {}

    def reset(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        if not isinstance(msg, RunInfo) or msg.model != 0:
            return
        st = self._runs.setdefault(run.run_id, _Devices())
        placement = (msg.host, msg.device, msg.device_expected, msg.device_uuid)
        if st.seen.get(msg.rank) == placement:
            return
        st.seen[msg.rank] = placement
        on_gpu = msg.device.startswith("cuda")
        shared_before = self._shared_groups(st)
        old = st.placed.pop(msg.rank, None)
        if old is not None:
            st.gpus[old].discard(msg.rank)
        if on_gpu and msg.device_uuid:
            key = (msg.host, msg.device_uuid)
            st.placed[msg.rank] = key
            st.gpus.setdefault(key, set()).add(msg.rank)
        shared = self._shared_groups(st)
        if shared != shared_before:
            if shared:
                self._raise_shared(run, book, shared)
            else:
                book.resolve(self.kinds[0], "shared")
        was_off = msg.rank in st.off
        off = on_gpu and bool(msg.device_expected)
        off = off and _norm(msg.device) != _norm(msg.device_expected)
        if off != was_off:
            if off:
                st.off.add(msg.rank)
            else:
                st.off.discard(msg.rank)
            if st.off:
                self._raise_misplaced(run, book, sorted(st.off))
            else:
                book.resolve(self.kinds[0], "misplaced")

    def tick(self, run: RunState, book: FindingBook) -> None:
        """Judged per message."""

    @staticmethod
    def _shared_groups(st: _Devices) -> dict[tuple[str, str], list[int]]:
        return {k: sorted(rs) for k, rs in st.gpus.items() if len(rs) > 1}

    def _raise_shared(
        self, run: RunState, book: FindingBook, shared: dict[tuple[str, str], list[int]]
    ) -> None:
        ranks = sorted(r for rs in shared.values() for r in rs)
        (host, uuid), first = min(shared.items(), key=lambda kv: kv[1])
        device_text = ", ".join(sorted({_info(run, r).device for r in first}))
        message = (
            f"{cap(ranks_phrase(first))} on {host} share one GPU ({device_text}, {uuid}). Each "
            "rank needs a GPU of its own: sharing halves memory and throughput, and NCCL refuses "
            "it ('Duplicate GPU detected')."
        )
        if len(shared) > 1:
            message += f" {len(shared) - 1} more GPU(s) are shared the same way."
        book.raise_or_update(
            "shared",
            Finding(
                kind="device_mismatch",
                severity="error",
                ranks=ranks,
                step=-1,
                message=message,
                fix=_FIX_DEVICE,
                evidence={
                    "shared": [
                        {"host": h, "gpu": u, "ranks": ranks_text(rs)}
                        for (h, u), rs in sorted(shared.items())[:MAX_LISTED]
                    ],
                    "devices": _device_table(run, ranks),
                },
            ),
        )

    def _raise_misplaced(self, run: RunState, book: FindingBook, ranks: list[int]) -> None:
        first = _info(run, ranks[0])
        message = (
            f"{cap(ranks_phrase(ranks))} train on a GPU other than LOCAL_RANK's: rank {first.rank} "
            f"(LOCAL_RANK {first.local_rank}) has its model on {first.device}, expected "
            f"{first.device_expected}. Usually the model was moved with .cuda() or to 'cuda' "
            "before torch.cuda.set_device(local_rank), so every rank lands on GPU 0."
        )
        book.raise_or_update(
            "misplaced",
            Finding(
                kind="device_mismatch",
                severity="warning",
                ranks=ranks,
                step=-1,
                message=message,
                fix=_FIX_DEVICE,
                evidence={"devices": _device_table(run, ranks)},
            ),
        )


def _norm(device: str) -> str:
    return device if ":" in device else f"{device}:0"


def _info(run: RunState, rank: int) -> RunInfo:
    info = run.ranks[rank].info
    assert info is not None
    return info


def _device_table(run: RunState, ranks: list[int]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in ranks[:MAX_LISTED]:
        info = run.ranks[r].info
        if info is None:
            continue
        out[str(r)] = {
            "host": info.host,
            "local_rank": info.local_rank,
            "device": info.device,
            "expected": info.device_expected or "-",
            "gpu": info.device_uuid or "-",
            "visible": info.cuda_visible,
        }
    return out
