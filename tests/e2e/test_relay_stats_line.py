"""The relay's statistics line says what it refused from its ranks, and why."""

from __future__ import annotations

from ddpscope.cli.relay import describe
from ddpscope.transport.relay import RelayStats


def test_the_stats_line_names_frames_refused_by_reason() -> None:
    stats = RelayStats(
        received=10,
        received_bytes=1000,
        requests=0,
        subscriptions=1,
        rejected=3,
        rejected_reasons=(("not a msgpack message", 2), ("step.rank", 1)),
    )
    line = describe(stats, None, 0.0)
    assert "3 refused as not valid telemetry (not a msgpack message 2, step.rank 1)" in line


def test_the_stats_line_says_nothing_of_refusals_when_there_were_none() -> None:
    stats = RelayStats(received=10, received_bytes=1000, requests=0, subscriptions=1)
    assert "refused" not in describe(stats, None, 0.0)
