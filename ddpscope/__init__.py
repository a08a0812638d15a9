"""ddpscope: see inside PyTorch DistributedDataParallel runs.

``import ddpscope`` stays light (no torch, no textual) so that the watcher
starts fast on a machine without torch; ``attach`` pulls in the rank side
only when called.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ddpscope import _exit
from ddpscope._version import __version__

if TYPE_CHECKING:
    from ddpscope.hooks.attach import Handle, InertHandle, PendingHandle


def attach(model: Any, **options: Any) -> Handle | InertHandle | PendingHandle:
    """Stream this rank's telemetry for ``model`` (a DistributedDataParallel, or a
    module under ``torch.distributed._composable.replicate``: attached at its first
    forward, when its DDP exists; docs/integrations.md).

    Options (keyword arguments) override DDPSCOPE_* environment variables;
    see docs/configuration.md. Returns a handle; calling twice on the same
    model returns the same handle.
    """
    from ddpscope.hooks.attach import attach as _attach

    return _attach(model, **options)


# Before the libraries a script imports next register their own exit work
# (ddpscope/_exit.py): a rank's end then comes after theirs.
_exit.register_early()

# When torch's DDP is already loaded, catch comm hooks registered before
# attach() so they can be wrapped (timed) instead of only left alone.
if "torch.nn.parallel.distributed" in sys.modules:  # pragma: no branch
    try:
        from ddpscope.hooks.comm import install_class_shim

        install_class_shim()
    except Exception:  # never let an import-time nicety break the user's import
        pass

__all__ = ["__version__", "attach"]
