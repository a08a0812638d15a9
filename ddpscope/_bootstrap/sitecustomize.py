"""ddpscope's start-up hook for processes launched by ``ddpscope run``.

``ddpscope run`` puts this directory first on PYTHONPATH, so Python's ``site``
module imports this file at start-up in every process of the job: torchrun's
agent, each rank, spawned DataLoader workers, helper scripts. Most of them never
build a DDP model, so this file does almost nothing at start-up: it does not
import torch (or ddpscope), it only adds a finder to ``sys.meta_path`` that
notices when torch's DistributedDataParallel module has been loaded and then
calls ``ddpscope.hooks.autoattach.install()``, which makes every DDP model
attach itself as its constructor returns.

It also runs the ``sitecustomize`` it shadows (the next one on sys.path), so
site or user customisation keeps working under ``ddpscope run``.

Rules for this file: never raise, never print except one warning line on an
error, stdlib only, no work at all unless DDPSCOPE_AUTOATTACH=1.
"""

from __future__ import annotations

import os
import sys

# Not `from typing import TYPE_CHECKING`: typing costs milliseconds at every start-up.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

_HERE = os.path.dirname(os.path.abspath(__file__))
_DDP_MODULE = "torch.nn.parallel.distributed"
_WATCHED = ("torch", _DDP_MODULE)


def _warn(what: str, exc: BaseException) -> None:
    try:
        sys.stderr.write(f"ddpscope: warning: {what}: {type(exc).__name__}: {exc}\n")
    except Exception:
        pass


def _still_loading(name: str) -> bool:
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


class _DDPWatch:
    """Meta-path finder that runs ``install`` once torch's DDP class is usable.

    ``import torch`` loads torch.nn.parallel.distributed half-way through
    torch/__init__.py; importing more of torch (ddpscope's hooks do) at that
    moment would run into the half-initialised package. So the install waits
    for whichever comes last: the DDP module loaded, or the body of torch
    finished. The finder finds nothing itself; it asks the other finders,
    wraps the loader's ``exec_module`` for the two modules it watches, and
    takes itself off ``sys.meta_path`` once it has installed.
    """

    def __init__(self) -> None:
        self.done = False

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname not in _WATCHED or self.done:
            return None
        try:
            spec = self._real_spec(fullname, path, target)
            loader = getattr(spec, "loader", None)
            if loader is not None and hasattr(loader, "exec_module"):
                self._wrap(loader, fullname)
            return spec
        except Exception as exc:
            _warn("could not watch the torch import; DDP models will not auto-attach", exc)
            return None

    def _real_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> ModuleSpec | None:
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                found: ModuleSpec = spec
                return found
        return None

    def _wrap(self, loader: object, fullname: str) -> None:
        original = loader.exec_module  # type: ignore[attr-defined]

        def exec_module(module: object) -> None:
            # Put the class method back first: the loader is the module's
            # __loader__ for good and should carry no trace of us.
            loader.__dict__.pop("exec_module", None)
            original(module)
            self.loaded(fullname)

        loader.exec_module = exec_module  # type: ignore[attr-defined]

    def loaded(self, fullname: str) -> None:
        if self.done:
            return
        if fullname == "torch":
            ready = _DDP_MODULE in sys.modules  # torch's body has run to its end
        else:
            ready = "torch" in sys.modules and not _still_loading("torch")
        if ready:
            self.install()

    def install(self) -> None:
        self.done = True
        try:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        except Exception:
            pass
        try:
            _ensure_ddpscope_importable()
            from ddpscope.hooks import autoattach

            autoattach.install()
        except Exception as exc:
            _warn("could not hook DistributedDataParallel; this process runs unwatched", exc)
            return
        try:
            from ddpscope.hooks import unwatched

            unwatched.watch()  # training with no DDP model at all gets a note at exit
        except Exception:
            pass


def _ensure_ddpscope_importable() -> None:
    # ddpscope may run from a checkout that only the launcher had on its path;
    # append (never prepend) its root so nothing of the user's is shadowed.
    import importlib.util

    if "ddpscope" in sys.modules or importlib.util.find_spec("ddpscope") is not None:
        return
    sys.path.append(os.path.dirname(os.path.dirname(_HERE)))


def _start_watching() -> None:
    watch = _DDPWatch()
    if _DDP_MODULE in sys.modules and not _still_loading("torch"):
        watch.install()  # torch came in before us (a .pth file imported it)
    else:
        sys.meta_path.insert(0, watch)


def _chain() -> None:
    """Run the sitecustomize this one shadows: the next on sys.path after us."""
    import importlib.machinery
    import importlib.util

    here = os.path.realpath(_HERE)
    entries = list(sys.path)
    for i, entry in enumerate(entries):
        if os.path.realpath(entry or os.curdir) == here:
            rest = [e for e in entries[i + 1 :] if os.path.realpath(e or os.curdir) != here]
            break
    else:
        return
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    # Theirs is the one user code means by `import sitecustomize`.
    ours = sys.modules.get("sitecustomize")
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        if ours is not None:
            sys.modules["sitecustomize"] = ours
        _warn(f"{spec.origin} raised", exc)


try:
    if os.environ.get("DDPSCOPE_AUTOATTACH") == "1":
        _start_watching()
except Exception as _exc:
    _warn("start-up hook failed; DDP models will not auto-attach", _exc)

try:
    _chain()
except Exception as _exc:
    _warn("could not run the sitecustomize that ddpscope's shadows", _exc)
