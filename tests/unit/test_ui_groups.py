"""The watch UI at cluster scale: hosts view, problem strip and filter, at 4,096 ranks.

The app is the real one, driven by its Pilot through the snapshot-source
seam (tests/support/cluster.py over tests/support/snapsource.py): 4,096 ranks on 512 hosts
of 8, rank 1365 (on node170) a straggler found by the straggler detector,
then rank 2730 (on node341) hung in its forward while every other rank
waits in the all-reduce, found by the hang detector. What the tests read is
the screen as drawn (the compositor's strips), not the widgets' data.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from textual.pilot import Pilot

from ddpscope.analysis.build import default_detectors
from ddpscope.analysis.detectors.hang import HangDetector
from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.analysis.hosts import group_rows
from ddpscope.analysis.snapshot import ERROR, OK, WARNING, RankRow
from ddpscope.ui import format as fmt
from ddpscope.ui.app import WatchApp, build_app
from ddpscope.ui.help import HelpScreen
from ddpscope.ui.hosts import HostLine, _problems
from ddpscope.ui.rankfilter import parse
from ddpscope.ui.ranks import COLUMNS as RANK_COLUMNS
from tests.support.cluster import Prebuilt, cluster_run, host_of, source

WORLD = 4096
SLOW, HUNG = 1365, 2730

Scenario = Callable[[Pilot[None]], Awaitable[None]]


@pytest.fixture(scope="module")
def cluster() -> Prebuilt:
    """Built once for the module (~5-10 s): every test's app shares its snapshots."""
    msgs = cluster_run(WORLD, slow=SLOW, hang=HUNG)
    return Prebuilt(source(msgs, [StragglerDetector(), HangDetector()]))


@pytest.fixture(scope="module")
def healthy() -> Prebuilt:
    msgs = cluster_run(1024)
    return Prebuilt(source(msgs, [StragglerDetector(), HangDetector()]))


def drive(src: Prebuilt, scenario: Scenario, size: tuple[int, int] = (160, 45)) -> WatchApp:
    app = build_app(src, pull_s=3600.0)  # one pull at start; the run is frozen anyway

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await scenario(pilot)

    asyncio.run(main())
    return app


def screen(app: WatchApp) -> list[str]:
    """The screen's lines as drawn."""
    return [strip.text for strip in app.screen._compositor.render_strips()]


def table_ranks(app: WatchApp) -> list[int]:
    return [row.rank for row in app.ranks.rows]


# --- the parts, without the app ---------------------------------------------------


def row(
    rank: int, host: str, status: str = "ok", level: int = OK, step_ms: float = 10.0
) -> RankRow:
    return RankRow(
        rank,
        host,
        5,
        0,
        step_ms,
        1.0,
        2.0,
        4.0,
        1.0,
        2.0,
        50.0,
        1 << 20,
        0.5,
        "data",
        status,
        level,
    )


def test_a_filter_keeps_ranks_ranges_host_names_and_badges() -> None:
    rows = [row(r, host_of(r)) for r in range(64)] + [row(64, "gpu-b7", "silent", ERROR)]
    kept = lambda text: [r.rank for r in parse(text).apply(rows)]  # noqa: E731
    assert kept("3") == [3]
    assert kept("12-14, 40") == [12, 13, 14, 40]
    assert kept("14-12") == [12, 13, 14]  # backwards means the same ranks
    assert kept("node003") == list(range(24, 32))
    assert kept("NODE00") == list(range(64))  # part of a name, case ignored
    assert kept("silent") == [64]
    assert kept("B7 2") == [2, 64]  # any term
    assert kept("node999") == []
    assert kept("  ") == list(range(65)) and parse("").empty


def test_every_status_fits_its_column_as_a_badge_of_its_own() -> None:
    # Cut to the column, "missing_set_epoch" showed as "missing_se" and
    # "checkpoint_all_ranks" as "checkpoint"; each kind gets a badge that fits.
    kinds = {k for det in default_detectors() for k in det.kinds}
    statuses = kinds | {"ok", "exited", "silent", "disabled", "no data"}
    badges = {s: fmt.badge(s) for s in statuses}
    assert all(len(b) <= fmt.BADGE_W for b in badges.values()), badges
    assert len(set(badges.values())) == len(badges)  # no two read alike
    assert set(fmt.BADGES) <= kinds  # no badge for a kind that is gone


