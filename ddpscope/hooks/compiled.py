"""Keeping ddpscope's probes working, and out of the graph, under ``torch.compile``.

Three shapes occur in real scripts:

- ``DDP(torch.compile(model))``: DDP's own hooks (ours among them) run
  outside the compiled module, as in eager mode. Nothing to do.
- ``torch.compile(ddp_model)``: the DDP module's ``__call__``, hooks
  included, is traced by dynamo. A traced hook that reads the clock breaks
  the graph, and any forward hook sends nn.Module down its slower hooked call
  path, which dynamo breaks once more. So ``torch.compile`` is wrapped to see
  the ``OptimizedModule`` being made, and the hooks move to it: its own hooks
  run in the interpreter, around the compiled call.
- ``ddp_model.compile()``: nn.Module compiles its own ``_call_impl`` with
  ``torch.compile`` and calls the result in its place. The hooks leave the
  DDP module and the compiled call is handed back wrapped in a function that
  runs them around it, in the interpreter; if the model was compiled before
  ddpscope attached, attach wraps what is there in the same way.

Wherever dynamo still meets one of ddpscope's functions (a hook left in place,
the collective wrappers DDP's forward calls), it runs as plain Python or traces
to nothing: see :func:`run_eagerly`.

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
_on_compiled: Callable[[Any, Any], Any] | None = None
_before: Callable[[Any], None] | None = None


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


def install(
    on_compiled: Callable[[Any, Any], Any], before: Callable[[Any], None] | None = None
) -> None:
    """Call ``on_compiled(original, compiled)`` whenever ``torch.compile`` wraps a module
    or a module's bound method; what it returns, if not None, replaces ``compiled``.

    ``before(module)`` runs first, when a module itself is compiled: what torch
    builds depends on the module as it is then (``OptimizedModule`` picks its
    entry frame by the type of ``module.forward``), so what ddpscope put on the
    module leaves before torch looks.
    """
    global _original, _ours, _on_compiled, _before
    with _lock:
        _on_compiled = on_compiled
        _before = before
        if _ours is not None and torch.compile is _ours:
            return
        orig = torch.compile

        @functools.wraps(orig)
        def compile(*args: Any, **kwargs: Any) -> Any:
            target = args[0] if args else None
            first = _before
            if first is not None and isinstance(target, torch.nn.Module):
                try:
                    first(target)
                except Exception as exc:  # never fail the user's compile
                    log.warning("ddpscope: could not prepare for torch.compile: %r", exc)
            out = orig(*args, **kwargs)
            told = _on_compiled
            if told is not None and isinstance(
                getattr(target, "__self__", target), torch.nn.Module
            ):
                try:
                    replaced = told(target, out)
                except Exception as exc:  # never fail the user's compile
                    log.warning("ddpscope: could not follow torch.compile: %r", exc)
                    replaced = None
                if replaced is not None:
                    return replaced
            return out

        _original, _ours = orig, compile
        torch.compile = compile


def uninstall() -> None:
    global _original, _ours, _on_compiled, _before
    with _lock:
        _on_compiled = None
        _before = None
        if _ours is not None and torch.compile is _ours and _original is not None:
            torch.compile = _original
            _original = _ours = None


def compiled_in_place(model: Any) -> bool:
    """Whether ``model.compile()`` replaced this module's call with a compiled one."""
    return getattr(model, "_compiled_call_impl", None) is not None


__all__ = ["compiled_in_place", "install", "run_eagerly", "uninstall"]
