"""One rank process's side of ddpscope, shared by every model attached in it.

:class:`RankProcess` holds the publisher thread, the process-wide probes
(samplers, DataLoader waits, recipe checks, collectives, torch.compile) and the
rank's end: at exit, on an uncaught exception, or on a stop signal, it sends
the end message and takes every probe back out of torch.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

from ddpscope import _exit
from ddpscope.config import Options
from ddpscope.hooks import collectives, compiled, crashstacks, loaderwait, recipe, runinfo
from ddpscope.hooks.host import HostProbe, device_memory_for
from ddpscope.hooks.publisher import Publisher
from ddpscope.hooks.samplers import SamplerProbe
from ddpscope.hooks.signalwake import SignalWake, die_by
from ddpscope.schema import SCHEMA_VERSION

#: Signals that end a rank with an end message (reason "signal") on the way out.
_END_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


class RankProcess:
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
        host = HostProbe(device_memory_for(runinfo.device_of(model)))
        self.publisher = Publisher(opts, self.run_id, self.rank, header, host)
        #: The attached models' ``ddpscope.hooks.attach.Handle``s (not imported: attach
        #: imports this module).
        self.handles: list[Any] = []
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
        return torch.is_grad_enabled() and any(h.entry.training for h in self.handles)

    def _periodic(self) -> list[tuple[str, int, dict[str, Any]]]:
        return [item for h in self.handles for item in h.periodic()]

    def _before_compile(self, module: Any) -> None:
        for h in self.handles:
            if h.entry is module:
                h.guard(h.leave_for_compile)

    def _on_compiled(self, original: Any, compiled_fn: Any) -> Any:
        in_place = getattr(original, "__func__", None) is torch.nn.Module._call_impl
        owner = getattr(original, "__self__", None) if in_place else None
        for h in self.handles:
            if h.entry is original:
                h.guard(h.follow_compiled, compiled_fn)
            elif owner is not None and h.entry is owner:
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


__all__ = ["RankProcess"]
