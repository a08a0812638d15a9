"""Timing every collective the training thread blocks in, besides the gradient all-reduce.

A fast rank does not only wait for a slow one at the gradient all-reduce.
DDP itself broadcasts rank 0's buffers at the start of every forward when the
module has buffers (every BatchNorm) and ``broadcast_buffers=True``; under
``Join`` it agrees on a rank in each forward; scripts all-reduce their loss
for logging and end epochs in barriers. Wherever the fast rank reaches such a
collective first, it waits there, and unless that wait is told apart it is
booked as the rank's own work: the straggler vanishes and a hang looks like a
rank busy in its forward.

Two sources, both on the training thread (the thread that attached):

- DDP's buffer broadcast goes through ``_distributed_broadcast_coalesced``;
  a class-level wrapper times it for the attached models (class ``ddp``, op
  ``broadcast``). The class, not the instance: an instance attribute would
  end up in ``torch.save(ddp_model)``'s pickle.
- ``torch.distributed`` collectives, which :mod:`ddpscope.hooks.recipe`
  already patches process-wide to count call sites, call :func:`timed` here.
  A call from DDP's or Join's own code is class ``ddp``; any other is
  ``user``, with the first call site outside torch and ddpscope. Only the
  outermost call is timed (``all_gather_object`` runs ``all_gather`` inside).
  An ``async_op=True`` call is timed at its ``Work.wait()``.

Why not the Flight Recorder: on gloo (torch 2.13) its entries carry the
enqueue time only, never a start, completion or duration, and every recorded
collective costs a C++ trace entry whether anyone reads it or not. Timing at
the Python boundary gives the time the training thread was blocked, which is
what the straggler and hang rules need.

Costs: an untimed call (another thread, a nested call, compiling) costs a few
attribute reads; a timed one two clock stamps, a site lookup cached per call
line and one tuple appended to the step. Every failure here turns timing off
with one warning; the collective itself always runs, exactly once.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddpscope.hooks import compiled, pid, recipe
from ddpscope.hooks.recipe import AVERAGING, group_arg, site_of, user_frame

log = logging.getLogger("ddpscope")


def _ddp_files() -> frozenset[str]:
    """Files whose collectives are DDP's own (Join's agreement, buffer-sync rank choice)."""
    files = {os.path.abspath(torch.nn.parallel.distributed.__file__)}
    try:
        from torch.distributed.algorithms import join

        files.add(os.path.abspath(join.__file__))
    except Exception:  # an install without Join: DDP's file alone
        pass
    return frozenset(files)


_DDP_FILES = _ddp_files()
#: Call sites cached per (file, line); beyond this, sites are formatted each time.
_MAX_SITES = 512
#: Async works remembered until waited on; the oldest is forgotten beyond this.
_MAX_PENDING = 256


class Sink(Protocol):
    """The step tracker's side: where a timed collective is booked."""

    def collective_begin(self, op: str, cls: str, site: str) -> tuple[int, str] | None: ...

    def collective_end(
        self, begun: tuple[int, str], op: str, cls: str, group: str, nbytes: int, site: str
    ) -> None: ...

    def phase_begin(self, phase: str) -> str | None: ...

    def phase_end(self, prev: str) -> None: ...


