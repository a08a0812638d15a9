"""Findings: what ddpscope tells the user, raised once and then kept up to date."""

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

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
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
        }


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

    def raise_or_update(self, key: str, finding: Finding) -> Finding:
        full = (finding.kind, key)
        old = self._by_key.get(full)
        if old is None:
            self.version += 1
            self._serial += 1
            finding.serial = self._serial
            finding.last_step = max(finding.last_step, finding.step)
            finding.raised_ns = finding.changed_ns = self.now_ns
            self._by_key[full] = finding
            return finding
        # Keep identity and first sighting; refresh the rest. The version only
        # moves on a visible change, so a UI redraws only when it must.
        before = (old.severity, old.ranks, old.message, old.evidence, old.active, old.fix)
        old.severity = max(old.severity, finding.severity, key=_RANK.__getitem__)
        old.ranks = finding.ranks
        old.message = finding.message
        old.fix = finding.fix
        old.evidence = finding.evidence
        old.last_step = max(old.last_step, finding.step, finding.last_step)
        old.active = finding.active
        old.updates += 1
        if before != (old.severity, old.ranks, old.message, old.evidence, old.active, old.fix):
            self.version += 1
            old.changed_ns = self.now_ns
        return old

    def resolve(self, kind: str, key: str) -> None:
        f = self._by_key.get((kind, key))
        if f is not None and f.active:
            f.active = False
            f.changed_ns = self.now_ns
            self.version += 1

    def get(self, kind: str, key: str) -> Finding | None:
        return self._by_key.get((kind, key))

    def __iter__(self) -> Iterator[Finding]:
        return iter(self._by_key.values())

    def __len__(self) -> int:
        return len(self._by_key)

    def sorted(self) -> list[Finding]:
        """Most severe first, then newest first."""
        return sorted(self._by_key.values(), key=lambda f: (-_RANK[f.severity], -f.serial))
