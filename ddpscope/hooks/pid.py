"""This process's id without a system call.

Hooks ask on every forward and collective whether they run in the process
that attached: a forked DataLoader worker inherits them and must stay out.
``os.getpid()`` is a system call each time (glibc stopped caching it); this
is a module attribute, refreshed in the child at every ``os.fork()``.
"""

from __future__ import annotations

import os

#: The id of the process this interpreter runs in.
current = os.getpid()


def _refresh() -> None:
    global current
    current = os.getpid()


if hasattr(os, "register_at_fork"):  # POSIX; where there is no fork, the pid never changes
    os.register_at_fork(after_in_child=_refresh)
