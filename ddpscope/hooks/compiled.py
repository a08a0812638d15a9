"""Keeping ddpscope's probes working, and out of the graph, under ``torch.compile``.

Two shapes occur in real scripts:

- ``DDP(torch.compile(model))``: DDP's own hooks (ours among them) run
  outside the compiled module, as in eager mode. Nothing to do.
- ``torch.compile(ddp_model)``: the DDP module's ``__call__``, hooks
  included, is traced by dynamo. A traced hook that reads the clock breaks
  the graph, so :class:`ddpscope.hooks.attach._ModuleHook` returns at once
  while dynamo traces (``torch.compiler.is_compiling()`` is a constant to it:
  the hook leaves nothing in the graph). The forward is then timed from the
  ``OptimizedModule`` that ``torch.compile`` returns: its own hooks run in
  the interpreter, around the compiled call. ``torch.compile`` is wrapped to
  see that module being made; if a script compiles some other way
  (``ddp_model.compile()``, which compiles ``_call_impl`` in place), the
  run info says that the forward and data phases are unavailable, and why.

Bucket timing needs nothing: DDP's reducer calls the comm hook from C++ once a
bucket's gradients are ready, compiled or not (DDPOptimizer only splits the
graph at bucket boundaries so that those come early).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("ddpscope")

#: Told to each attached model when torch.compile wraps it: (handle, compiled module).
_lock = threading.Lock()
_original: Callable[..., Any] | None = None
_ours: Callable[..., Any] | None = None
_on_compiled: Callable[[Any, Any], None] | None = None

#: Why a signal is missing when the DDP module itself is compiled in place.
IN_PLACE = (
    "the DDP module's forward is compiled in place (module.compile()); ddpscope's forward "
    "hooks are traced as no-ops to keep the graph whole, so forward and data time fall "
    "into 'other'. Compile with model = torch.compile(ddp_model) to keep them."
)


def run_eagerly(*fns: Any) -> bool:
    """Have torch.compile run these functions and all they call as plain Python.

    ``torch.compile(ddp_model)`` runs the DDP module's hooks, and the
    collective wrappers DDP's forward calls, through dynamo: traced, one that
    reads the clock breaks the graph and changes the program the user
    compiled. Where dynamo meets such a function as a frame of its own, SKIP
    (frame and callees) leaves it to the interpreter, so it times as in eager
    mode. Where dynamo inlines it into a frame it traces, SKIP does not apply:
    each of them starts with a ``torch.compiler.is_compiling()`` guard, a
    constant to dynamo, and leaves nothing in the graph. The C-level switch is what
    ``torch._dynamo.eval_frame.skip_code`` uses; reached directly it costs no
    import of torch._dynamo (about 0.7 s) in jobs that never compile.
    """
    try:
        from torch._C._dynamo import eval_frame as ef

        strategy = ef._FrameExecStrategy(ef._FrameAction.SKIP, ef._FrameAction.SKIP)
        for fn in fns:
            ef.set_code_exec_strategy(fn.__code__, strategy)
        return True
    except Exception as exc:  # a torch without the switch: is_compiling() guards remain
        log.debug("ddpscope: cannot keep hooks out of torch.compile: %r", exc)
        return False


def install(on_compiled: Callable[[Any, Any], None]) -> None:
    """Call ``on_compiled(original, compiled)`` whenever ``torch.compile`` wraps a module."""
    global _original, _ours, _on_compiled
    with _lock:
        _on_compiled = on_compiled
        if _ours is not None and torch.compile is _ours:
            return
        orig = torch.compile

        @functools.wraps(orig)
        def compile(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            told = _on_compiled
            if told is not None and args and isinstance(args[0], torch.nn.Module):
                try:
                    told(args[0], out)
                except Exception as exc:  # never fail the user's compile
                    log.warning("ddpscope: could not follow torch.compile: %r", exc)
            return out

        _original, _ours = orig, compile
        torch.compile = compile


def uninstall() -> None:
    global _original, _ours, _on_compiled
    with _lock:
        _on_compiled = None
        if _ours is not None and torch.compile is _ours and _original is not None:
            torch.compile = _original
            _original = _ours = None


def compiled_in_place(model: Any) -> bool:
    """Whether ``model.compile()`` replaced this module's call with a compiled one."""
    return getattr(model, "_compiled_call_impl", None) is not None


__all__ = ["IN_PLACE", "compiled_in_place", "install", "run_eagerly", "uninstall"]
