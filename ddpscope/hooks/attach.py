"""``ddpscope.attach(model)``: wire every probe to one DDP model.

One :class:`~ddpscope.hooks.process.RankProcess` per rank process holds what
is shared by all attached models (publisher thread, process-wide probes, the
rank's end); one :class:`Handle` per DDP model holds its step tracker and
fingerprinter. A module under ``replicate()`` is attached at its first
forward, when its DDP exists (:class:`~ddpscope.hooks.standins.PendingHandle`).

Nothing here may raise into the training loop once attach has returned:
every hook runs behind a guard that disables ddpscope on the rank with one
warning if ddpscope itself fails.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ddpscope import config
from ddpscope.config import ConfigError, Options
from ddpscope.hooks import backward as backward_calls
from ddpscope.hooks import (
    bucket_cost,
    collectives,
    comm,
    compiled,
    forward,
    recipe,
    runinfo,
    target,
)
from ddpscope.hooks.clocks import clock_for
from ddpscope.hooks.fingerprint import Fingerprinter, hparams, hparams_key
from ddpscope.hooks.modelcheck import check_model, compiled_ddp, fabric_ddp

# _inert stays importable from here: models pickled before the move name it so.
from ddpscope.hooks.modulehook import _inert  # noqa: F401
from ddpscope.hooks.process import RankProcess
from ddpscope.hooks.standins import InertHandle, PendingHandle
from ddpscope.hooks.steps import StepTracker
from ddpscope.hooks.unusedsearch import UnusedSearch
from ddpscope.schema import BucketLayout, Fingerprint, HParams, RunInfo

log = logging.getLogger("ddpscope")
_LOCK = threading.Lock()
#: Steps between hyperparameter checks once the first values are sent. Every
#: rank checks at the same steps, which is all the comparison needs; a
#: scheduler that moves the learning rate each step would otherwise cost a
#: key, a message and a record entry per step.
HPARAMS_EVERY = 8
# Handle._notify_after skips the steps in between: nothing else may fall there.
assert recipe.SNAPSHOT_EVERY % HPARAMS_EVERY == 0
assert HPARAMS_EVERY & (HPARAMS_EVERY - 1) == 0 and HPARAMS_EVERY >= bucket_cost.DECIDE_AT_STEP
_HANDLES: weakref.WeakKeyDictionary[Any, Handle | PendingHandle] = weakref.WeakKeyDictionary()
_PROCESS: RankProcess | None = None


class Handle:
    """What ``attach`` returns: the live link between one DDP model and ddpscope."""

    def __init__(
        self, tgt: target.Target, proc: RankProcess, index: int, after: Handle | None = None
    ) -> None:
        """``after``: the handle of an earlier DDP model over the same parameters, which
        this one replaces (``retire``): its index, and its step count carried on."""
        model = tgt.ddp
        self.model = model
        #: What the loop calls: the DDP model, or a module under ``replicate()``.
        self.entry = tgt.entry
        #: The user's layers, whose parameters tell a re-wrap of them (``rewraps``).
        self.module = tgt.module
        self.index = index
        self._proc = proc
        self.publisher = proc.publisher
        self.run_id = proc.run_id
        self.rank = proc.rank
        self.error = ""
        opts = proc.opts
        named = tgt.named
        self.param_names = [n for n, _ in named]
        self.fingerprinter = Fingerprinter(
            [p for _, p in named],
            [b for _, b in tgt.module.named_buffers()],
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
        if after is not None:
            self.tracker.take_over(after.tracker)
        self._info = runinfo.run_info_fields(tgt, opts, proc.started_wall_ns)
        extra = proc.recipe.guard(
            recipe.run_info_fields, model, self._info["local_rank"], self._info["local_world_size"]
        )
        self._info.update(extra or {})
        watch = proc.recipe.add_model(model, index, tgt.module)
        self._watch = watch
        self._hparams_key: Any = None
        self._hparams: list[dict[str, Any]] = []
        self._hparams_step = 0
        self._forward = forward.ForwardTiming(tgt.entry, self.tracker, watch, model)
        self.tracker.on_error = self.failed
        self.tracker.use_marker()
        self.tracker.search = proc.recipe.guard(UnusedSearch.of, model)
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
        entry = tgt.entry
        if compiled.compiled_in_place(entry):
            # ddp_model.compile() ran before attach: wrap what it made, as if we had seen it.
            entry._compiled_call_impl = self.wrap_compiled_call(
                entry._compiled_call_impl, announce=False
            )
        self.publisher.post(RunInfo.KIND, index, self._run_info())
        if opts.checksum_every != -1:
            self._fingerprint(self.job_step, "initial")

    @property
    def enabled(self) -> bool:
        return self.tracker.enabled

    @property
    def step(self) -> int:
        """Steps of this model so far, with those of the wrapper it replaced."""
        return self.tracker.step + self.tracker.step_base

    @property
    def job_step(self) -> int:
        """Steps of the job so far, counted alike on every rank.

        A rank that ran out of data under ``Join`` shadows each step the others
        still take; counting those, it numbers its weight fingerprints by the
        same point of training as theirs, which is what the desync check
        compares. Equal to ``step`` in a job without Join.
        """
        return self.step + self.tracker.state.join_shadow

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

    def _time_collectives(self, proc: RankProcess, model: Any) -> None:
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

    def time_this_call(self, args: Any, kwargs: Any) -> None:
        """Attached inside a forward's pre-hooks (replicate()): time that forward too."""
        self.guard(self._forward.time_this_call, args, kwargs)

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
        nxt = min(
            nxt, max(step + 1, fp.quiet_until - tracker.state.join_shadow - tracker.step_base)
        )
        tracker.notify_at = nxt
        if fp.requested != fp.served:
            # A request that came in meanwhile (request_fingerprint sets 0 after
            # counting it; whichever of the two writes lands last, it is seen).
            tracker.notify_at = 0

    def _check_hparams(self, step: int, final: bool = False) -> None:
        opts = list(self.tracker.optimizers.values())
        key = hparams_key(opts)
        if opts and key != self._hparams_key:
            self._hparams_key = key
            self._hparams = hparams(opts)
            step += self.tracker.step_base
            self._hparams_step = step
            fields: dict[str, Any] = {"step": step, "optimizers": self._hparams}
            if final:
                fields["final"] = True
            self.publisher.post(HParams.KIND, self.index, fields)

    def _finish_fingerprint(self, _payload: Any, force: bool) -> dict[str, Any] | None:
        # Never wait here: on a GPU stuck behind a hung collective, waiting
        # would freeze heartbeats exactly when they matter. A check that is
        # still not done when forced is given up (and counted as dropped).
        fields = self.fingerprinter.poll(False)
        if fields is None and force:
            self.fingerprinter.discard_oldest()
        return fields

    def rewraps(self, tgt: target.Target) -> bool:
        """Whether ``tgt`` wraps any of this model's parameters: the loop re-wrapped them
        (DDP must be rebuilt to train layers unfrozen after it was made; a second
        ``Trainer.fit`` wraps the same module again)."""
        if not self.tracker.enabled:
            return False
        try:
            mine = {id(p) for p in self.module.parameters()}
            return any(id(p) in mine for p in tgt.module.parameters())
        except Exception:  # a module whose parameters() fails: a model of its own
            return False

    def retire(self) -> None:
        """A new DDP model over the same parameters replaces this one: stop watching it.

        Its hooks would otherwise go on firing on the shared parameters, each backward
        of the new wrapper a step of this one with no forward through it (a false
        ``forward_bypasses_ddp``), and this handle would keep the old wrapper, with
        its gradient buckets, alive. The new handle sends the final state instead."""
        self.finish(clean=False, last=False)
        _HANDLES.pop(self.entry, None)
        comm.unlink(self.model)
        if self._proc.timer is not None:
            self._proc.timer.forget(self.model)

    def finish(self, clean: bool = True, last: bool = True) -> None:
        if self.tracker.enabled:
            self.guard(self.tracker.flush)
            if last and self._hparams_key is not None:
                # A scheduler's last move after the last checked step (without it
                # a short run reports the rate it had there as its last), sent as
                # the next step's: the rate it moved to, at a step no rank sent yet
                # (hyperparam_mismatch compares each step once all ranks sent it).
                self.guard(self._check_hparams, self.tracker.step + 1, True)
            if clean and self.fingerprinter.every != -1:
                self._fingerprint(self.job_step, "final")
        # Also after an internal error disabled the tracker: nothing stays in torch.
        self._forward.remove()
        for hook in self._opt_hooks:
            hook.remove()
        self.tracker.drop_marker()
        if self.tracker.search is not None:
            self.tracker.search.close()
        backward_calls.remove(self.tracker)
        self.tracker.enabled = False


