"""The layer of a DataLoader's dataset that reshuffles by ``set_epoch``, and its epoch.

Streaming datasets (and map-style ones that draw a mixture by epoch) take their
epoch from a ``set_epoch`` method of their own, called by the loop in the
training process. DataLoader workers each hold a copy of the dataset, made
when they start; with ``persistent_workers=True`` they start once, so an
epoch set later reaches the training process's copy and never theirs, and
every epoch replays the first one's order (datasets issue #6673, fixed there by
keeping the epoch in shared memory; VeOmni and starVLA hit it again in 2026).

:func:`epoch_layer` finds the innermost layer with a ``set_epoch`` (wrappers
such as accelerate's ``IterableDatasetShard`` forward the call inward, and the
inner one is the one that shuffles), reads its epoch, and says whether that
epoch lives in shared memory (a torch tensor in shared memory, a
``multiprocessing.Value``), where the workers see it change. Called once per
DataLoader pass, on the training thread (a few attribute reads).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ddpscope.hooks.typename import type_name

#: How many ``.dataset`` wrappers are looked through, at most.
_DEPTH = 4
#: Where datasets keep their epoch, raw storage first: a property may read a shared
#: value into a plain int.
_STORES = ("_epoch", "epoch", "_cur_epoch", "cur_epoch", "current_epoch")
#: Wrappers whose ``set_epoch`` only passes the epoch inward (accelerate's and the
#: HF Trainer's shard of a stream): their epoch orders nothing, except that they seed
#: the ``generator`` of a dataset with no ``set_epoch`` of its own by it.
_FORWARDERS = frozenset(
    {
        "accelerate.data_loader.IterableDatasetShard",
        "transformers.trainer_pt_utils.IterableDatasetShard",
    }
)


class EpochLayer(NamedTuple):
    #: The layer's qualified type name.
    name: str
    #: Its epoch as read now; -1 when no attribute holds an int.
    epoch: int
    #: The epoch is kept in shared memory: workers started earlier see it change.
    shared: bool


def epoch_layer(dataset: Any) -> EpochLayer | None:
    """The innermost layer of ``dataset`` (itself, then ``.dataset`` inward) that has
    a callable ``set_epoch``; None when none has."""
    found = None
    layer = dataset
    for _ in range(_DEPTH):
        if layer is None:
            break
        inner = getattr(layer, "dataset", None)
        if callable(getattr(layer, "set_epoch", None)) and _orders(layer, inner):
            found = layer
        layer = inner
    if found is None:
        return None
    epoch, shared = _read(found)
    return EpochLayer(type_name(found), epoch, shared)


def _orders(layer: Any, inner: Any) -> bool:
    """Whether the layer's epoch can change the order it yields (not a mere forwarder,
    nor a ``datasets`` stream before 2.19 that was never shuffled: it kept the shuffle
    in ``_shuffling``, None without one)."""
    name = type_name(layer)
    if name.startswith("datasets.") and getattr(layer, "_shuffling", False) is None:
        return False
    if name not in _FORWARDERS:
        return True
    return not callable(getattr(inner, "set_epoch", None)) and isinstance(
        getattr(inner, "generator", None), torch.Generator
    )


def _read(layer: Any) -> tuple[int, bool]:
    own = getattr(layer, "__dict__", {})
    for name in _STORES:
        value = own[name] if name in own else getattr(type(layer), name, None)
        if value is None:
            continue
        if isinstance(value, property):
            try:
                value = getattr(layer, name)
            except Exception:
                continue
        epoch, shared = _value(value)
        if epoch >= 0:
            return epoch, shared
    return -1, False


def _value(value: Any) -> tuple[int, bool]:
    if isinstance(value, bool):
        return -1, False
    if isinstance(value, int):
        return value, False
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return int(value.item()), value.is_shared()
    # multiprocessing.Value (a synchronized wrapper of a shared ctypes object).
    inner = getattr(value, "value", None)
    if callable(getattr(value, "get_obj", None)) and isinstance(inner, int):
        return inner, True
    return -1, False


__all__ = ["EpochLayer", "epoch_layer"]
