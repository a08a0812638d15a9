"""Which of a model's layers train differently in eval mode.

A loop that calls ``model.eval()`` to evaluate and never ``model.train()``
again trains on with dropout off and BatchNorm normalising by, and no longer
updating, its running statistics. Nothing fails. The step tracker
(hooks/steps.py) marks steps whose training forwards all ran in eval mode;
on the first, it asks here which layers that changes, so that a model with
none (eval mode then changes nothing it can see) is not named
(``eval_mode_training``).

torch's own layers only: a layer of the script's own that reads
``self.training`` cannot be told from one that does not. A model with any
such layer back in train mode (``model.eval()`` then ``model.head.train()``:
a frozen backbone under a head that trains) is set that way on purpose, and
names none.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.instancenorm import _InstanceNorm

from ddpscope.schema import MAX_EVAL_LAYERS


def _changes(m: nn.Module) -> bool:
    if isinstance(m, _DropoutNd):
        return m.p > 0
    if isinstance(m, _BatchNorm | _InstanceNorm):
        return bool(m.track_running_stats)
    if isinstance(m, nn.MultiheadAttention):
        return m.dropout > 0
    if isinstance(m, nn.RNNBase):
        return m.dropout > 0 and m.num_layers > 1
    return False


def eval_mode_layers(model: Any) -> tuple[str, ...]:
    """Class names (each once, in model order, at most MAX_EVAL_LAYERS) of the layers in eval
    mode whose training forward differs: dropout, running statistics. None (an empty
    tuple) when any such layer is in train mode: a model put in eval mode and then
    partly back in train mode (a frozen backbone under a head that trains) is set that
    way on purpose."""
    kinds: dict[str, None] = {}
    try:
        for m in model.modules():
            if _changes(m):
                if m.training:
                    return ()
                kinds.setdefault(type(m).__name__)
    except Exception:  # a module whose walk raises: name none, and so raise nothing
        return ()
    return tuple(kinds)[:MAX_EVAL_LAYERS]


__all__ = ["eval_mode_layers"]
