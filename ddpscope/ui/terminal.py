"""A terminal driver that survives its terminal going away.

Textual writes the screen from a background thread; once the terminal has
hung up, that thread's write raises EIO and the thread dies. The app's
next writes then fill the thread's bounded queue and block the event loop
for good: the app can no longer exit, whatever signal it gets. Writes that
fail here are dropped instead, so the app can always shut down (the
lifeline, ddpscope/cli/lifeline.py, tells it when).

Textual also restarts application mode on every SIGCONT, suspended or not,
and each restart starts another input and output thread. The kernel sends
SIGCONT with the SIGHUP of a lost terminal, and ``kill -CONT`` or a shell's
``fg``/``bg`` send it too: the extra input threads, which are not daemons,
outlive the app's exit and the process never ends. Here SIGCONT resumes
only what a SIGTSTP suspended.

Textual's SIGTSTP handler stops application mode inside the signal handler,
and that writes to the output thread's queue: a signal that lands while the
event loop is itself in the middle of a write (holding the queue's lock)
deadlocks the process, never stopped and never drawing again. Here both
signals are only noted in the handler and acted on by the event loop.
"""

from __future__ import annotations

import asyncio
import sys
from typing import IO, Any

from textual.app import App


class _Tolerant:
    """A text file whose writes and flushes never raise OSError."""

    def __init__(self, file: IO[str]) -> None:
        self._file = file

    def write(self, text: str) -> int:
        try:
            return self._file.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        try:
            self._file.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def use_tolerant_driver(app: App[Any]) -> None:
    """Make ``app`` draw through a driver whose output survives a hangup (POSIX only)."""
    if sys.platform == "win32":
        return
    base = app.driver_class
    if getattr(base, "_ddpscope_tolerant", False):
        return

    class TolerantDriver(base):  # type: ignore[valid-type,misc]
        _ddpscope_tolerant = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            file = getattr(self, "_file", None)
            if file is not None:
                self._file = _Tolerant(file)

        def _defer(self, act: Any, args: tuple[Any, ...]) -> None:
            # A signal handler runs on the main thread, inside the app's loop
            # when it is running; outside it (start-up, shutdown) there is no
            # loop to wait for and nothing of the app's mid-write.
            try:
                asyncio.get_running_loop().call_soon_threadsafe(act, *args)
            except RuntimeError:
                act(*args)

        def _sigtstp_application(self, *args: Any) -> None:
            self._defer(super()._sigtstp_application, args)

        def _sigcont_application(self, *args: Any) -> None:
            # Textual sets this flag exactly when its SIGTSTP handler suspended
            # application mode to be restarted; start_application_mode clears it.
            self._defer(self._resume_if_suspended, args)

        def _resume_if_suspended(self, *args: Any) -> None:
            if getattr(self, "_must_signal_resume", False):
                super()._sigcont_application(*args)
                # The terminal comes back blank (a fresh alternate screen)
                # and Textual repaints only what changed meanwhile.
                self._app.refresh(layout=True)

    app.driver_class = TolerantDriver
