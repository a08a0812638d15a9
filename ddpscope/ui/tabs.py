"""The line naming the views and their keys; the current one is highlighted."""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.widgets import Static

from ddpscope.ui.messages import ViewChosen

#: View name, key, label.
VIEWS: tuple[tuple[str, str, str], ...] = (
    ("ranks", "1", "Ranks"),
    ("steps", "2", "Step time"),
    ("buckets", "3", "Buckets"),
    ("findings", "4", "Findings"),
    ("log", "5", "Job log"),
    ("phases", "6", "Phases"),
    ("hosts", "7", "Hosts"),
)


class ViewBar(Static):
    DEFAULT_CSS = """
    ViewBar { height: 1; background: $panel; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.current = "ranks"
        self.findings = 0
        self.worst = ""
        self._spans: list[tuple[int, int, str]] = []
        self._last = ""
        self.note = ""

    def show(self, current: str, findings: int, worst: str, note: str = "") -> None:
        """``note``: the active filter, said after the views ("" when none)."""
        self.current, self.findings, self.worst, self.note = current, findings, worst, note
        text = Text(no_wrap=True, overflow="ellipsis")
        if note:
            # First, so that 80 columns never cut it off.
            text.append(f" {note} ", "bold reverse cyan")
            text.append(" ")
        self._spans = []
        for name, key, label in VIEWS:
            if name == "findings" and findings:
                label = f"{label} ({findings})"
            start = len(text)
            style = "bold reverse" if name == current else ""
            text.append(f" {key} ", "bold " + ("reverse" if name == current else "dim"))
            finding_style = {"error": "bold red", "warning": "bold yellow"}.get(worst, "")
            text.append(f"{label} ", style or (finding_style if name == "findings" else ""))
            self._spans.append((start, len(text), name))
        key = text.plain + current
        if key != self._last:
            self._last = key
            self.update(text, layout=False)

    def on_click(self, event: events.Click) -> None:
        for start, end, name in self._spans:
            if start <= event.x < end:
                self.post_message(ViewChosen(name))
                return
