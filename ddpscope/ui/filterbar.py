"""The one-line filter prompt that ``/`` opens above the footer."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Input, Label

from ddpscope.ui.messages import FilterCancelled, FilterChosen

PLACEHOLDER = "ranks 12, 100-200; host node07; badge straggler  (enter: apply, empty: all, esc)"


class FilterPrompt(Horizontal):
    """The prompt "filter /" and the input after it: one line at the bottom, hidden until ``/``."""

    DEFAULT_CSS = """
    FilterPrompt { dock: bottom; height: 1; background: $boost; }
    FilterPrompt > Label { width: auto; padding: 0 0 0 1; text-style: bold; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.display = False
        self.bar = FilterBar()

    def compose(self) -> ComposeResult:
        yield Label("filter /")
        yield self.bar

    def open(self, text: str) -> None:
        bar = self.bar
        bar.value = text
        self.display = True
        bar.focus()
        bar.cursor_position = len(text)

    def close(self) -> None:
        self.display = False


class FilterBar(Input):
    DEFAULT_CSS = """
    FilterBar { width: 1fr; height: 1; border: none; padding: 0 1; background: $boost; }
    FilterBar:focus { border: none; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel", show=False)]

    def __init__(self) -> None:
        super().__init__(placeholder=PLACEHOLDER, compact=True)

    def close(self) -> None:
        parent = self.parent
        if isinstance(parent, FilterPrompt):
            parent.close()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.close()
        self.post_message(FilterChosen(event.value))

    def action_cancel(self) -> None:
        self.close()
        self.post_message(FilterCancelled())
