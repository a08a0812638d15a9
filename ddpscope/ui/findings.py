"""Every finding, most severe and newest first, with its evidence and what to do."""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.segment import Segment
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

from ddpscope.analysis.evidence import EvidenceBlock, EvidenceTable, paired
from ddpscope.analysis.snapshot import FindingView
from ddpscope.ui import format as fmt
from ddpscope.ui.literal import add_row, literal
from ddpscope.ui.literal import title as literal_title

SEVERITY_STYLE = {"error": "bold red", "warning": "bold yellow", "info": "bold cyan"}
ICON = {"error": "✖", "warning": "▲", "info": "●"}


def _where(f: FindingView) -> str:
    ranks = f"rank {f.ranks[0]}" if len(f.ranks) == 1 else f"ranks {fmt.ranks(list(f.ranks))}"
    if not f.ranks:
        ranks = "run"
    since = f"since step {f.step}" + (f" (epoch {f.epoch})" if f.epoch >= 0 else "")
    state = "" if f.active else f"  resolved by step {f.last_step}"
    return f"{ranks}  {since}{state}"


def compact_line(f: FindingView) -> Text:
    style = SEVERITY_STYLE.get(f.severity, "") if f.active else "dim"
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f"{ICON.get(f.severity, '●')} {f.kind} ", style)
    text.append(f"{_where(f)}: ", "bold" if f.active else "dim")
    text.append(f.message.splitlines()[0] if f.message else "", "" if f.active else "dim")
    return text


def card(f: FindingView) -> RenderableType:
    style = SEVERITY_STYLE.get(f.severity, "") if f.active else "dim"
    head = Text.assemble(
        (f"{ICON.get(f.severity, '●')} {f.severity.upper()} ", style),
        (f.kind, style),
        ("  " + _where(f), "bold" if f.active else "dim"),
    )
    body = Text(f.message, style="" if f.active else "dim")
    fix = Text.assemble(("→ ", "bold green"), (f.fix, "green" if f.active else "dim"))
    parts: list[RenderableType] = [head, body, fix]
    parts += [evidence_block(b, f.active) for b in f.tables]
    parts.append(Text(""))
    return Group(*parts)


def evidence_block(block: EvidenceBlock, active: bool = True) -> RenderableType:
    """One evidence table (key/value rows, or ranks across) or text block, small and dim."""
    style = "" if active else "dim"
    if not isinstance(block, EvidenceTable):
        lines = [Text(block.title, style="bold " + style)]
        lines += [
            Text("  " + ln, style="dim", no_wrap=True, overflow="ellipsis") for ln in block.lines
        ]
        return Group(*lines)
    pairs = paired(block)
    if pairs is not block:
        return _FitPairs(block, pairs, active)
    return _evidence_table(block, active)


class _FitPairs:
    """A key/value table drawn two pairs a line where they fit the width, else one.

    Folded to fit, a value breaks mid-word ("exceptio" over "n") in the findings
    panel beside the ranks table; one pair a line is longer but reads.
    """

    def __init__(self, block: EvidenceTable, pairs: EvidenceTable, active: bool) -> None:
        self.block, self.pairs, self.active = block, pairs, active

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        widths = [max((len(row[i]) for row in self.pairs.rows), default=0) for i in range(4)]
        fits = sum(widths) + 3 * 3 <= options.max_width  # three gaps of 3 between columns
        yield _evidence_table(self.pairs if fits else self.block, self.active)


def _evidence_table(block: EvidenceTable, active: bool) -> Table:
    style = "" if active else "dim"
    header = any(block.columns)
    table = Table(
        title=literal_title(block.title) if block.title else None,
        title_justify="left",
        title_style="bold " + style,
        box=None,
        pad_edge=False,
        # Paired key/value columns need a wider gap to read as two pairs.
        padding=(0, 1 if header or len(block.columns) < 4 else 3, 0, 0),
        show_header=header,
        header_style="bold " + style,
        style=style,
    )
    for i, name in enumerate(block.columns):
        # The first column names the rows; the others hold figures (per rank, per field).
        # Paired key/value tables have keys in every other column.
        key = i == 0 or (not header and i % 2 == 0)
        table.add_column(
            literal(name),
            style="cyan" if key else "",
            justify="right" if header and i else "left",
            no_wrap=key or header,
            overflow="fold" if i and not header else "ellipsis",
        )
    for row in block.rows:
        add_row(table, *row)
    if block.more:
        table.caption = f"({block.more})"
        table.caption_justify = "left"
    return table


