"""Hugging Face ``transformers.Trainer``: ``callbacks=[DDPScopeCallback()]`` attaches ddpscope.

The Trainer wraps the model in DDP inside ``train()`` (through accelerate's
``prepare``), after the callbacks exist, and it hands callbacks the unwrapped
model only. So the callback makes the next DDP models attach themselves as
they are built, exactly as ``ddpscope run`` does for a whole job, and checks in
``on_train_begin`` that the model being trained is watched. accelerate scripts
without a Trainer are watched with ``ddpscope run``, or with
``ddpscope.attach(model)`` on what ``accelerator.prepare`` returned.

Importing this module imports transformers: install ``ddpscope[hf]``. Nothing
else in ddpscope imports it.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

log = logging.getLogger("ddpscope")

__all__ = ["DDPScopeCallback"]


class DDPScopeCallback(TrainerCallback):
    """Attach ddpscope to the DDP model the Trainer builds; ``options`` as for ``attach``."""

    def __init__(self, **options: Any) -> None:
        from ddpscope import config
        from ddpscope.hooks import autoattach

        self.options = options
        self.handle: Any = None
        if options:
            config.load(options)  # a bad option is the caller's error: raise it here
            autoattach.set_options(options)
        autoattach.install()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from ddpscope.hooks.attach import current_handles

        model = kwargs.get("model")
        for handle in current_handles():
            if getattr(handle.model, "module", None) is model:
                self.handle = handle
                return
        if args.world_size > 1:
            log.warning(
                "ddpscope: the Trainer's model is not wrapped in DistributedDataParallel "
                "(or was wrapped before DDPScopeCallback existed); not watched"
            )
