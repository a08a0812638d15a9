"""One line per rank, drawn on demand: the base of the ranks table, step times and buckets.

A Line API widget: ``render_line`` builds only the lines on screen, from the
newest rows, so applying a snapshot is a list swap and a refresh whatever the
world size. (A DataTable updating 1,024 rows x 14 cells took 130 ms per
snapshot plus 70 ms to redraw on this machine: too slow to stay responsive.)

The first line is a fixed header; the first ``fixed_width`` cells (the rank)
stay put when the view scrolls sideways. The cursor follows a rank, not a
position, so a re-sort never moves it to another rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ddpscope.analysis.snapshot import ERROR, INFO, OK, WARNING
from ddpscope.ui.messages import RankChosen, RankHighlighted


class Line(Protocol):
    """What a view needs of each line it draws: a key the cursor follows (a rank,
    or a negative number for lines that are not ranks) and a status level."""

    @property
    def rank(self) -> int: ...

    @property
    def level(self) -> int: ...


RowT = TypeVar("RowT", bound=Line)

LEVEL_CLASS = {
    OK: "rows--ok",
    INFO: "rows--info",
    WARNING: "rows--warning",
    ERROR: "rows--error",
}


def cell(text: str, width: int, style: Style, right: bool = False) -> Segment:
    """A cell of exactly ``width`` characters (cut or padded) and one space after it."""
    text = text[:width]
    body = text.rjust(width) if right else text.ljust(width)
    return Segment(body + " ", style)


class RowsView(ScrollView, Generic[RowT], can_focus=True):
    """Rows in the order the app chose (problem ranks first, or the user's sort)."""

    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "edge(-1)", "First", show=False),
        Binding("end", "edge(1)", "Last", show=False),
        Binding("enter", "choose", "Rank detail"),
    ]

    COMPONENT_CLASSES = {
        "rows--header",
        "rows--cursor",
        "rows--ok",
        "rows--info",
        "rows--warning",
        "rows--error",
        "rows--dim",
    }

    DEFAULT_CSS = """
    RowsView { height: 1fr; }
    RowsView > .rows--header { text-style: bold; background: $panel; }
    RowsView > .rows--cursor { background: $primary 40%; }
    RowsView:focus > .rows--cursor { background: $primary 70%; }
    RowsView > .rows--ok { color: $success; }
    RowsView > .rows--info { color: $accent; }
    RowsView > .rows--warning { color: $warning; text-style: bold; }
    RowsView > .rows--error { color: $error; text-style: bold; }
    RowsView > .rows--dim { color: $text-muted; }
    """

    #: Cells on the left that do not scroll sideways.
    fixed_width = 6

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows: tuple[RowT, ...] = ()
        #: What the last set_rows was handed, and its key: handed them again (a key
        #: that changed nothing here), the view keeps its drawn lines.
        self._given: object = None
        self._given_key: object = None
        self._index: dict[int, int] = {}
        self.cursor_rank: int | None = None
        # Until the user picks a rank, the cursor stays on the first row: the
        # worst rank, when problem ranks sort first.
        self.user_moved = False
        self._lines: dict[int, Strip] = {}
        # Resolving a style from CSS costs ~0.1 ms; a frame needs hundreds.
        self._styles: dict[str, Style] = {}

    @property
    def view_width(self) -> int:
        """Cells a line shows: the widget's width less its vertical scrollbar."""
        return self.scrollable_content_region.width

    # --- what subclasses draw --------------------------------------------------

    def content_width(self) -> int:
        """Width of a full line, before sideways scrolling."""
        return self.view_width

    def header_segments(self) -> list[Segment]:
        raise NotImplementedError

    def row_segments(self, row: RowT) -> list[Segment]:
        raise NotImplementedError

    # --- data ------------------------------------------------------------------

    def set_rows(self, rows: Sequence[RowT], key: object = None) -> None:
        """New rows, already in display order. Cheap: nothing is drawn here.

        ``key`` names the set of rows, whatever their order (the snapshot and the
        filter): views that sum up every row (a scale, the columns in use) skip
        that while it is unchanged, so a re-sort costs a sort. None: always sum.
        The very same sequence with the same key changes nothing and draws nothing.
        """
        if key is not None and rows is self._given and key == self._given_key:
            return
        self._given, self._given_key = rows, key
        self.rows = tuple(rows)
        self._index = {row.rank: i for i, row in enumerate(self.rows)}
        self._lines.clear()
        if self.rows and (
            not self.user_moved or self.cursor_rank is None or self.cursor_rank not in self._index
        ):
            self.cursor_rank = self.rows[0].rank
        self.virtual_size = Size(self.content_width(), len(self.rows) + 1)
        self.refresh()

    def redraw(self) -> None:
        """Forget drawn lines (after a change of what rows mean, e.g. the metric)."""
        self._lines.clear()
        self.virtual_size = Size(self.content_width(), len(self.rows) + 1)
        self.refresh()

    def on_resize(self, event: events.Resize) -> None:
        self.redraw()

    def style(self, name: str) -> Style:
        style = self._styles.get(name)
        if style is None:
            style = self._styles[name] = self.get_component_rich_style(name)
        return style

    @property
    def base_style(self) -> Style:
        style = self._styles.get("")
        if style is None:
            style = self._styles[""] = self.rich_style
        return style

    def notify_style_update(self) -> None:
        # Focus, theme or CSS changed: the styles are stale, and so are the lines
        # drawn with them unless only the cursor's changed (focus does just that, and
        # the cursor is laid on at draw time): then a view switch redraws no line.
        super().notify_style_update()
        old, self._styles = self._styles, {}
        if any(
            self._resolve(name) != style for name, style in old.items() if name != "rows--cursor"
        ):
            self._lines.clear()

    def _resolve(self, name: str) -> Style:
        return self.base_style if name == "" else self.style(name)

    def level_style(self, level: int) -> Style:
        return self.style(LEVEL_CLASS.get(level, "rows--ok"))

    # --- drawing -----------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        width = self.view_width
        scroll_x, scroll_y = self.scroll_offset
        base = self.base_style
        if y == 0:
            strip = Strip(self.header_segments()).apply_style(self.style("rows--header"))
            return self._crop(strip, scroll_x, width, self.style("rows--header"))
        index = scroll_y + y - 1
        if not 0 <= index < len(self.rows):
            return Strip.blank(width, base)
        row = self.rows[index]
        cached = self._lines.get(index)
        strip = cached if cached is not None else Strip(self.row_segments(row))
        self._lines[index] = strip
        if row.rank == self.cursor_rank:
            strip = strip.apply_style(self.style("rows--cursor"))
            return self._crop(strip, scroll_x, width, base + self.style("rows--cursor"))
        return self._crop(strip, scroll_x, width, base)

    def _crop(self, strip: Strip, scroll_x: int, width: int, fill: Style) -> Strip:
        fixed = min(self.fixed_width, width)
        if scroll_x <= 0:
            return strip.crop_extend(0, width, fill)
        left = strip.crop_extend(0, fixed, fill)
        right = strip.crop_extend(fixed + scroll_x, scroll_x + width, fill)
        return Strip.join([left, right])

    # --- cursor ------------------------------------------------------------------

    @property
    def cursor_index(self) -> int:
        if self.cursor_rank is None:
            return 0
        return self._index.get(self.cursor_rank, 0)

    def move_to_index(self, index: int) -> None:
        if not self.rows:
            return
        index = max(0, min(len(self.rows) - 1, index))
        rank = self.rows[index].rank
        changed = rank != self.cursor_rank
        self.cursor_rank = rank
        self.user_moved = True
        self.scroll_to_cursor()
        self.refresh()
        if changed:
            self.announce(rank)

    def announce(self, key: int) -> None:
        """The cursor moved to the line keyed ``key`` (a rank here)."""
        self.post_message(RankHighlighted(key))

    def selected_rank(self) -> int | None:
        """The rank the cursor stands for, which every other view then follows."""
        return self.cursor_rank

    def follow(self, rank: int | None) -> None:
        """Put the cursor on ``rank`` (another view moved it) without announcing it."""
        if rank is None:
            return
        self.user_moved = True
        if rank != self.cursor_rank:
            self.cursor_rank = rank
            self.scroll_to_cursor()
            self.refresh()

    @property
    def visible_rows(self) -> int:
        # The header takes a line, and a horizontal scrollbar another.
        return max(1, self.scrollable_content_region.height - 1)

    def _cursor_target(self) -> int | None:
        """Where to scroll so the cursor's row shows, or None when it already does."""
        visible = self.visible_rows
        index = self.cursor_index
        top = round(self.scroll_y)
        if index < top:
            return index
        if index >= top + visible:
            return index - visible + 1
        return None

    def scroll_to_cursor(self) -> None:
        target = self._cursor_target()
        if target is not None:
            # Deferred to after the next refresh; check again then, because a
            # scrollbar appearing meanwhile changes how many rows fit.
            self.scroll_to(y=target, animate=False, on_complete=self._settle_cursor)

    def _settle_cursor(self) -> None:
        target = self._cursor_target()
        if target is not None:
            self.scroll_to(y=target, animate=False, immediate=True)

    def action_cursor(self, delta: int) -> None:
        self.move_to_index(self.cursor_index + delta)

    def action_page(self, direction: int) -> None:
        self.move_to_index(self.cursor_index + direction * max(1, self.visible_rows - 1))

    def action_edge(self, direction: int) -> None:
        self.move_to_index(0 if direction < 0 else len(self.rows) - 1)

    def action_choose(self) -> None:
        if self.cursor_rank is not None and self.rows:
            self.post_message(RankChosen(self.cursor_rank))

    def on_click(self, event: events.Click) -> None:
        if event.y == 0:
            self.header_clicked(
                event.x + (round(self.scroll_x) if event.x >= self.fixed_width else 0)
            )
            return
        index = round(self.scroll_y) + event.y - 1
        if 0 <= index < len(self.rows):
            self.move_to_index(index)
            if event.chain >= 2:
                self.action_choose()

    def header_clicked(self, x: int) -> None:
        """A click on the header at content column ``x`` (subclasses may sort)."""
