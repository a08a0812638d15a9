"""Timing each gradient bucket's all-reduce by wrapping DDP's comm hook.

DDP has one comm-hook slot, and compression hooks (fp16, bf16, PowerSGD) live
in it too, so ddpscope never takes the slot from the user: it registers a thin
wrapper whose inner hook is the user's (or DDP's default all-reduce), and
reroutes later ``register_comm_hook`` calls on the instance into that wrapper.

The wrapper stamps the clock when the bucket is handed over and again in the
Future's ``then`` callback: on gloo that callback runs when the reduction is
done; on NCCL it runs once the work is enqueued on the stream, which is why
the stamp there is a CUDA event read later, never a host time.

The wrapper is registered only where its floor fits the step
(hooks/bucket_cost.py); until then, and on models where it does not fit,
DDP's C++ path runs untouched and ``register_comm_hook`` calls from the
script go to DDP as they would without ddpscope.

Per-bucket detail is sampled (see ``StepTracker.bucket_every``): between
detailed steps the wrapper takes an untimed path that does no more than
DDP's default hook does, minus its Python layers. A Python comm hook cannot
be swapped for DDP's C++ one after the first backward, and its result must
be a Python object (the reducer asserts it), so a hook entry and one
``then`` callback per bucket are the floor of this path.
"""

# No ``from __future__ import annotations`` here: DDP inspects the hook's
# annotations and rejects string ones.

import ctypes
import functools
import logging
import threading
import time
import weakref
from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger("ddpscope")

STATE_ATTR = "_ddpscope_comm"
_original_register = DistributedDataParallel.register_comm_hook
_original_builtin = DistributedDataParallel._register_builtin_comm_hook
_original_match = DistributedDataParallel._match_all_reduce_for_bwd_pass
_original_notify = Join.notify_join_context

#: The step tracker of each attached model (weak: a model is never kept alive,
#: and nothing ddpscope holds lands in a pickled model).
_trackers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
#: Models whose slot a built-in (C++) hook took before ddpscope wrapped it.
_builtin_taken: weakref.WeakSet[Any] = weakref.WeakSet()


def _none() -> None:
    return None


class HookState:
    """What the registered wrapper calls into; one per DDP model."""

    __slots__ = (
        "direct",
        "inner",
        "inner_state",
        "join_work",
        "static",
        "tracker",
        "user_registered",
    )

    def __init__(self, inner: Any, inner_state: Any) -> None:
        self.inner = inner
        self.inner_state = inner_state
        self.tracker: Any = None
        self.user_registered = False
        # (process group, its size, 1 / size, gradients are bucket views) while
        # the inner hook is DDP's default all-reduce: the wrapper then issues it
        # itself, skipping the Python layers of dist.all_reduce and a second
        # chained Future, and scales the bucket as DDP's C++ path would have.
        size = inner_state.size()
        self.direct: tuple[Any, int, float, bool] | None = (inner_state, size, 1.0 / size, False)
        #: ``direct`` over the whole group; ``direct`` itself counts only the
        #: ranks still training inside Join(divide_by_initial_world_size=False).
        self.static = self.direct
        #: That Join's all-reduce counting them, until the backward reads it.
        self.join_work: Any = None

    def views_kept(self) -> None:
        """Gradients are views of the buckets (``gradient_as_bucket_view``)."""
        if self.direct is not None:
            self.direct = self.static = (*self.direct[:3], True)

    def joined(self, work: Any, divide_by_world: bool) -> None:
        """A training forward told Join it has not joined (once per forward).

        With ``divide_by_initial_world_size=False`` DDP's C++ path averages
        over the ranks that have not joined: the sum of ``work`` (one per such
        rank), which the reducer waits for at the first gradient of the
        backward. The hook, standing in for that path, reads the same count.
        """
        if self.direct is None:
            return
        if work is None or divide_by_world:
            self.join_work = None
            self.direct = self.static
        else:
            self.join_work = work

    def count_active(self) -> tuple[Any, int, float, bool]:
        """Scale by the ranks still training (the first bucket after ``joined``)."""
        work, self.join_work = self.join_work, None
        work.wait()  # DDP's reducer has waited for it already, at the first gradient
        active = int(work.get_future().value()[0].item())
        group, _, _, as_view = self.static
        self.direct = (group, active, 1.0 / active, as_view)
        return self.direct

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # Pickling the DDP model (torch.save(ddp_model)): the copy gets a fresh
        # reducer without this wrapper, so it must not believe it is wrapped.
        return (_none, ())


# A callback runs on the process group's thread once the all-reduce is done. That
# thread has no Python thread state: torch makes one for each call and deletes it
# after (measured: ~1 per bucket, 84-90 in 20 steps of a 2-rank job; none on DDP's
# C++ path). CPython < 3.12 (gh-112275) takes the runtime's head lock to make one
# without holding the GIL, and a fork at that instant (a DataLoader starting its
# workers) leaves the child waiting for that lock forever: a worker that never
# answers and a rank stuck in `iter(loader)`, seen on a 3-rank job with DCP saves
# (gdb: _PyThreadState_DeleteExcept in PyOS_AfterFork_Child). One extra
# PyGILState_Ensure, never released, keeps the thread's state for its life: no
# thread state is made or deleted per bucket after the first call on each thread.
_gil_ensure = ctypes.pythonapi.PyGILState_Ensure
_gil_ensure.restype = ctypes.c_int
_gil_ensure.argtypes = []
_kept: set[int] = set()
_ident = threading.get_ident
_MAIN = threading.main_thread().ident


