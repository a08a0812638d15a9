"""Telemetry health (``telemetry``): is ddpscope seeing the whole run?

Findings about the monitor itself, so that a quiet report is not mistaken for a
healthy run when data is missing:

- Lost messages. Sender-side queue overflows (``Heartbeat.dropped_queue``)
  are lost everywhere, the recording included. Live, gaps in a rank's
  sequence numbers (``RankView.missing``) add what the wire lost (send
  high-water mark, a slow watcher). In a recording gaps mean nothing (the
  periodic re-sends of run info are sent, not recorded): a recorded ``Mode``
  says so; ``Heartbeat.dropped_send`` is then only a note that
  a live watcher missed messages the recording has.
  Warning at 1 % of a run's messages or 5 % of one rank's, info below: a few
  drops on a live watcher do not change any diagnosis.
- Silent ranks: run info says N ranks, some never sent anything after a grace
  period (max(15 s, 3 resends)) or by the time every heard rank has ended.
  Warning: those ranks are not watched at all.
- Rejected messages (``RunState.rejected``: ranks outside the world, absurd
  values; a watcher may add its decode rejects there, e.g. a schema version
  it cannot read). Warning for a schema version, or 1 % of messages.
- ddpscope turned itself off on a rank (End ``disabled``, with its error):
  warning, the rank trains on unobserved. A handle closed while the run
  went on (End ``close``): info.
- Ranks running different ddpscope versions: info.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.position import option
from ddpscope.analysis.protocol import LIVE, Mode
from ddpscope.analysis.state import RunState
from ddpscope.analysis.wording import NS, ranks_phrase, ranks_text
from ddpscope.schema import Message

#: Share of lost messages that makes a warning, for the run and for one rank.
RUN_LOSS_WARN = 0.01
RANK_LOSS_WARN = 0.05
SILENT_GRACE_S = 15.0
#: Errors of disabled ranks kept in evidence (identical texts are folded).
MAX_ERRORS = 8


@dataclass
class _TeleRun:
    signatures: dict[str, tuple[Any, ...]] = field(default_factory=dict)


class TelemetryDetector:
    kinds: tuple[str, ...] = ("telemetry",)
    #: The messages observe() looks at (the engine calls it for no others).
    observes: tuple[type, ...] = ()

    def __init__(self, mode: Mode = LIVE, silent_grace_s: float = SILENT_GRACE_S) -> None:
        self.mode = mode
        #: False when fed from record files: sequence gaps are then not losses.
        self.live = mode.live
        self.silent_grace_s = silent_grace_s
        self._runs: dict[str, _TeleRun] = {}

    def reset(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.tick(run, book)

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        """Everything here is judged on ticks: counters, not single messages."""

    def tick(self, run: RunState, book: FindingBook) -> None:
        st = self._runs.setdefault(run.run_id, _TeleRun())
        for key, finding in (
            ("drops", self._drops(run)),
            ("silent", self._silent(run)),
            ("rejected", self._rejected(run)),
            ("disabled", self._disabled(run)),
            ("closed", self._closed(run)),
            ("versions", self._versions(run)),
        ):
            self._publish(book, st, key, finding)

    @staticmethod
    def _publish(book: FindingBook, st: _TeleRun, key: str, finding: Finding | None) -> None:
        if finding is None:
            if st.signatures.pop(key, None) is not None:
                book.resolve("telemetry", key)
            return
        # Re-raise only on change, not on every tick.
        signature = (finding.severity, tuple(finding.ranks), finding.message)
        if st.signatures.get(key) == signature:
            return
        st.signatures[key] = signature
        book.raise_or_update(key, finding)

    # --- lost messages -------------------------------------------------------

    def _drops(self, run: RunState) -> Finding | None:
        per_rank: dict[str, dict[str, int]] = {}
        lost_total = received_total = queue_total = wire_total = 0
        loud: list[int] = []
        for r in sorted(run.ranks):
            view = run.ranks[r]
            hb = view.heartbeat
            queue = hb.dropped_queue if hb is not None else 0
            send = hb.dropped_send if hb is not None else 0
            gaps = view.missing if self.live else 0
            lost = queue + gaps
            received = view.seq_count
            received_total += received
            lost_total += lost
            queue_total += queue
            wire_total += gaps if self.live else send
            if lost and lost / (lost + received) >= RANK_LOSS_WARN:
                loud.append(r)
            if queue or send or gaps:
                per_rank[str(r)] = {
                    "received": received,
                    "dropped_queue": queue,
                    "dropped_send": send,
                    "sequence_gaps": gaps,
                }
        if not per_rank:
            return None
        share = lost_total / (lost_total + received_total) if lost_total else 0.0
        severity = "warning" if share >= RUN_LOSS_WARN or loud else "info"
        ranks = [int(r) for r in per_rank]
        message, fix = self._drop_text(ranks, lost_total, share, queue_total, wire_total)
        return Finding(
            kind="telemetry",
            severity=severity,
            ranks=loud or ranks,
            step=_min_step(run, ranks),
            message=message,
            fix=fix,
            evidence={
                "lost": lost_total,
                "received": received_total,
                "lost_share": round(share, 4),
                "live": self.live,
                "per_rank": per_rank,
            },
        )

    def _drop_text(
        self, ranks: list[int], lost: int, share: float, queue: int, wire: int
    ) -> tuple[str, str]:
        parts = []
        fixes = []
        if queue:
            parts.append(
                f"{queue} dropped on the ranks because the publisher queue was full "
                "(missing from the recording too)"
            )
            fixes.append(
                "raise DDPSCOPE_QUEUE_SIZE, or give the rank's publisher thread CPU time "
                "(the training loop outran it)"
            )
        if wire and self.live:
            parts.append(f"{wire} lost between the ranks and this watcher")
            fixes.append(
                "raise DDPSCOPE_SNDHWM, run one relay per node, or read the recording "
                "(--record), which has every message the ranks produced"
            )
        elif wire:
            parts.append(f"{wire} not delivered to a live watcher (the recording has them)")
        if lost:
            head = f"{lost} messages from {ranks_phrase(ranks)} were lost ({share:.1%})"
        else:
            head = f"No data is missing, but {ranks_phrase(ranks)} could not send everything live"
        message = f"{head}: {'; '.join(parts)}."
        fix = (
            ("To lose nothing: " + "; ".join(fixes) + ".")
            if fixes
            else "Nothing to do for the diagnosis; a live watcher that keeps up sees all."
        )
        if lost:
            fix += " Findings that need every step (straggler, desync) may come late or not at all."
        return message, fix

    # --- ranks that never spoke ------------------------------------------------

    def _silent(self, run: RunState) -> Finding | None:
        silent = run.silent_ranks()
        if not silent or not run.world_size:
            return None
        grace = max(self.silent_grace_s, 3 * option(run, "resend_s", 5.0))
        waited = (run.now_ns - run.first_rx_ns) / NS
        all_ended = bool(run.ranks) and all(v.end is not None for v in run.ranks.values())
        if waited < grace and not all_ended:
            return None
        return Finding(
            kind="telemetry",
            severity="warning",
            ranks=silent,
            step=0,
            message=(
                f"{ranks_phrase(silent).capitalize()} of the {run.world_size} in this run sent "
                f"nothing{'' if all_ended else f' in {waited:.0f} s'}: ddpscope sees "
                f"{_count(run.world_size - len(silent), 'rank')}, and every figure and finding "
                "is about those only."
            ),
            fix=(
                "Make sure every rank calls ddpscope.attach(model) (or runs under `ddpscope "
                "run`), that DDPSCOPE_DISABLE is not set there, and that it can reach the "
                "endpoint (ranks on other hosts need a non-loopback endpoint or a relay). For a "
                "recording, put DDPSCOPE_RECORD on storage every node shares, or merge the "
                "nodes' run directories. A rank with another ddpscope version is rejected: "
                "see the problems."
            ),
            evidence={
                "world_size": run.world_size,
                "silent": ranks_text(silent),
                "heard": ranks_text(run.ranks),
                "waited_s": round(waited, 1),
            },
        )

    # --- rejected messages ---------------------------------------------------

    def _rejected(self, run: RunState) -> Finding | None:
        total = sum(run.rejected.values())
        if not total:
            return None
        reasons = dict(run.rejected.most_common())
        version = any("version" in why for why in reasons)
        share = total / (total + run.received)
        severity = "warning" if version or share >= RUN_LOSS_WARN else "info"
        listed = ", ".join(f"{why} ({n})" for why, n in reasons.items())
        return Finding(
            kind="telemetry",
            severity=severity,
            ranks=[],
            step=0,
            message=f"{total} messages were rejected ({share:.1%}): {listed}.",
            fix=(
                "Run the same ddpscope version on every rank and in the watcher"
                if version
                else "Rejected messages had impossible values (a rank outside the world, "
                "negative durations): a corrupt stream or two jobs sharing one endpoint; give "
                "each job its own DDPSCOPE_ENDPOINT"
            )
            + ".",
            evidence={"rejected": reasons, "received": run.received},
        )

    # --- ranks where ddpscope stopped ------------------------------------------

    def _disabled(self, run: RunState) -> Finding | None:
        ranks = sorted(
            r for r, v in run.ranks.items() if v.end is not None and v.end.reason == "disabled"
        )
        if not ranks:
            return None
        errors: dict[str, list[int]] = {}
        for r in ranks:
            end = run.ranks[r].end
            text = end.error.strip() if end is not None else ""
            errors.setdefault(text or "(no error text)", []).append(r)
        first = run.ranks[ranks[0]].end
        step = min(e.step for r in ranks if (e := run.ranks[r].end) is not None)
        return Finding(
            kind="telemetry",
            severity="warning",
            ranks=ranks,
            step=step,
            message=(
                f"ddpscope turned itself off on {ranks_phrase(ranks)} at step {step} after an "
                f"internal error ({_one_line(first.error if first else '')}); training went on "
                "there, unobserved from then on."
            ),
            fix=(
                "This is a ddpscope bug: report it with the error in the evidence. Findings "
                "about those ranks after that step are missing; DDPSCOPE_DISABLE=1 turns "
                "ddpscope off everywhere if it gets in the way."
            ),
            evidence={
                "errors": [
                    {"ranks": ranks_text(rs), "error": text}
                    for text, rs in list(errors.items())[:MAX_ERRORS]
                ]
            },
        )

    def _closed(self, run: RunState) -> Finding | None:
        top = max((v.step_count for v in run.ranks.values()), default=0)
        closed = sorted(
            r
            for r, v in run.ranks.items()
            if v.end is not None and v.end.reason == "close" and v.end.step < top
        )
        if not closed:
            return None
        step = min(e.step for r in closed if (e := run.ranks[r].end) is not None)
        return Finding(
            kind="telemetry",
            severity="info",
            ranks=closed,
            step=step,
            message=(
                f"{ranks_phrase(closed).capitalize()} stopped reporting at step {step} (the "
                f"ddpscope handle was closed) while other ranks went on to step {top}."
            ),
            fix="Nothing to do if the handle was closed on purpose; keep it open to watch the "
            "whole run.",
            evidence={"closed": ranks_text(closed), "latest_step": top},
        )

    @staticmethod
    def _versions(run: RunState) -> Finding | None:
        seen: dict[str, list[int]] = {}
        for r, v in sorted(run.ranks.items()):
            if v.info is not None:
                seen.setdefault(str(v.info.versions.get("ddpscope", "?")), []).append(r)
        if len(seen) < 2:
            return None
        return Finding(
            kind="telemetry",
            severity="info",
            ranks=sorted(r for rs in seen.values() for r in rs),
            step=0,
            message="Ranks run different ddpscope versions: "
            + "; ".join(f"{ver} on {ranks_phrase(rs)}" for ver, rs in seen.items())
            + ".",
            fix="Install one ddpscope version in every rank's environment.",
            evidence={ver: ranks_text(rs) for ver, rs in seen.items()},
        )


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no error text"


def _min_step(run: RunState, ranks: list[int]) -> int:
    steps = [run.ranks[r].step_count for r in ranks if r in run.ranks]
    return min(steps, default=0)
