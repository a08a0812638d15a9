"""When a terminal command must end: a stop signal, or its terminal gone.

A Textual app in raw mode sees neither: Ctrl-C is a key, and once the
terminal hangs up (an ssh connection drops, a tmux session is killed) its
input thread reads end-of-file in a loop, at 100% of a core, forever. So
``watch``, ``replay`` and ``run`` hold a :class:`Lifeline` while their UI
runs: the signal handlers only note the signal (and, for ``run``, pass it to
the job), and the app asks :meth:`Lifeline.should_stop` on its own timer,
which also notices a terminal that is gone without any signal (SIGHUP
ignored, or sent elsewhere).

No textual import here: the launcher without a UI uses the same handlers.
"""

from __future__ import annotations

import os
import signal
import sys
import termios
from collections.abc import Callable
from types import FrameType

#: The signals a user, a scheduler or a lost terminal sends to stop a command.
STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class Lifeline:
    """Stop signals and the terminal's presence, for one command's lifetime.

    ``on_signal`` runs inside the handler (keep it to a ``kill``);
    ``on_terminal_lost`` once, from :meth:`should_stop`, when the terminal
    went away without a signal having said so. A signal that was ignored when
    the command started (``nohup``) stays ignored, as a shell would leave it.
    """

    def __init__(
        self,
        on_signal: Callable[[int], None] | None = None,
        on_terminal_lost: Callable[[], None] | None = None,
        terminal_fd: int | None = None,
    ) -> None:
        self.on_signal = on_signal
        self.on_terminal_lost = on_terminal_lost
        self.terminal_fd = terminal_fd
        #: The first stop signal received, if any.
        self.signum: int | None = None
        self.terminal_lost = False
        self.ignored: set[int] = set()
        self._previous: dict[int, object] = {}

    # --- installing ---------------------------------------------------------------

    def install(self) -> Lifeline:
        for sig in STOP_SIGNALS:
            try:
                if signal.getsignal(sig) is signal.SIG_IGN:
                    self.ignored.add(sig)
                    continue
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: the caller keeps its own handling
                return self
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def __enter__(self) -> Lifeline:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        if self.on_signal is not None:
            self.on_signal(signum)

    # --- asking -------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self.signum is not None or self.terminal_lost

    def should_stop(self) -> bool:
        """True once a stop signal came or the terminal is gone (checked now)."""
        if not self.terminal_lost and self.terminal_fd is not None and _hung_up(self.terminal_fd):
            self.terminal_lost = True
            silence_stdio()
            if self.signum is None and self.on_terminal_lost is not None:
                self.on_terminal_lost()
        return self.stopping

    def exit_status(self) -> int:
        """What a shell would report for a command ended this way (128 + signal)."""
        if self.signum is not None:
            return 128 + self.signum
        return 128 + int(getattr(signal, "SIGHUP", 1))


def _hung_up(fd: int) -> bool:
    # After a hangup every read of the tty returns end-of-file at once and its
    # ioctls fail with EIO: the cheapest test that reads nothing from it.
    try:
        termios.tcgetattr(fd)
    except termios.error:
        return True
    except OSError:
        return True
    return False


def silence_stdio() -> None:
    """Point stdin, stdout and stderr at /dev/null: their terminal is gone.

    Every later write (the UI restoring the screen, a last message, the
    interpreter's final flush) would fail with EIO and turn a clean exit
    into a traceback and exit status 120.
    """
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    for fd in (0, 1, 2):
        try:
            os.dup2(null, fd)
        except OSError:
            pass
    os.close(null)


def say(text: str) -> None:
    """A line to stderr that never fails because the terminal went away."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
