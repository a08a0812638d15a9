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
import importlib
import importlib.util
import sys
import weakref
from collections.abc import Callable
from typing import Any

_MARK = "_ddpscope_autoattach"
_REPLICATE_MODULE = "torch.distributed._composable.replicate"
_original_init: Callable[..., None] | None = None
_original_record: Callable[..., None] | None = None
#: The parameter lists replicate() builds its DDP over: that DDP is not attached.
_replicated: weakref.WeakSet[Any] = weakref.WeakSet()
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


def _auto_attach_replicated(module: Any, state: Any) -> None:
    """A module just put under ``replicate()``: attached at its first forward."""
    try:
        from ddpscope import config
        from ddpscope.hooks.attach import attach_replicated

        _replicated.add(state._param_list)
        attach_replicated(module, state, config.load(_options), dict(_options))
    except Exception as exc:
        _warn_once(exc)


class _ReplicateWatch:
    """Meta-path finder: patches ``replicate()`` once torch loads its module.

    For a process where :func:`install` ran while torch was still importing
    (``ddpscope run``'s start-up hook): importing the module then would meet a
    half-made torch, and the first DDP comes too late, from inside the first
    replicated forward. Finds nothing itself; takes itself off when done.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _REPLICATE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            original = loader.exec_module

            def exec_module(module: Any) -> None:
                loader.__dict__.pop("exec_module", None)
                original(module)
                _install_replicate(module)

            loader.exec_module = exec_module
        return spec


def _install_replicate(module: Any = None) -> None:
    """Patch ``replicate()``'s state to attach each module it is given.

    Its last step records the arguments it builds DDP from at the first
    forward: the module's hooks are all in place by then, so ddpscope's come
    after them. The DDP it builds there is left alone (:func:`install`): its
    module is a bare parameter list, never called.
    """
    global _original_record
    if module is None:
        module = sys.modules.get(_REPLICATE_MODULE)
    if module is None and not _torch_ready():
        if not any(isinstance(f, _ReplicateWatch) for f in sys.meta_path):
            sys.meta_path.insert(0, _ReplicateWatch())
        return
    try:
        if module is None:
            module = importlib.import_module(_REPLICATE_MODULE)
        _ReplicateState = module._ReplicateState
    except (ImportError, AttributeError):  # a torch without the composable API
        return
    record = _ReplicateState.record_init_args
    if getattr(record, _MARK, False):
        return
    _original_record = record

    @functools.wraps(record)
    def record_init_args(self: Any, *args: Any, **kwargs: Any) -> None:
        record(self, *args, **kwargs)
        _auto_attach_replicated(args[0] if args else kwargs.get("module"), self)

    setattr(record_init_args, _MARK, True)
    _ReplicateState.record_init_args = record_init_args


def _construction_failed(exc: BaseException) -> None:
    """Leave ``ddpscope run`` a note of the error and the line that built the model."""
    try:
        from ddpscope.hooks import unwatched

        caller = sys._getframe(2)  # the script's DDP(...) line, past our wrapper
        site = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        unwatched.construction_failed(exc, site)
    except Exception:
        pass


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
        try:
            init(self, *args, **kwargs)
        except Exception as exc:
            _construction_failed(exc)
            raise
        if getattr(self, "module", None) not in _replicated:
            _auto_attach(self)

    setattr(__init__, _MARK, True)
    DDP.__init__ = __init__  # type: ignore[method-assign]
    _install_replicate()
    if _torch_ready():
        _install_shim()
    else:
        # Called mid-`import torch`: wait for the first model, torch is whole by then.
        _shim_pending = True
    return True


def uninstall() -> None:
    """Undo :func:`install` (for tests). The comm-hook class shim stays."""
    global _original_init, _original_record
    if _original_record is not None:
        from torch.distributed._composable.replicate import _ReplicateState

        _ReplicateState.record_init_args = _original_record  # type: ignore[method-assign]
        _original_record = None
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
