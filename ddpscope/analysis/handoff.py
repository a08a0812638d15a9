"""Handing snapshots from the thread that builds them to the threads that read them.

The live feed and the replay player each build snapshots on their own
thread, when a reader asks. Readers get the newest by reference (a frozen
object needs no lock), a listener is called with each one built (the UI
posts it to its own thread), and scripts and tests can ask and wait.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ddpscope.analysis.snapshot import Snapshot, SnapshotRequest

SnapshotListener = Callable[[Snapshot], None]


class SnapshotHandoff:
    def __init__(self) -> None:
        self._want: SnapshotRequest | None = None
        self._built = threading.Condition()
        self._listener: SnapshotListener | None = None
        self._seq = 0
        #: The newest snapshot built (None before the first).
        self.latest: Snapshot | None = None

    # --- readers (any thread) ---------------------------------------------------

    def listen(self, listener: SnapshotListener | None) -> None:
        """Call ``listener(snapshot)`` from the building thread after each build."""
        self._listener = listener

    def request_snapshot(self, request: SnapshotRequest | None = None) -> None:
        """Ask for a snapshot; it is built on the next turn of the building thread."""
        self._want = request or SnapshotRequest()

    def snapshot(self, request: SnapshotRequest | None = None, timeout: float = 10.0) -> Snapshot:
        """Ask for a snapshot and wait for it (for scripts and tests)."""
        with self._built:
            seq = self._seq
            self.request_snapshot(request)
            if not self._built.wait_for(lambda: self._seq > seq, timeout):
                raise TimeoutError(f"{type(self).__name__} built no snapshot in time")
            assert self.latest is not None
            return self.latest

    # --- the building thread -------------------------------------------------------

    def take_request(self) -> SnapshotRequest | None:
        """What a reader asked for since the last call (None: nothing)."""
        want, self._want = self._want, None
        return want

    def hand_over(self, snap: Snapshot) -> None:
        with self._built:
            self.latest = snap
            self._seq = snap.seq
            self._built.notify_all()
        listener = self._listener
        if listener is not None:
            listener(snap)
