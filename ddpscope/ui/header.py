"""The three header lines: the run, its pace, and the monitor's own health."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.widgets import Static

from ddpscope.analysis.snapshot import Health, RunHeader, Snapshot
from ddpscope.ui import format as fmt


@dataclass(frozen=True)
class Situation:
    """What the app knows beside the snapshot: where it listens, pause, the job it launched."""

    endpoint: str
    paused: bool = False
    #: Exit status of the job ``ddpscope run`` launched (None: running or no job).
    job_status: int | None = None
    #: The replay's state ("REPLAY ▶ 4x"), or "" when watching live.
    replay: str = ""


def run_lines(head: RunHeader) -> tuple[Text, Text]:
    hosts = fmt.ranks(list(head.hosts), 3) if head.hosts else "?"
    n_hosts = len(head.hosts)
    first = Text.assemble(
        ("ddpscope ", "bold"),
        ("run ", "dim"),
        (head.run_id, "bold cyan"),
        ("  ", ""),
        (f"{head.world_size} ranks", "bold"),
        (f" on {n_hosts} host{'s' if n_hosts != 1 else ''} ({hosts})", ""),
        (f"  {head.backend}/{head.device}" if head.backend else "", "dim"),
    )
    second = Text.assemble(
        ("step ", "dim"),
        (str(max(head.step, 0)), "bold"),
        ("  epoch ", "dim"),
        ("-" if head.epoch < 0 else str(head.epoch), "bold"),
        ("  ", ""),
        (f"{head.steps_per_s:.1f}" if head.steps_per_s else "-", "bold"),
        (" steps/s", "dim"),
        ("  elapsed ", "dim"),
        (fmt.clock(head.elapsed_s), "bold"),
        (f"  (run {head.runs_seen} seen; showing the newest)" if head.runs_seen > 1 else "", "dim"),
        (f"  {head.earlier}" if head.earlier else "", "bold yellow"),
    )
    return first, second


def health_line(health: Health) -> Text:
    rate = f" ({fmt.count(int(health.rate))}/s)" if health.rate >= 0 else ""
    lag = "-" if health.lag_s < 0 else f"{health.lag_s * 1000:.0f}ms"
    parts: list[tuple[str, str]] = [
        ("monitor ", "dim"),
        ("rx ", "dim"),
        (fmt.count(health.received) + rate, ""),
        ("  dropped ", "dim"),
        (fmt.count(health.dropped), "bold yellow" if health.dropped else ""),
        ("  rejected ", "dim"),
        (fmt.count(health.rejected), "bold yellow" if health.rejected else ""),
        (_reasons(health), "yellow"),
        ("  silent ", "dim"),
        (
            fmt.ranks(list(health.silent), 4) if health.silent else "0",
            "bold red" if health.silent else "",
        ),
        ("  lag ", "dim"),
        (lag, "bold yellow" if health.lag_s > 2.0 else ""),
    ]
    if health.detector_note:
        parts.append(("  " + health.detector_note, "yellow"))
    return Text.assemble(*parts)


def _reasons(health: Health) -> str:
    if not health.rejected_reasons:
        return ""
    return " (" + ", ".join(f"{why} {n}" for why, n in health.rejected_reasons) + ")"


def state_badge(snapshot: Snapshot | None, situation: Situation) -> Text:
    if situation.replay:
        return Text(f" {situation.replay} ", "bold reverse magenta")
    if situation.paused:
        return Text(" PAUSED (space) ", "bold reverse yellow")
    if situation.job_status is not None:
        style = "bold reverse green" if situation.job_status == 0 else "bold reverse red"
        return Text(f" job exited {situation.job_status} ", style)
    if snapshot is not None and snapshot.header is not None and snapshot.header.ended:
        return Text(" ENDED ", "bold reverse")
    if snapshot is None or snapshot.header is None:
        return Text(" WAITING ", "bold reverse blue")
    return Text(" LIVE ", "bold reverse green")


class HeaderPanel(Static):
    DEFAULT_CSS = """
    HeaderPanel { height: 3; padding: 0 1; background: $boost; text-wrap: nowrap;
        text-overflow: ellipsis; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._last = ""
        #: The three lines as plain text.
        self.plain = ""

    def show(self, snapshot: Snapshot | None, situation: Situation) -> None:
        badge = state_badge(snapshot, situation)
        if snapshot is None or snapshot.header is None:
            first = Text.assemble(
                ("ddpscope ", "bold"), ("listening on ", "dim"), (situation.endpoint, "bold")
            )
            second = Text(
                "waiting for ranks: ddpscope.attach(model) in the script, or "
                "ddpscope run -- torchrun ...",
                "dim",
            )
        else:
            first, second = run_lines(snapshot.header)
        health = health_line(snapshot.health) if snapshot is not None else Text("monitor idle")
        text = Text.assemble(badge, " ", first, "\n", second, "\n", health)
        text.no_wrap = True
        text.overflow = "ellipsis"
        key = text.plain + repr(text.spans)
        if key != self._last:  # redraw only on change
            self._last = key
            self.plain = text.plain
            self.update(text, layout=False)  # three lines, always: no layout pass needed