def test_a_rank_is_found_by_its_badge_or_by_its_findings_kind() -> None:
    rows = [row(0, "a"), row(1, "a", "missing_set_epoch", WARNING), row(2, "b", "dataparallel")]
    kept = lambda text: [r.rank for r in parse(text).apply(rows)]  # noqa: E731
    assert kept("set_epoch") == kept("missing_set_epoch") == [1]
    assert kept("nn.DP") == kept("dataparallel") == [2]
    ranks_status = next(c for c in RANK_COLUMNS if c.key == "status")
    assert ranks_status.text(rows[1]) == "set_epoch"
    host = group_rows(rows)[0]
    assert "1 set_epoch" in _problems(host, {r.rank: r for r in rows})


def test_hosts_group_their_ranks_worst_first_with_the_worst_figures() -> None:
    rows = [row(r, host_of(r)) for r in range(24)]
    rows[13] = row(13, "node001", "straggler", WARNING, step_ms=30.0)
    rows[20] = row(20, "node002", "hang", ERROR)
    rows[21] = row(21, "node002", "silent", ERROR)
    groups = group_rows(rows)
    assert [g.host for g in groups] == ["node002", "node001", "node000"]
    hung, slow, fine = groups
    assert hung.ranks == tuple(range(16, 24)) and hung.problems == 2
    assert hung.kinds == ("hang", "silent") and hung.worst_rank == 20
    assert slow.status == "straggler" and slow.worst_rank == 13 and slow.step_ms == 30.0
    assert slow.busy_ms == 30.0 - 2.0  # its own work: step less the all-reduce wait
    assert fine.level == OK and fine.problems == 0 and fine.kinds == ()


# --- 4,096 ranks in the app -----------------------------------------------------------


def test_the_straggler_and_the_hang_are_on_the_first_screen_at_4096_ranks(
    cluster: Prebuilt,
) -> None:
    for size in ((160, 45), (80, 24)):
        drawn: list[str] = []

        async def look(pilot: Pilot[None], drawn: list[str] = drawn) -> None:
            drawn.extend(screen(pilot.app))  # type: ignore[arg-type]

        drive(cluster, look, size)
        text = "\n".join(drawn)
        assert f"hang rank {HUNG} on {host_of(HUNG)}" in text, size
        assert f"straggler rank {SLOW} on {host_of(SLOW)}" in text, size
        strip = next(i for i, line in enumerate(drawn) if "✖ hang" in line)
        assert strip < 6, "the problem strip sits right under the header and view bar"


def test_the_problem_strip_stays_when_the_table_is_sorted_away_from_the_problems(
    cluster: Prebuilt,
) -> None:
    async def sort_by_rank(pilot: Pilot[None]) -> None:
        app = pilot.app
        assert isinstance(app, WatchApp)
        await pilot.press("less_than_sign")  # status -> rank
        await pilot.pause()
        assert app.ranks.sort_column == "rank" and table_ranks(app)[:3] == [0, 1, 2]
        text = "\n".join(screen(app))
        assert f"rank {HUNG} on" in text and f"rank {SLOW} on" in text

    drive(cluster, sort_by_rank)


def test_the_hosts_view_puts_the_problem_hosts_first_and_opens_them(cluster: Prebuilt) -> None:
    async def hosts(pilot: Pilot[None]) -> None:
        app = pilot.app
        assert isinstance(app, WatchApp)
        await pilot.press("7")
        await pilot.pause()
        lines = [line for line in screen(app) if line.lstrip().startswith(("▸", "▾"))]
        assert len(app.hosts.groups) == WORLD // 8
        assert lines[0].split()[1] == host_of(HUNG) and "hang" in lines[0]
        assert lines[1].split()[1] == host_of(SLOW) and "straggler" in lines[1]
        assert "ok" in lines[2]
        await pilot.press("enter")  # the cursor starts on the worst host
        await pilot.pause()
        items = app.hosts.rows
        assert isinstance(items[0], HostLine) and items[0].expanded
        opened = [it.rank for it in items[1:9]]
        assert opened[0] == HUNG and sorted(opened) == list(range(2728, 2736))
        assert any(f"rank {HUNG}" in line for line in screen(app))
        assert app.selected == HUNG  # the host stands for its worst rank in the other views
        await pilot.press("down", "enter")  # the hung rank's own line: its detail
        await pilot.pause()
        assert app._detail_screen() is not None and app._detail_screen().rank == HUNG

    drive(cluster, hosts)


