"""Snapshot tests of the watch app: exact screens at 80x24 and at a large size.

The app is fed through the snapshot-source seam (tests.support.snapsource, no
socket): its clock is frozen and the synthetic run's messages carry fixed
sender clocks, so every figure on screen (elapsed time, ages, rates, lag) is
the same on every run. The SVGs live in tests/unit/__snapshots__/ (syrupy
keys them by this module's folder and name); after a deliberate change
to the UI, review and accept new ones with ``pytest --snapshot-update``.
Textual is pinned in the dev extras: its rendering changes between versions.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from textual.pilot import Pilot

from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.ui.app import WatchApp, build_app
from ddpscope.ui.detail import RankDetailScreen
from tests.support.snapsource import MonitorSource
from tests.support.synth import SyntheticRun, clock_at
from tests.unit.test_ui_collectives import batchnorm_run

# Rank 5 turns slow at step 20: the step-time view shows the onset.
RUN = dict(run_id="snapshot-run", world=8, buckets=12, slow_rank=5, slow_ms=60, slow_from=20)
STEPS = 60

SnapCompare = Callable[..., bool]


@pytest.fixture
def app() -> WatchApp:
    run = SyntheticRun(**RUN)  # type: ignore[arg-type]
    # Received in one burst with the clock at the last step, as a live feed would take it.
    source = MonitorSource.of(
        run.opening() + run.steps(0, STEPS), [StragglerDetector()], clock=clock_at(run, STEPS)
    )
    return build_app(source, pull_s=0.05)


def settled(app: WatchApp) -> bool:
    """Everything ingested, the straggler found, and a snapshot with an empty lag window shown."""
    snap = app.snapshot
    return (
        snap is not None
        and bool(snap.findings)
        and snap.health.lag_s == -1
        and any(r.status == "straggler" for r in snap.rows)
    )


async def wait_settled(pilot: Pilot[None], extra: Callable[[], bool] = lambda: True) -> None:
    app = pilot.app
    assert isinstance(app, WatchApp)
    deadline = time.monotonic() + 15
    while not (settled(app) and extra()):
        assert time.monotonic() < deadline, "the app never settled"
        await pilot.pause(0.05)
    await pilot.pause(0.2)  # one more pull, so every panel shows the same snapshot


def test_main_view_at_80x24(app: WatchApp, snap_compare: SnapCompare) -> None:
    assert snap_compare(app, terminal_size=(80, 24), run_before=wait_settled)


def test_step_time_view_at_80x24(app: WatchApp, snap_compare: SnapCompare) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await pilot.press("2")
        await wait_settled(pilot, lambda: bool(app.steps.rows and app.steps.rows[0].recent_busy_ms))

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_bucket_view_at_80x24(app: WatchApp, snap_compare: SnapCompare) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await pilot.press("3")
        await wait_settled(pilot, lambda: app.buckets.matrix is not None)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_findings_view_at_80x24(app: WatchApp, snap_compare: SnapCompare) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await pilot.press("4")
        await wait_settled(pilot)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_rank_detail_at_80x24(app: WatchApp, snap_compare: SnapCompare) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await wait_settled(pilot)
        await pilot.press("enter")  # the cursor starts on the first row: the straggler
        await wait_settled(
            pilot,
            lambda: isinstance(app.screen, RankDetailScreen) and app.screen.detail is not None,
        )

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_dashboard_at_200x50(app: WatchApp, snap_compare: SnapCompare) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await wait_settled(pilot, lambda: app.buckets.matrix is not None and bool(app.steps.rows))

    assert snap_compare(app, terminal_size=(200, 50), run_before=run_before)


# --- a run with collective waits -----------------------------------------------------------


@pytest.fixture
def bn_app() -> WatchApp:
    """Three ranks with BatchNorm and a loss all-reduce; rank 1 loads data 20 ms longer,
    so the others wait in DDP's buffer broadcast (see test_ui_collectives.py)."""
    source = MonitorSource.of(batchnorm_run(), [StragglerDetector()])
    return build_app(source, pull_s=0.05)


async def shown(pilot: Pilot[None], *keys: str) -> None:
    await pilot.pause(0.1)
    await pilot.press(*keys)
    await pilot.pause(0.2)


def test_collective_waits_main_view_at_80x24(bn_app: WatchApp, snap_compare: SnapCompare) -> None:
    assert snap_compare(bn_app, terminal_size=(80, 24), run_before=shown)


def test_collective_waits_phases_view_at_80x24(bn_app: WatchApp, snap_compare: SnapCompare) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await shown(pilot, "6")

    assert snap_compare(bn_app, terminal_size=(80, 24), run_before=run_before)


def test_collective_waits_rank_detail_at_80x34(bn_app: WatchApp, snap_compare: SnapCompare) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await shown(pilot, "enter")  # the straggler, first as problem ranks sort first

    assert snap_compare(bn_app, terminal_size=(80, 34), run_before=run_before)


def test_collective_waits_finding_card_at_80x40(
    bn_app: WatchApp, snap_compare: SnapCompare
) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await shown(pilot, "4")

    assert snap_compare(bn_app, terminal_size=(80, 40), run_before=run_before)


def test_collective_waits_dashboard_at_200x50(bn_app: WatchApp, snap_compare: SnapCompare) -> None:
    assert snap_compare(bn_app, terminal_size=(200, 50), run_before=shown)
