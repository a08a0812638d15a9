"""The watch app on runs with collective waits, through the snapshot-source seam.

The app is driven with its Pilot as in test_ui.py, fed by
:class:`tests.support.snapsource.MonitorSource` (a Monitor over synthetic messages, no
socket), so each test reads exact screens within a second. The run: three
ranks with BatchNorm (DDP broadcasts buffers at each forward) and a loss
all-reduce each step; rank 1 loads data 20 ms longer from step 5, so ranks 0
and 2 wait for it in the buffer broadcast, not in the gradient all-reduce.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

import pytest
from rich.console import Console, RenderableType
from textual.pilot import Pilot
from textual.widget import Widget

from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.analysis.snapshot import PhaseRow
from ddpscope.schema import Message
from ddpscope.ui.app import WatchApp, build_app
from ddpscope.ui.detail import RankDetailScreen, collectives_table, phase_table
from ddpscope.ui.findings import FindingsPanel, card
from ddpscope.ui.phases import SEGMENTS, PhaseBars
from ddpscope.ui.ranks import RanksTable
from tests.support.pilot import lines
from tests.support.snapsource import MonitorSource
from tests.support.synth import (
    MS,
    constant,
    heartbeat,
    lockstep,
    run_infos,
    straggler,
    with_collectives,
)

SLOW = 1
SPLIT = ("ar wt", "sync", "coll", "data", "fwd", "bwd", "opt", "other")


def batchnorm_run(steps: int = 80) -> list[Message]:
    slow = straggler(constant(), SLOW, start=5, extra_ns={"data": 20 * MS})
    return [
        *run_infos(3),
        *with_collectives(
            lockstep(3, steps, slow), sync_ns=MS // 2, coll_ns=MS // 4, wait_in_sync=True
        ),
    ]


def app_of(msgs: list[Message], with_straggler: bool = False) -> WatchApp:
    detectors = []
    if with_straggler:
        detectors = [StragglerDetector()]
    return build_app(MonitorSource.of(msgs, detectors), pull_s=0.05)


def drive(
    app: WatchApp, scenario: Callable[[Pilot[None]], Awaitable[None]], size: tuple[int, int]
) -> None:
    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.1)  # the first pulls
            await scenario(pilot)

    asyncio.run(main())


def text_of(widget: Widget) -> str:
    return "\n".join(widget.render_line(y).text.rstrip() for y in range(widget.size.height))


def plain(renderable: RenderableType, width: int = 80) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def columns_of(table: RanksTable) -> dict[int, dict[str, str]]:
    """Each shown rank's cells by column label, cut at the table's column widths."""
    out = {}
    for row in table.rows:
        cells = {}
        for c in table.columns:
            cells[c.label] = c.text(row).strip()
        out[row.rank] = cells
    return out


# --- the ranks table ----------------------------------------------------------------------


def test_sync_and_coll_columns_appear_and_the_split_adds_up_to_the_step() -> None:
    app = app_of(batchnorm_run())

    async def scenario(pilot: Pilot[None]) -> None:
        table = app.query_one(RanksTable)
        header = lines(table)[0].split()
        assert header[header.index("ms") + 1 : header.index("ms") + 10] == [
            "ar", "wt", "sync", "coll", "data", "fwd", "bwd", "opt", "other",
        ]  # fmt: skip
        for r in table.rows:
            parts = (r.wait_ms, r.sync_ms, r.coll_ms, r.data_ms, r.forward_ms, r.backward_ms)
            assert sum(parts) + r.optimizer_ms + r.other_ms == pytest.approx(r.step_ms)
        cells = columns_of(table)
        for rank, row in cells.items():  # and as shown, up to each cell's rounding
            split = sum(float(row[name]) for name in SPLIT)
            assert split == pytest.approx(float(row["step ms"]), abs=0.1), rank
        # The waiters wait in the buffer broadcast; the slow rank's data phase grew.
        assert float(cells[0]["sync"]) > 19 and float(cells[SLOW]["sync"]) < 1
        assert float(cells[SLOW]["data"]) > 20 and float(cells[0]["data"]) < 1
        assert {row["coll"] for row in cells.values()} == {"0.25"}

    drive(app, scenario, (100, 30))


def test_runs_without_collective_waits_keep_the_80_column_table() -> None:
    app = app_of([*run_infos(2), *lockstep(2, 20, constant())])

    async def scenario(pilot: Pilot[None]) -> None:
        header = lines(app.query_one(RanksTable))[0]
        assert "sync" not in header and "coll" not in header
        # Everything up to the CPU column still fits in 80 columns.
        assert header.split()[-2:] == ["other", "cpu%"]

    drive(app, scenario, (80, 24))


def test_a_rank_blocked_in_a_collective_shows_its_name_and_the_time_in_it() -> None:
    msgs = batchnorm_run(20)
    t = max(m.t for m in msgs)
    msgs += [
        heartbeat(0, 20, t + 1, phase="collective", in_phase_s=70.0, coll_op="broadcast",
                  coll_class="ddp"),
        heartbeat(2, 20, t + 1, phase="collective", in_phase_s=3.25, coll_op="all_reduce",
                  coll_class="user", coll_site="/job/train.py:42 in train"),
        heartbeat(1, 19, t + 1, phase="data", in_phase_s=70.0),
    ]  # fmt: skip
    app = app_of(msgs)

    async def scenario(pilot: Pilot[None]) -> None:
        table = app.query_one(RanksTable)
        shown = {int(ln.split()[0]): ln for ln in lines(table)[1:4]}
        assert "broadcast (DDP) 70s" in shown[0]
        assert "all_reduce 3.2s" in shown[2]
        assert "data 70s" in shown[SLOW]
        await pilot.press("down", "down")
        cursor = table.cursor_rank
        await pilot.press("enter")
        await pilot.pause(0.1)
        screen = app.screen
        assert isinstance(screen, RankDetailScreen) and screen.detail is not None
        summary = text_of(screen.query_one("#detail-summary"))
        if cursor == 2:
            assert "blocked in all_reduce for 3.2s at /job/train.py:42 in train" in summary
        else:
            assert cursor == 0 and "blocked in broadcast (DDP) for 70s" in summary

    drive(app, scenario, (139, 30))  # one view, wide enough for the phase column


# --- each rank's step as a bar ----------------------------------------------------------------


def test_phases_view_shows_the_slow_ranks_own_work_and_the_others_waits_as_bars() -> None:
    app = app_of(batchnorm_run())

    async def scenario(pilot: Pilot[None]) -> None:
        await pilot.press("6")
        bars = app.query_one(PhaseBars)
        await pilot.pause(0.1)
        assert bars.display and bars.has_focus
        header = lines(bars)[0]
        assert all(label in header for label, *_ in SEGMENTS) and "0-28.8 ms" in header
        by_rank: dict[int, dict[str, int]] = {}
        for y in range(1, 4):
            strip = bars.render_line(y)
            rank = int(strip.text.split()[0])
            cells: dict[str, int] = {}
            for seg in strip:
                colour = seg.style.color.name if seg.style and seg.style.color else ""
                for label, _, hex_colour, glyph in SEGMENTS:
                    if colour == hex_colour and seg.text.strip(" ") == glyph * len(seg.text):
                        cells[label] = cells.get(label, 0) + len(seg.text)
            by_rank[rank] = cells
        width = bars.bar_width()
        # Equal step times: every bar fills the scale.
        assert all(sum(c.values()) == width for c in by_rank.values())
        # The slow rank's data block is most of its bar; the others' bars are mostly sync wait.
        assert by_rank[SLOW]["data"] > 0.6 * width and by_rank[SLOW].get("sync", 0) < 3
        assert by_rank[0]["sync"] > 0.6 * width and by_rank[0]["data"] < 3

    drive(app, scenario, (100, 30))


def test_the_dashboard_shows_the_bars_with_the_table_and_the_sparklines() -> None:
    app = app_of(batchnorm_run())

    async def scenario(pilot: Pilot[None]) -> None:
        bars, table = app.query_one(PhaseBars), app.query_one(RanksTable)
        assert bars.display and table.display
        assert table.region.bottom <= bars.region.y
        assert len(bars.rows) == 3

    drive(app, scenario, (200, 50))


# --- rank detail ----------------------------------------------------------------------


def test_rank_detail_lists_every_collective_of_the_last_step_with_its_call_site() -> None:
    app = app_of(batchnorm_run())

    async def scenario(pilot: Pilot[None]) -> None:
        await pilot.press("enter")  # the first row: rank 0 (no finding: rank order)
        await pilot.pause(0.1)
        screen = app.screen
        assert isinstance(screen, RankDetailScreen) and screen.detail is not None
        d = screen.detail
        assert d.collectives_step == 79
        assert [(c.op, c.cls) for c in d.collectives] == [
            ("all_reduce", "user"), ("broadcast", "ddp"), ("all_reduce", "grad"),
        ]  # fmt: skip
        text = text_of(screen.query_one("#detail-collectives"))
        assert "collectives of step 79" in text
        start = next(i for i, ln in enumerate(text.splitlines()) if "collectives of" in ln)
        table = text.splitlines()[start + 2 : start + 5]
        rows = {ln.split()[0] + " " + ln.split()[1]: ln for ln in table}
        assert "DDP gradients, 4 buckets" in rows["all_reduce DDP"]
        assert (
            "/job/train.py:42 in train" in rows["all_reduce user"]
            and "4B" in rows["all_reduce user"]
        )
        assert "DDP buffers" in rows["broadcast DDP"]
        blocked = sum(c.blocked_ms for c in d.collectives)
        last = d.phases[-1]
        assert blocked == pytest.approx(last.wait_ms + last.sync_ms + last.coll_ms)
        history = text_of(screen.query_one("#detail-phases")).splitlines()
        assert history[0].startswith("phase history") and history[1].split() == [
            "step", "ep", "total", "data", "fwd", "bwd", "ar", "wt", "sync", "coll", "opt",
            "other", "mb",
        ]  # fmt: skip

    drive(app, scenario, (80, 40))


def test_the_total_column_of_the_history_is_never_cut() -> None:
    row = PhaseRow(
        step=12345, epoch=3, total_ms=27_412.0, data_ms=27_000.0, forward_ms=12.5,
        backward_ms=250.0, wait_ms=0.01, optimizer_ms=99.9, other_ms=50.0, micro_batches=1,
        optimizer_steps=1, sync_ms=1234.5, coll_ms=0.5,
    )  # fmt: skip
    text = plain(phase_table((row,)), width=70)
    assert "…" not in text
    assert text.splitlines()[2].split() == [
        "12345", "3", "27412", "27000", "12.5", "250", "0.01", "1234", "0.50", "99.9", "50.0", "1",
    ]  # fmt: skip


def test_a_step_without_collectives_says_so() -> None:
    assert "none in the last step" in plain(collectives_table((), -1, 0))


# --- findings ----------------------------------------------------------------------------------


def test_finding_cards_show_the_evidence_as_tables_with_ranks_as_columns() -> None:
    app = app_of(batchnorm_run(), with_straggler=True)

    async def scenario(pilot: Pilot[None]) -> None:
        await pilot.press("4")
        await pilot.pause(0.1)
        panel = app.query_one(FindingsPanel)
        assert panel.findings and panel.findings[0].kind == "straggler"
        text = plain(card(panel.findings[0]), width=78)
        assert "{rank:" not in text and "phases_ms=" not in text
        lines_ = [ln.rstrip() for ln in text.splitlines()]
        title = lines_.index("phases_ms")
        assert lines_[title + 1].split() == ["rank", "others", "delta"]
        data = lines_[title + 2].split()
        assert data[0] == "data" and float(data[3]) == pytest.approx(20, abs=0.5)
        # Facts two to a line, sizes as sizes.
        facts = " ".join(lines_[:title])
        assert re.search(r"waiting_ranks +0, 2 ", facts) and re.search(r"rss_bytes +512 MiB", facts)
        assert re.search(r"grown_phases +data ", facts) and re.search(r"ratio +3.581 ", facts)

    drive(app, scenario, (80, 30))