def test_filter_by_range_host_and_both_then_escape_shows_every_rank(cluster: Prebuilt) -> None:
    async def filtering(pilot: Pilot[None]) -> None:
        app = pilot.app
        assert isinstance(app, WatchApp)
        assert "Clear filter" not in app.keys_line.plain and "Filter" in app.keys_line.plain

        async def type_filter(text: str) -> None:
            await pilot.press("slash")
            await pilot.pause()
            assert app.filter_prompt.bar.has_focus
            await pilot.press(*text, "enter")
            await pilot.pause()

        await type_filter("1360-1370")
        assert table_ranks(app)[0] == SLOW  # problem first within the filter too
        assert sorted(table_ranks(app)) == list(range(1360, 1371))
        assert "1360-1370: 11 of 4096 ranks" in screen(app)[3]
        assert "Clear filter" in app.keys_line.plain

        await type_filter(host_of(HUNG))
        assert table_ranks(app)[0] == HUNG and sorted(table_ranks(app)) == list(range(2728, 2736))

        await type_filter(f"{SLOW},{host_of(HUNG)}")
        assert sorted(table_ranks(app)) == [SLOW, *range(2728, 2736)]
        await pilot.press("7")
        await pilot.pause()
        assert [g.host for g in app.hosts.groups] == [host_of(HUNG), host_of(SLOW)]
        await pilot.press("1")
        await pilot.pause()

        await pilot.press("escape")
        await pilot.pause()
        assert len(app.ranks.rows) == WORLD and app.rank_filter.empty
        assert "of 4096 ranks" not in screen(app)[3]
        assert "Clear filter" not in app.keys_line.plain

    drive(cluster, filtering)


def test_escape_in_the_prompt_keeps_the_filter_and_an_empty_one_clears_it(
    cluster: Prebuilt,
) -> None:
    async def prompt(pilot: Pilot[None]) -> None:
        app = pilot.app
        assert isinstance(app, WatchApp)
        app.set_filter("0-15")
        await pilot.pause()
        await pilot.press("slash", "9", "escape")
        await pilot.pause()
        assert app.rank_filter.text == "0-15" and len(app.ranks.rows) == 16
        assert app.ranks.has_focus and app.keys_line.display
        await pilot.press("slash", *["backspace"] * 4, "enter")
        await pilot.pause()
        assert app.rank_filter.empty and len(app.ranks.rows) == WORLD

    drive(cluster, prompt)


def test_help_lists_the_filter_and_hosts_keys(cluster: Prebuilt) -> None:
    async def help_screen(pilot: Pilot[None]) -> None:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(pilot.app.screen, HelpScreen)
        text = "\n".join(screen(pilot.app))  # type: ignore[arg-type]
        assert "filter the rank views" in text and "hosts: one line per host" in text

    drive(cluster, help_screen, (120, 60))


# --- the other side: a healthy run --------------------------------------------------


def test_a_healthy_1024_rank_run_shows_no_problem_strip(healthy: Prebuilt) -> None:
    async def look(pilot: Pilot[None]) -> None:
        app = pilot.app
        assert isinstance(app, WatchApp)
        assert not app.problems.display and app.problems.plain == ""
        assert not any(line.lstrip().startswith(("✖", "▲")) for line in screen(app))
        await pilot.press("7")
        await pilot.pause()
        hosts = [g.host for g in app.hosts.groups]
        assert hosts == sorted(hosts) and all(g.level == OK for g in app.hosts.groups)

    drive(healthy, look)
