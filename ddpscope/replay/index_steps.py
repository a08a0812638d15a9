"""When each step was complete on every rank: the replay index's step table, in flat arrays.

The pass notes, per step number, how many reports it has seen and the time it
counts the step done from (its first report until every rank has sent it,
then each later report's). Two dicts did that: about 200 bytes a step in
int objects and hash slots, growing with the run. Steps are numbered densely
from where a run starts, so here they are slots of two arrays (16 bytes a
step) from the first step seen; a step far outside that range (a run that
resumed at step 10**9 partway) goes to a small dict instead of stretching the
arrays. Read as the mapping the dict was, in the order steps first came.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping

#: A step at most this far past the arrays' end grows them to reach it.
REACH = 1 << 16


class StepTimes(Mapping[int, int]):
    """step -> the time it counts as done from; filled by :meth:`report`."""

    def __init__(self) -> None:
        self._base: int | None = None
        self._t = array("q")
        #: Reports seen per slot; 0: the step was never reported.
        self._seen = array("q")
        #: Steps far outside the slots: step -> [reports, time].
        self._far: dict[int, list[int]] = {}
        #: Step numbers in the order first reported (the mapping's order).
        self._order = array("q")

    def report(self, step: int, t: int, expected: int) -> None:
        """One rank reported ``step`` at ``t``; ``expected``: the ranks the run has."""
        i = self._slot(step)
        if i < 0:
            far = self._far.get(step)
            if far is None:
                self._order.append(step)
                self._far[step] = [1, t]
                return
            far[0] += 1
            if far[0] >= expected:
                far[1] = t
            return
        seen = self._seen[i] + 1
        self._seen[i] = seen
        if seen == 1:
            self._order.append(step)
            self._t[i] = t
        elif seen >= expected:
            self._t[i] = t

    def _slot(self, step: int) -> int:
        base = self._base
        if base is None:
            self._base = base = step
        i = step - base
        n = len(self._t)
        if 0 <= i < n:
            return i
        if i < 0 or i >= n + REACH:
            return -1
        grow = i + 1 - n
        zeros = array("q", bytes(grow * 8))
        self._t.extend(zeros)
        self._seen.extend(zeros)
        return i

    def __getitem__(self, step: int) -> int:
        base = self._base
        if base is not None:
            i = step - base
            if 0 <= i < len(self._seen) and self._seen[i]:
                return self._t[i]
        far = self._far.get(step)
        if far is None:
            raise KeyError(step)
        return far[1]

    def __contains__(self, step: object) -> bool:
        try:
            self[step]  # type: ignore[index]
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
