"""The model ddpscope attached to, as its probes need it (:class:`Target`).

A ``DistributedDataParallel`` model is one object: it owns the reducer, wraps
the user's layers in ``.module`` and is what the training loop calls. torch's
composable ``replicate()`` (torchtitan's data-parallel path) splits those
roles: the loop calls the user's own module, whose forward hooks drive a
``DistributedDataParallel`` built over a bare parameter list at the module's
first forward. The probes read each role from where it lives:

- ``ddp``: the reducer's owner (bucket layout, comm hooks, sync flags, settings);
- ``module``: the user's layers (parameter and buffer names, BatchNorm layers,
  train/eval mode);
- ``entry``: what the loop calls, whose forward is timed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddpscope.schema import DDP_API_REPLICATE as REPLICATE


@dataclass(frozen=True)
class Target:
    ddp: Any
    module: Any
    entry: Any
    #: (name, parameter) in the order DDP hands them to its reducer.
    named: list[tuple[str, Any]]
    #: "ddp", or REPLICATE.
    api: str = "ddp"

    @property
    def syncs_buffers(self) -> bool:
        """Whether the module's buffers are broadcast from rank 0 in each forward.

        ``replicate()`` builds its DDP over the parameters only: buffers (BatchNorm's
        running statistics) stay each rank's own, as with ``broadcast_buffers=False``.
        """
        return self.api != REPLICATE and bool(getattr(self.ddp, "broadcast_buffers", False))


def of_ddp(ddp: Any) -> Target:
    module = ddp.module
    return Target(ddp, module, ddp, list(module.named_parameters()))


def replicate_state(model: Any) -> Any:
    """The ``replicate()`` state of ``model``, or None if it is not a replicated module."""
    try:
        from torch.distributed._composable.replicate import DDP as Replicated
        from torch.distributed._composable.replicate import replicate
    except ImportError:  # a torch without the composable API
        return None
    if not isinstance(model, Replicated):
        return None
    return replicate.state(model)  # type: ignore[arg-type]


def replicated_ddp(state: Any) -> Any:
    """The DDP ``replicate()`` built, or None before the module's first forward."""
    return state.__dict__.get("_ddp") if state is not None else None


def of_replicated(module: Any, state: Any) -> Target:
    """A replicated module whose DDP is built (:func:`replicated_ddp` is not None)."""
    named = list(zip(state._param_names, state._param_list, strict=True))
    return Target(replicated_ddp(state), module, module, named, REPLICATE)


__all__ = ["REPLICATE", "Target", "of_ddp", "of_replicated", "replicate_state", "replicated_ddp"]
