"""What ``ddpscope.attach()`` accepts: a DDP model, a wrapper it can find one in, or a
module under torch's composable ``replicate()``.

A wrong argument is the caller's error and raises ``TypeError`` with the fix
(DataParallel gets its own explanation); ``torch.compile(ddp_model)`` and what
Lightning Fabric's ``setup`` returns are unwrapped to the DDP module inside.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import DataParallel
from torch.nn.parallel import DistributedDataParallel

from ddpscope.hooks.target import replicate_state
from ddpscope.hooks.typename import type_name


def compiled_ddp(model: Any) -> Any:
    """The DDP model inside ``torch.compile(ddp_model)``, else None."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, DistributedDataParallel) and isinstance(model, torch.nn.Module):
        return inner
    return None


def fabric_ddp(model: Any) -> Any:
    """The DDP model inside what Lightning Fabric's ``setup`` returns, else None."""
    inner = getattr(model, "_forward_module", None)
    return inner if isinstance(inner, DistributedDataParallel) else None


def _sharded(model: Any) -> bool:
    """An FSDP model: ``FullyShardedDataParallel`` or a module under ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:
        return False
    return isinstance(model, (FSDPModule, FullyShardedDataParallel))


def check_model(model: Any) -> None:
    if isinstance(model, DistributedDataParallel) or compiled_ddp(model) is not None:
        return
    if fabric_ddp(model) is not None or replicate_state(model) is not None:
        return
    if isinstance(model, DataParallel):
        raise TypeError(
            "ddpscope.attach() got torch.nn.DataParallel, which runs one process on several "
            "GPUs; ddpscope watches DistributedDataParallel, one process per GPU. Launch with "
            "torchrun, call torch.distributed.init_process_group(), and wrap with "
            "DistributedDataParallel(model, device_ids=[local_rank]) instead."
        )
    if _sharded(model):
        raise TypeError(
            f"ddpscope.attach() got {type_name(model)}, a fully sharded (FSDP) model: each "
            "rank holds a different shard of the weights, and ddpscope watches data-parallel "
            "replicas (DistributedDataParallel, or a module under "
            "torch.distributed._composable.replicate), whose weights are the same on every "
            "rank. FSDP is not supported; train without attaching it."
        )
    raise TypeError(
        f"ddpscope.attach() expects a torch.nn.parallel.DistributedDataParallel model (or a "
        f"module under torch.distributed._composable.replicate), got {type_name(model)}. "
        "Wrap the model first: model = DistributedDataParallel(model); ddpscope.attach(model)."
    )
