"""A rank up close: the last step's collectives, phase history, sampler, fingerprint,
Python stacks (Enter on a row)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Static

from ddpscope.analysis.snapshot import CollectiveRow, PassRow, PhaseRow, RankDetail, StacksView
from ddpscope.ui import format as fmt
from ddpscope.ui.keysline import KeysLine
from ddpscope.ui.literal import add_row
from ddpscope.ui.literal import title as literal_title


def summary(d: RankDetail) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f"rank {d.rank}", "bold cyan")
    text.append(f"  {d.host}  pid {d.pid}  local rank {d.local_rank}  {d.backend}/{d.device}")
    phase = f"  blocked in {d.blocked_in}" if d.blocked_in else f"  in {d.phase}" if d.phase else ""
    if d.in_phase_s >= 0:
        phase += f" for {fmt.age(d.in_phase_s)}"
    if d.blocked_site:
        phase += f" at {short_path(d.blocked_site)}"
    text.append(phase, "bold yellow" if d.blocked_in else "bold")
    if d.end:
        text.append(f"  ended: {d.end}", "bold yellow")
    text.append("\nfingerprint: ", "dim")
    style = "bold red" if "DIFFERS" in d.fingerprint else ""
    text.append(d.fingerprint, style)
    return text


def _table(title: str) -> Table:
    """The detail screen's borderless table style: one space between columns,
    so a dozen of them fit in 80 columns."""
    return Table(
        title=literal_title(title),
        title_justify="left",
        box=None,
        pad_edge=False,
        padding=(0, 1, 0, 0),
        header_style="bold",
        expand=False,
    )


def _ms(value: float) -> str:
    return fmt.ms(value, 7).strip()


def phase_table(rows: tuple[PhaseRow, ...]) -> RenderableType:
    if not rows:
        return Text("no steps yet", style="dim")
    table = _table("phase history (ms, newest first)")
    # Columns as wide as their widest figure: a squeezed one would read "27…".
    sync = any(r.sync_ms > 0 for r in rows)
    coll = any(r.coll_ms > 0 for r in rows)
    names = ["step", "ep", "total", "data", "fwd", "bwd", "ar wt"]
    names += ["sync"] * sync + ["coll"] * coll + ["opt", "other", "mb"]
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    for r in reversed(rows):
        waits = [_ms(r.wait_ms)] + [_ms(r.sync_ms)] * sync + [_ms(r.coll_ms)] * coll
        add_row(
            table,
            str(r.step),
            "-" if r.epoch < 0 else str(r.epoch),
            _ms(r.total_ms),
            _ms(r.data_ms),
            _ms(r.forward_ms),
            _ms(r.backward_ms),
            *waits,
            _ms(r.optimizer_ms),
            _ms(r.other_ms),
            f"{r.micro_batches}" + ("" if r.optimizer_steps else " skip"),
        )
    return table


#: How each class of collective reads in the detail.
CLASS_LABEL = {"grad": "DDP grad", "ddp": "DDP", "user": "user"}


def collectives_table(rows: tuple[CollectiveRow, ...], step: int, more: int) -> RenderableType:
    if not rows:
        return Text("collectives: none in the last step", style="dim")
    extra = f", {more} more not listed" if more else ""
    table = _table(f"collectives of step {step} (ms; blocked = time the rank waited{extra})")
    for name in ("op", "class", "group", "bytes", "at", "blocked", "site"):
        right = name in ("bytes", "at", "blocked")
        table.add_column(name, justify="right" if right else "left", no_wrap=name != "site")
    longest = max(c.blocked_ms for c in rows)
    for c in rows:
        add_row(
            table,
            c.op,
            CLASS_LABEL.get(c.cls, c.cls),
            c.group or "all",
            fmt.nbytes(c.nbytes),
            "-" if c.offset_ms < 0 else _ms(c.offset_ms),
            Text(_ms(c.blocked_ms), style="bold" if c.blocked_ms == longest > 0 else ""),
            short_path(c.site),
        )
    return table


def sampler_table(rows: tuple[PassRow, ...]) -> RenderableType:
    if not rows:
        return Text("sampler: no DataLoader pass seen", style="dim")
    table = _table("sampler passes")
    for name in (
        "loader",
        "pass",
        "step",
        "epoch",
        "sampler",
        "seed",
        "drawn",
        "digest",
        "overlap",
    ):
        table.add_column(name, justify="right" if name not in ("sampler",) else "left")
    for p in rows:
        drawn = (
            "-" if p.count < 0 else f"{p.count}/{p.expected}" if p.expected >= 0 else str(p.count)
        )
        overlap = "-" if p.overlap < 0 else f"{p.overlap:.0%}"
        add_row(
            table,
            str(p.loader),
            str(p.pass_id),
            str(p.step),
            "-" if p.epoch < 0 else str(p.epoch),
            p.sampler + ("" if p.distributed else " (not distributed)"),
            "-" if p.seed < 0 else str(p.seed),
            drawn + ("" if p.complete else " …"),
            f"{p.digest:016x}" if p.digest else "-",
            Text(overlap, style="bold red" if p.overlap > 0.2 else ""),
        )
    return table


def short_path(path: str) -> str:
    """Installed packages from their package root; other long paths by their last parts."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    parts = path.split("/")
    return path if len(path) <= 48 or len(parts) <= 3 else "…/" + "/".join(parts[-3:])


