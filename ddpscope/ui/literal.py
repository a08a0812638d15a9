"""Table cells and titles as literal text, never as Rich markup.

Rich reads a ``str`` handed to a Table (a cell, a title, a header) as markup.
What the watcher shows comes from the ranks: an error that quotes gloo's source
path (``[/__w/pytorch/pytorch/third_party/gloo/.../pair.cc:553] Connection
closed by peer``), a file path or a host name with brackets in it. As markup
those raise MarkupError in the middle of drawing, which ends the app, or lose
their bracketed words. Everything that goes into a Table goes through here.

Strings stay strings, escaped: Rich still styles them as it styles any table
text (the title's style, numbers highlighted), which Text objects would lose.
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.markup import escape
from rich.table import Table


def literal(value: RenderableType) -> RenderableType:
    """``value`` escaped when it is a str; any other renderable as it is."""
    return escape(value) if isinstance(value, str) else value


def title(value: str) -> str:
    """A table's title (or header) escaped."""
    return escape(value)


def add_row(table: Table, *cells: RenderableType) -> None:
    """``table.add_row`` with every str cell taken literally."""
    table.add_row(*(literal(c) for c in cells))
