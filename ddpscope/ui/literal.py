"""Table cells and titles as literal text, never as Rich markup.

Rich reads a ``str`` handed to a Table (a cell, a title, a header) as markup.
What the watcher shows comes from the ranks: an error that quotes gloo's source
path (``[/__w/pytorch/pytorch/third_party/gloo/.../pair.cc:553] Connection
closed by peer``), a file path or a host name with brackets in it. As markup
those raise MarkupError in the middle of drawing, which ends the app, or lose
their bracketed words. Everything that goes into a Table goes through here.
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text


def literal(value: RenderableType) -> RenderableType:
    """``value`` as Text when it is a str; any other renderable as it is."""
    return Text(value) if isinstance(value, str) else value


def title(value: str) -> Text:
    """A table's title (or header) as literal text."""
    return Text(value)


def add_row(table: Table, *cells: RenderableType) -> None:
    """``table.add_row`` with every str cell taken literally."""
    table.add_row(*(literal(c) for c in cells))
