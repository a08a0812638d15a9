"""The publisher's tick stretches with the step (fewer wake-ups a step), and
nothing with a deadline of its own (close, heartbeats) waits for a long tick."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ddpscope.config import load
from ddpscope.hooks import tickpace
from ddpscope.hooks.publisher import Publisher
from ddpscope.hooks.tickpace import TICK_MAX_S, TICK_MIN_S, TickPace
from ddpscope.record.reader import choose_run
from ddpscope.schema import End, Heartbeat, SaveCall


def _train(pace: TickPace, step_s: float, seconds: float, start: float = 0.0) -> float:
    """Drain ticks as the publisher would while steps end every ``step_s``; the end time."""
    t, ended = start, int(start / step_s) if step_s else 0
    while t < start + seconds:
        t += pace.tick_s
        now_ended = int(t / step_s) if step_s else 0
        steps = now_ended - ended
        ended = now_ended
        pace.drained(steps, steps, t)
    return t


def test_the_tick_starts_at_the_shortest() -> None:
    assert TickPace(0.0, 4096).tick_s == TICK_MIN_S


def test_steps_of_a_few_ms_keep_the_shortest_tick() -> None:
    pace = TickPace(0.0, 4096)
    _train(pace, 0.005, 5.0)
    assert pace.tick_s == TICK_MIN_S


def test_a_50_ms_step_shares_a_tick_with_three_others() -> None:
    pace = TickPace(0.0, 4096)
    _train(pace, 0.05, 5.0)
    assert pace.tick_s == pytest.approx(0.2, rel=0.1)


def test_slow_steps_and_a_rank_without_steps_tick_at_the_longest() -> None:
    slow = TickPace(0.0, 4096)
    _train(slow, 0.5, 5.0)
    idle = TickPace(0.0, 4096)
    _train(idle, 0.0, 5.0)
    assert slow.tick_s == idle.tick_s == TICK_MAX_S


def test_the_tick_follows_the_step_back_down_within_two_seconds() -> None:
    pace = TickPace(0.0, 4096)
    t = _train(pace, 0.0, 5.0)  # validation: no steps
    assert pace.tick_s == TICK_MAX_S
    _train(pace, 0.01, 2.0, start=t)
    assert pace.tick_s == TICK_MIN_S


def test_one_slow_tick_does_not_move_it_before_a_second_is_read() -> None:
    pace = TickPace(0.0, 4096)
    pace.drained(0, 0, 0.5)
    assert pace.tick_s == TICK_MIN_S


def test_a_burst_goes_back_to_the_shortest_tick_at_once() -> None:
    pace = TickPace(0.0, 4096)
    t = _train(pace, 0.0, 2.0)
    assert pace.tick_s == TICK_MAX_S
    pace.drained(600, 600, t + 0.01)  # over an eighth of the queue in one tick
    assert pace.tick_s == TICK_MIN_S


def _publisher(tmp_path: Path, **opts: float) -> Publisher:
    rec = tmp_path / "rec"
    options = load({"endpoint": f"ipc://{tmp_path}/s", "record": str(rec), **opts}, env={})
    pub = Publisher(options, "tick", 0, {"world_size": 1})
    pub.start(close_at_exit=False)
    return pub


def test_close_wakes_a_thread_asleep_in_a_long_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tickpace, "TICK_MIN_S", 60.0)
    pub = _publisher(tmp_path, heartbeat_s=60.0, resend_s=60.0)
    time.sleep(0.8)  # past the connect grace: nothing is due for a minute
    saved = {"step": 3, "path": "/ckpt.pt", "site": "train.py:9 in main", "what": "other"}
    pub.post(SaveCall.KIND, 0, saved)
    pub.close()
    assert not pub._thread.is_alive()  # join() gives it 2 s; without the wake it sleeps 60
    rf = choose_run(str(tmp_path / "rec")).files[0]
    kinds = [m.KIND for m in rf.messages()]
    assert rf.problems == [] and kinds[-3:] == [SaveCall.KIND, Heartbeat.KIND, End.KIND]


def test_heartbeats_keep_their_own_schedule_under_a_long_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tickpace, "TICK_MIN_S", 60.0)
    pub = _publisher(tmp_path, heartbeat_s=0.1, resend_s=60.0)
    time.sleep(1.0)
    pub.close()
    rf = choose_run(str(tmp_path / "rec")).files[0]
    beats = [m for m in rf.messages() if m.KIND == Heartbeat.KIND]
    assert len(beats) >= 6  # ~10 in the second, and the one at close


def test_a_heartbeat_goes_out_after_what_was_queued_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tickpace, "TICK_MIN_S", 60.0)
    pub = _publisher(tmp_path, heartbeat_s=0.2, resend_s=60.0)
    try:
        time.sleep(0.3)
        saved = {"step": 3, "path": "/ckpt.pt", "site": "train.py:9 in main", "what": "other"}
        pub.post(SaveCall.KIND, 0, saved)
        time.sleep(0.5)  # two heartbeats, and no tick for a minute
        rf = choose_run(str(tmp_path / "rec")).files[0]
        kinds = [m.KIND for m in rf.messages()]
    finally:
        pub.close()
    assert SaveCall.KIND in kinds and kinds[-1] == Heartbeat.KIND
