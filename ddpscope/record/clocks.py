"""Putting the ranks of several hosts on one clock.

Every message carries its sender's monotonic time, which means nothing on
another host (it counts from that host's boot). Every record file's header
holds an anchor: the process's wall-clock and monotonic times read together.
Their difference converts a host's monotonic times to wall time; the
difference between two hosts' anchors moves one host's times onto the
other's clock. The result is as good as the hosts' wall clocks agree (NTP:
about a millisecond; PTP: microseconds). Ranks of one host share one anchor
(the first one seen), so their relative order stays exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def anchor(header: Mapping[str, Any]) -> int | None:
    """Wall minus monotonic ns of the process that wrote ``header`` (None: unknown)."""
    wall, mono = header.get("wall_ns"), header.get("mono_ns")
    if isinstance(wall, int) and isinstance(mono, int):
        return wall - mono
    return None


class HostClocks:
    """Shifts onto the monotonic clock of the first host seen, or onto a clock
    whose anchor is given (``reference``: this process's, say)."""

    def __init__(self, reference: int | None = None) -> None:
        self._by_host: dict[str, int] = {}
        #: The reference clock's anchor: a time on it plus this is wall time.
        self.reference: int | None = reference

    def shift(self, header: Mapping[str, Any]) -> int:
        """ns to add to the times of the file with ``header`` (0 when it has no anchor)."""
        own = anchor(header)
        if own is None:
            return 0
        own = self._by_host.setdefault(str(header.get("host", "")), own)
        if self.reference is None:
            self.reference = own
        return own - self.reference
