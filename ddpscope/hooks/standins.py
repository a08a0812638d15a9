"""What ``attach`` returns when there is no live handle to return (yet).

- :class:`InertHandle`: ddpscope is off on this rank (disabled, or attach failed);
- :class:`PendingHandle`: a module under ``replicate()`` whose DDP does not exist
  yet. ``replicate()`` builds it in the module's first forward, and that build
  broadcasts rank 0's weights: building it earlier would move the user's
  collective (and undo weights loaded between attach and that forward), so the
  handle is made there instead, from a pre-hook that runs after replicate's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ddpscope.hooks.modulehook import _ModuleHook

log = logging.getLogger("ddpscope")


class InertHandle:
    """Returned when ddpscope is disabled: same surface, does nothing."""

    enabled = False
    step = 0
    job_step = 0
    record_path = None
    run_id = ""
    rank = -1
    error = ""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<ddpscope.Handle disabled: {self.reason}>"

    def request_fingerprint(self) -> None:
        pass

    def close(self) -> None:
        pass


class PendingHandle:
    """A handle whose model is attached at its first forward; then it answers as that one.

    ``attach_now(module)`` makes the live handle (or an :class:`InertHandle`);
    ``close_process()`` stops the rank's publishing, as a live handle's ``close``
    does. Until the first forward: no step taken.
    """

    def __init__(
        self,
        module: Any,
        attach_now: Callable[[Any], Any],
        close_process: Callable[[], None],
    ) -> None:
        self._real: Any = None
        self._closed = False
        self._attach_now = attach_now
        self._close_process = close_process
        hook = _ModuleHook(self._first_forward, self._failed)
        self._hook = module.register_forward_pre_hook(hook, with_kwargs=True)

    @property
    def live(self) -> Any:
        """The handle made at the first forward, or None before it."""
        return self._real

    def _first_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        self._hook.remove()
        if self._closed:
            return
        real = self._real = self._attach_now(module)
        time_call = getattr(real, "time_this_call", None)
        if time_call is not None:
            time_call(args, kwargs)

    def _failed(self, exc: BaseException) -> None:
        log.warning("ddpscope could not attach and is off on this rank: %r", exc)
        self._real = InertHandle(f"attach failed: {exc!r}")

    def __getattr__(self, name: str) -> Any:
        # Only for names not set on this object: the live handle's, else a quiet default.
        real = self.__dict__.get("_real")
        if real is not None:
            return getattr(real, name)
        return getattr(InertHandle, name)

    @property
    def enabled(self) -> bool:
        return not self._closed if self._real is None else bool(self._real.enabled)

    def __repr__(self) -> str:
        if self._real is not None:
            return repr(self._real)
        return "<ddpscope.Handle: attaches at the model's first forward (replicate())>"

    def request_fingerprint(self) -> None:
        # Before the first forward the handle's initial fingerprint will serve it.
        if self._real is not None:
            self._real.request_fingerprint()

    def close(self) -> None:
        if self._real is not None:
            self._real.close()
        else:
            self._closed = True
            self._hook.remove()
            self._close_process()


__all__ = ["InertHandle", "PendingHandle"]
