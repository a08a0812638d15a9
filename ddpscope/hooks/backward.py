"""Where each backward starts and ends, for every attached model, at the least cost.

A step tracker needs three marks per backward: its start, the end of autograd's
work (before DDP waits for its buckets), and the end of that wait. Measured on
the 2-core development VM (training-thread CPU per step, world size 1, 2026-12-02):

- a Python hook on the forward output's gradient (``Tensor.register_hook`` or
  its node's pre-hook) costs ~15 us per step: autograd wraps the fresh
  gradient tensor in a Python object to call it;
- a post-accumulate-grad hook on one parameter costs ~3.6 us with the final
  callback it queues: the parameter already is a Python object;
- a wrapper around ``torch.autograd.backward`` (what ``Tensor.backward`` calls)
  costs one Python frame.

So the start and the end come from the wrapper here, and the end of autograd's
work from a final callback queued by a post-accumulate-grad hook on one of the
model's parameters (its *marker*, :class:`ddpscope.hooks.steps.StepTracker`).
That callback runs before DDP's own finalisation, which DDP queues only once the
last gradient is ready; the wrapper's return comes after it. A backward the
wrapper does not see (``torch.autograd.grad``, a C++ caller) is still cut: the
marker then stamps the start itself and a second callback stamps the end.

The wrapper only stamps the trackers that had a training forward since their
last backward (*armed*) and tells them when the call returns; which of them the
call really reached, the marker says. A backward inside a backward (reentrant
activation checkpointing) is the outer one's. Only the thread that attached is
watched; other threads' backwards pass straight through.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("ddpscope")

#: Trackers told about backward calls (one per attached model).
_trackers: list[Any] = []
_original: Callable[..., Any] | None = None
_ours: Callable[..., Any] | None = None
_owner = 0
#: Nesting of backward calls on the owner thread; 0 outside any.
depth = 0


def _backward(*args: Any, **kwargs: Any) -> Any:
    global depth
    run = _original
    assert run is not None
    if threading.get_ident() != _owner:
        return run(*args, **kwargs)
    if depth:  # a backward inside a backward (reentrant checkpointing): the outer one's
        depth += 1
        try:
            return run(*args, **kwargs)
        finally:
            depth -= 1
    depth = 1
    for tr in _trackers:
        if tr.armed:  # the tracker's backward_called(), spelled out: every step
            try:
                tr.call_token = tr.stamp()
                tr.in_call = True
            except Exception as exc:
                tr.on_error(exc)
    try:
        return run(*args, **kwargs)
    finally:
        depth = 0
        for tr in _trackers:
            if tr.in_call:
                try:
                    tr.backward_returned()
                except Exception as exc:
                    tr.on_error(exc)


def install(tracker: Any) -> None:
    """Tell ``tracker`` about backward calls from the current thread (patches once)."""
    global _original, _ours, _owner
    if _ours is None or torch.autograd.backward is not _ours:
        _original = torch.autograd.backward
        _ours = functools.wraps(_original)(_backward)
        torch.autograd.backward = _ours
        # The tracker's side of it runs in the interpreter, never traced by torch.compile.
        from ddpscope.hooks import compiled

        compiled.run_eagerly(_backward)
    _owner = threading.get_ident()
    if tracker not in _trackers:
        _trackers.append(tracker)


def remove(tracker: Any) -> None:
    """Stop telling ``tracker``; the last one out restores torch's own function."""
    global _original, _ours
    if tracker in _trackers:
        _trackers.remove(tracker)
    if not _trackers and _ours is not None and torch.autograd.backward is _ours:
        torch.autograd.backward = _original  # type: ignore[assignment]
        _original = _ours = None


__all__ = ["depth", "install", "remove"]