def attach(model: Any, **options: Any) -> Handle | InertHandle | PendingHandle:
    """Attach ddpscope to a DDP model. Safe to call twice (returns the same handle)."""
    check_model(model)
    wrapper = None
    if fabric_ddp(model) is not None:
        model = fabric_ddp(model)  # its forward calls the DDP module: hooks there fire
    if compiled_ddp(model) is not None:
        wrapper, model = model, compiled_ddp(model)
    opts = config.load(options)  # bad options are the caller's error: raise them
    state = target.replicate_state(model)
    if state is None:
        return _attach(target.of_ddp(model), opts, options, wrapper)
    return attach_replicated(model, state, opts, options)


def attach_replicated(module: Any, state: Any, opts: Options, options: dict[str, Any]) -> Any:
    """Attach a module under ``replicate()``: now if its DDP exists, else at its first forward."""
    if target.replicated_ddp(state) is not None:
        return _attach(target.of_replicated(module, state), opts, options, None)
    with _LOCK:
        existing = _HANDLES.get(module)
        if existing is None and not opts.disable:
            try:
                # The process side now: samplers and loaders made before the first
                # forward are followed from their first batch.
                _process_for(opts, module)
            except Exception as exc:
                log.warning("ddpscope could not attach and is off on this rank: %r", exc)
                return InertHandle(f"attach failed: {exc!r}")
            existing = _HANDLES[module] = PendingHandle(
                module,
                lambda m: _attach(target.of_replicated(m, state), opts, {}, None, pending=True),
                _close_process,
            )
    return existing if existing is not None else InertHandle("DDPSCOPE_DISABLE is set")


