"""Findings: what ddpscope tells the user, raised once and then kept up to date.

A finding may be the consequence of another one in the same book: the extra
forward of a rank with more batches (``rank0_only_collective``) follows from
``uneven_inputs``, a rank blocked in a collective with a crashed peer follows
from ``rank_exit``. :meth:`FindingBook.explain` links it to its cause: the
finding keeps being updated by its detector, but is shown at the cause's
chosen lower level, with a note and the cause's fix, and ``cause`` names the
cause's kind and key. The rules that decide which findings explain which live
in ``analysis/causes.py``; the book only keeps the links true across updates.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

SEVERITIES = ("info", "warning", "error")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}


def severity_at_least(severity: str, floor: str) -> bool:
    return _RANK[severity] >= _RANK[floor]


@dataclass
class Finding:
    #: One of the kinds in docs/findings.md (straggler, desync, ...).
    kind: str
    severity: str
    #: The ranks the finding is about (the slow rank, the minority replicas...).
    ranks: list[int]
    #: First step (and epoch, where it applies) at which it was seen.
    step: int
    message: str
    #: What to do about it.
    fix: str
    epoch: int = -1
    #: The figures behind it (JSON-ready values only).
    evidence: dict[str, Any] = field(default_factory=dict)
    #: Step at which it was last updated, and how many times.
    last_step: int = -1
    updates: int = 0
    #: Whether the condition still holds (a straggler that recovered: False).
    active: bool = True
    #: Order in which findings were raised (for "newest first").
    serial: int = 0
    #: Analysis clock (sender monotonic ns in replays and reports, the
    #: watcher's monotonic clock live) when it was raised and last changed.
    raised_ns: int = -1
    changed_ns: int = -1
    #: Its key in the book (set when raised): with ``kind``, what a ``cause`` refers to.
    key: str = ""
    #: (kind, key) of the finding this one is a consequence of; None when it stands alone.
    cause: tuple[str, str] | None = None
    #: The level its detector gives it when it is a consequence ("" otherwise).
    own_severity: str = ""

    def to_json(self) -> dict[str, Any]:
        cause = None
        if self.cause is not None:
            cause = {"kind": self.cause[0], "key": self.cause[1]}
            cause["own_severity"] = self.own_severity
        return {
            "kind": self.kind,
            "key": self.key,
            "severity": self.severity,
            "ranks": list(self.ranks),
            "step": self.step,
            "epoch": self.epoch,
            "last_step": self.last_step,
            "message": self.message,
            "evidence": self.evidence,
            "fix": self.fix,
            "active": self.active,
            "updates": self.updates,
            "cause": cause,
        }


@dataclass
class _Link:
    """A finding explained by another: what its detector says, and how it is shown."""

    cause: tuple[str, str]
    #: Level while a consequence (never above what the detector says), note, fix.
    severity: str
    note: str
    fix: str
    #: What the detector last said, so that the link can be undone.
    own_severity: str
    own_message: str
    own_fix: str


class FindingBook:
    """Findings keyed by (kind, key): a detector raises, then updates, never repeats."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], Finding] = {}
        self._serial = 0
        #: Bumped on every change, so a UI can tell cheaply whether to redraw.
        self.version = 0
        #: The analysis clock, set by the Analysis before detectors run, so
        #: findings carry the moment they were raised without each detector
        #: having to know it.
        self.now_ns = -1
        #: (kind, key) -> its cause, for findings that are consequences.
        self._links: dict[tuple[str, str], _Link] = {}
        #: The version the cause rules last saw (analysis/causes.py).
        self.linked_version = -1

    def raise_or_update(self, key: str, finding: Finding) -> Finding:
        full = (finding.kind, key)
        old = self._by_key.get(full)
        if old is None:
            self.version += 1
            self._serial += 1
            finding.serial = self._serial
            finding.key = key
            finding.last_step = max(finding.last_step, finding.step)
            finding.raised_ns = finding.changed_ns = self.now_ns
            self._by_key[full] = finding
            return finding
        link = self._links.get(full)
        # Keep identity and first sighting; refresh the rest. The version only
        # moves on a visible change, so a UI redraws only when it must.
        before = (old.severity, old.ranks, old.message, old.evidence, old.active, old.fix)
        own = old.severity if link is None else link.own_severity
        old.severity = max(own, finding.severity, key=_RANK.__getitem__)
        old.ranks = finding.ranks
        old.message = finding.message
        old.fix = finding.fix
        old.evidence = finding.evidence
        old.last_step = max(old.last_step, finding.step, finding.last_step)
        old.active = finding.active
        old.updates += 1
        if link is not None:
            link.own_severity, link.own_message, link.own_fix = old.severity, old.message, old.fix
            _show(old, link)
        if before != (old.severity, old.ranks, old.message, old.evidence, old.active, old.fix):
            self.version += 1
            old.changed_ns = self.now_ns
        return old

    def changed(self, finding: Finding) -> None:
        """A detector edited ``finding`` in place (its ranks, step, evidence): show it."""
        self.version += 1
        finding.changed_ns = self.now_ns

    def set_severity(self, finding: Finding, severity: str) -> None:
        """A detector's own level for its finding, up or down; a cause's cap still holds."""
        before = finding.severity
        link = self._links.get((finding.kind, finding.key))
        if link is None:
            finding.severity = severity
        else:
            link.own_severity = severity
            _show(finding, link)
        if finding.severity != before:
            self.changed(finding)

    # --- consequences --------------------------------------------------------

    def explain(
        self,
        kind: str,
        key: str,
        cause: tuple[str, str],
        note: str,
        *,
        severity: str = "info",
        fix: str = "",
    ) -> bool:
        """Mark finding (kind, key) as a consequence of ``cause``, another finding here.

        It is shown at ``severity`` at most, its message followed by ``note``
        and its fix replaced by ``fix`` (when given), for as long as the link
        holds: its detector's later updates keep it so. True when something
        a reader sees changed.
        """
        f = self._by_key.get((kind, key))
        if f is None or cause not in self._by_key or cause == (kind, key):
            return False
        link = self._links.get((kind, key))
        if link is None:
            link = _Link(cause, severity, note, fix, f.severity, f.message, f.fix)
            self._links[(kind, key)] = link
        else:
            link.cause, link.severity, link.note, link.fix = cause, severity, note, fix
        return self._changed(f, lambda: _show(f, link))

    def unexplain(self, kind: str, key: str) -> bool:
        """Undo :meth:`explain`: the finding stands on its own again, as its detector said."""
        link = self._links.pop((kind, key), None)
        f = self._by_key.get((kind, key))
        if link is None or f is None:
            return False

        def restore() -> None:
            # A detector may have edited the shown text in place since (a suffix on the
            # message): take the note out of what is there rather than go back in time.
            note = f" {link.note}" if link.note else ""
            f.message = f.message.replace(note, "", 1) if note else f.message
            f.fix = link.own_fix if not link.fix or f.fix == link.fix else f.fix
            f.severity, f.cause, f.own_severity = link.own_severity, None, ""

        return self._changed(f, restore)

    def links(self) -> dict[tuple[str, str], tuple[str, str]]:
        """(kind, key) of each consequence -> (kind, key) of its cause."""
        return {k: link.cause for k, link in self._links.items()}

    def _changed(self, f: Finding, change: Any) -> bool:
        before = (f.severity, f.message, f.fix, f.cause)
        change()
        if before == (f.severity, f.message, f.fix, f.cause):
            return False
        self.version += 1
        f.changed_ns = self.now_ns
        return True

    def resolve(self, kind: str, key: str) -> None:
        f = self._by_key.get((kind, key))
        if f is not None and f.active:
            f.active = False
            f.changed_ns = self.now_ns
            self.version += 1

    def get(self, kind: str, key: str) -> Finding | None:
        return self._by_key.get((kind, key))

    def of_kind(self, kind: str) -> list[Finding]:
        return [f for (k, _), f in self._by_key.items() if k == kind]

    def __iter__(self) -> Iterator[Finding]:
        return iter(self._by_key.values())

    def __len__(self) -> int:
        return len(self._by_key)

    def sorted(self) -> list[Finding]:
        """Most severe first, then newest first."""
        return sorted(self._by_key.values(), key=lambda f: (-_RANK[f.severity], -f.serial))


def _show(f: Finding, link: _Link) -> None:
    """The finding as a consequence: capped level, the note after its own message."""
    f.cause = link.cause
    f.own_severity = link.own_severity
    f.severity = min(link.own_severity, link.severity, key=_RANK.__getitem__)
    f.message = f"{link.own_message} {link.note}" if link.note else link.own_message
    f.fix = link.fix or link.own_fix
