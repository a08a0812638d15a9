"""Training with no model to attach to, in a job ``ddpscope run`` launched.

A script that starts a process group and a DistributedSampler but never wraps
its model in DistributedDataParallel trains one model per rank, each on its own
shard, and nothing says so: pytorch/examples' imagenet ``main.py`` does exactly
this on a machine without a GPU (it wraps the model only on CUDA). ddpscope has
no DDP model to attach to there, and used to say only that nothing was
recorded.

While no model is attached, every optimizer step (torch's global step hook)
notes the default process group's size and its collective sequence number
(``_get_sequence_number_for_group``: one per collective issued on it, 0.2 us to
read). At exit, a rank that stepped at least :data:`MIN_STEPS` times in a group
of two or more ranks, with fewer collectives than one per
:data:`STEPS_PER_COLLECTIVE` steps between its first and last step, and with
no sharded wrapper in sight (parameters that are DTensors or FSDP's flat
parameters, DeepSpeed or Horovod loaded), writes one JSON note to
``$DDPSCOPE_NOTES_DIR``; ``ddpscope run`` reads the notes after the job and
says what they show (``cli/run.py``). Gradients averaged by hand all-reduce at
least once a step and stay quiet.

A DDP model whose constructor raised (``SyncBatchNorm`` on a CPU module, a
model with no trainable parameter, a bad ``device_ids``) leaves a note too
(:func:`construction_failed`): the error and the line that built it, so that
"recorded nothing" says why instead of "the job built none".

Nothing here runs outside ``ddpscope run`` (no notes directory), and the hook
stops counting at the first step after a model attached.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from typing import Any

from ddpscope.config import NOTES_VAR

#: Optimizer steps a rank must take before its training counts as training.
MIN_STEPS = 8
#: Fewer collectives than one per this many steps: nothing synchronises the replicas.
STEPS_PER_COLLECTIVE = 4
#: Modules whose presence means the replicas are kept in step some other way.
_OTHER_WRAPPERS = ("deepspeed", "horovod.torch")


class _Tally:
    __slots__ = ("first_seq", "last_seq", "off", "rank", "sharded", "steps", "world")

    def __init__(self) -> None:
        self.steps = 0
        self.world = 0
        self.rank = -1
        self.first_seq = -1
        self.last_seq = -1
        self.sharded = False
        #: Set for good once a model attached or a call failed. (The hook stays
        #: registered: torch iterates its global hooks while it calls them.)
        self.off = False


_tally: _Tally | None = None


def watch() -> None:
    """Count optimizer steps until a model attaches; write a note at exit. Idempotent."""
    global _tally
    notes = os.environ.get(NOTES_VAR)
    if not notes or _tally is not None:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _tally = _Tally()
    register_optimizer_step_post_hook(_stepped)
    atexit.register(_write, notes)


def _attached() -> bool:
    attach = sys.modules.get("ddpscope.hooks.attach")
    return attach is not None and bool(attach.current_handles())


def _stepped(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    t = _tally
    if t is None or t.off:
        return
    try:
        if _attached():
            t.off = True  # watched from here on: the recording says the rest
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        group = dist.distributed_c10d._get_default_group()
        seq = int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
        if t.steps == 0:
            t.world, t.rank, t.first_seq = dist.get_world_size(), dist.get_rank(), seq
            t.sharded = _sharded(optimizer)
        t.steps += 1
        t.last_seq = seq
    except Exception:
        t.off = True  # a torch without these calls: say nothing rather than guess


def _sharded(optimizer: Any) -> bool:
    """Whether the optimizer steps parameters a sharded wrapper keeps in step."""
    for group in getattr(optimizer, "param_groups", []):
        for p in group.get("params", []):
            name = type(p).__name__
            if name in ("DTensor", "FlatParameter") or hasattr(p, "_fsdp_flattened"):
                return True
    return False


def note(t: _Tally, loaded: Any = sys.modules) -> dict[str, Any] | None:
    """What the rank's note says, or None when its training needs no note."""
    if t.off or t.steps < MIN_STEPS or t.world < 2 or t.sharded or _attached():
        return None
    if any(name in loaded for name in _OTHER_WRAPPERS):
        return None
    collectives = max(0, t.last_seq - t.first_seq)
    if collectives * STEPS_PER_COLLECTIVE >= t.steps:
        return None
    return {"rank": t.rank, "world": t.world, "steps": t.steps, "collectives": collectives}


#: Characters of a construction error a note keeps.
MAX_ERROR = 300
#: Note files of constructions that raised: ``failed-RANK-PID.json``.
FAILED_PREFIX = "failed-"


def construction_failed(exc: BaseException, site: str) -> None:
    """Note that a ``DistributedDataParallel(...)`` at ``site`` raised ``exc`` (never raises)."""
    notes = os.environ.get(NOTES_VAR)
    if not notes:
        return
    try:
        rank = int(os.environ.get("RANK", "-1") or -1)
        error = f"{type(exc).__name__}: {exc}".strip()
        found = {"rank": rank, "error": error[:MAX_ERROR], "site": site}
        path = os.path.join(notes, f"{FAILED_PREFIX}{rank}-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(found, f)
    except Exception:
        pass  # the user's error is what must surface, not ours


def _write(notes: str) -> None:
    try:
        found = note(_tally) if _tally is not None else None
        if found is None:
            return
        path = os.path.join(notes, f"unwatched-{found['rank']}-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(found, f)
    except Exception:
        pass  # exit must never fail because of ddpscope