class CardLines(Widget):
    """The finding cards, laid out by Rich once per change of cards, width or style.

    A Static holding the cards lays their evidence tables out again whenever it
    is measured or repainted (a focus change, a layout pass): at 4,096 ranks
    that was ~25 ms a time, several times per key. These lines are kept until
    the cards change, for each width and style they were drawn at: a panel
    that gains a scrollbar is laid out at two widths, each once.
    """

    DEFAULT_CSS = """
    CardLines { width: 1fr; height: auto; }
    """

    #: Widths (and styles) kept at once; more only come from resizing the terminal.
    KEEP = 4

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._renderable: RenderableType = ""
        self._laid_out: dict[tuple[int, object], list[Strip]] = {}

    def update(self, renderable: RenderableType) -> None:
        self._renderable = renderable
        self._laid_out.clear()
        self.refresh(layout=True)

    def _lay_out(self, width: int) -> list[Strip]:
        style = self.visual_style.rich_style
        strips = self._laid_out.get((width, style))
        if strips is None:
            console = self.app.console
            options = self.app.console_options.update(highlight=False, width=width)
            segments = console.render(self.post_render(self._renderable, style), options)
            lines = Segment.split_and_crop_lines(
                segments, width, include_new_lines=False, pad=False
            )
            strips = [Strip(line) for line in lines]
            if len(self._laid_out) >= self.KEEP:
                self._laid_out.clear()
            self._laid_out[(width, style)] = strips
        return strips

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._lay_out(width))

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        strips = self._lay_out(width)
        return strips[y] if y < len(strips) else Strip.blank(width, self.visual_style.rich_style)


class FindingsPanel(VerticalScroll, can_focus=True):
    """Full cards, or one line per finding when squeezed under the ranks in a narrow terminal."""

    DEFAULT_CSS = """
    FindingsPanel { padding: 0 1; }
    FindingsPanel > Static { width: 1fr; }
    FindingsPanel.-compact > Static { text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.findings: tuple[FindingView, ...] = ()
        self.compact = False
        self._drawn: tuple[int, bool] | None = None
        self._version = -1
        #: The book's version the cards were made for: showing them again after
        #: the compact lines (a view switch) lays nothing out again.
        self._cards_version: int | None = None
        # One line per finding (compact) as text; full cards as lines laid out once.
        self._body = Static(id="findings-body")
        self._cards = CardLines(id="findings-cards")

    def compose(self) -> ComposeResult:
        yield self._body
        yield self._cards

    def on_mount(self) -> None:
        self._draw()

    def show(self, findings: tuple[FindingView, ...], version: int) -> None:
        """New findings; redrawn only when the book's version moved."""
        self.findings = findings
        self._version = version
        self._draw()

    def set_compact(self, compact: bool) -> None:
        """One line per finding (squeezed under the views) or full cards."""
        self.compact = compact
        self.set_class(compact, "-compact")
        self._draw()

    def _draw(self) -> None:
        if self._drawn == (self._version, self.compact):
            return
        self._drawn = (self._version, self.compact)
        findings, compact = self.findings, self.compact
        active = sum(f.active for f in findings)
        self.border_title = f"Findings: {active} active" + (
            f", {len(findings) - active} resolved" if len(findings) > active else ""
        )
        cards = bool(findings) and not compact
        self._body.display = not cards
        self._cards.display = cards
        if not findings:
            self._body.update(Text("No findings: nothing wrong seen so far.", style="dim"))
        elif compact:
            lines = [compact_line(f) for f in findings]
            lines.append(Text("4: evidence and what to do", style="dim"))
            self._body.update(Text("\n").join(lines))
        elif self._cards_version != self._version:
            self._cards_version = self._version
            self._cards.update(Group(*(card(f) for f in findings)))

    @property
    def text(self) -> str:
        """What the panel says, as plain text (for tests and screen readers)."""
        if self.compact:
            return "\n".join(compact_line(f).plain for f in self.findings)
        out = []
        for f in self.findings:
            out.append(f"{f.severity} {f.kind} {_where(f)}\n{f.message}\n{f.fix}")
        return "\n".join(out)
