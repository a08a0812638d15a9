"""The watch UI over a recording: the same screens, plus a transport bar and its keys."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Input, Label, Static

from ddpscope.replay.player import ReplayFeed, ReplayStatus
from ddpscope.ui import format as fmt
from ddpscope.ui.app import WatchApp
from ddpscope.ui.header import Situation
from ddpscope.ui.help import HelpScreen

#: The UI asks a replay for snapshots this often (faster than live: playback moves).
REPLAY_PULL_S = 0.25

REPLAY_KEYS = (
    ("space", "play / pause"),
    ("+ -", "faster / slower: 1x 2x 4x ... 64x, then as fast as it reads"),
    (". ,", "one step forward / back (pauses)"),
    ("g", "go to a step (type its number)"),
    ("n N", "to the moment the next / previous finding was raised"),
    ("0  e", "to the start / the end (a run still being written: follow its end)"),
)


def bar_text(status: ReplayStatus, width: int = 30) -> Text:
    """The transport line: state, speed, position, progress, findings so far."""
    span = max(status.end_t - status.first_t, 1)
    done = min(max((status.t - status.first_t) / span, 0.0), 1.0)
    filled = round(done * width)
    last = "?" if status.last_step < 0 else str(status.last_step)
    parts: list[tuple[str, str]] = [
        ("▶ " if status.playing else "❚❚ ", "bold green" if status.playing else "bold yellow"),
        (status.speed_label, "bold"),
        ("  step ", "dim"),
        (f"{max(status.step, 0)}/{last}", "bold"),
        ("  ", ""),
        (fmt.clock((status.t - status.first_t) / 1e9), ""),
        (" / ", "dim"),
        (fmt.clock(span / 1e9), "dim"),
        ("  ", ""),
        ("━" * filled, "magenta"),
        ("─" * (width - filled), "dim"),
        ("  findings ", "dim"),
        (f"{status.findings_now}/{status.findings_total}", "bold"),
    ]
    if status.indexed < 1.0:
        parts.append((f"  reading {status.indexed:.0%}", "yellow"))
    elif status.following:
        parts.append(("  following the end", "cyan"))
    if status.notice:
        parts.append(("  " + status.notice, "yellow"))
    text = Text.assemble(*parts)
    text.no_wrap = True
    text.overflow = "ellipsis"
    return text


class ReplayBar(Static):
    DEFAULT_CSS = """
    ReplayBar { height: 1; padding: 0 1; background: $boost; text-wrap: nowrap;
        text-overflow: ellipsis; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.plain = ""

    def show(self, status: ReplayStatus) -> None:
        text = bar_text(status)
        if text.plain != self.plain:
            self.plain = text.plain
            self.update(text, layout=False)


class GoToStep(ModalScreen[int | None]):
    """Asks for a step number; dismisses with it, or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    GoToStep { align: center middle; }
    GoToStep > Vertical { width: 44; height: auto; border: round $accent;
        background: $surface; padding: 0 1; }
    """

    def __init__(self, last_step: int) -> None:
        super().__init__()
        self.last_step = last_step

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"Go to step (0-{max(self.last_step, 0)}), enter to go, esc to cancel")
            yield Input(placeholder="step", type="integer", id="step")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        self.dismiss(int(value) if value.lstrip("-").isdigit() else None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ReplayApp(WatchApp):
    TITLE = "ddpscope replay"

    BINDINGS = [
        Binding("space", "play", "Play/pause"),
        Binding("plus,equals_sign", "speed(1)", "Faster"),
        Binding("minus", "speed(-1)", "Slower", show=False),
        Binding("full_stop", "step(1)", "Step", show=False),
        Binding("comma", "step(-1)", "Back", show=False),
        Binding("g", "goto", "Go to"),
        Binding("n", "finding(1)", "Next finding"),
        Binding("N", "finding(-1)", "Prev finding", show=False),
        Binding("0", "start", "Start", show=False),
        Binding("e", "end", "End", show=False),
    ]

    def __init__(self, feed: ReplayFeed, *, log_path: str | None = None) -> None:
        super().__init__(feed, log_path=log_path, pull_s=REPLAY_PULL_S)
        self.feed = feed
        self.bar = ReplayBar(id="replaybar")

    def compose(self) -> ComposeResult:
        widgets: Iterable[Widget] = super().compose()
        for widget in widgets:
            yield widget
            if widget is self.header:
                yield self.bar

    def _situation(self) -> Situation:
        status = self.feed.status
        if status.at_end and not status.playing:
            state = "END"
        elif status.playing:
            state = f"▶ {status.speed_label}"
        else:
            state = "❚❚"
        return replace(super()._situation(), replay=f"REPLAY {state}")

    def _apply(self) -> None:
        super()._apply()
        self.bar.show(self.feed.status)

    def _pull(self, detail_rank: int | None = None, *, if_more: bool = False) -> None:
        super()._pull(detail_rank, if_more=if_more)
        self.bar.show(self.feed.status)

    def _help_screen(self) -> HelpScreen:
        return HelpScreen(REPLAY_KEYS, "Replay")

    # --- the transport ---------------------------------------------------------------

    def _after(self) -> None:
        # Commands are done on the player's thread; ask for the result right away.
        self._pull()

    def action_play(self) -> None:
        self.feed.play()
        self._after()

    def action_pause(self) -> None:  # space in the live app: here it plays/pauses
        self.action_play()

    def action_speed(self, delta: int) -> None:
        self.feed.faster(delta)
        self._after()

    def action_step(self, delta: int) -> None:
        self.feed.step_by(delta)
        self._after()

    def action_finding(self, direction: int) -> None:
        self.feed.to_finding(direction)
        self._after()

    def action_start(self) -> None:
        self.feed.to_start()
        self._after()

    def action_end(self) -> None:
        self.feed.to_end()
        self._after()

    def action_goto(self) -> None:
        def go(step: int | None) -> None:
            if step is not None:
                self.feed.seek_step(step)
                self._after()

        self.push_screen(GoToStep(self.feed.status.last_step), go)
