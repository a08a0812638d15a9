"""The watch app driven by Pilot, fed a synthetic run through the snapshot-source seam.

The source is a real Monitor on the app's own thread with a frozen clock that
follows the messages (tests.support.snapsource), so a test hands it messages
and the next pull shows them. Over real ZeroMQ: tests/e2e/test_ui_sockets.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from textual.pilot import Pilot

from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.schema import Message, Step
from ddpscope.ui import format as fmt
from ddpscope.ui.app import WatchApp, build_app
from ddpscope.ui.buckets import BucketView
from ddpscope.ui.detail import RankDetailScreen
from ddpscope.ui.findings import CardLines, FindingsPanel, evidence_block
from ddpscope.ui.header import HeaderPanel
from ddpscope.ui.help import KEYS, HelpScreen, keys_beside
from ddpscope.ui.hosts import HostsView
from ddpscope.ui.logview import LogView
from ddpscope.ui.ranks import RanksTable
from ddpscope.ui.replay import REPLAY_KEYS
from ddpscope.ui.steptimes import METRICS, StepTimes
from tests.support.pilot import Scenario, drive, lines, until
from tests.support.snapsource import MonitorSource
from tests.support.synth import SyntheticRun, clock_at

SLOW = 4


@dataclass
class Rig:
    run: SyntheticRun
    source: MonitorSource

    def send(self, messages: list[Message]) -> None:
        self.source.send(messages)


def _rig(run: SyntheticRun) -> Rig:
    # The clock starts at the run's step 0 on its anchors and follows what is sent.
    source = MonitorSource.of([], [StragglerDetector()], clock=clock_at(run, 0), follow=True)
    return Rig(run, source)


@pytest.fixture
def rig() -> Rig:
    return _rig(SyntheticRun(world=6, buckets=8, slow_rank=SLOW, slow_ms=60))


def app_for(rig: Rig, **kwargs: object) -> WatchApp:
    return build_app(rig.source, pull_s=0.05, **kwargs)  # type: ignore[arg-type]


def _has_finding(app: WatchApp) -> bool:
    return app.snapshot is not None and any(f.kind == "straggler" for f in app.snapshot.findings)


# --- ranks table -------------------------------------------------------------------------


def test_ranks_table_lists_every_rank_and_puts_the_straggler_first(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        table = app.query_one(RanksTable)
        rig.send(rig.run.opening() + rig.run.steps(0, 60))
        await until(pilot, lambda: _has_finding(app) and table.rows[0].rank == SLOW)
        shown = lines(table)
        assert shown[0].split()[:3] == ["rank", "status▲", "step"]
        assert shown[1].split()[:3] == [str(SLOW), "straggler", "60"]
        assert [row.rank for row in table.rows] == [SLOW, 0, 1, 2, 3, 5]
        assert table.cursor_rank == SLOW  # the cursor stays on the worst rank until moved
        assert all(line.split()[1] == "ok" for line in shown[2:7])

    drive(app, scenario)


def test_sort_keys_cycle_columns_and_r_reverses(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        table = app.query_one(RanksTable)
        rig.send(rig.run.opening() + rig.run.steps(0, 10))
        await until(pilot, lambda: len(table.rows) == 6)
        await pilot.press("greater_than_sign", "greater_than_sign", "greater_than_sign")
        await pilot.press("greater_than_sign")
        assert table.sort_column == "wait_ms"
        await until(pilot, lambda: table.rows[-1].rank == SLOW)  # waits least: last
        assert "▼ar wt" in lines(table)[0]
        await pilot.press("r")
        await until(pilot, lambda: table.rows[0].rank == SLOW)
        assert "▲ar wt" in lines(table)[0]
        await pilot.press("less_than_sign")
        assert table.sort_column == "step_ms"

    drive(app, scenario)


def test_clicking_a_column_header_sorts_by_that_column(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        table = app.query_one(RanksTable)
        rig.send(rig.run.opening() + rig.run.steps(0, 10))
        await until(pilot, lambda: len(table.rows) == 6)
        shown = table.columns
        x = sum(c.width + 1 for c in shown[: [c.key for c in shown].index("cpu")]) + 1
        await pilot.click(RanksTable, offset=(x, 0))
        assert table.sort_column == "cpu"
        # cpu% is 95 + rank % 5 in the synthetic run: rank 4 (99%) first, biggest first.
        await until(pilot, lambda: [r.rank for r in table.rows][:2] == [4, 3])

    drive(app, scenario)


def test_cursor_moves_with_arrows_and_is_shared_by_every_rank_view(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        table = app.query_one(RanksTable)
        rig.send(rig.run.opening() + rig.run.steps(0, 10))
        await until(pilot, lambda: len(table.rows) == 6)
        await pilot.press("down", "down", "end", "up")
        assert table.cursor_rank == table.rows[4].rank == app.selected
        await pilot.press("2")
        steps = app.query_one(StepTimes)
        await until(pilot, lambda: len(steps.rows) == 6)
        assert steps.cursor_rank == app.selected and steps.has_focus

    drive(app, scenario)


# --- header ------------------------------------------------------------------------------


def test_header_shows_the_run_its_pace_and_the_monitors_health(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        header = app.query_one(HeaderPanel)
        await until(pilot, lambda: "WAITING" in header.plain)
        assert f"listening on {rig.source.endpoint}" in header.plain
        rig.send(rig.run.opening() + rig.run.steps(0, 20))
        await until(pilot, lambda: "step 20" in header.plain)
        first, second, health = header.plain.splitlines()
        assert "LIVE" in first and rig.run.run_id in first and "6 ranks on 1 host" in first
        assert "epoch 0" in second and "6.2 steps/s" in second  # 160 ms steps
        assert "rx 144" in health and "dropped 0" in health and "silent 0" in health

    drive(app, scenario)


# --- step times and buckets ------------------------------------------------------------------


def test_step_time_view_draws_a_sparkline_per_rank_where_the_straggler_stands_out(
    rig: Rig,
) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        rig.send(rig.run.opening() + rig.run.steps(0, 30))
        await pilot.press("2")
        steps = app.query_one(StepTimes)
        await until(pilot, lambda: len(steps.rows) == 6 and bool(steps.rows[0].recent_busy_ms))
        shown = {int(line.split()[0]): line for line in lines(steps)[1:7]}
        assert set(shown) == set(range(6))
        assert "█" * 30 in shown[SLOW] and shown[SLOW].split()[-2:] == ["160", "160"]
        assert "█" not in shown[0] and shown[0].split()[-2:] == ["100", "100"]
        await pilot.press("m")  # step time: equal on every rank
        assert steps.metric == "step"
        assert "step time" in lines(steps)[0]

    drive(app, scenario)


def test_bucket_view_shows_the_waiting_ranks_and_spares_the_slow_one(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        rig.send(rig.run.opening() + rig.run.steps(0, 12))
        await pilot.press("3")
        buckets = app.query_one(BucketView)
        await until(pilot, lambda: buckets.matrix is not None and len(buckets.rows) == 6)
        shown = {int(line.split()[0]): line for line in lines(buckets)[1:7]}
        assert "█" not in shown[SLOW] and shown[SLOW].split()[-1] == "0.00"
        assert all("██" in shown[r] and shown[r].split()[-1] == "60.0" for r in shown if r != SLOW)
        assert "steps 7-11" in lines(buckets)[0]

    drive(app, scenario)


def test_bucket_view_says_when_steps_came_without_bucket_timings() -> None:
    run = SyntheticRun(world=4, buckets=8)
    rig = _rig(run)
    app = app_for(rig)
    # What ranks on DDP's C++ path send: no bucket arrays, b_every 0.
    untimed = [
        replace(m, b_detail=False, b_every=0, b_index=[], b_nbytes=[], b_offset_ns=[], b_dur_ns=[])
        if isinstance(m, Step)
        else m
        for m in run.steps(0, 12)
    ]

    async def scenario(pilot: Pilot[None]) -> None:
        await pilot.press("3")
        buckets = app.query_one(BucketView)
        rig.send(run.opening())
        await until(pilot, lambda: "no complete step yet" in lines(buckets)[0])
        rig.send(untimed)
        await until(pilot, lambda: len(buckets.rows) == 4 and buckets.rows[0].step > 0)
        assert buckets.matrix is None
        assert "DDPSCOPE_BUCKET_EVERY=1" in "".join(lines(buckets))

    drive(app, scenario, size=(120, 30))


# --- findings ------------------------------------------------------------------------------


def test_a_finding_appears_in_the_findings_panel_with_evidence_and_fix(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        panel = app.query_one(FindingsPanel)
        rig.send(rig.run.opening() + rig.run.steps(0, 5))
        await until(pilot, lambda: app.snapshot is not None and app.snapshot.header is not None)
        assert panel.findings == () and "No findings" in str(
            panel.query_one("#findings-body").render()
        )
        rig.send(rig.run.steps(5, 60))
        await until(pilot, lambda: bool(panel.findings))
        assert panel.compact  # squeezed under the table at 120 columns
        assert f"straggler rank {SLOW}" in panel.text
        await pilot.press("4")  # the findings view: full cards
        await until(pilot, lambda: not panel.compact)
        finding = panel.findings[0]
        assert finding.kind == "straggler" and finding.ranks == (SLOW,)
        assert finding.fix in panel.text and finding.evidence
        assert panel.border_title == "Findings: 1 active"

    drive(app, scenario)


GLOO_LOST = (
    'Traceback (most recent call last):\n  File "/data/exp[3]/train.py", line 9, in <module>\n'
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [127.0.0.1]:32436. [bold]not markup[/bold]\n"
)


def test_errors_that_look_like_markup_are_drawn_as_they_are() -> None:
    # A rank's error quoting gloo's source path ("[/__w/...]") once ended the app with
    # Rich's MarkupError while it drew the rank_exit card's evidence.
    from ddpscope.analysis.detectors.rank_exit import RankExitDetector

    run = SyntheticRun(world=3, buckets=2)
    source = MonitorSource.of([], [RankExitDetector()], clock=clock_at(run, 0), follow=True)
    app = build_app(source, pull_s=0.05)  # type: ignore[arg-type]

    async def scenario(pilot: Pilot[None]) -> None:
        panel = app.query_one(FindingsPanel)
        source.send(run.opening() + run.steps(0, 10))
        first = "Traceback (most recent call last):\nRuntimeError: simulated failure\n"
        source.send([replace(run.end(1, 10), reason="exception", error=first)])
        source.send([m for m in run.steps(10, 12) if m.rank != 1])
        # The others then lose their peer: their errors fill the evidence's table.
        source.send([replace(run.end(r, 12), reason="exception", error=GLOO_LOST) for r in (0, 2)])
        await until(pilot, lambda: bool(panel.findings))
        await pilot.press("4")  # full cards, with the evidence tables
        await until(pilot, lambda: not panel.compact)
        await pilot.pause(0.2)
        cards = app.query_one("#findings-cards", CardLines)
        drawn = "".join(s.text.rstrip() + " " for s in cards._lay_out(cards.size.width))
        assert drawn.count("RuntimeError: [/__w/pytor") == 2  # ranks 0 and 2, cut to fit

    drive(app, scenario, size=(200, 60))


def test_table_cells_titles_and_headers_are_literal() -> None:
    from rich.console import Console

    from ddpscope.analysis.evidence import EvidenceTable
    from ddpscope.analysis.snapshot import CollectiveRow
    from ddpscope.ui.detail import collectives_table

    console = Console(width=200, record=True, color_system=None)
    block = EvidenceTable(
        title="[/x] title", columns=("[b]key[/b]", "value"), rows=(("[i]k", "[/y] v"),)
    )
    console.print(evidence_block(block))
    row = CollectiveRow(
        op="all_reduce", cls="user", group="[g]", nbytes=8, offset_ms=1.0, blocked_ms=2.0,
        site="/runs/[/a]/train.py:3 in f",
    )  # fmt: skip
    console.print(collectives_table((row,), 7, 0))
    out = console.export_text()
    for literal in ("[/x] title", "[b]key[/b]", "[i]k", "[/y] v", "[g]", "[/a]/train.py:3"):
        assert literal in out, out


# --- rank detail and stacks ------------------------------------------------------------------


def test_enter_opens_the_rank_detail_and_escape_comes_back(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        table = app.query_one(RanksTable)
        rig.send(rig.run.opening() + rig.run.steps(0, 30))
        await until(pilot, lambda: len(table.rows) == 6)
        await pilot.press("down")
        chosen = table.cursor_rank
        await pilot.press("enter")
        screen = app.screen
        assert isinstance(screen, RankDetailScreen) and screen.rank == chosen
        await until(pilot, lambda: screen.detail is not None)
        assert screen.detail is not None
        assert [p.step for p in screen.detail.phases][-1] == 29
        assert screen.detail.fingerprint == "no fingerprint yet"
        await pilot.press("right")  # next rank in the table's order
        nxt = app.screen
        order = [r.rank for r in table.rows]
        following = order[(order.index(chosen) + 1) % len(order)]  # wraps past the last
        assert isinstance(nxt, RankDetailScreen) and nxt.rank == following
        await pilot.press("escape")
        assert app.screen.query_one(RanksTable) is table

    drive(app, scenario)


def test_s_asks_the_rank_for_fresh_stacks_and_the_detail_shows_them(rig: Rig) -> None:
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
        assert rig.source.requests == [("stacks", screen.rank)]
        rig.send([rig.run.stacks(screen.rank, 10)])  # the rank's answer
        await until(pilot, lambda: screen.detail is not None and screen.detail.stacks is not None)
        assert "train.py:88 in train" in screen.stacks_plain
        assert screen.detail.stacks_pending_s == -1
        await pilot.press("f")  # and a weight fingerprint, from every rank
        assert rig.source.requests[-1] == ("fingerprint", -1)

    drive(app, scenario)


# --- pause, help, layout ------------------------------------------------------------------------


def test_space_pauses_the_display_and_space_resumes_it(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        table = app.query_one(RanksTable)
        header = app.query_one(HeaderPanel)
        rig.send(rig.run.opening() + rig.run.steps(0, 10))
        await until(pilot, lambda: bool(table.rows) and table.rows[0].step == 10)
        await pilot.press("space")
        assert "PAUSED" in header.plain
        rig.send(rig.run.steps(10, 20))
        await pilot.pause(0.3)  # several pulls' worth
        assert table.rows[0].step == 10 and "step 10" in header.plain
        await pilot.press("enter")  # a rank opened while paused still gets its detail
        screen = app.screen
        assert isinstance(screen, RankDetailScreen)
        await until(pilot, lambda: screen.detail is not None)
        await pilot.press("escape", "space")
        await until(pilot, lambda: table.rows[0].step == 20)
        assert "LIVE" in header.plain

    drive(app, scenario)


def test_replays_help_gives_space_one_meaning() -> None:
    # It listed "space play / pause" and, under it, "space pause / resume the display".
    common = dict(keys_beside(REPLAY_KEYS))
    assert "space" not in common and "q" in common and "?  esc" in common
    assert dict(keys_beside(())) == dict(KEYS)


def test_question_mark_opens_help_and_escape_closes_it(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)

    drive(app, scenario)


def test_80x24_shows_one_view_with_the_findings_squeezed_beneath(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        rig.send(rig.run.opening() + rig.run.steps(0, 60))
        await until(pilot, lambda: _has_finding(app))
        table, panel = app.query_one(RanksTable), app.query_one(FindingsPanel)
        assert table.display and not app.query_one(StepTimes).display
        assert panel.compact and panel.region.height <= 8
        assert table.region.height >= 8  # the table keeps most of the screen
        assert table.region.bottom <= panel.region.y
        await pilot.press("4")
        assert not app.query_one("#views").display and not panel.compact

    drive(app, scenario, size=(80, 24))


def test_a_large_terminal_shows_every_panel_at_once(rig: Rig) -> None:
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        rig.send(rig.run.opening() + rig.run.steps(0, 60))
        await until(pilot, lambda: _has_finding(app))
        steps, buckets = app.query_one(StepTimes), app.query_one(BucketView)
        await until(pilot, lambda: len(steps.rows) == 6 and len(buckets.rows) == 6)
        table, panel = app.query_one(RanksTable), app.query_one(FindingsPanel)
        assert not panel.compact and panel.region.x > table.region.right - 1
        assert steps.region.y > table.region.y and buckets.region.x > steps.region.x

    drive(app, scenario, size=(200, 60))


def test_a_narrow_step_time_panel_keeps_its_whole_scale_in_its_title(rig: Rig) -> None:
    # Beside the findings on a 160-column terminal the panel is ~28 columns of
    # sparkline: the long metric name left "busy ms (step - waits), 0.00", which
    # read as a scale of zero.
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        rig.send(rig.run.opening() + rig.run.steps(0, 60))
        await until(pilot, lambda: _has_finding(app))
        steps = app.query_one(StepTimes)
        await until(pilot, lambda: len(steps.rows) == 6 and steps.high > 1)
        assert steps.display and steps.spark_width() < len(METRICS["busy"]) + 12
        title = lines(steps)[0]
        assert f"-{fmt.ms(steps.high, 7).strip()}" in title and "busy ms" in title

    drive(app, scenario, size=(160, 45))


def test_a_narrow_bucket_panel_keeps_its_max_column(rig: Rig) -> None:
    # Beside the findings on a 160-column terminal: the heat map was widened to 40
    # columns for its title whatever the room, and the max column fell off ("60").
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        rig.send(rig.run.opening() + rig.run.steps(0, 120))
        await until(pilot, lambda: _has_finding(app))
        buckets = app.query_one(BucketView)
        await until(pilot, lambda: buckets.matrix is not None and buckets.matrix.steps[-1] >= 100)
        assert buckets.display and buckets.content_width() <= buckets.view_width
        head, *rows = lines(buckets)[:7]
        assert head.split()[-2:] == ["max", "ms"]
        assert f"█ {fmt.ms(buckets.worst, 6).strip()}ms" in head  # its scale, whole
        shown = {int(line.split()[0]): line.split()[-1] for line in rows}
        assert shown[SLOW] == "0.00" and all(shown[r] == "60.0" for r in shown if r != SLOW)

    drive(app, scenario, size=(160, 45))


def test_the_layout_follows_a_resized_terminal_at_once(rig: Rig) -> None:
    # A resize laid the screen out for the size before it, until the next key.
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        rig.send(rig.run.opening() + rig.run.steps(0, 60))
        await until(pilot, lambda: _has_finding(app))
        steps, panel = app.query_one(StepTimes), app.query_one(FindingsPanel)
        assert steps.display and not panel.compact
        await pilot.resize_terminal(80, 24)
        assert not steps.display and panel.compact
        await pilot.resize_terminal(160, 45)
        assert steps.display and not panel.compact

    drive(app, scenario, size=(160, 45))


def test_a_narrow_hosts_panel_keeps_its_last_columns(rig: Rig) -> None:
    # Beside the findings on a 160-column terminal the hosts table had 102 of its
    # 112 columns: rss and hb fell off. The problems column gives up room first.
    app = app_for(rig)

    async def scenario(pilot: Pilot[None]) -> None:
        rig.send(rig.run.opening() + rig.run.steps(0, 60))
        await until(pilot, lambda: _has_finding(app))
        await pilot.press("7")
        hosts = app.query_one(HostsView)
        await until(pilot, lambda: bool(hosts.rows))
        assert hosts.display and hosts.content_width() <= hosts.view_width
        head, line = lines(hosts)[:2]
        assert head.split()[-2:] == ["rss", "hb"] and line.split()[-1].endswith("s")

    drive(app, scenario, size=(160, 45))


# --- 256 ranks ---------------------------------------------------------------------------------


def test_256_ranks_scroll_with_the_problem_rank_first() -> None:
    rig = _rig(SyntheticRun(world=256, buckets=32, slow_rank=200, slow_ms=60))
    app = app_for(rig)
    drive(app, _scroll_256(app, rig), size=(80, 24))


def _scroll_256(app: WatchApp, rig: Rig) -> Scenario:

    async def scenario(pilot: Pilot[None]) -> None:
        table = app.query_one(RanksTable)
        rig.send(rig.run.opening() + rig.run.steps(0, 40))
        await until(pilot, lambda: _has_finding(app) and table.rows[0].rank == 200)
        assert len(table.rows) == 256 and table.virtual_size.height == 257
        assert lines(table)[1].split()[:2] == ["200", "straggler"]
        await pilot.press("end")
        assert table.cursor_rank == table.rows[-1].rank
        last = str(table.rows[-1].rank)
        await until(pilot, lambda: lines(table)[-1].split()[0] == last)  # scrolled into view

    return scenario


# --- runs and jobs -------------------------------------------------------------------------------


def test_a_new_run_is_announced_and_followed(rig: Rig) -> None:
    app = app_for(rig)
    notes: list[str] = []

    async def scenario(pilot: Pilot[None]) -> None:
        header = app.query_one(HeaderPanel)
        rig.send(rig.run.opening() + rig.run.steps(0, 5))
        await until(pilot, lambda: rig.run.run_id in header.plain)
        nxt = SyntheticRun(run_id="second-run", world=2)
        rig.send(nxt.opening() + nxt.steps(0, 3))
        await until(pilot, lambda: "second-run" in header.plain)
        assert "2 ranks" in header.plain and "run 2 seen" in header.plain
        notes.extend(n.message for n in app._notifications)

    drive(app, scenario)
    assert any("new run second-run" in n for n in notes)


def test_the_job_log_view_tails_the_log_file(rig: Rig, tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("epoch 0 started\nloss 2.30\rloss 2.10\n")
    app = app_for(rig, log_path=str(log))

    async def scenario(pilot: Pilot[None]) -> None:
        view = app.query_one(LogView)
        await pilot.press("5")
        assert view.display and view.has_focus
        await until(pilot, lambda: "loss 2.10" in view.lines)
        assert "loss 2.30" not in view.lines  # a carriage return redraws the line
        with log.open("a") as f:
            f.write("epoch 1 started\npartial")
        await until(pilot, lambda: "epoch 1 started" in view.lines)
        assert "partial" not in view.lines  # shown once its line is complete

    drive(app, scenario)


def test_key_value_evidence_pairs_up_only_where_the_pairs_fit() -> None:
    from rich.console import Console

    from ddpscope.analysis.evidence import EvidenceTable

    rows = tuple((f"stopped.1.key{i}", "exception") for i in range(8))
    block = EvidenceTable(title="", columns=("", ""), rows=rows)

    def drawn(width: int) -> list[str]:
        console = Console(width=width, record=True, color_system=None)
        console.print(evidence_block(block))
        return console.export_text().splitlines()

    wide = drawn(120)
    assert len(wide) == 4 and wide[0].count("exception") == 2  # two pairs a line
    narrow = drawn(40)
    # One pair a line, every value whole: never "exceptio" over "n".
    assert len(narrow) == 8 and all(line.rstrip().endswith("exception") for line in narrow)
