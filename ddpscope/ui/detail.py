"""A rank up close: phase history, sampler, fingerprint, Python stacks (Enter on a row)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from ddpscope.analysis.snapshot import PassRow, PhaseRow, RankDetail, StacksView
from ddpscope.ui import format as fmt


def summary(d: RankDetail) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f"rank {d.rank}", "bold cyan")
    text.append(f"  {d.host}  pid {d.pid}  local rank {d.local_rank}  {d.backend}/{d.device}")
    phase = f"  in {d.phase}" if d.phase else ""
    if d.in_phase_s >= 0:
        phase += f" for {fmt.age(d.in_phase_s)}"
    text.append(phase, "bold")
    if d.end:
        text.append(f"  ended: {d.end}", "bold yellow")
    text.append("\nfingerprint: ", "dim")
    style = "bold red" if "DIFFERS" in d.fingerprint else ""
    text.append(d.fingerprint, style)
    return text


def _table(title: str) -> Table:
    """The detail screen's borderless table style."""
    return Table(
        title=title,
        title_justify="left",
        box=None,
        pad_edge=False,
        header_style="bold",
        expand=False,
    )


def phase_table(rows: tuple[PhaseRow, ...]) -> RenderableType:
    if not rows:
        return Text("no steps yet", style="dim")
    table = _table("phase history (ms, newest first)")
    for name in ("step", "ep", "total", "data", "fwd", "bwd", "wait", "opt", "other", "mb"):
        table.add_column(name, justify="right")
    for r in reversed(rows):
        table.add_row(
            str(r.step),
            "-" if r.epoch < 0 else str(r.epoch),
            fmt.ms(r.total_ms, 7),
            fmt.ms(r.data_ms),
            fmt.ms(r.forward_ms),
            fmt.ms(r.backward_ms),
            fmt.ms(r.wait_ms),
            fmt.ms(r.optimizer_ms),
            fmt.ms(r.other_ms),
            f"{r.micro_batches}" + ("" if r.optimizer_steps else " skip"),
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
        table.add_row(
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


class RankDetailScreen(Screen[None]):
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
        self._summary = Static(Text(f"rank {rank}: waiting for data…"), id="detail-summary")
        self._body = Horizontal(id="detail-body")
        self._phases = Static(id="detail-phases")
        self._sampler = Static(id="detail-sampler")
        self._stacks = Static(id="detail-stack-text")

    def compose(self) -> ComposeResult:
        yield self._summary
        with self._body:
            with VerticalScroll(id="detail-history"):
                yield self._phases
                yield self._sampler
            with VerticalScroll(id="detail-stacks"):
                yield self._stacks
        yield Footer()

    def on_mount(self) -> None:
        self._draw()

    def on_resize(self) -> None:
        self._body.set_class(self.size.width < 120, "-narrow")

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
        self._sampler.update(sampler_table(detail.passes))
        self._stacks.update(stacks_text(detail.stacks, detail.stacks_pending_s))

    @property
    def stacks_plain(self) -> str:
        d = self.detail
        if d is None or d.stacks is None:
            return ""
        return "\n".join(f"{f[0]}:{f[1]} in {f[2]}" for t in d.stacks.threads for f in t.frames)
