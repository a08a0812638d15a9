"""``ddpscope.attach(model)``: wire every probe to one DDP model.

One :class:`_Process` per rank process holds what is shared by all attached
models (publisher thread, sampler probe, global optimizer hooks); one
:class:`Handle` per DDP model holds its step tracker and fingerprinter.

Nothing here may raise into the training loop once attach has returned:
every hook runs behind a guard that disables ddpscope on the rank with one
warning if ddpscope itself fails.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ddpscope import _exit, config
from ddpscope.config import ConfigError, Options
from ddpscope.hooks import backward as backward_calls
from ddpscope.hooks import (
    bucket_cost,
    collectives,
    comm,
    compiled,
    crashstacks,
    forward,
    loaderwait,
    recipe,
    runinfo,
)
from ddpscope.hooks.clocks import clock_for
from ddpscope.hooks.fingerprint import Fingerprinter, hparams, hparams_key
from ddpscope.hooks.host import HostProbe
from ddpscope.hooks.modelcheck import check_model, compiled_ddp, fabric_ddp

# _inert stays importable from here: models pickled before the move name it so.
from ddpscope.hooks.modulehook import _inert  # noqa: F401
from ddpscope.hooks.publisher import Publisher
from ddpscope.hooks.samplers import SamplerProbe
from ddpscope.hooks.signalwake import SignalWake, die_by
from ddpscope.hooks.steps import StepTracker
from ddpscope.schema import SCHEMA_VERSION, BucketLayout, Fingerprint, HParams, RunInfo

log = logging.getLogger("ddpscope")
#: Signals that end a rank with an end message (reason "signal") on the way out.
_END_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))

_LOCK = threading.Lock()
#: Steps between hyperparameter checks once the first values are sent. Every
#: rank checks at the same steps, which is all the comparison needs; a
#: scheduler that moves the learning rate each step would otherwise cost a
#: key, a message and a record entry per step.
HPARAMS_EVERY = 8
# Handle._notify_after skips the steps in between: nothing else may fall there.
assert recipe.SNAPSHOT_EVERY % HPARAMS_EVERY == 0
assert HPARAMS_EVERY & (HPARAMS_EVERY - 1) == 0 and HPARAMS_EVERY >= bucket_cost.DECIDE_AT_STEP
_HANDLES: weakref.WeakKeyDictionary[Any, Handle] = weakref.WeakKeyDictionary()
_PROCESS: _Process | None = None


def _device_memory_for(device: str) -> Callable[[], tuple[int, int]]:
    if not device.startswith("cuda"):
        return lambda: (-1, -1)
    dev = torch.device(device)

    def read() -> tuple[int, int]:
        return (torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev))

    return read


class _Process:
    """Per-process state shared by every attached model."""

    def __init__(self, opts: Options, model: Any) -> None:
        self.opts = opts
        self.run_id = runinfo.resolve_run_id(opts)
        topo = runinfo.topology()
        self.rank = topo["rank"]
        self.started_wall_ns = time.time_ns()
        anchor = runinfo.clock_anchor()
        header = {
            "run_id": self.run_id,
            "rank": self.rank,
            "world_size": topo["world_size"],
            "host": runinfo.socket.gethostname(),
            "pid": runinfo.os.getpid(),
            "schema_version": SCHEMA_VERSION,
            "versions": runinfo.versions(),
            **anchor,
        }
        host = HostProbe(_device_memory_for(runinfo.device_of(model)))
        self.publisher = Publisher(opts, self.run_id, self.rank, header, host)
        self.handles: list[Handle] = []
        self._finished = False
        self._finishing = False
        self._sigterm_pending = 0
        # Who ends the rank: the main thread (finish) or, for a stop signal its
        # handler could not run for, the publisher thread (end_from_publisher).
        self._end_lock = threading.RLock()
        self._wake: SignalWake | None = None
        self.sampler_probe = SamplerProbe(
            post=lambda kind, fields: self.publisher.post(kind, 0, fields),
            current_step=lambda: self.publisher.state.step,
            training=self._training,
        )
        self.sampler_probe.install()
        loaderwait.install(self.publisher.state)
        self.recipe = recipe.RecipeProbe(
            post=lambda kind, fields: self.publisher.post(kind, 0, fields),
            post_model=self.publisher.post,
            current_step=lambda: self.publisher.state.step,
        )
        self.recipe.install()
        #: Made with the first model: user collectives are booked in its steps.
        self.timer: collectives.CollectiveTimer | None = None
        compiled.install(self._on_compiled, before=self._before_compile)
        self.publisher.add_periodic(self._periodic)
        self.publisher.on_request("fingerprint", self._request_fingerprint)
        self._excepthook = sys.excepthook
        sys.excepthook = self._on_uncaught
        self._install_sigterm()
        crashstacks.enable()
        self.publisher.start(close_at_exit=False)
        # After the exit work of libraries registered since ddpscope's import.
        _exit.end_at_exit(self.finish, functools.partial(self.publisher.close, "exit"))

    def _training(self) -> bool:
        return torch.is_grad_enabled() and any(h.model.training for h in self.handles)

    def _periodic(self) -> list[tuple[str, int, dict[str, Any]]]:
        return [item for h in self.handles for item in h.periodic()]

    def _before_compile(self, module: Any) -> None:
        for h in self.handles:
            if h.model is module:
                h.guard(h.leave_for_compile)

    def _on_compiled(self, original: Any, compiled_fn: Any) -> Any:
        in_place = getattr(original, "__func__", None) is torch.nn.Module._call_impl
        owner = getattr(original, "__self__", None) if in_place else None
        for h in self.handles:
            if h.model is original:
                h.guard(h.follow_compiled, compiled_fn)
            elif owner is not None and h.model is owner:
                return h.wrap_compiled_call(compiled_fn)
        return None

    def _request_fingerprint(self) -> None:
        for h in self.handles:
            h.request_fingerprint()

    def _install_sigterm(self) -> None:
        # torchrun SIGTERMs the surviving ranks when one fails, and passes on a
        # SIGTERM or SIGHUP it gets itself (a scheduler, a lost terminal).
        # Without a word from them, a report cannot tell the rank that died
        # first from the ones that were stopped. Only the default action is
        # replaced: a user's own handler (checkpoint on preemption) is left alone.
        installed = []
        for sig in _END_SIGNALS:
            try:
                if signal.getsignal(sig) is signal.SIG_DFL:
                    signal.signal(sig, self._on_sigterm)
                    installed.append(sig)
            except (ValueError, OSError):  # not the main thread, or no signals here
                break
        # A rank blocked in a collective runs no Python handler: the publisher thread
        # hears the signal instead (ddpscope/hooks/signalwake.py).
        wake = SignalWake(installed) if installed else None
        if wake is not None and wake.active:
            self._wake = wake
            self.publisher.watch_signals(wake, self.end_from_publisher)

    def end_from_publisher(self, signum: int) -> None:
        """On the publisher thread: a stop signal the main thread could not handle
        within signalwake.GRACE_S. Record the end, then die by the signal."""
        with self._end_lock:
            if self._finished:
                return  # the main thread is ending the rank (or has)
            self._finished = True
        self.publisher.close("signal", signal.Signals(signum).name)
        die_by(signum)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._finishing:
            # Interrupting our own shutdown (after an exception, at exit) would
            # lose its end message: let it finish, then terminate.
            self._sigterm_pending = signum
            return
        self._sigterm_pending = signum
        self.finish(reason="signal", error=signal.Signals(signum).name)

    def _on_uncaught(self, exc_type: Any, exc: Any, tb: Any) -> None:
        text = crashstacks.bounded_traceback(exc_type, exc, tb)
        try:
            self.finish(reason="exception", error=text)
        finally:
            self._excepthook(exc_type, exc, tb)

    def finish(self, reason: str = "exit", error: str = "") -> None:
        with self._end_lock:
            if self._finished:
                return
            self._finished = True
        self._finishing = True
        if sys.excepthook == self._on_uncaught:
            sys.excepthook = self._excepthook
        try:
            for h in self.handles:
                # A rank leaving on an exception or a signal may be mid-step:
                # its weights are not comparable, so no final fingerprint.
                h.finish(clean=reason in ("exit", "close"))
            try:
                self.sampler_probe.flush()
                self.sampler_probe.uninstall()
            except Exception:
                pass
            compiled.uninstall()
            loaderwait.uninstall()
            if self.timer is not None:
                collectives.uninstall(self.timer)
            self.recipe.finish()
            self.publisher.close(reason, error)
        finally:
            self._finishing = False
            if self._wake is not None:
                self._wake.close()
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        for sig in _END_SIGNALS:
            try:
                if signal.getsignal(sig) == self._on_sigterm:
                    signal.signal(sig, signal.SIG_DFL)
            except (ValueError, OSError):
                return
        if self._sigterm_pending:
            os.kill(os.getpid(), self._sigterm_pending)  # the one deferred while finishing


class Handle:
    """What ``attach`` returns: the live link between one DDP model and ddpscope."""

    def __init__(self, model: Any, proc: _Process, index: int) -> None:
        self.model = model
        self.index = index
        self._proc = proc
        self.publisher = proc.publisher
        self.run_id = proc.run_id
        self.rank = proc.rank
        self.error = ""
        opts = proc.opts
        named = list(model.module.named_parameters())
        self.param_names = [n for n, _ in named]
        self.fingerprinter = Fingerprinter(
            [p for _, p in named],
            [b for _, b in model.module.named_buffers()],
            every=opts.checksum_every,
            budget=opts.checksum_budget,
        )
        device_type = runinfo.device_of(model).split(":")[0]
        self.tracker = StepTracker(
            model,
            index,
            clock_for(device_type),
            proc.publisher,
            {id(p): i for i, (_, p) in enumerate(named)},
            on_step_end=self._on_step_end,
            sampler=proc.sampler_probe,
        )
        if opts.bucket_every:
            self.tracker.fixed_every = opts.bucket_every
        self._info = runinfo.run_info_fields(model, opts, proc.started_wall_ns)
        extra = proc.recipe.guard(
            recipe.run_info_fields, model, self._info["local_rank"], self._info["local_world_size"]
        )
        self._info.update(extra or {})
        watch = proc.recipe.add_model(model, index)
        self._watch = watch
        self._hparams_key: Any = None
        self._hparams: list[dict[str, Any]] = []
        self._hparams_step = 0
        self._forward = forward.ForwardTiming(model, self.tracker, watch)
        self.tracker.on_error = self.failed
        self.tracker.use_marker()
        backward_calls.install(self.tracker)
        # Global: every optimizer step of the process; the tracker keeps to its own.
        self._opt_hooks = [
            register_optimizer_step_pre_hook(self.tracker.optimizer_pre),
            register_optimizer_step_post_hook(self.tracker.optimizer_post),
        ]
        proc.recipe.guard(self._time_collectives, proc, model)
        comm.link(model, self.tracker)
        self.tracker.request_hook = self._hook_buckets
        # 0: decided from the first steps' cost (hooks/bucket_cost.py); -1: never.
        self._bucket_mode = opts.bucket_every
        if self.comm is not None:  # the user registered a Python hook before attach
            self.comm.tracker = self.tracker
            self.tracker.hooked_now()
        elif opts.bucket_every > 0 or getattr(model, "_comm_hooks", None):
            # A hook registered before ddpscope could wrap it: wrap() says so.
            self._hook_buckets()
        if compiled.compiled_in_place(model):
            # ddp_model.compile() ran before attach: wrap what it made, as if we had seen it.
            model._compiled_call_impl = self.wrap_compiled_call(
                model._compiled_call_impl, announce=False
            )
        self.publisher.post(RunInfo.KIND, index, self._run_info())
        if opts.checksum_every != -1:
            self._fingerprint(0, "initial")

    @property
    def enabled(self) -> bool:
        return self.tracker.enabled

    @property
    def step(self) -> int:
        return self.tracker.step

    @property
    def job_step(self) -> int:
        """Steps of the job so far, counted alike on every rank.

        A rank that ran out of data under ``Join`` shadows each step the others
        still take; counting those, it numbers its weight fingerprints by the
        same point of training as theirs, which is what the desync check
        compares. Equal to ``step`` in a job without Join.
        """
        return self.tracker.step + self.tracker.state.join_shadow

    @property
    def record_path(self) -> str | None:
        return self.publisher.record_path

    def __repr__(self) -> str:
        return f"<ddpscope.Handle run={self.run_id} rank={self.rank} model={self.index}>"

    def request_fingerprint(self) -> None:
        """Fingerprint the weights after the next optimizer step."""
        self.fingerprinter.request()
        self.tracker.notify_at = 0

    def close(self) -> None:
        """Stop publishing for the whole process (flushes what is queued)."""
        self._proc.finish(reason="close")

    # --- internals -----------------------------------------------------------

    def _time_collectives(self, proc: _Process, model: Any) -> None:
        if proc.timer is None:
            proc.timer = collectives.CollectiveTimer(self.tracker, proc.recipe.group_key)
            collectives.install(proc.timer)
        proc.timer.wrap_buffer_sync(model, self.tracker)

    def leave_for_compile(self) -> None:
        """``torch.compile(ddp_model)`` is about to look at the model (ForwardTiming)."""
        self._forward.leave_for_compile()

    def follow_compiled(self, wrapper: Any) -> None:
        """``torch.compile(ddp_model)`` made ``wrapper``: the forward is timed there."""
        if self.tracker.enabled and self._forward.follow_compiled(wrapper):
            self._info["compiled"] = "torch.compile(ddp_model)"
            self.publisher.post(RunInfo.KIND, self.index, self._run_info())

    def wrap_compiled_call(
        self, compiled_fn: Callable[..., Any], announce: bool = True
    ) -> Callable[..., Any]:
        """``ddp_model.compile()``: run the timing around the compiled call, not in it."""
        call = self._forward.wrap_compiled_call(compiled_fn) if self.tracker.enabled else None
        if call is None:
            return compiled_fn
        self._info["compiled"] = "ddp_model.compile()"
        if announce:
            self.publisher.post(RunInfo.KIND, self.index, self._run_info())
        return call

    def guard(self, fn: Callable[..., Any], *args: Any) -> bool:
        try:
            fn(*args)
        except Exception as exc:
            self.failed(exc)
            return False
        return True

    def failed(self, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        self.tracker.fail(exc)

    def _fingerprint(self, step: int, reason: str) -> None:
        if self.guard(self.fingerprinter.start, step, reason):
            self.publisher.post(Fingerprint.KIND, self.index, None, self._finish_fingerprint)

    def _run_info(self) -> dict[str, Any]:
        fields = dict(self._info)
        fields.update(runinfo.clock_anchor())
        return fields

    def periodic(self) -> list[tuple[str, int, dict[str, Any]]]:
        out = [(RunInfo.KIND, self.index, self._run_info())]
        if self.tracker.layout_gen:
            out.append((BucketLayout.KIND, self.index, self.tracker.layout_fields()))
        if self._hparams:
            fields = {"step": self._hparams_step, "optimizers": self._hparams}
            out.append((HParams.KIND, self.index, fields))
        return out

    @property
    def comm(self) -> comm.HookState | None:
        """ddpscope's comm-hook wrapper on this model, once registered."""
        return getattr(self.model, comm.STATE_ATTR, None)

    def _hook_buckets(self) -> None:
        """Register ddpscope's comm hook now: buckets are timed from the next step."""
        if self.comm is not None or not self.tracker.enabled:
            return
        comm.wrap(self.model)

    def _decide_bucket_timing(self) -> None:
        tracker = self.tracker
        nbytes = list(tracker._layout.values())
        device = tracker.clock.name
        median = tracker.median_step_ns()
        if bucket_cost.hook_fits(nbytes, device, median):
            self._hook_buckets()
            return
        if nbytes and median > 0:
            cost = bucket_cost.hook_floor_ns(nbytes, device)
            log.info(
                "ddpscope: per-bucket all-reduce timing is off: a comm hook on %d buckets "
                "would cost ~%.0f us of each %.1f ms step (budget %.1f%%); set "
                "DDPSCOPE_BUCKET_EVERY=1 to time them anyway",
                len(nbytes),
                cost / 1e3,
                median / 1e6,
                100 * bucket_cost.HOOK_BUDGET,
            )

    def _on_step_end(self, step: int) -> None:
        """After a step closed, on the steps the tracker is told to call (notify_at)."""
        fp = self.fingerprinter
        at = self.job_step
        if fp.due(at, self.tracker.median_step_ns()):
            self._fingerprint(at, fp.pending_reason)
        if step <= bucket_cost.DECIDE_AT_STEP or step % HPARAMS_EVERY == 0:
            # Multiples of HPARAMS_EVERY past the first steps (recipe snapshots
            # fall on powers of two, then on multiples of SNAPSHOT_EVERY).
            if (
                step == bucket_cost.DECIDE_AT_STEP
                and self._bucket_mode == 0
                and self.comm is None
                and not getattr(self.model, "_comm_hooks", None)
            ):
                self._decide_bucket_timing()
            recipe_probe = self._proc.recipe
            if recipe_probe.enabled and recipe.snapshot_due(step):
                recipe_probe.guard(recipe_probe.on_step_end, step)
        if step % HPARAMS_EVERY == 0 or self._hparams_key is None:
            self._check_hparams(step)
        self._notify_after(step)

    def _notify_after(self, step: int) -> None:
        """Tell the tracker the next step anything here can be due: none is called before."""
        tracker = self.tracker
        if step < bucket_cost.DECIDE_AT_STEP or self._hparams_key is None:
            nxt = step + 1
        else:
            nxt = step - step % HPARAMS_EVERY + HPARAMS_EVERY
        fp = self.fingerprinter
        # In the tracker's own steps (the fingerprints count the job's: see job_step).
        nxt = min(nxt, max(step + 1, fp.quiet_until - tracker.state.join_shadow))
        tracker.notify_at = nxt
        if fp.requested != fp.served:
            # A request that came in meanwhile (request_fingerprint sets 0 after
            # counting it; whichever of the two writes lands last, it is seen).
            tracker.notify_at = 0

    def _check_hparams(self, step: int) -> None:
        opts = list(self.tracker.optimizers.values())
        key = hparams_key(opts)
        if opts and key != self._hparams_key:
            self._hparams_key = key
            self._hparams = hparams(opts)
            self._hparams_step = step
            fields = {"step": step, "optimizers": self._hparams}
            self.publisher.post(HParams.KIND, self.index, fields)

    def _finish_fingerprint(self, _payload: Any, force: bool) -> dict[str, Any] | None:
        # Never wait here: on a GPU stuck behind a hung collective, waiting
        # would freeze heartbeats exactly when they matter. A check that is
        # still not done when forced is given up (and counted as dropped).
        fields = self.fingerprinter.poll(False)
        if fields is None and force:
            self.fingerprinter.discard_oldest()
        return fields

    def finish(self, clean: bool = True) -> None:
        if self.tracker.enabled:
            self.guard(self.tracker.flush)
            if clean and self.fingerprinter.every != -1:
                self._fingerprint(self.job_step, "final")
        # Also after an internal error disabled the tracker: nothing stays in torch.
        self._forward.remove()
        for hook in self._opt_hooks:
            hook.remove()
        self.tracker.drop_marker()
        backward_calls.remove(self.tracker)
        self.tracker.enabled = False


