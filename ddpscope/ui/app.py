"""The watch app: pull a snapshot at a fixed pace, apply it in one batch.

Telemetry never reaches this thread. Every ``pull_s`` the app asks its source
(:class:`ddpscope.analysis.live.LiveFeed`) for a snapshot holding only what
is on screen (series when the step-time view shows, the bucket matrix when
the bucket view shows, the detail of the rank being inspected); the ingest
thread builds it and posts one :class:`SnapshotReady`, which replaces any
older one still queued. Applying it is a few list swaps inside
``batch_update``; the per-rank views draw only their visible lines.

Layout follows the terminal: below ``WIDE`` columns one view at a time with
the findings squeezed underneath (one line each); from ``WIDE`` columns the
findings sit beside the views; from ``TALL`` rows as well, ranks, phase bars,
step times and buckets show together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, Horizontal, Vertical
from textual.geometry import Size
from textual.reactive import Reactive
from textual.screen import Screen
from textual.widget import Widget

from ddpscope.analysis.snapshot import RankRow, Snapshot, SnapshotRequest
from ddpscope.ui.buckets import BucketView
from ddpscope.ui.detail import RankDetailScreen
from ddpscope.ui.filterbar import FilterPrompt
from ddpscope.ui.findings import FindingsPanel
from ddpscope.ui.header import HeaderPanel, Situation
from ddpscope.ui.help import HelpScreen
from ddpscope.ui.hosts import HostsView
from ddpscope.ui.keysline import KeysLine
from ddpscope.ui.logview import LogView
from ddpscope.ui.messages import (
    FilterCancelled,
    FilterChosen,
    RankChosen,
    RankHighlighted,
    SnapshotReady,
    SortRequested,
    ViewChosen,
)
from ddpscope.ui.phases import PhaseBars
from ddpscope.ui.problems import ProblemStrip
from ddpscope.ui.rankfilter import EVERYTHING, RankFilter, parse
from ddpscope.ui.ranks import RanksTable, order_rows
from ddpscope.ui.rows import RowsView
from ddpscope.ui.steptimes import StepTimes
from ddpscope.ui.tabs import VIEWS, ViewBar

#: Seconds between snapshots (the issue asks for 1-4 Hz).
PULL_S = 0.5
#: Seconds between asking the lifeline whether to end (a signal, a lost terminal).
LIFELINE_S = 0.2
#: Columns from which the findings sit beside the views.
WIDE = 140
#: Rows from which (when wide too) ranks, step times and buckets show together.
TALL = 40


class SnapshotSource(Protocol):
    """What the app needs from the ingest side (LiveFeed; a replay can be another)."""

    endpoint: str

    def listen(self, listener: Callable[[Snapshot], None] | None) -> None: ...

    def request_snapshot(self, request: SnapshotRequest | None = None) -> None: ...

    def request_stacks(self, rank: int) -> None: ...

    def request_fingerprint(self, rank: int = -1) -> None: ...


class Lifeline(Protocol):
    """What ends the app from outside (ddpscope.cli.lifeline.Lifeline)."""

    def should_stop(self) -> bool: ...


class Job(Protocol):
    """The job ``ddpscope run`` launched (a ddpscope.cli.launch.Job)."""

    def poll(self) -> int | None: ...


class MainScreen(Screen[None]):
    """Textual's default screen, except that moving focus does not repaint all of it.

    Screen.focused repaints the whole screen on every change; the widgets whose
    style follows focus restyle and refresh themselves anyway. At 200x50 that
    full repaint was the largest part of a view switch on the dashboard.
    """

    focused: Reactive[Widget | None] = Reactive(None, repaint=False)


class WatchApp(App[None]):
    TITLE = "ddpscope watch"
    # Every command has a key and the footer lists them; the palette would only add noise.
    ENABLE_COMMAND_PALETTE = False

    CSS = """
    Screen { layout: vertical; }
    #body { height: 1fr; layout: vertical; }
    #body.-wide { layout: horizontal; }
    #views { height: 1fr; width: 1fr; }
    #ranks, #hosts, #log, #phases { height: 1fr; }
    #lower { height: 1fr; }
    #steps, #buckets { width: 1fr; height: 1fr; }
    #body.-dash #ranks, #body.-dash #hosts { height: auto; max-height: 45%;
        border-bottom: hkey $panel-lighten-2; }
    #body.-dash #phases { height: auto; max-height: 30%; border-bottom: hkey $panel-lighten-2; }
    #body.-dash #steps { border-right: vkey $panel-lighten-2; }
    #findings { height: auto; max-height: 8; border-top: hkey $panel-lighten-2; }
    #findings.-full { height: 1fr; max-height: 100%; }
    #body.-wide #findings { width: 36%; max-width: 80; height: 1fr; max-height: 100%;
        border: round $panel-lighten-2; }
    #findings:focus { border-title-color: $accent; }
    """

    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("space", "pause", "Pause"),
        Binding("question_mark", "help", "Help"),
        Binding("s", "stacks", "Stacks"),
        Binding("less_than_sign", "sort(-1)", "Sort"),
        Binding("greater_than_sign", "sort(1)", "Sort", show=False),
        Binding("r", "reverse", "Reverse", show=False),
        Binding("m", "metric", "Metric", show=False),
        Binding("slash", "filter", "Filter"),
        Binding("escape", "clear_filter", "Clear filter"),
        *(Binding(key, f"view('{name}')", label, show=False) for name, key, label in VIEWS),
    ]

    def __init__(
        self,
        source: SnapshotSource,
        *,
        log_path: str | None = None,
        job: Job | None = None,
        pull_s: float = PULL_S,
    ) -> None:
        super().__init__()
        self.source = source
        self.log_path = log_path
        self.job = job
        self.pull_s = pull_s
        self.snapshot: Snapshot | None = None
        self.paused = False
        self.view = "ranks"
        self.selected: int | None = None
        self.job_status: int | None = None
        #: Set before ``run()`` by whoever owns the process's signals and terminal.
        self.lifeline: Lifeline | None = None
        self._run_id: str | None = None
        self._order: list[int] = []
        self.rank_filter: RankFilter = EVERYTHING
        #: (snapshot seq, rows, filter) -> the rows kept; with (sort column, reverse)
        #: -> the rows in display order: a key that changes none of them (a view, the
        #: cursor) filters and sorts nothing again, and the views, handed the very same
        #: lists, see that nothing changed and redraw nothing.
        self._kept_key: tuple[object, ...] = ()
        self._ordered_key: tuple[object, ...] = ()
        self._ordered: list[RankRow] = []
        self._kept: list[RankRow] = []
        #: The last snapshot asked for: a view switch asks for one only when it needs
        #: more than that (series, buckets); one that needs less (the job log on the
        #: dashboard) waits for the next pull. At 4,096 ranks that spares the ingest
        #: thread a build and the UI a snapshot to apply.
        self._requested: SnapshotRequest | None = None
        #: The rank detail, built on first use and reused (installed, so that
        #: closing it keeps it mounted).
        self._detail: RankDetailScreen | None = None
        # The main screen's widgets, held directly: App.query_one searches the
        # active screen, which is the rank detail or help while those are open.
        self.header = HeaderPanel(id="header")
        self.viewbar = ViewBar(id="viewbar")
        self.problems = ProblemStrip(id="problems")
        self.filter_prompt = FilterPrompt(id="filter")
        self.keys_line = KeysLine(id="keys")
        self.ranks = RanksTable(id="ranks")
        self.hosts = HostsView(id="hosts")
        self.phases = PhaseBars(id="phases")
        self.steps = StepTimes(id="steps")
        self.buckets = BucketView(id="buckets")
        self.log_view = LogView(log_path, id="log")
        self.findings = FindingsPanel(id="findings")
        self.body = Container(id="body")
        self.views = Vertical(id="views")
        self.lower = Horizontal(id="lower")

    # --- building ------------------------------------------------------------------

    def get_default_screen(self) -> Screen[None]:
        return MainScreen(id="_default")

    def compose(self) -> ComposeResult:
        yield self.header
        yield self.viewbar
        yield self.problems
        with self.body:
            with self.views:
                yield self.ranks
                yield self.hosts
                yield self.phases
                with self.lower:
                    yield self.steps
                    yield self.buckets
                yield self.log_view
            yield self.findings
        yield self.filter_prompt
        yield self.keys_line

    def on_mount(self) -> None:
        self.source.listen(self._from_source)
        self._layout()
        self._show_header()
        self.ranks.focus()
        # Its own timer, not the pull's: a paused app or a modal screen must
        # still end on a signal or a lost terminal.
        self.set_interval(LIFELINE_S, self._check_lifeline)
        self.set_interval(self.pull_s, self._pull)
        self._pull()

    def _check_lifeline(self) -> None:
        if self.lifeline is not None and self.lifeline.should_stop():
            self.exit()

    def on_unmount(self) -> None:
        self.source.listen(None)

    def _from_source(self, snapshot: Snapshot) -> None:
        # Runs on the ingest thread; post_message is the thread-safe way in.
        self.post_message(SnapshotReady(snapshot))

    # --- the pace --------------------------------------------------------------------

    def _pull(self, detail_rank: int | None = None, *, if_more: bool = False) -> None:
        """Ask for a snapshot; ``if_more``: only if it asks for more than the last one."""
        self._check_job()
        self.log_view.poll()
        if self.paused:
            return
        detail = self._detail_screen()
        if detail_rank is None and detail is not None:
            detail_rank = detail.rank
        main = detail_rank is None
        request = SnapshotRequest(
            detail_rank=detail_rank,
            series=main and self._shown(self.steps),
            buckets=main and self._shown(self.buckets),
        )
        if if_more and not _asks_more(request, self._requested):
            return
        self._requested = request
        self.source.request_snapshot(request)

    def _check_job(self) -> None:
        if self.job is None or self.job_status is not None:
            return
        status = self.job.poll()
        if status is not None:
            self.job_status = status
            self._show_header()
            self.notify(
                f"The job exited with status {status}. The view keeps its final state; q quits.",
                title="job finished",
                severity="information" if status == 0 else "error",
                timeout=10,
            )

    def _detail_screen(self) -> RankDetailScreen | None:
        top = self.screen_stack[-1] if self.screen_stack else None
        return top if isinstance(top, RankDetailScreen) else None

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        if not self.screen_stack:  # shutting down
            return
        detail = self._detail_screen()
        if self.paused:
            # Frozen, except that a rank opened while paused gets its first detail.
            if detail is not None and detail.detail is None:
                detail.show(message.snapshot.detail)
            return
        # The same snapshot again is applied too (the header and a replay's bar show
        # state from outside it); its rows are the views' already, so they draw nothing.
        self.snapshot = message.snapshot
        self._apply()

    # --- applying a snapshot ------------------------------------------------------

    def _situation(self) -> Situation:
        return Situation(
            endpoint=self.source.endpoint,
            paused=self.paused,
            job_status=self.job_status,
        )

    def _show_header(self) -> None:
        self.header.show(self.snapshot, self._situation())

    def _shown(self, widget: Widget) -> bool:
        return all(a.display for a in widget.ancestors_with_self if isinstance(a, Widget))

    def _apply(self) -> None:
        snap = self.snapshot
        if snap is None:
            return
        with self.batch_update():
            self._show_header()
            self._notice_new_run(snap)
            active = [f for f in snap.findings if f.active]
            worst = active[0].severity if active else ""
            self.viewbar.show(self.view, len(active), worst, self._filter_note(snap))
            self.problems.show(snap.rows, snap.findings)
            self.findings.show(snap.findings, snap.findings_version)
            detail = self._detail_screen()
            if detail is not None:
                detail.show(snap.detail)
            else:
                self._apply_rows(snap)

    def _filter_note(self, snap: Snapshot) -> str:
        if self.rank_filter.empty:
            return ""
        kept = len(self._kept_rows(snap))
        return f"/ {self.rank_filter.text}: {kept} of {len(snap.rows)} ranks (esc: all)"

    def _kept_rows(self, snap: Snapshot) -> list[RankRow]:
        kept_key = (snap.seq, id(snap.rows), self.rank_filter)
        if kept_key != self._kept_key:
            self._kept = self.rank_filter.apply(snap.rows)
            self._kept_key = kept_key
        return self._kept

    def _order_rows(self, snap: Snapshot) -> list[RankRow]:
        table = self.ranks
        kept = self._kept_rows(snap)
        key = (*self._kept_key, table.sort_column, table.sort_reverse)
        if key != self._ordered_key:
            self._ordered = order_rows(kept, table.sort_column, table.sort_reverse)
            self._ordered_key = key
        return self._ordered

    def _apply_rows(self, snap: Snapshot) -> None:
        ordered = self._order_rows(snap)
        key = self._kept_key  # the set of rows: snapshot and filter, not their order
        self._order = [r.rank for r in ordered]
        views: tuple[RowsView[Any], ...] = (
            self.ranks,
            self.hosts,
            self.phases,
            self.steps,
            self.buckets,
        )
        focused = self.focused
        if isinstance(focused, RowsView) and focused.user_moved:
            # The view the user moves in is the truth, even before its message lands.
            self.selected = focused.selected_rank()
        for view in views:
            if not self._shown(view):
                continue  # hidden views are not drawn; they catch up when shown
            if isinstance(view, BucketView):
                view.set_matrix(snap.buckets, ordered, key)
            elif isinstance(view, HostsView):
                view.set_ranks(self._kept)
            else:
                view.set_rows(ordered, key)
            view.follow(self.selected)

    def _notice_new_run(self, snap: Snapshot) -> None:
        run_id = snap.header.run_id if snap.header is not None else None
        if run_id is None or run_id == self._run_id:
            return
        if self._run_id is not None:
            # The run id is the user's (--run-id, torchelastic's): not markup.
            self.notify(
                f"new run {run_id} started; showing it", title="new run", timeout=8, markup=False
            )
        self._run_id = run_id

    # --- layout ----------------------------------------------------------------------

    def on_resize(self, event: events.Resize) -> None:
        # The event's size: the app's own is updated only after this handler,
        # and a layout from it kept the old one until the next key.
        self._layout(event.size)

    def _layout(self, size: Size | None = None) -> None:
        width, height = self.size if size is None else size
        wide = width >= WIDE
        dash = wide and height >= TALL
        view = self.view
        body = self.body
        body.set_class(wide, "-wide")
        body.set_class(dash, "-dash")
        show = dict.fromkeys(
            ("ranks", "hosts", "phases", "lower", "steps", "buckets", "log"), False
        )
        if dash:
            # The top panel: the hosts when that view was chosen, else the ranks.
            show["hosts" if view == "hosts" else "ranks"] = True
            if view == "log":
                show["log"] = True
            else:
                show.update(phases=True, lower=True, steps=True, buckets=True)
        elif view in ("steps", "buckets"):
            show.update({"lower": True, view: True})
        elif view in ("ranks", "hosts", "log", "phases"):
            show[view] = True
        else:  # findings: beside the ranks when wide, alone when narrow
            show["ranks"] = wide
        panels: dict[str, Widget] = {
            "ranks": self.ranks,
            "hosts": self.hosts,
            "phases": self.phases,
            "lower": self.lower,
            "steps": self.steps,
            "buckets": self.buckets,
            "log": self.log_view,
        }
        for name, visible in show.items():
            panels[name].display = visible
        self.views.display = any(show.values())
        findings = self.findings
        findings.set_class(view == "findings" and not wide, "-full")
        findings.set_compact(not wide and view != "findings")
        self.problems.limit = 3 if wide else 2

    # --- actions -----------------------------------------------------------------------

    def action_view(self, name: str) -> None:
        self.view = name
        self._layout()
        self._view_widget(name).focus()
        if self.snapshot is not None:
            self._apply()
        self._pull(if_more=True)

    def _view_widget(self, name: str) -> Widget:
        widgets: dict[str, Widget] = {
            "ranks": self.ranks,
            "hosts": self.hosts,
            "phases": self.phases,
            "steps": self.steps,
            "buckets": self.buckets,
            "findings": self.findings,
            "log": self.log_view,
        }
        return widgets[name]

    def on_view_chosen(self, message: ViewChosen) -> None:
        self.action_view(message.view)

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._show_header()
        if not self.paused:
            self._pull()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(self._help_screen())

    def _help_screen(self) -> HelpScreen:
        return HelpScreen()

    def action_sort(self, delta: int) -> None:
        self.ranks.step_column(delta)
        self._apply()

    def action_reverse(self) -> None:
        self.ranks.sort_by(self.ranks.sort_column)
        self._apply()

    def on_sort_requested(self, message: SortRequested) -> None:
        self.ranks.sort_by(message.column)
        self._apply()

    def action_metric(self) -> None:
        self.steps.toggle_metric()

    # --- the filter ----------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # The filter belongs to the main screen's views, not to the rank detail or help;
        # "Clear filter" is in the keys line (and escape means it) only while one is set.
        if action == "filter":
            return len(self.screen_stack) <= 1
        if action == "clear_filter":
            return len(self.screen_stack) <= 1 and not self.rank_filter.empty
        return True

    def action_filter(self) -> None:
        # The prompt takes the keys line's place: the same height, so nothing
        # else moves and no view is redrawn for it.
        self.keys_line.display = False
        self.filter_prompt.open(self.rank_filter.text)

    def on_filter_chosen(self, message: FilterChosen) -> None:
        self.keys_line.display = True
        self.set_filter(message.text)

    def on_filter_cancelled(self, message: FilterCancelled) -> None:
        self.keys_line.display = True
        self._focus_view()

    def action_clear_filter(self) -> None:
        self.set_filter("")

    def set_filter(self, text: str) -> None:
        """Show only the ranks ``text`` names (see ddpscope.ui.rankfilter); "" shows all."""
        self.rank_filter = parse(text)
        self.refresh_bindings()
        self._focus_view()
        if self.snapshot is not None:
            self._apply()

    def _focus_view(self) -> None:
        if self.view in ("ranks", "hosts", "phases", "steps", "buckets"):
            self._view_widget(self.view).focus()

    def _target_rank(self) -> int | None:
        detail = self._detail_screen()
        if detail is not None:
            return detail.rank
        focused = self.focused
        view = focused if isinstance(focused, RowsView) else self.ranks
        return view.selected_rank()

    def action_stacks(self) -> None:
        rank = self._target_rank()
        if rank is None:
            self.notify("no rank selected yet", severity="warning")
            return
        self.source.request_stacks(rank)
        self.notify(f"asked rank {rank} for its Python stacks", timeout=3)
        self._pull()

    def action_fingerprint(self) -> None:
        self.source.request_fingerprint(-1)
        self.notify("asked every rank for a weight fingerprint", timeout=3)

    def action_neighbour(self, delta: int) -> None:
        screen = self._detail_screen()
        if screen is None or not self._order:
            return
        i = self._order.index(screen.rank) if screen.rank in self._order else 0
        self._open_detail(self._order[(i + delta) % len(self._order)])

    def on_rank_highlighted(self, message: RankHighlighted) -> None:
        self.selected = message.rank

    def on_rank_chosen(self, message: RankChosen) -> None:
        self._open_detail(message.rank)

    def _open_detail(self, rank: int) -> None:
        self.selected = rank
        screen = self._detail
        if screen is None:
            screen = self._detail = RankDetailScreen(rank)
            self.install_screen(screen, "rank-detail")
        screen.show_rank(rank)
        if self._detail_screen() is None:
            self.push_screen(screen)
        self._requested = SnapshotRequest(detail_rank=rank)
        self.source.request_snapshot(self._requested)


def _asks_more(request: SnapshotRequest, last: SnapshotRequest | None) -> bool:
    """Whether ``request`` wants something a snapshot built for ``last`` lacks."""
    if last is None or request.detail_rank != last.detail_rank:
        return True
    return (request.series and not last.series) or (request.buckets and not last.buckets)


def build_app(
    source: SnapshotSource,
    *,
    log_path: str | None = None,
    job: Job | None = None,
    pull_s: float = PULL_S,
) -> WatchApp:
    """The app, for ``ddpscope watch``, ``ddpscope run`` and the tests alike."""
    return WatchApp(source, log_path=log_path, job=job, pull_s=pull_s)
