"""A digest of what a batch holds, for the first batches of each DataLoader pass.

Ranks that shard their data draw different batches; ranks that read the same
stream (an IterableDataset nobody split by rank) draw the same ones. Sampler
indices tell the two apart for map-style datasets; an IterableDataset has no
indices to follow, so the analysis compares these digests across ranks
instead (``unsharded_data``, detectors/sampling/same_batches.py).

Only the first :data:`DIGEST_BATCHES` batches of a pass are read, on the
training thread (hooks/loaderwait.py): the first tensor of the batch, its
shape and dtype, and its values hashed (blake2b, the same in every process):
all of them for a small tensor (a batch of token ids), else
:data:`DIGEST_ELEMENTS` spread evenly over the whole batch, so that samples
sharing a prefix (a prompt template, an image border, padding) still differ.
Only on the CPU (a GPU tensor would need a synchronisation: no digest).
Measured with timeit on the 2-core VM: 32 us for an 8x3x32x32 batch, 49 us
for 16x512 token ids, 65-72 us for a 64x3x224x224 image batch contiguous or
channels-last, ~150 us for a crop viewed in a larger tensor; four a pass
(benchmarks/loader_cost.py has the per-batch figure).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

#: Batches of each pass a digest is taken of.
DIGEST_BATCHES = 4
#: Values of the first tensor a digest hashes at most: every one of a smaller tensor.
DIGEST_ELEMENTS = 4096
#: Samples read from a batch whose memory has gaps (a slice of a larger tensor).
_ROWS = 8
#: How deep into tuples, lists and dicts the first tensor is looked for.
_DEPTH = 4
_MASK = (1 << 63) - 1


def first_tensor(obj: Any, depth: int = _DEPTH) -> torch.Tensor | None:
    """The first tensor of a batch: itself, or the first found in its containers."""
    if isinstance(obj, torch.Tensor):
        return obj
    if depth <= 0:
        return None
    if isinstance(obj, Mapping):
        items: Any = obj.values()
    elif isinstance(obj, (tuple, list)):
        items = obj
    else:
        return None
    for i, item in enumerate(items):
        if i >= 8:
            break
        found = first_tensor(item, depth - 1)
        if found is not None:
            return found
    return None


def _spread(x: torch.Tensor) -> torch.Tensor:
    """At most :data:`DIGEST_ELEMENTS` of ``x``'s values, spread over all of it (1-D, dense)."""
    n = x.numel()
    if not x.is_contiguous() and x.dim() > 1:
        # Dense memory in another order than the shape's (channels-last): the same
        # values in memory order are a contiguous view.
        strides = x.stride()
        order = sorted(range(x.dim()), key=lambda d: -strides[d])
        x = x.permute(order)
    if x.is_contiguous() or x.dim() == 1:
        flat = x.reshape(-1)  # a view here
        return flat[:: -(-n // DIGEST_ELEMENTS)].contiguous()
    # Slices with gaps between them (a crop viewed in a larger tensor): a few samples.
    rows = x.shape[0]
    picks = sorted({i * (rows - 1) // (_ROWS - 1) for i in range(_ROWS)})
    per = DIGEST_ELEMENTS // len(picks)
    parts = []
    for i in picks:
        row = x[i]
        # The same step along every axis: a view of about ``per`` values, then copied.
        step = max(1, round((row.numel() / per) ** (1 / max(1, row.dim()))))
        parts.append(row[(slice(None, None, step),) * row.dim()].reshape(-1))
    return torch.cat(parts)


def content_digest(batch: Any) -> int:
    """A 63-bit digest (never 0) of the batch's first CPU tensor: shape, dtype, values.

    0 when there is none to read: no tensor, a GPU tensor, an empty or a sparse one.
    """
    t = first_tensor(batch)
    if t is None or t.device.type != "cpu" or t.numel() == 0 or t.layout != torch.strided:
        return 0
    try:
        values = _spread(t.detach())
        raw = values.view(torch.uint8).numpy().tobytes()  # 4,096 values at most
    except (RuntimeError, TypeError, ValueError):
        return 0
    h = hashlib.blake2b(f"{tuple(t.shape)} {t.dtype}".encode(), digest_size=8)
    h.update(raw)
    return (int.from_bytes(h.digest(), "little") & _MASK) or 1


__all__ = ["DIGEST_BATCHES", "DIGEST_ELEMENTS", "content_digest", "first_tensor"]