class InertHandle:
    """Returned when ddpscope is disabled: same surface, does nothing."""

    enabled = False
    step = 0
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


def attach(model: Any, **options: Any) -> Handle | InertHandle:
    """Attach ddpscope to a DDP model. Safe to call twice (returns the same handle)."""
    global _PROCESS
    check_model(model)
    wrapper = None
    if fabric_ddp(model) is not None:
        model = fabric_ddp(model)  # its forward calls the DDP module: hooks there fire
    if compiled_ddp(model) is not None:
        wrapper, model = model, compiled_ddp(model)
    opts = config.load(options)  # bad options are the caller's error: raise them
    with _LOCK:
        existing = _HANDLES.get(model)
        if existing is not None:
            if options:
                log.warning(
                    "ddpscope: this model is already attached (by an earlier attach() or by "
                    "`ddpscope run`); the options %s are ignored. Set them as DDPSCOPE_* "
                    "variables or `ddpscope run` flags instead.",
                    ", ".join(sorted(options)),
                )
            if wrapper is not None:
                existing.guard(existing.follow_compiled, wrapper)
            return existing
        if opts.disable:
            return InertHandle("DDPSCOPE_DISABLE is set")
        try:
            if _PROCESS is None or not _PROCESS.publisher._alive:
                if _PROCESS is not None:
                    _PROCESS.finish(reason="close")  # release its global hooks first
                _PROCESS = _Process(opts, model)
            handle = Handle(model, _PROCESS, len(_PROCESS.handles))
            _PROCESS.handles.append(handle)
        except (ConfigError, TypeError):
            raise
        except Exception as exc:
            log.warning("ddpscope could not attach and is off on this rank: %r", exc)
            return InertHandle(f"attach failed: {exc!r}")
        _HANDLES[model] = handle
    if wrapper is not None:
        handle.guard(handle.follow_compiled, wrapper)
    return handle


def current_handles() -> list[Handle]:
    return list(_PROCESS.handles) if _PROCESS is not None else []


def _reset_for_tests() -> None:
    global _PROCESS
    if _PROCESS is not None:
        _PROCESS.finish(reason="close")
    _PROCESS = None
    _HANDLES.clear()