def _attach(
    tgt: target.Target, opts: Options, options: dict[str, Any], wrapper: Any, pending: bool = False
) -> Any:
    model = tgt.entry
    with _LOCK:
        existing = _HANDLES.get(model)
        if isinstance(existing, PendingHandle):
            # Its first forward has come (pending), or attach() was called again after it.
            existing = None if pending else existing.live or existing
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
            proc = _process_for(opts, tgt.ddp)
            old = next((h for h in reversed(proc.handles) if h.rewraps(tgt)), None)
            if old is None:
                handle = Handle(tgt, proc, len(proc.handles))
                proc.handles.append(handle)
            else:
                old.retire()
                handle = Handle(tgt, proc, old.index, after=old)
                proc.handles[proc.handles.index(old)] = handle
                if proc.timer is not None and proc.timer.sink is old.tracker:
                    # The script's own collectives were booked to the old model's steps.
                    proc.timer.sink = handle.tracker
        except (ConfigError, TypeError):
            raise
        except Exception as exc:
            log.warning("ddpscope could not attach and is off on this rank: %r", exc)
            return InertHandle(f"attach failed: {exc!r}")
        if not pending:
            _HANDLES[model] = handle
    if wrapper is not None:
        handle.guard(handle.follow_compiled, wrapper)
    return handle


def _process_for(opts: Options, model: Any) -> RankProcess:
    """This process's side of ddpscope, started by the first attach (under _LOCK)."""
    global _PROCESS
    if _PROCESS is None or not _PROCESS.publisher._alive:
        if _PROCESS is not None:
            _PROCESS.finish(reason="close")  # release its global hooks first
        _PROCESS = RankProcess(opts, model)
    return _PROCESS


def _close_process() -> None:
    if _PROCESS is not None:
        _PROCESS.finish(reason="close")


def current_handles() -> list[Handle]:
    return list(_PROCESS.handles) if _PROCESS is not None else []


def _reset_for_tests() -> None:
    global _PROCESS
    if _PROCESS is not None:
        _PROCESS.finish(reason="close")
    _PROCESS = None
    _HANDLES.clear()
