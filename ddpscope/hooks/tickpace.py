"""How long the publisher thread sleeps between ticks.

Each tick costs the rank a wake-up, a read of the training thread's run-queue
wait, a record write and a send, whatever it carries: ~100-250 us of CPU on a
virtual machine whose system calls are dear (measured in docs/benchmarks.md),
against ~50-75 us to finish, encode and send one step. A fixed 50 ms tick
carries ten steps of a 5 ms loop but one of a 50 ms loop, where the tick's own
cost was most of the thread's. So the tick stretches with the step: it aims
at :data:`STEPS_PER_TICK` steps a tick, between :data:`TICK_MIN_S` and
:data:`TICK_MAX_S`, read from the steps the thread drained over the last
second; a rank that trains no steps (validation, a hang, before its first
step) ticks at the longest. A tick that drains a burst (an eighth of the
queue) goes back to the shortest at once, so a long tick never fills the
queue.

What the longer tick costs: step messages reach the watcher and the record
file up to :data:`TICK_MAX_S` after the step ends (heartbeats, requests and
stop signals keep their own deadlines; the thread wakes for them), and a rank
killed outright loses up to one tick of records.
"""

from __future__ import annotations

#: The shortest tick: steps of 12.5 ms and less share one this long.
TICK_MIN_S = 0.05
#: The longest tick: an idle rank, or steps of 62.5 ms and more.
TICK_MAX_S = 0.25
#: Steps a tick aims to carry.
STEPS_PER_TICK = 4
#: The step rate is read over at least this long before the tick changes.
ADAPT_EVERY_S = 1.0


class TickPace:
    """The publisher's tick length, adapted to the step rate it drains."""

    __slots__ = ("_burst", "_since", "_steps", "tick_s")

    def __init__(self, now: float, queue_cap: int) -> None:
        self.tick_s = TICK_MIN_S
        self._steps = 0
        self._since = now
        self._burst = max(16, queue_cap // 8)

    def drained(self, steps: int, items: int, now: float) -> None:
        """Note one tick's drain: ``steps`` step messages of ``items`` in all, at ``now``."""
        self._steps += steps
        if items >= self._burst:
            self._restart(TICK_MIN_S, now)
            return
        elapsed = now - self._since
        if elapsed < ADAPT_EVERY_S:
            return
        rate = self._steps / elapsed
        if rate * TICK_MAX_S <= STEPS_PER_TICK:
            self._restart(TICK_MAX_S, now)
        else:
            self._restart(max(TICK_MIN_S, STEPS_PER_TICK / rate), now)

    def _restart(self, tick_s: float, now: float) -> None:
        self.tick_s = tick_s
        self._steps = 0
        self._since = now
