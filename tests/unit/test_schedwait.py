"""The run-queue wait reader, on this process's real /proc."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ddpscope.hooks.schedwait import RunQueueWait, parse_schedstat

HAS_SCHEDSTAT = os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat")
needs_proc = pytest.mark.skipif(not HAS_SCHEDSTAT, reason="no /proc schedstat (macOS)")


def _raw(tid: int) -> tuple[int, int, int]:
    with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
        return parse_schedstat(f.read())


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@needs_proc
def test_the_thread_s_schedstat_parses_to_three_counters_that_only_grow() -> None:
    tid = threading.get_native_id()
    before = _raw(tid)
    _spin(0.02)
    after = _raw(tid)
    assert all(x >= 0 for x in before)
    # 20 ms on a CPU: the first counter moved; the wait and timeslices never go back.
    assert after[0] > before[0]
    assert after[1] >= before[1] and after[2] >= before[2]


@needs_proc
def test_a_reading_is_the_wait_field_of_the_thread_it_was_made_for() -> None:
    tid = threading.get_native_id()
    reader = RunQueueWait(tid)
    try:
        low = _raw(tid)[1]
        got = reader.read()
        high = _raw(tid)[1]
        assert reader.available and low <= got <= high
        readings = [reader.read() for _ in range(50)]
        assert readings == sorted(readings)
    finally:
        reader.close()


@needs_proc
def test_another_thread_is_read_by_its_native_id_from_this_one() -> None:
    started, stop, ids = threading.Event(), threading.Event(), []

    def train() -> None:
        ids.append(threading.get_native_id())
        started.set()
        stop.wait()

    t = threading.Thread(target=train)
    t.start()
    started.wait()
    reader = RunQueueWait(ids[0])
    try:
        low = _raw(ids[0])[1]
        got = reader.read()
        assert reader.available and got >= low
    finally:
        stop.set()
        t.join()
        reader.close()


def test_a_thread_with_no_schedstat_reads_as_unknown_everywhere() -> None:
    """What a rank on macOS (no /proc) puts on the wire: -1. No task has id 0."""
    reader = RunQueueWait(0)
    reader.sample(1_000)
    reader.sample(2_000)
    assert not reader.available
    assert reader.read() == -1 and reader.at(1_500) == -1 and reader.cpu_at(1_500) == -1


@needs_proc
@pytest.mark.parametrize("reading", ["at", "cpu_at"])
def test_the_reading_at_a_step_s_end_lies_between_the_readings_around_it(reading: str) -> None:
    reader = RunQueueWait(threading.get_native_id())
    at = getattr(reader, reading)  # the wait, or the time on a CPU
    try:
        reader.sample(1_000_000)
        first = at(1_000_000)
        _spin(0.02)
        reader.sample(2_000_000)
        last = at(2_000_000)
        inside = [at(t) for t in range(1_000_000, 2_000_001, 100_000)]
        assert 0 <= first <= last
        assert inside[0] == first and inside[-1] == last and inside == sorted(inside)
        # A step that ended before the earlier reading gets that reading; a
        # later time than the last reading gets the last one.
        assert at(0) == first and at(3_000_000) == last
    finally:
        reader.close()


@needs_proc
def test_the_cpu_time_is_the_thread_s_own_and_grows_only_while_it_runs() -> None:
    # What the contention rule compares across ranks: time on a CPU, measured,
    # from the same reading as the wait.
    tid = threading.get_native_id()
    reader = RunQueueWait(tid)
    try:
        low = _raw(tid)[0]
        reader.sample(1_000_000)
        first = reader.cpu_at(1_000_000)
        _spin(0.05)
        reader.sample(2_000_000)
        last = reader.cpu_at(2_000_000)
        high = _raw(tid)[0]
        assert low <= first <= last <= high
        # 50 ms spun: on a CPU for most of it, however loaded the host.
        assert last - first > 0.01e9
        # What the publisher puts on a step: both readings at its end.
        step = {"t_end": 1_500_000}
        reader.stamp(step, 2_000_000)
        assert step == {
            "t_end": 1_500_000,
            "rq_wait_ns": reader.at(1_500_000),
            "cpu_ns": reader.cpu_at(1_500_000),
        }
        time.sleep(0.05)
        reader.sample(3_000_000)
        # Asleep: off the CPU (a few us of waking up at most).
        assert reader.cpu_at(3_000_000) - last < 0.01e9
    finally:
        reader.close()


@needs_proc
def test_runnable_time_grows_while_the_thread_computes_and_not_while_it_sleeps() -> None:
    # What the hang rule reads from heartbeats to tell a rank computing alone
    # (an evaluation behind a barrier) from one asleep or blocked.
    reader = RunQueueWait(threading.get_native_id())
    try:
        start = reader.runnable()
        _spin(0.2)
        spun = reader.runnable()
        time.sleep(0.2)
        slept = reader.runnable()
        assert 0 <= start <= spun <= slept
        # On a CPU or waiting for one all through the spin, however loaded the host.
        assert spun - start > 0.15e9
        assert slept - spun < 0.05e9
    finally:
        reader.close()
    assert RunQueueWait(0).runnable() == -1
