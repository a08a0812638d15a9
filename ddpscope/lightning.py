"""PyTorch Lightning: ``Trainer(callbacks=[DDPScopeCallback()])`` attaches ddpscope.

Lightning builds the DDP model itself (its DDP strategy wraps the module in
``strategy.setup``), so a script has no DDP object to pass to
:func:`ddpscope.attach`. The callback attaches to ``trainer.strategy.model``
in ``on_fit_start``, the first hook that runs after the wrapping. Scripts run
under ``ddpscope run`` need no callback (every DDP model attaches itself); with
both, the callback gets the same handle back.

Importing this module imports Lightning (``pytorch_lightning``, else
``lightning.pytorch``): install ``ddpscope[lightning]``. Nothing else in
ddpscope imports it.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    import pytorch_lightning as pl
except ImportError:  # the unified package
    import lightning.pytorch as pl  # type: ignore[no-redef]

log = logging.getLogger("ddpscope")

__all__ = ["DDPScopeCallback"]


class DDPScopeCallback(pl.Callback):
    """Attach ddpscope to the DDP model Lightning builds; ``options`` as for ``attach``."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options
        self.handle: Any = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        import ddpscope

        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            # Single process, or a strategy that is not DDP (FSDP, DeepSpeed): nothing to watch.
            log.info("ddpscope: %s is not DDP; not attached", type(model).__name__)
            return
        self.handle = ddpscope.attach(model, **self.options)