def _keep_thread_state(tid):
    _kept.add(tid)
    if tid != _MAIN:  # the main thread's state lives as long as the process
        _gil_ensure()


def _bucket_done(ends, pos, stamp, fut):
    ends[pos] = stamp()
    tid = _ident()
    if tid not in _kept:
        _keep_thread_state(tid)
    return fut.value()


def _direct_done(ends, pos, stamp, fut):
    ends[pos] = stamp()
    tid = _ident()
    if tid not in _kept:
        _keep_thread_state(tid)
    return fut.value()[0]


def _first(fut):
    tid = _ident()
    if tid not in _kept:
        _keep_thread_state(tid)
    return fut.value()[0]


def _scale(tensor, size, inverse, viewed):
    """Average the bucket the way DDP's C++ path does, to the last bit.

    Without a comm hook the reducer multiplies each gradient by ``1 / size``
    while copying it into the bucket, or divides the bucket view in place
    when the gradient already was that view before the backward
    (``gradient_as_bucket_view`` with gradients kept between steps: the
    tracker reads that at the forward, ``StepTracker.grads_viewed``; by the
    time a hook runs every gradient is a view). A Python hook gets the
    bucket unscaled; dividing it when DDP would have multiplied differs in
    the last bit for world sizes that are not powers of two, and ddpscope
    must not change what a run computes.
    """
    if viewed:
        tensor.div_(size)
    else:
        tensor.mul_(inverse)


def timed_hook(state, bucket):
    tracker = state.tracker
    if tracker is None:
        return state.inner(state.inner_state, bucket)
    direct = state.direct
    if state.join_work is not None:
        direct = state.count_active()
    if tracker.cheap:
        # A step between samples: what the heartbeat needs (the bucket a hang
        # is stuck at), then the all-reduce alone.
        tracker.state.bucket = bucket.index()
        if direct is not None:
            tensor = bucket.buffer()
            if not tensor.is_complex():
                group, size, inverse, as_view = direct
                if size != 1:  # x / 1 is x: a pass over the bucket saved
                    _scale(tensor, size, inverse, as_view and tracker.grads_viewed)
                return group.allreduce([tensor]).get_future().then(_first)
        return state.inner(state.inner_state, bucket)
    began = time.perf_counter_ns()
    slot = tracker.bucket_start(bucket)
    if slot is None:
        return state.inner(state.inner_state, bucket)
    ends, pos = slot
    if direct is not None:
        tensor = bucket.buffer()
        if not tensor.is_complex():  # dist.all_reduce views complex as real; leave it that
            group, size, inverse, as_view = direct
            # The same arithmetic as DDP's built-in path: scale, then sum.
            if size != 1:
                _scale(tensor, size, inverse, as_view and tracker.grads_viewed)
            # What the timing adds, not the launch every path pays (on gloo the
            # launch can take tens of us: it hands the work to another thread).
            launch = time.perf_counter_ns()
            fut = group.allreduce([tensor]).get_future()
            back = time.perf_counter_ns()
            fut = fut.then(functools.partial(_direct_done, ends, pos, tracker.clock.stamp))
            tracker.detail_ns += time.perf_counter_ns() - back + launch - began
            return fut
    launch = time.perf_counter_ns()
    fut = state.inner(state.inner_state, bucket)
    back = time.perf_counter_ns()
    fut = fut.then(functools.partial(_bucket_done, ends, pos, tracker.clock.stamp))
    tracker.detail_ns += time.perf_counter_ns() - back + launch - began
    return fut


_BUILTIN = {
    "ALLREDUCE": default_hooks.allreduce_hook,
    "FP16_COMPRESS": default_hooks.fp16_compress_hook,
}


def _route(model: Any, hs: HookState, state: object, hook: Any) -> None:
    """A user's registration on a wrapped model: their hook goes inside the wrapper."""
    if hs.user_registered:
        raise RuntimeError(
            "register_comm_hook or register_builtin_comm_hook can only be called once."
        )
    model._check_comm_hook(hook)
    hs.inner, hs.inner_state, hs.user_registered = hook, state, True
    hs.direct = None
    model._comm_hooks.append((hook, state))
    if getattr(model, "logger", None) is not None:
        model.logger._set_comm_hook_name(getattr(hook, "__qualname__", str(hook)))


def _register(model: Any) -> HookState:
    install_class_shim()  # later registrations on this model are routed by the class
    hs = HookState(default_hooks.allreduce_hook, model.process_group)
    if getattr(model, "gradient_as_bucket_view", False):
        hs.views_kept()
    _original_register(model, hs, timed_hook)
    model._comm_hooks.pop()  # keep DDP's list to what the user registered
    setattr(model, STATE_ATTR, hs)
    tracker = _trackers.get(model)
    if tracker is not None:
        hs.tracker = tracker
        tracker.hooked_now()
    return hs


