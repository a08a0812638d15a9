"""HostProbe: a heartbeat's CPU share is measured over an interval long enough to mean anything."""

from __future__ import annotations

import time

from ddpscope.hooks.host import MIN_CPU_INTERVAL_S, HostProbe


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


def test_a_sample_right_after_start_reports_no_cpu_share_yet() -> None:
    probe = HostProbe()
    _spin(0.02)  # a few clock ticks of CPU in a few ms: psutil read this as hundreds of %
    assert probe.sample()["cpu_pct"] == -1.0


def test_a_busy_interval_reads_about_one_core() -> None:
    probe = HostProbe()
    _spin(MIN_CPU_INTERVAL_S + 0.15)
    cpu = probe.sample()["cpu_pct"]
    # One thread spinning: at most one core, plus whatever the interpreter's other
    # threads did; at least a third of it even on a machine shared with other jobs.
    assert 30.0 <= cpu <= 130.0


def test_a_sample_sooner_than_the_interval_repeats_the_last_share() -> None:
    probe = HostProbe()
    time.sleep(MIN_CPU_INTERVAL_S + 0.05)
    idle = probe.sample()["cpu_pct"]
    _spin(0.05)  # five clock ticks in 50 ms: 100% if it were measured now
    assert probe.sample()["cpu_pct"] == idle
    assert idle < 30.0
