"""What a key costs the watch app: a key that changes no row rebuilds none, asks for no snapshot.

At 4,096 ranks a key is answered in time only if it redraws what it changed
and nothing else (benchmarks/ui_keys.py measures it). These tests pin the
behaviour that makes it so, on the real app driven by its Pilot through the
snapshot-source seam: views handed the rows they show already keep them, a
view switch that needs no other snapshot asks for none, the finding cards
are laid out once per change of the findings, and the rank detail is one
screen, built once and shown for each rank it is opened for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from textual.pilot import Pilot

from ddpscope.analysis.detectors.hang import HangDetector
from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.ui.app import WatchApp, build_app
from ddpscope.ui.detail import RankDetailScreen
from ddpscope.ui.rows import RowsView
from tests.support.cluster import cluster_run, source
from tests.support.snapsource import MonitorSource

WORLD = 64
DASHBOARD = (200, 50)
NARROW = (80, 24)

Scenario = Callable[[Pilot[None]], Awaitable[None]]


@pytest.fixture
def feed() -> MonitorSource:
    """A source that builds a new snapshot (a new ``seq``) for every request."""
    return source(cluster_run(WORLD, slow=21, hang=42), [StragglerDetector(), HangDetector()])


def drive(src: MonitorSource, scenario: Scenario, size: tuple[int, int]) -> WatchApp:
    app = build_app(src, pull_s=3600.0)  # no pull but the first and those keys make

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await scenario(pilot)

    asyncio.run(main())
    return app


def row_views(app: WatchApp) -> list[RowsView]:  # type: ignore[type-arg]
    return [app.ranks, app.phases, app.steps, app.buckets]


def test_view_keys_on_the_dashboard_ask_for_no_snapshot_and_keep_every_views_rows(
    feed: MonitorSource,
) -> None:
    async def scenario(pilot: Pilot[None]) -> None:
        app = pilot.app
        assert isinstance(app, WatchApp) and app.snapshot is not None
        shown = app.snapshot
        rows = [view.rows for view in row_views(app)]
        assert all(rows)
        # The job log (5) needs less than the snapshot shown: it waits for the next pull.
        for key in ("2", "3", "5", "6", "1"):
            await pilot.press(key)
            await pilot.pause()
            assert app.view != "hosts" and app.snapshot is shown, key
            assert [view.rows for view in row_views(app)] == rows
            assert all(a is b for a, b in zip(rows, [v.rows for v in row_views(app)], strict=True))

    drive(feed, scenario, DASHBOARD)


def test_a_view_that_needs_what_the_snapshot_lacks_asks_for_it(feed: MonitorSource) -> None:
    async def scenario(pilot: Pilot[None]) -> None:
        app = pilot.app
        assert isinstance(app, WatchApp) and app.snapshot is not None
        first = app.snapshot
        assert not first.rows[0].recent_busy_ms  # the ranks view alone asks for no series
        await pilot.press("2")
        await pilot.pause()
        assert app.snapshot is not first and app.snapshot.rows[0].recent_busy_ms
        assert app.snapshot.buckets is None
        await pilot.press("3")
        await pilot.pause()
        assert app.snapshot.buckets is not None

    drive(feed, scenario, NARROW)


def test_a_re_sort_reorders_the_rows_without_a_new_snapshot(feed: MonitorSource) -> None:
    async def scenario(pilot: Pilot[None]) -> None:
        app = pilot.app
        assert isinstance(app, WatchApp) and app.snapshot is not None
        shown = app.snapshot
        before = [r.rank for r in app.ranks.rows]
        await pilot.press("less_than_sign")  # status -> rank: ranks in order
        await pilot.pause()
        assert app.snapshot is shown and app.ranks.sort_column == "rank"
        assert [r.rank for r in app.ranks.rows] == sorted(before)
        assert [r.rank for r in app.phases.rows] == sorted(before)  # every view in that order

    drive(feed, scenario, DASHBOARD)


def test_the_rank_detail_is_one_screen_shown_for_each_rank_it_is_opened_for(
    feed: MonitorSource,
) -> None:
    async def scenario(pilot: Pilot[None]) -> None:
        app = pilot.app
        assert isinstance(app, WatchApp)
        first = app.ranks.cursor_rank
        await pilot.press("enter")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, RankDetailScreen) and screen.rank == first
        assert screen.detail is not None and screen.detail.rank == first
        await pilot.press("escape", "down")
        await pilot.pause()
        second = app.ranks.cursor_rank
        assert second != first
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is screen and screen.rank == second
        assert screen.detail is not None and screen.detail.rank == second
        assert str(screen._summary.content).startswith(f"rank {second} ")
        await pilot.press("right")  # the next rank in the table, on the same screen
        await pilot.pause()
        third = [r.rank for r in app.ranks.rows][2]
        assert app.screen is screen and screen.rank == third
        assert screen.detail is not None and screen.detail.rank == third

    drive(feed, scenario, NARROW)


def test_a_detail_reopened_for_another_rank_while_paused_shows_that_rank(
    feed: MonitorSource,
) -> None:
    async def scenario(pilot: Pilot[None]) -> None:
        app = pilot.app
        assert isinstance(app, WatchApp)
        await pilot.press("space", "enter")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, RankDetailScreen) and screen.detail is not None
        await pilot.press("escape", "down", "enter")
        await pilot.pause()
        assert app.screen is screen and screen.rank == app.ranks.cursor_rank
        # Paused, a rank's first detail still comes; the last rank's is not kept for it.
        assert screen.detail is not None and screen.detail.rank == screen.rank

    drive(feed, scenario, NARROW)


def test_the_finding_cards_shown_again_are_the_lines_laid_out_before(feed: MonitorSource) -> None:
    async def scenario(pilot: Pilot[None]) -> None:
        app = pilot.app
        assert isinstance(app, WatchApp)
        cards = app.findings._cards
        await pilot.press("4")  # full cards, in place of the compact lines
        await pilot.pause()
        laid_out = dict(cards._laid_out)
        assert laid_out and cards.display
        drawn = [strip.text for strip in app.screen._compositor.render_strips()]
        assert any("hang" in line for line in drawn)
        await pilot.press("1", "4")  # compact lines under the ranks, then the cards again
        await pilot.pause()
        assert cards.display and all(
            cards._laid_out.get(key) is strips for key, strips in laid_out.items()
        )
        assert [strip.text for strip in app.screen._compositor.render_strips()] == drawn

    drive(feed, scenario, NARROW)
