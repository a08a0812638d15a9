"""The help screen: keys, views, and what the monitor's health figures mean."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ddpscope.ui.literal import add_row
from ddpscope.ui.literal import title as literal_title

KEYS = (
    ("q", "quit (a job started by ddpscope run keeps running; the launcher waits for it)"),
    ("space", "pause / resume the display (telemetry is still taken in)"),
    ("?  esc", "this help / close it"),
    ("1 2 3 4 5 6", "views: ranks, step time, buckets, findings, job log, phases"),
    (
        "7",
        "hosts: one line per host with the worst of its ranks, problem hosts first; "
        "enter opens a host (its ranks under it) or closes it",
    ),
    ("↑ ↓ pgup pgdn", "move between ranks, home/end: first/last (the views share one cursor)"),
    ("enter", "rank detail: phase history, sampler, fingerprint, Python stacks"),
    ("s", "ask the highlighted rank for fresh Python stacks (answers even when hung)"),
    ("< >", "sort the ranks by the previous / next column (or click a header)"),
    ("r", "reverse the sort"),
    ("m", "step-time view: busy time (step minus collective waits) or step time"),
    (
        "/",
        "filter the rank views: ranks 12, ranges 100-200, a part of a host name (node07), "
        "a badge (straggler); several terms keep what any matches; enter applies, empty shows all",
    ),
    ("esc", "clear the filter (shown below while one is set)"),
    ("tab", "move focus between panels"),
)

DETAIL_KEYS = (
    "In the rank detail: s fresh stacks, f fingerprint now, left/right previous/next "
    "rank, esc back."
)

HEALTH = (
    ("rx", "telemetry messages received (per second in brackets)"),
    (
        "dropped",
        "messages lost on the way: gaps in the ranks' sequence numbers plus what ranks dropped "
        "from their own full queue. A steady climb means the watcher or the network is too slow.",
    ),
    (
        "rejected",
        "messages refused: undecodable, oversized, another schema version, absurd values, a "
        "rank outside the world; the commonest reasons follow in brackets",
    ),
    ("silent", "ranks the run says exist that sent nothing for 5 s (or never did)"),
    (
        "lag",
        "median delay from a message's creation on its rank to its ingestion here over the last "
        "snapshot (other hosts add their clock offset). Flat when the watcher keeps up; it "
        "grows when the watcher falls behind.",
    ),
)

COLUMNS = (
    ("step ms", "step time; the columns after it split it, means over the last 5 steps"),
    ("ar wt", "blocked in DDP's gradient all-reduce after backward"),
    ("sync", "blocked in DDP's own syncs: the buffer broadcast at each forward, Join's (shown "
     "when a rank has any)"),
    ("coll", "blocked in collectives the script called: a loss all_reduce, a barrier (shown "
     "when a rank has any)"),
    ("data fwd bwd opt other", "the rank's own work: loading, forward, backward, "
     "optimizer.step(), the rest"),
    ("phase", "what the rank does now; a collective by name ('broadcast (DDP) 12s')"),
)  # fmt: skip

BADGES_HELP = (
    "Status badges: ok, exited; a finding's kind (straggler, hang, ...) when a finding singles "
    "the rank out, shortened where it is wider than the column (set_epoch: missing_set_epoch, "
    "rank0 coll: rank0_only_collective, no destroy: no_destroy_process_group, ...); silent "
    "(nothing for 5 s), no data (never heard from), disabled (ddpscope turned itself off on "
    "that rank). Problem ranks sort first. The red strip under the views' names lists them by "
    "kind with their hosts, whatever the table shows; a run with none has no strip."
)


def keys_beside(extra: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """The common keys shown under a mode's own: a key the mode gives its own meaning
    (replay's space: play / pause) is not listed again with the live one."""
    taken = {key for key, _ in extra}
    return tuple((key, text) for key, text in KEYS if key not in taken)


def _table(rows: tuple[tuple[str, str], ...], title: str) -> Table:
    table = Table(
        title=literal_title(title),
        title_justify="left",
        title_style="bold",
        box=None,
        show_header=False,
        pad_edge=False,
        expand=True,
    )
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column(ratio=1)
    for key, what in rows:
        add_row(table, key, what)
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark", "app.pop_screen", "Close")]

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 96%; max-width: 110; height: 94%;
        border: round $accent; background: $surface; padding: 0 1; }
    """

    def __init__(self, extra: tuple[tuple[str, str], ...] = (), extra_title: str = "") -> None:
        """``extra``: keys of a mode (replay) listed above the common ones."""
        super().__init__()
        self.extra = extra
        self.extra_title = extra_title

    def compose(self) -> ComposeResult:
        with VerticalScroll() as scroll:
            scroll.border_title = "ddpscope: help (esc closes)"
            first: list[Table | Text] = (
                [_table(self.extra, self.extra_title), Text("")] if self.extra else []
            )
            common = keys_beside(self.extra)
            yield Static(
                Group(
                    *first,
                    _table(common, "Keys"),
                    Text(DETAIL_KEYS, style="dim"),
                    Text(""),
                    _table(COLUMNS, "The ranks table (6: the same split as bars)"),
                    Text(""),
                    _table(HEALTH, "The header's monitor line"),
                    Text(""),
                    Text(BADGES_HELP),
                )
            )
