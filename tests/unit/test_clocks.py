"""The clock interface: host stamps, and CUDA events read lazily (faked here).

The CUDA path cannot run on these machines; its logic (ring, readiness,
lost events, forced reads) runs against a fake event with the same surface
as torch.cuda.Event(enable_timing=True).
"""

from __future__ import annotations

from ddpscope.hooks.clocks import EventClock, HostClock
from tests.support.fake_cuda import FakeEvent


def test_host_clock_tokens_are_monotonic_nanoseconds() -> None:
    c = HostClock()
    a, b = c.stamp(), c.stamp()
    assert b >= a and c.resolve([a, b], force=False) == [a, b] and c.host_ns(a) == a


def test_event_clock_waits_for_events_then_reports_device_offsets() -> None:
    events: list[FakeEvent] = []

    def make() -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]

    c = EventClock(make, ring=8)
    a, b = c.stamp(), c.stamp()
    assert c.resolve([a, b], force=False) is None  # not complete: never blocks
    for e in events:
        e.done = True
    ta, tb = c.resolve([a, b], force=False)  # type: ignore[misc]
    assert ta == c.host_ns(a)
    assert tb - ta == 1_500_000  # 1.5 ms of device time between the events


def test_forced_read_falls_back_to_host_times() -> None:
    c = EventClock(FakeEvent, ring=8)
    a, b = c.stamp(), c.stamp()
    assert c.resolve([a, b], force=True) == [c.host_ns(a), c.host_ns(b)]


def test_overwritten_ring_slots_are_counted_as_lost() -> None:
    c = EventClock(FakeEvent, ring=4)
    first = c.stamp()
    for _ in range(4):
        c.stamp()
    out = c.resolve([first], force=False)
    assert c.lost == 1 and out == [0]