def stacks_text(stacks: StacksView | None, pending_s: float) -> RenderableType:
    parts: list[RenderableType] = []
    if pending_s >= 0:
        parts.append(
            Text(
                f"fresh stacks asked {fmt.age(pending_s)} ago; waiting for the rank…",
                style="bold yellow",
            )
        )
    if stacks is None:
        parts.append(
            Text("no stacks yet: press s to ask this rank for its Python stacks", style="dim")
        )
        return Group(*parts)
    age = f", {fmt.age(stacks.age_s)} ago" if stacks.age_s >= 0 else ""
    parts.append(
        Text(
            f"Python stacks ({stacks.reason}, in {stacks.phase} at step {stacks.step}{age})",
            style="bold",
        )
    )
    for t in stacks.threads:
        parts.append(Text(f"thread {t.name}" + (" (main)" if t.main else ""), style="bold cyan"))
        for file, line, func in t.frames:
            where = f"{short_path(file)}:{line}"
            parts.append(Text.assemble(("  ", ""), (where, "dim"), (f" in {func}", "")))
    return Group(*parts)


def _waiting(rank: int) -> Text:
    return Text(f"rank {rank}: waiting for data…")


#: Below this many columns the stacks go under the history, not beside it.
NARROW = 160


class RankDetailScreen(Screen[None]):
    """Built once and reused for every rank (:meth:`show_rank`): mounting a screen
    styles each of its widgets, which cost more than the rest of opening it."""

    BINDINGS = [
        Binding("escape,backspace", "app.pop_screen", "Back"),
        # The app owns the feed and the rank order: these are its actions.
        Binding("s", "app.stacks", "Fresh stacks"),
        Binding("f", "app.fingerprint", "Fingerprint"),
        Binding("left", "app.neighbour(-1)", "Prev rank"),
        Binding("right", "app.neighbour(1)", "Next rank"),
    ]

    DEFAULT_CSS = """
    RankDetailScreen #detail-summary { height: 2; padding: 0 1; background: $boost; }
    RankDetailScreen #detail-collectives { margin-bottom: 1; }
    RankDetailScreen #detail-body { height: 1fr; }
    RankDetailScreen #detail-body.-narrow { layout: vertical; }
    RankDetailScreen VerticalScroll { width: 1fr; height: 1fr; padding: 0 1; }
    RankDetailScreen #detail-stacks { border-left: vkey $panel-lighten-2; }
    RankDetailScreen #detail-body.-narrow #detail-stacks { border-left: none;
        border-top: hkey $panel-lighten-2; }
    """

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.detail: RankDetail | None = None
        self._summary = Static(_waiting(rank), id="detail-summary")
        self._body = Horizontal(id="detail-body")
        self._phases = Static(id="detail-phases")
        self._collectives = Static(id="detail-collectives")
        self._sampler = Static(id="detail-sampler")
        self._stacks = Static(id="detail-stack-text")

    def compose(self) -> ComposeResult:
        yield self._summary
        with self._body:
            with VerticalScroll(id="detail-history"):
                # The last step's collectives first: a few lines, and the newest news.
                yield self._collectives
                yield self._phases
                yield self._sampler
            with VerticalScroll(id="detail-stacks"):
                yield self._stacks
        # Not Textual's Footer: it rebuilds a widget per key each time the screen shows.
        yield KeysLine()

    def on_mount(self) -> None:
        self._draw()

    def on_resize(self) -> None:
        # Side by side only when the history's dozen columns still fit in half.
        self._body.set_class(self.size.width < NARROW, "-narrow")

    def show_rank(self, rank: int) -> None:
        """Stand for ``rank`` from now on; what was drawn for another rank goes."""
        if rank == self.rank:
            return
        self.rank = rank
        self.detail = None
        self._summary.update(_waiting(rank))
        for part in (self._phases, self._collectives, self._sampler, self._stacks):
            part.update("")

    def show(self, detail: RankDetail | None) -> None:
        """Take the newest detail of this rank (drawn now if mounted, else on mount)."""
        if detail is None or detail.rank != self.rank or detail == self.detail:
            return
        self.detail = detail
        if self.is_mounted:
            self._draw()

    def _draw(self) -> None:
        detail = self.detail
        if detail is None:
            return
        self._summary.update(summary(detail))
        self._phases.update(phase_table(detail.phases))
        self._collectives.update(
            collectives_table(detail.collectives, detail.collectives_step, detail.collectives_more)
        )
        self._sampler.update(sampler_table(detail.passes))
        self._stacks.update(stacks_text(detail.stacks, detail.stacks_pending_s))

    @property
    def stacks_plain(self) -> str:
        d = self.detail
        if d is None or d.stacks is None:
            return ""
        return "\n".join(f"{f[0]}:{f[1]} in {f[2]}" for t in d.stacks.threads for f in t.frames)
