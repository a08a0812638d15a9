"""End to end: a real 2-rank torchrun job with a straggler, watched by the running app."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from textual.pilot import Pilot

from ddpscope.analysis.live import LiveFeed
from ddpscope.ui.app import WatchApp, build_app
from ddpscope.ui.detail import RankDetailScreen
from tests.support.pilot import until
from tests.support.torchrun import DEMO, ROOT, job_env

pytestmark = pytest.mark.torchrun


def test_a_straggling_rank_in_a_real_job_is_named_and_answers_for_its_stacks(
    endpoint: str,
) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(DEMO), "--epochs", "12", "--slow-rank", "1", "--slow-ms", "80",
    ]  # fmt: skip
    feed = LiveFeed(endpoint)  # the default detectors, as `ddpscope watch` runs them
    job = subprocess.Popen(
        cmd,
        env=job_env(DDPSCOPE_ENDPOINT=endpoint),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    app = build_app(feed, job=job, pull_s=0.2)

    def straggler() -> list[int]:
        snap = app.snapshot
        found = [f for f in snap.findings if f.kind == "straggler" and f.active] if snap else []
        return list(found[0].ranks) if found else []

    async def scenario(pilot: Pilot[None]) -> None:
        await until(pilot, lambda: straggler() != [], timeout=120)
        assert straggler() == [1]
        await until(pilot, lambda: app.ranks.rows[0].rank == 1, timeout=5)
        assert app.ranks.rows[0].status == "straggler"
        await pilot.press("4")
        assert "warning straggler rank 1" in app.findings.text
        # Its stacks, asked for while the job runs, come from the demo script itself.
        await pilot.press("1", "home", "enter", "s")
        screen = app.screen
        assert isinstance(screen, RankDetailScreen) and screen.rank == 1
        await until(pilot, lambda: "train.py" in screen.stacks_plain, timeout=30)
        assert screen.detail is not None and screen.detail.stacks is not None
        assert screen.detail.stacks.reason == "request"
        await pilot.press("escape")
        # When the job ends the view stays, on every rank's final state.
        await until(pilot, lambda: app.job_status is not None, timeout=120)
        await until(pilot, lambda: all(r.phase == "exited" for r in app.ranks.rows), 10)
        assert app.job_status == 0 and app.is_running
        # The straggler keeps its badge on the finished run; the other rank just exited.
        assert [(r.rank, r.status) for r in app.ranks.rows] == [(1, "straggler"), (0, "exited")]

    async def main(app: WatchApp) -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            await scenario(pilot)

    try:
        with feed:
            asyncio.run(main(app))
    finally:
        if job.poll() is None:
            job.kill()
        _, err = job.communicate(timeout=30)
    assert job.returncode == 0, err[-4000:]
