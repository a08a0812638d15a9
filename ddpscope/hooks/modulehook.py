"""The module hooks ddpscope puts on a compiled wrapper: errors disable ddpscope, never training.

An eager DDP model is timed from its ``forward`` attribute instead
(hooks/forward.py); models saved by earlier versions carry these hooks.

A pickled model (``torch.save(ddp_model)``) names what its hooks reduce to,
``_inert``; models pickled before this module existed name it in
``ddpscope.hooks.attach``, which re-exports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_is_compiling = torch.compiler.is_compiling


def _noop_hook(*args: Any, **kwargs: Any) -> None:
    return None


def _inert() -> Callable[..., None]:
    return _noop_hook


class _ModuleHook:
    """A hook ddpscope put on the user's model. Errors disable ddpscope, never training.

    ``torch.save(ddp_model)`` pickles the module with its hook dicts: the hook
    pickles as a no-op, so saving works and the copy carries no live probe.
    """

    __slots__ = ("fn", "on_error")

    def __init__(self, fn: Callable[..., Any], on_error: Callable[[BaseException], None]):
        self.fn = fn
        self.on_error = on_error

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            # Traced by dynamo (torch.compile(ddp_model)): leave no trace in
            # the graph. The compiled module's own hooks do the timing.
            return None
        try:
            return self.fn(*args, **kwargs)
        except Exception as exc:
            self.on_error(exc)
            return None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_inert, ())
