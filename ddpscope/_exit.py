"""A rank's end, run after the exit work of the libraries it trains with.

``atexit`` runs its handlers last-registered first. Libraries register their
exit work as they start it: Lightning destroys an NCCL process group in a
handler it registers inside ``init_process_group``. A ddpscope session made
later (``attach`` runs after the model exists) would end first, and report
that process group as left alive by the script: an info finding on every
Lightning GPU job, telling users to do what Lightning does for them.

So ``import ddpscope`` registers one handler here, and a script imports
ddpscope at its top, before any of that (``ddpscope run`` imports it when
``import torch`` loads DDP); sessions made afterwards hand their end to it.
Imported after a library's registration, ddpscope is where it was before:
the session registers its own handler.

No torch here: ``import ddpscope`` stays light.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable

_enders: list[Callable[[], None]] = []
_registered = False


def register_early() -> None:
    """Register the exit handler (once); ``import ddpscope`` calls this."""
    global _registered
    if not _registered:
        atexit.register(_run)
        _registered = True


def defer(ender: Callable[[], None]) -> bool:
    """Run ``ender`` from the early handler; False when there is none (register your own)."""
    if not _registered:
        return False
    _enders.append(ender)
    return True


def end_at_exit(end: Callable[[], None], close: Callable[[], None]) -> None:
    """At exit, ``end`` and then ``close`` (which runs even if ``end`` failed half-way):
    from the early handler where there is one, else through atexit."""
    if defer(close):
        defer(end)  # both run last-in first-out
    else:
        atexit.register(close)
        atexit.register(end)


def _run() -> None:
    while _enders:
        ender = _enders.pop()
        try:
            ender()
        except Exception:  # exit must never fail because of ddpscope
            pass
