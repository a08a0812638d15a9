"""The layers of a DataLoader that each keep one rank's share of the data.

A loader split by rank once is sharded; split twice, each rank keeps a share
of its share and the ranks together train on a fraction of the dataset every
epoch. Nothing fails and the loss curve looks normal. The usual way there:
a DataLoader built with a ``DistributedSampler`` and then handed to
accelerate's ``prepare()`` (or the Hugging Face Trainer, through a sampler of
its own), which shards the batches again (``BatchSamplerShard``, or
``DataLoaderDispatcher`` slicing what rank 0 drew); or a rank-aware sampler
of the script's own that Lightning wraps in its ``DistributedSamplerWrapper``.

Read once per pass at ``iter(loader)`` (hooks/samplers.py), by walking the
loader's batch sampler and samplers (a few attribute reads; at most
:data:`MAX_DEPTH` layers). Each layer found is (qualified type name, ways):
a ``DistributedSampler`` or a sampler built like one (``num_replicas``,
``set_epoch``) splitting ``num_replicas`` ways, accelerate's
``BatchSamplerShard`` and ``DataLoaderDispatcher`` splitting
``num_processes`` ways. Layers of one way are left out.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.utils.data import DistributedSampler

from ddpscope.hooks.typename import type_name

#: Layers of samplers walked, at most.
MAX_DEPTH = 6
#: Frames above ``iter(loader)`` looked at for accelerate's dispatcher, at most.
MAX_FRAMES = 12
#: accelerate's types that shard a loader by process (matched by name: no import).
_ACCELERATE_SHARDS = ("BatchSamplerShard", "DataLoaderDispatcher")


def _ways(obj: Any, attr: str) -> int:
    value = getattr(obj, attr, 1)
    return value if type(value) is int else 1


def _splits_by_rank(sampler: Any) -> int:
    """Ways ``sampler`` splits by rank (1: it does not)."""
    if isinstance(sampler, DistributedSampler):
        return _ways(sampler, "num_replicas")
    if callable(getattr(sampler, "set_epoch", None)) and hasattr(sampler, "rank"):
        return _ways(sampler, "num_replicas")  # built like it (RASampler)
    return 1


def _inner(sampler: Any) -> Any:
    """The sampler ``sampler`` draws from, if it wraps one."""
    for attr in ("sampler", "_sampler"):
        inner = getattr(sampler, attr, None)
        if inner is not None and inner is not sampler:
            return inner
    # Lightning's and catalyst's DistributedSamplerWrapper: a DistributedSampler over a
    # dataset that holds the wrapped sampler.
    source = getattr(sampler, "dataset", None)
    for attr in ("_sampler", "sampler"):
        inner = getattr(source, attr, None)
        if inner is not None and inner is not sampler:
            return inner
    return None


def _dispatcher() -> Any:
    """accelerate's DataLoaderDispatcher iterating the loader whose ``iter()`` is on the
    stack (it iterates a plain DataLoader of its own, ``base_dataloader``), or None."""
    frame: Any = sys._getframe(2)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        if frame.f_code.co_name == "__iter__":
            owner = frame.f_locals.get("self")
            if type(owner).__name__ == "DataLoaderDispatcher":
                return owner
        frame = frame.f_back
    return None


def _process_ways(obj: Any) -> int:
    ways = _ways(obj, "num_processes")
    return ways if ways > 1 else _ways(getattr(obj, "state", None), "num_processes")


def rank_splits(loader: Any) -> list[tuple[str, int]]:
    """(type, ways) of every layer of ``loader`` that keeps one rank's share, outermost
    first; an internal error gives what was found so far."""
    found: list[tuple[str, int]] = []
    try:
        outer = loader if type(loader).__name__ in _ACCELERATE_SHARDS else _dispatcher()
        if outer is not None:
            ways = _process_ways(outer)
            if ways > 1:
                found.append((type_name(outer), ways))
        layer: Any = getattr(loader, "batch_sampler", None)
        for _ in range(MAX_DEPTH):
            if layer is None:
                break
            if type(layer).__name__ in _ACCELERATE_SHARDS:
                ways = _ways(layer, "num_processes")
                if ways > 1:
                    found.append((type_name(layer), ways))
                layer = getattr(layer, "batch_sampler", None)
                continue
            ways = _splits_by_rank(layer)
            if ways > 1:
                found.append((type_name(layer), ways))
            layer = _inner(layer)
        if not found and getattr(loader, "batch_sampler", None) is None:
            sampler = getattr(loader, "sampler", None)
            ways = _splits_by_rank(sampler)
            if ways > 1:
                found.append((type_name(sampler), ways))
    except Exception:  # a sampler whose attributes raise: what was found so far
        pass
    return found


__all__ = ["rank_splits"]
