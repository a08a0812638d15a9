"""What the filter key (``/``) keeps: ranks by number or range, hosts by name, rows by badge.

A filter is a few terms separated by commas or spaces, and a row is kept when
any term matches it: ``12`` (rank 12), ``12-40`` (ranks 12 to 40, both
included), any other word a piece of the host name (``node03``, case
ignored) or a status badge (``straggler``, ``silent``). No textual here: the
parse is plain data, tested on its own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ddpscope.analysis.snapshot import RankRow
from ddpscope.ui.format import badge

_RANGE = re.compile(r"^(\d+)-(\d+)$")


@dataclass(frozen=True)
class RankFilter:
    """The parsed filter; ``text`` is what the user typed, as typed."""

    text: str
    ranks: frozenset[int] = frozenset()
    #: Inclusive (first, last) pairs.
    ranges: tuple[tuple[int, int], ...] = ()
    #: Lower-case words matched against the host name (a part of it) and the badge (all of it).
    words: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.ranks or self.ranges or self.words)

    def matches(self, row: RankRow) -> bool:
        rank = row.rank
        if rank in self.ranks:
            return True
        for first, last in self.ranges:
            if first <= rank <= last:
                return True
        if self.words:
            host = row.host.lower()
            for word in self.words:
                if word in host or word in (row.status, badge(row.status).lower()):
                    return True
        return False

    def apply(self, rows: Sequence[RankRow]) -> list[RankRow]:
        """The rows kept, in the order given (every row when the filter is empty)."""
        if self.empty:
            return list(rows)
        return [r for r in rows if self.matches(r)]


def parse(text: str) -> RankFilter:
    """``"3, 12-40 node07"`` -> ranks {3}, range 12-40, host word "node07".

    A range written backwards (``40-12``) means the same ranks; there is no
    invalid input, only words that match nothing.
    """
    ranks: set[int] = set()
    ranges: list[tuple[int, int]] = []
    words: list[str] = []
    for term in text.replace(",", " ").split():
        if term.isdigit():
            ranks.add(int(term))
            continue
        m = _RANGE.match(term)
        if m is not None:
            a, b = int(m.group(1)), int(m.group(2))
            ranges.append((min(a, b), max(a, b)))
            continue
        words.append(term.lower())
    return RankFilter(text.strip(), frozenset(ranks), tuple(ranges), tuple(words))


#: Keeps every row.
EVERYTHING = RankFilter("")
