"""Messages a rank file is missing, as a replay standing at a time would count them.

A file's records reach the index in time order, which is its write order but
for a few records: a step held for its CUDA events goes out after a later
heartbeat, a record stamped at its step's end after one queued just before
it. Counted as they come, each such pair shows a message missing for the
moment between their two times, and a replay standing there said "dropped
1" of a message that is in the file. So a change in the count is settled
with hindsight: only once :data:`SETTLE_RECORDS` more records have come
(the stream's reorder window at most), or the pass reaches the end of what
is written, and less the holes those records filled.
"""

from __future__ import annotations

from collections import deque
from typing import Any

#: Records after a change in the count that may still fill its holes (the
#: widest reorder window a stream is sorted within: record/stream.py).
SETTLE_RECORDS = 64


class SeqGaps:
    """Sequence numbers seen, and the settled count of missing ones by time.

    ``times`` and ``counts`` are the stream's arrays: from ``times[i]`` on,
    ``counts[i]`` messages were missing (appended only when the count changes).
    """

    def __init__(self, times: Any, counts: Any) -> None:
        self.times = times
        self.counts = counts
        self._low = self._high = -1
        self._seen = 0
        self._raw = 0
        self._settled = counts[-1] if len(counts) else 0
        #: Sequence numbers of the last SETTLE_RECORDS records.
        self._recent: deque[int] = deque(maxlen=SETTLE_RECORDS)
        #: Unsettled changes: (records seen then, time, low, high, missing then).
        self._pending: deque[tuple[int, int, int, int, int]] = deque()

    def add(self, seq: int, t: int) -> None:
        """A record with sequence number ``seq`` (>= 0), at running time ``t``."""
        self._seen += 1
        low = seq if self._low < 0 or seq < self._low else self._low
        if seq > self._high:
            self._high = seq
        self._low = low
        missing = self._high - low + 1 - self._seen
        if missing < 0:
            missing = 0
        self._recent.append(seq)
        if missing != self._raw:
            self._raw = missing
            self._pending.append((self._seen, t, low, self._high, missing))
        pending = self._pending
        while pending and self._seen - pending[0][0] >= SETTLE_RECORDS:
            self._settle(pending.popleft())

    def settle(self) -> None:
        """Settle every change with what has come so far (the end of what is written)."""
        while self._pending:
            self._settle(self._pending.popleft())

    def _settle(self, change: tuple[int, int, int, int, int]) -> None:
        seen, t, low, high, missing = change
        later = self._seen - seen
        recent = self._recent
        # Records after the change whose numbers lie inside its range filled one of
        # its holes: those were late, not lost.
        filled = sum(1 for i in range(len(recent) - later, len(recent)) if low <= recent[i] <= high)
        count = max(0, missing - filled)
        if count != self._settled:
            self._settled = count
            self.times.append(t)
            self.counts.append(count)