def link(model: Any, tracker: Any) -> None:
    """Tell the class-level shims which tracker a model's hooks report to."""
    _trackers[model] = tracker
    install_class_shim()


def unlink(model: Any) -> None:
    """Forget ``model``'s tracker: the tracker holds the model, so the weak key never dies."""
    _trackers.pop(model, None)


def wrap(model: Any) -> HookState | None:
    """Install the timing wrapper; None when the slot was taken before we came."""
    hs = getattr(model, STATE_ATTR, None)
    if hs is not None:
        return hs
    if model in _builtin_taken:
        log.info("ddpscope: a built-in comm hook holds DDP's slot; buckets are not timed")
        return None
    if getattr(model, "_comm_hooks", None):
        hook = model._comm_hooks[-1][0]
        log.warning(
            "ddpscope: comm hook %s was registered before ddpscope could wrap it; it keeps "
            "working, but per-bucket all-reduce timing is off for this model. Import ddpscope "
            "before registering the hook, call ddpscope.attach(model) first, or use "
            "`ddpscope run`.",
            getattr(hook, "__qualname__", hook),
        )
        return None
    return _register(model)


def _class_register(self: Any, state: object, hook: Any) -> None:
    # Class-level (not per-instance closures, which would make the model
    # unpicklable). A Python hook of the user's already pays the floor the
    # wrapper would add, so it goes inside the wrapper at once: its buckets
    # are timed for little more.
    hs = getattr(self, STATE_ATTR, None)
    if hs is None and not getattr(self, "_comm_hooks", None) and self not in _builtin_taken:
        hs = _register(self)
    if hs is None:
        _original_register(self, state, hook)
        return
    _route(self, hs, state, hook)


def _class_register_builtin(self: Any, comm_hook_type: Any) -> None:
    hs = getattr(self, STATE_ATTR, None)
    if hs is None:
        # Not wrapped yet: a C++ hook is what the user chose for speed; keep it.
        _original_builtin(self, comm_hook_type)
        _builtin_taken.add(self)
        return
    name = getattr(comm_hook_type, "name", str(comm_hook_type)).rsplit(".", 1)[-1]
    hook = _BUILTIN.get(name)
    if hook is None:
        raise RuntimeError(f"ddpscope cannot wrap builtin comm hook {comm_hook_type}")
    _route(self, hs, self.process_group, hook)


def _class_match(self: Any) -> Any:
    # A joined rank (torch.distributed.algorithms.Join) shadows each backward
    # of the others with one all-reduce per bucket, issued from here.
    tracker = _trackers.get(self)
    if tracker is not None:
        tracker.join_pass()
    hs = self.__dict__.get(STATE_ATTR)
    if hs is not None:
        hs.joined(None, True)  # its buckets are zeros: no count to wait for
    return _original_match(self)


def _class_notify(joinable: Any) -> Any:
    # Join's per-forward all-reduce counting the ranks not yet joined, which
    # DDP's reducer divides by under divide_by_initial_world_size=False.
    work = _original_notify(joinable)
    hs = getattr(joinable, "__dict__", {}).get(STATE_ATTR)
    if hs is not None:
        hs.joined(work, getattr(joinable, "_divide_by_initial_world_size", True))
    return work


def install_class_shim() -> None:
    """Route comm-hook registrations through ddpscope's wrapper (idempotent)."""
    if DistributedDataParallel.register_comm_hook is not _class_register:
        DistributedDataParallel.register_comm_hook = _class_register  # type: ignore[method-assign]
        DistributedDataParallel._register_builtin_comm_hook = _class_register_builtin  # type: ignore[method-assign]
        DistributedDataParallel._match_all_reduce_for_bwd_pass = _class_match  # type: ignore[method-assign]


def count_active_ranks() -> None:
    """Let wrapped hooks read Join's count of the ranks still training (idempotent).

    Installed only once a model trains inside ``Join(...,
    divide_by_initial_world_size=False)``, the one case that needs it: every
    DDP forward calls ``Join.notify_join_context``, and a compiled model's
    would trace this shim as frames of its own.
    """
    if Join.notify_join_context is not _class_notify:
        Join.notify_join_context = staticmethod(_class_notify)  # type: ignore[method-assign]


def uninstall_class_shim() -> None:
    DistributedDataParallel.register_comm_hook = _original_register  # type: ignore[method-assign]
    DistributedDataParallel._register_builtin_comm_hook = _original_builtin  # type: ignore[method-assign]
    DistributedDataParallel._match_all_reduce_for_bwd_pass = _original_match  # type: ignore[method-assign]
    Join.notify_join_context = staticmethod(_original_notify)  # type: ignore[method-assign]


__all__ = [
    "HookState",
    "count_active_ranks",
    "install_class_shim",
    "link",
    "timed_hook",
    "uninstall_class_shim",
    "wrap",
]