def tensor_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of the tensors a collective was handed (first level and lists); -1 if none."""
    total = 0
    seen = False
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
            seen = True
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    total += item.numel() * item.element_size()
                    seen = True
    return total if seen else -1


class CollectiveTimer:
    """Process-wide: routes the training thread's collectives to a step tracker."""

    def __init__(self, sink: Sink, group_key: Callable[[Any], str]) -> None:
        self.sink = sink
        self.group_key = group_key
        self.ident = threading.get_ident()
        self.pid = os.getpid()
        self.enabled = True
        self.depth = 0
        self._sites: dict[tuple[str, int], str] = {}
        self._pending: dict[int, tuple[Any, str, str, int, str]] = {}
        # Keyed weakly: a model the script drops must not be kept alive by us.
        self._models: weakref.WeakKeyDictionary[Any, tuple[Sink, str]] = weakref.WeakKeyDictionary()

    def disable(self, exc: BaseException) -> None:
        if self.enabled:
            self.enabled = False
            log.warning("ddpscope collective timing disabled after an internal error: %r", exc)

    def _site(self, frame: FrameType | None) -> str:
        if frame is not None and AVERAGING in frame.f_code.co_filename:
            # torch's model averaging, named at its own site as the recipe counts it:
            # its all-reduce of the parameters is not the script's.
            return site_of(frame)
        frame = user_frame(frame)
        if frame is None:
            return ""
        key = (frame.f_code.co_filename, frame.f_lineno)
        site = self._sites.get(key)
        if site is None:
            site = site_of(frame)
            if len(self._sites) < _MAX_SITES:
                self._sites[key] = site
        return site

    def _active(self) -> bool:
        # is_compiling first: under dynamo everything after it would be traced.
        return (
            not torch.compiler.is_compiling()
            and self.enabled
            and not self.depth
            and threading.get_ident() == self.ident
            and pid.current == self.pid  # a forked DataLoader worker: not ours
        )

    # --- torch.distributed functions -------------------------------------------

    def call(
        self,
        op: str,
        orig: Callable[..., Any],
        caller: FrameType,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        group_at: int | None,
    ) -> Any:
        if not self._active():
            return orig(*args, **kwargs)
        try:
            cls = "ddp" if caller.f_code.co_filename in _DDP_FILES else "user"
            group_text = self.group_key(group_arg(args, kwargs, group_at))
            nbytes = tensor_bytes(args, kwargs)
            site = "" if cls == "ddp" else self._site(caller)
            if kwargs.get("async_op"):
                work = orig(*args, **kwargs)
                if work is not None and cls == "user":
                    self._remember(work, op, group_text, nbytes, site)
                return work
        except Exception as exc:
            self.disable(exc)
            return orig(*args, **kwargs)
        return self._blocking(self.sink, orig, args, kwargs, op, cls, group_text, nbytes, site)

    def _blocking(
        self,
        sink: Sink,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        op: str,
        cls: str,
        group: str,
        nbytes: int,
        site: str,
    ) -> Any:
        return self._bracket(
            fn,
            args,
            kwargs,
            sink.collective_begin,
            (op, cls, site),
            sink.collective_end,
            (op, cls, group, nbytes, site),
        )

    def _bracket(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        begin: Callable[..., Any],
        begin_args: tuple[Any, ...],
        end: Callable[..., None],
        end_args: tuple[Any, ...],
    ) -> Any:
        """``fn`` between ``begin`` and ``end(begun, ...)``, nested calls untracked.

        ``begin`` returning None (the tracker is off) runs ``fn`` alone; an error
        of ours disables the timer and never reaches the script.
        """
        try:
            begun = begin(*begin_args)
        except Exception as exc:
            self.disable(exc)
            begun = None
        if begun is None:
            return fn(*args, **kwargs)
        self.depth = 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.depth = 0
            try:
                end(begun, *end_args)
            except Exception as exc:
                self.disable(exc)

    def _remember(self, work: Any, op: str, group: str, nbytes: int, site: str) -> None:
        pending = self._pending
        if len(pending) >= _MAX_PENDING:
            # A script that never waits on its works: forget the oldest.
            del pending[next(iter(pending))]
        pending[id(work)] = (work, op, group, nbytes, site)

    def wait(self, orig: Callable[..., Any], work: Any, args: tuple[Any, ...], kw: Any) -> Any:
        entry = self._pending.pop(id(work), None) if self._pending else None
        if entry is None or entry[0] is not work or not self._active():
            return orig(work, *args, **kw)
        _, op, group, nbytes, site = entry
        return self._blocking(self.sink, orig, (work, *args), kw, op, "user", group, nbytes, site)

    # --- torch.save ------------------------------------------------------------

    def save(self, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> Any:
        """A checkpoint written on the training thread: its heartbeats say "save".

        Ranks waiting in a barrier for a rank that writes a checkpoint are not
        hung (analysis/detectors/hang.py); without this phase the writer read
        as "data", stuck between steps.
        """
        if not self._active():
            return orig(*args, **kwargs)
        sink = self.sink
        return self._bracket(orig, args, kwargs, sink.phase_begin, ("save",), sink.phase_end, ())

    # --- DDP's buffer broadcast ------------------------------------------------

    def wrap_buffer_sync(self, model: Any, sink: Sink) -> None:
        """Time the buffer broadcast DDP runs at the start of this model's forwards."""
        self._models[model] = (sink, self.group_key(getattr(model, "process_group", None)))

    def forget(self, model: Any) -> None:
        """Stop timing ``model``'s buffer broadcast (its sink holds it: the key never dies)."""
        self._models.pop(model, None)

    def buffer_sync(self, orig: Callable[..., Any], model: Any, args: Any, kwargs: Any) -> Any:
        known = self._models.get(model) if self._active() else None
        if known is None:
            return orig(model, *args, **kwargs)
        sink, group = known
        nbytes = tensor_bytes(tuple(args[:1]), {})
        return self._blocking(
            sink, orig, (model, *args), kwargs, "broadcast", "ddp", group, nbytes, ""
        )


# --- process-wide hook points --------------------------------------------------

_timer: CollectiveTimer | None = None
#: (owner, attribute, original, ours) for each class-level patch in place.
_patches: list[tuple[Any, str, Any, Any]] = []


def active() -> CollectiveTimer | None:
    return _timer


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    # Dynamo enters these wrappers as frames of their own when DDP's forward is
    # compiled; run them as Python so that they break no graph (hooks/compiled.py).
    compiled.run_eagerly(fn)
    return fn


def _work_wait(orig: Callable[..., Any]) -> Callable[..., Any]:
    @_eager
    @functools.wraps(orig)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        timer = _timer
        if timer is None or torch.compiler.is_compiling():
            return orig(self, *args, **kwargs)
        return timer.wait(orig, self, args, kwargs)

    return wait


def _buffer_sync(orig: Callable[..., Any]) -> Callable[..., Any]:
    @_eager
    @functools.wraps(orig)
    def _distributed_broadcast_coalesced(self: Any, *args: Any, **kwargs: Any) -> Any:
        timer = _timer
        if timer is None or torch.compiler.is_compiling():
            # torch.compile(ddp_model) traces DDP's forward: leave its broadcast as it was.
            return orig(self, *args, **kwargs)
        return timer.buffer_sync(orig, self, args, kwargs)

    return _distributed_broadcast_coalesced


def install(timer: CollectiveTimer) -> None:
    global _timer
    _timer = timer
    recipe.set_timing(timer)
    if _patches:
        return
    targets = [
        (getattr(dist, "Work", None), "wait", _work_wait),
        (DistributedDataParallel, "_distributed_broadcast_coalesced", _buffer_sync),
    ]
    for owner, name, make in targets:
        orig = owner.__dict__.get(name) if owner is not None else None
        if callable(orig):
            ours = make(orig)
            setattr(owner, name, ours)
            _patches.append((owner, name, orig, ours))


def uninstall(timer: CollectiveTimer) -> None:
    global _timer
    if _timer is not timer:
        return
    _timer = None
    recipe.set_timing(None)
    for owner, name, orig, ours in reversed(_patches):
        if owner.__dict__.get(name) is ours:  # someone patched on top: leave theirs
            setattr(owner, name, orig)
    _patches.clear()


__all__ = ["CollectiveTimer", "Sink", "active", "install", "tensor_bytes", "uninstall"]
