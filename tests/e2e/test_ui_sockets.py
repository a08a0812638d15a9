"""The watch app over real ZeroMQ: what the snapshot-source seam cannot show.

A synthetic run is published by tests.support.wire to a LiveFeed bound on a
private endpoint (tests/unit/test_ui.py drives the same screens through the
seam): the endpoint the header names, what the feed counts off the socket,
a stack request that travels over the control socket to the "rank" and back,
and a real job process that exits under the view.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from textual.pilot import Pilot

from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.analysis.live import LiveFeed
from ddpscope.schema import Message
from ddpscope.ui.app import WatchApp, build_app
from ddpscope.ui.detail import RankDetailScreen
from ddpscope.ui.header import HeaderPanel
from ddpscope.ui.ranks import RanksTable
from tests.support.pilot import drive, until
from tests.support.synth import SyntheticRun
from tests.support.wire import Wire, wait_received

SLOW = 4


@dataclass
class Rig:
    run: SyntheticRun
    wire: Wire
    feed: LiveFeed

    def send(self, messages: list[Message]) -> None:
        before = self.feed.received
        self.wire.send(messages)
        wait_received(self.feed, before + len(messages))


@pytest.fixture
def rig(endpoint: str) -> Iterator[Rig]:
    run = SyntheticRun(world=6, buckets=8, slow_rank=SLOW, slow_ms=60)
    feed = LiveFeed(endpoint, detectors=[StragglerDetector()])
    wire = Wire(endpoint)
    feed.start()
    try:
        wire.wait_subscribed()
        yield Rig(run, wire, feed)
    finally:
        feed.stop()
        wire.close()


def app_for(rig: Rig, **kwargs: object) -> WatchApp:
    return build_app(rig.feed, pull_s=0.05, **kwargs)  # type: ignore[arg-type]


def test_the_header_names_the_bound_endpoint_and_counts_what_came_over_it(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        header = app.query_one(HeaderPanel)
        await until(pilot, lambda: "WAITING" in header.plain)
        assert "listening on ipc://" in header.plain
        rig.send(rig.run.opening() + rig.run.steps(0, 20))
        await until(pilot, lambda: "step 20" in header.plain)
        first, second, health = header.plain.splitlines()
        assert "LIVE" in first and rig.run.run_id in first and "6 ranks on 1 host" in first
        assert "epoch 0" in second and "6.2 steps/s" in second  # 160 ms steps
        assert "rx 144" in health and "dropped 0" in health and "silent 0" in health

    drive(app, scenario)


def test_s_sends_a_stack_request_over_the_control_socket_and_the_answer_is_shown(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        table = app.query_one(RanksTable)
        rig.send(rig.run.opening() + rig.run.steps(0, 10))
        await until(pilot, lambda: len(table.rows) == 6)
        await pilot.press("down", "down", "enter")
        screen = app.screen
        assert isinstance(screen, RankDetailScreen)
        await until(pilot, lambda: screen.detail is not None)
        assert screen.detail is not None and screen.detail.stacks is None
        await pilot.press("s")
        await until(
            pilot, lambda: screen.detail is not None and screen.detail.stacks_pending_s >= 0
        )
        # The rank's publisher answers the request it received over the control socket.
        await until(pilot, lambda: rig.wire.answer_stacks(rig.run, 10) > 0)
        # (once, or again if the answer was slow: the feed re-asks after a second)
        assert {(r.what, r.target, r.run) for r in rig.wire.requests} == {
            ("stacks", screen.rank, rig.run.run_id)
        }
        await until(pilot, lambda: screen.detail is not None and screen.detail.stacks is not None)
        assert "train.py:88 in train" in screen.stacks_plain
        assert screen.detail.stacks_pending_s == -1
        await pilot.press("f")  # and a weight fingerprint, from every rank
        await until(pilot, lambda: bool(rig.wire.poll_requests()))
        assert rig.wire.requests[-1].what == "fingerprint" and rig.wire.requests[-1].target == -1

    drive(app, scenario)


def test_after_a_real_job_exits_the_view_keeps_its_final_state(rig: Rig) -> None:
    job = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    job.wait()
    app = app_for(rig, job=job)

    async def scenario(pilot: Pilot[None]) -> None:
        header = app.query_one(HeaderPanel)
        table = app.query_one(RanksTable)
        rig.send(rig.run.opening() + rig.run.steps(0, 8) + [rig.run.end(r, 8) for r in range(6)])
        await until(pilot, lambda: "job exited 3" in header.plain)
        await until(pilot, lambda: bool(table.rows) and table.rows[0].status == "exited")
        await pilot.pause(0.3)
        assert app.is_running and "step 8" in header.plain
        assert all(r.status == "exited" for r in table.rows)

    drive(app, scenario)
