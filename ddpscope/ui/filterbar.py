"""The one-line filter prompt that ``/`` opens above the footer."""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import Input

from ddpscope.ui.messages import FilterCancelled, FilterChosen

PLACEHOLDER = "ranks 12, 100-200; host node07; badge straggler  (enter: apply, empty: all, esc)"


class FilterBar(Input):
    DEFAULT_CSS = """
    FilterBar { dock: bottom; height: 1; border: none; padding: 0 1; background: $boost; }
    FilterBar:focus { border: none; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel", show=False)]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(placeholder=PLACEHOLDER, id=id, compact=True)
        self.display = False

    def open(self, text: str) -> None:
        self.value = text
        self.display = True
        self.focus()
        self.cursor_position = len(text)

    def close(self) -> None:
        self.display = False

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.close()
        self.post_message(FilterChosen(event.value))

    def action_cancel(self) -> None:
        self.close()
        self.post_message(FilterCancelled())
