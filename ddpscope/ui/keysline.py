"""The bottom line: the keys that work now, as one line of text.

Textual's Footer rebuilds a widget per key whenever focus moves (every view
switch): at 200x50 that cost more than the rest of answering the key. This
line draws the same keys as text, redrawn only when they change; a click on
a key runs its action as the Footer's would.
"""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.dom import DOMNode
from textual.screen import Screen
from textual.widgets import Static


class KeysLine(Static):
    DEFAULT_CSS = """
    KeysLine { dock: bottom; height: 1; background: $panel; text-wrap: nowrap;
        text-overflow: ellipsis; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.plain = ""
        self._spans: list[tuple[int, int, DOMNode, str]] = []

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, self._changed)

    def on_unmount(self) -> None:
        self.screen.bindings_updated_signal.unsubscribe(self)

    def _changed(self, screen: Screen[object]) -> None:
        if self.is_attached and screen is self.screen:
            self.show()

    def show(self) -> None:
        text = Text(no_wrap=True, overflow="ellipsis")
        spans: list[tuple[int, int, DOMNode, str]] = []
        seen: set[str] = set()
        for node, binding, enabled, _tooltip in self.screen.active_bindings.values():
            if not binding.show or binding.action in seen:
                continue
            seen.add(binding.action)
            start = len(text)
            key = self.app.get_key_display(binding)
            text.append(f" {key} ", "bold reverse" if enabled else "dim reverse")
            text.append(f"{binding.description} ", "" if enabled else "dim")
            spans.append((start, len(text), node, binding.action))
            text.append(" ")
        self._spans = spans
        if text.plain != self.plain:
            self.plain = text.plain
            self.update(text, layout=False)

    async def on_click(self, event: events.Click) -> None:
        for start, end, node, action in self._spans:
            if start <= event.x < end:
                await self.app.run_action(action, node)
                return
