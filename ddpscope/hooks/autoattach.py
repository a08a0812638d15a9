"""Attach ddpscope to every DistributedDataParallel model, with no code change.

``ddpscope run`` makes each launched process call :func:`install` as soon as
torch's DDP class exists (see ddpscope/_bootstrap/sitecustomize.py). From then
on every DDP model calls ``ddpscope.attach(self)`` when its constructor
returns, and comm hooks registered right after construction are wrapped, not
missed. A script that also calls ``ddpscope.attach(model)`` itself gets the
same handle back (attach is idempotent), so the two ways combine.

An error in ddpscope must never stop training: a failed attach prints one
warning and the model trains unwatched.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

_MARK = "_ddpscope_autoattach"
_original_init: Callable[..., None] | None = None
_warned = False
_shim_pending = False
#: attach() options for models that attach themselves (a framework callback's).
_options: dict[str, Any] = {}


def set_options(options: dict[str, Any]) -> None:
    """Options for the models attached from now on (``ddpscope run`` sets none)."""
    _options.clear()
    _options.update(options)


def _warn_once(exc: BaseException) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    try:
        sys.stderr.write(
            "ddpscope: warning: could not attach to a DistributedDataParallel model "
            f"({type(exc).__name__}: {exc}); training continues without ddpscope\n"
        )
    except Exception:
        pass


def _torch_ready() -> bool:
    # The shim imports more of torch; not while torch/__init__.py is still running.
    spec = getattr(sys.modules.get("torch"), "__spec__", None)
    return not getattr(spec, "_initializing", False)


def _install_shim() -> None:
    global _shim_pending
    _shim_pending = False
    from ddpscope.hooks.comm import install_class_shim

    install_class_shim()


def _auto_attach(model: Any) -> None:
    try:
        if _shim_pending:
            _install_shim()
        import ddpscope

        ddpscope.attach(model, **_options)
    except Exception as exc:
        _warn_once(exc)


def install() -> bool:
    """Patch ``DistributedDataParallel.__init__``; idempotent. True if patched now."""
    global _original_init, _shim_pending
    from torch.nn.parallel.distributed import DistributedDataParallel as DDP

    init = DDP.__init__
    if getattr(init, _MARK, False):
        return False
    _original_init = init

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _auto_attach(self)

    setattr(__init__, _MARK, True)
    DDP.__init__ = __init__  # type: ignore[method-assign]
    if _torch_ready():
        _install_shim()
    else:
        # Called mid-`import torch`: wait for the first model, torch is whole by then.
        _shim_pending = True
    return True


def uninstall() -> None:
    """Undo :func:`install` (for tests). The comm-hook class shim stays."""
    global _original_init
    if _original_init is None:
        return
    from torch.nn.parallel.distributed import DistributedDataParallel as DDP

    DDP.__init__ = _original_init  # type: ignore[method-assign]
    _original_init = None


def installed() -> bool:
    if "torch.nn.parallel.distributed" not in sys.modules:
        return False
    from torch.nn.parallel.distributed import DistributedDataParallel as DDP

    return bool(getattr(DDP.__init__, _MARK, False))


__all__ = ["install", "installed", "uninstall"]
