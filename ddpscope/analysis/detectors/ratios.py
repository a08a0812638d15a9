"""The windows of step ratios the straggler rule keeps per rank (``straggler.py``).

Each complete step gives every rank a :class:`Sample`: its own work over the
other ranks' median. A :class:`Window` keeps the last ones; the rule keeps two
per rank over the same samples. The short one (20 steps, a second of run time
at least) names a rank whose median ratio reaches 1.33 (NVIDIA resiliency-ext's
score of 0.75), high enough that a loaded machine's bursts are not named. A
rank steadily a quarter slower stays under it and was named only when noise
lifted one window over the line: minGPT-ddp (pytorch/examples) with 30 ms of
extra work a step on ~100 ms steps read a median of 1.27-1.30 in every
100-step stretch, 97% of its steps at 1.15 or more, costing the job a fifth
of its time, and was named at step 340 of 468. The long view (100 steps, the
same second at least) names a rank slow on nearly all of its steps (90%) with
a median ratio of 1.2 or more, as significant as the short rule asks: a burst
cannot hold that long. Healthy runs stay far from it: the worst 100-step
stretch of 20 recordings of real jobs on the 2-core development VM (ignite,
torchtnt, minGPT-ddp, nanoGPT, Hugging Face, 3 ranks on 2 cores among them)
read a median of 1.13 with 45% of its steps at 1.15 or more.

The long view keeps plain numbers, not samples: 24 bytes a step, 2.4 KB a rank
(100 samples a rank would be ~90 MB at 4,096 ranks).
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import median


# Not frozen: one is made per rank and complete step (4,096 a step at 4,096
# ranks), and a frozen dataclass's __init__ costs ~6x a plain one's. Never changed.
@dataclass(slots=True)
class Sample:
    step: int
    #: The rank's step time, own work, and the others' median own work (ns).
    dur: int
    own: int
    ref: float
    ratio: float
    slow: bool


#: A step counts in a window's run time for at most this many typical steps (the
#: lower median of it and the few before it): a stall is one long step, not a second
#: of evidence.
_SPAN_CAP = 3
#: Step durations a window keeps to tell a typical step.
_RECENT = 5


@dataclass
class Window:
    """The last ``size`` samples, or more when they span less than ``min_span_ns``.

    A stall (a rank stopped for seconds in one step, then resumed) would fill
    ``min_span_ns`` on its own and leave a window of a few short steps after
    it, where scheduler noise on a loaded machine looks persistent. So each
    step counts in the span for at most ``_SPAN_CAP`` times the lower median
    of its own and the last ``_RECENT`` step durations: a straggler's steady
    long steps count in full once they are the typical ones.
    """

    size: int
    min_span_ns: int
    cap: int
    samples: deque[Sample] = field(default_factory=deque)
    #: Each sample's share of ``span``, in the same order.
    shares: deque[int] = field(default_factory=deque)
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=_RECENT))
    slow: int = 0
    span: int = 0

    def push(self, sample: Sample) -> None:
        recent = self.recent
        typical = sorted([*recent, sample.dur])[len(recent) // 2]
        share = min(sample.dur, _SPAN_CAP * typical)
        recent.append(sample.dur)
        self.samples.append(sample)
        self.shares.append(share)
        self.slow += sample.slow
        self.span += share
        samples, shares = self.samples, self.shares
        while len(samples) > self.cap or (
            len(samples) > self.size and self.span - shares[0] >= self.min_span_ns
        ):
            old = samples.popleft()
            self.slow -= old.slow
            self.span -= shares.popleft()


def log_z(ratios: Iterable[float]) -> float:
    """The median log-ratio over its robust standard error: 1.4826 MAD estimates sigma,
    and a median's standard error is ~1.2533 sigma / sqrt(n)."""
    logs = [math.log(x) if x > 0 else -50.0 for x in ratios]
    center = median(logs)
    mad = median(abs(x - center) for x in logs)
    se = 1.4826 * mad * 1.2533 / math.sqrt(len(logs))
    return center / se if se > 0 else (math.inf if center > 0 else 0.0)


def onset_of(win: Window, persist: float) -> int:
    """First step of the longest recent stretch in which the rank was mostly slow."""
    return _onset(((s.step, s.slow) for s in reversed(win.samples)), persist)


def _onset(newest_first: Iterable[tuple[int, bool]], persist: float) -> int:
    """The oldest slow step from which, counting back from the newest (the default),
    at least ``persist`` of the steps were slow."""
    onset, slow = -1, 0
    for i, (step, is_slow) in enumerate(newest_first, 1):
        if i == 1:
            onset = step
        slow += is_slow
        if is_slow and slow >= persist * i:
            onset = step
    return onset


class LongView:
    """A rank's last ``size`` step ratios, and more while they span less than
    ``min_span_ns`` of run time (at most ``cap``): flat arrays, O(1) a step."""

    __slots__ = ("cap", "durs", "head", "min_span_ns", "ratios", "size", "slow", "span", "steps")

    def __init__(self, size: int, min_span_ns: int, cap: int) -> None:
        self.size, self.min_span_ns, self.cap = size, min_span_ns, cap
        self.ratios = array("d")
        self.durs = array("q")
        self.steps = array("q")
        self.head = 0
        self.slow = 0
        self.span = 0

    def __len__(self) -> int:
        return len(self.ratios) - self.head

    def push(self, sample: Sample) -> None:
        ratios, durs, steps = self.ratios, self.durs, self.steps
        ratios.append(sample.ratio)
        durs.append(sample.dur)
        # A slow step keeps its number, a quick one its complement: one array for both.
        steps.append(sample.step if sample.slow else ~sample.step)
        slow, span, head = self.slow + sample.slow, self.span + sample.dur, self.head
        n = len(ratios) - head
        while n > self.cap or (n > self.size and span - durs[head] >= self.min_span_ns):
            slow -= steps[head] >= 0
            span -= durs[head]
            head += 1
            n -= 1
        if head >= 64 and 2 * head >= len(ratios):
            del ratios[:head], durs[:head], steps[:head]
            head = 0
        self.slow, self.span, self.head = slow, span, head

    def clear(self) -> None:
        for a in (self.ratios, self.durs, self.steps):
            del a[:]
        self.head = self.slow = self.span = 0

    def mostly_slow(self, persist: float) -> bool:
        """Full (``size`` steps over ``min_span_ns``) and slow in ``persist`` of them."""
        n = len(self)
        return n >= self.size and self.span >= self.min_span_ns and self.slow >= persist * n

    def verdict(self) -> tuple[float, float]:
        """(median ratio, its z)."""
        ratios = self.ratios[self.head :]
        return median(ratios), log_z(ratios)

    def onset(self, persist: float) -> int:
        """First step of the longest recent stretch in which the rank was mostly slow."""
        marks = reversed(self.steps[self.head :])
        return _onset(((m if m >= 0 else ~m, m >= 0) for m in marks), persist)
