"""Whether a sampler draws its own order: the one test the sampler probe (what a pass
reports as ``SamplerPass.shuffle``) and the repeated-epoch check (which leaves a
shuffling sampler's repeats to ``missing_set_epoch``) both apply."""

from __future__ import annotations

from typing import Any

from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

_RANDOM = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def shuffles(sampler: Any) -> bool:
    """torch's random samplers, and any sampler (DistributedSampler, one built like it)
    whose ``shuffle`` is True."""
    return isinstance(sampler, _RANDOM) or getattr(sampler, "shuffle", False) is True


__all__ = ["shuffles"]
