"""Playing a recording back into the watch UI: the replay's snapshot source.

The player stands at a time T of the recording (sender clock). What the UI
shows at T is what a live watcher showed then: every record with a time up
to T has been fed to a :class:`~ddpscope.analysis.monitor.Monitor` (whose
clock reads T), and the findings are the ones the index's pass had raised by
T. Playing moves T forward and feeds the records it passes; any other move
(back a step, to a step, to a finding) rebuilds the monitor from a short
stretch before the target: the newest records of each rarely sent kind (run
info, bucket layouts, sampler passes, fingerprints...) and the last
``WINDOW_STEPS`` steps of every rank, which is all a screen shows but for
the bucket view: it looks through the newest ``BUCKET_SCAN`` steps for five
that every rank timed per bucket, and bucket timing is sampled (every 16th or
32nd step, hooks/steps.py), so when the window holds fewer than five such
steps the seek feeds every rank's steps back to the view's reach as well. A
seek therefore costs the same anywhere in a run of any length.

One thread owns the monitor and the files; the UI talks to it through a
queue of commands and reads an immutable :class:`ReplayStatus`.
"""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

from ddpscope.analysis.bucketmatrix import BUCKET_SCAN, BUCKET_STEPS, bucket_matrix
from ddpscope.analysis.handoff import SnapshotHandoff
from ddpscope.analysis.monitor import FeedStats, Monitor
from ddpscope.analysis.snapshot import SnapshotRequest
from ddpscope.analysis.views import DETAIL_STEPS, SERIES_LEN, RunExtras
from ddpscope.record.fdlimit import ensure_open_files
from ddpscope.record.format import MAX_RECORD_BYTES, RECORD_HEAD, crc32
from ddpscope.replay.index import KIND_CODE, RecordingIndex, Stream
from ddpscope.schema import Message, SchemaError, decode

#: Playback speeds offered, slowest first; 0 is "as fast as it can".
SPEEDS = (1, 2, 4, 8, 16, 32, 64, 0)
#: Steps per rank fed before a seek target: the most any screen shows of a
#: rank's steps (the rank detail's 24). The sparklines' longer history comes
#: from the index's per-step figures.
WINDOW_STEPS = DETAIL_STEPS + 8
#: How many of each rarely sent kind a seek feeds from before its window.
KEEP_BEFORE = {
    "run_info": 1,
    # Heartbeats come every second; the window can be shorter than that.
    "heartbeat": 1,
    "buckets": 8,
    "sampler_pass": 16,
    "sampler_pass_end": 16,
    "fingerprint": 2,
    "hparams": 2,
    "stacks": 1,
    "end": 1,
    "batch": 4,
    "save": 4,
    "collectives": 4,
    "dataparallel": 1,
    "shutdown": 1,
}
#: How long the first screen waits for the run's first step to be read.
START_WAIT_S = 1.0
#: The player looks at commands and the clock this often.
FRAME_S = 0.02
#: At full speed, records fed per frame before the UI gets a snapshot.
FAST_RECORDS = 4096


class ReplayClock:
    """The monitor's clock: recorded time, moved by the player."""

    def __init__(self) -> None:
        self.now = 0
        #: Recorded wall minus recorded monotonic time (from the run info).
        self.wall_offset = 0

    def mono_ns(self) -> int:
        return self.now

    def wall_ns(self) -> int:
        return self.now + self.wall_offset


@dataclass(frozen=True, slots=True)
class ReplayStatus:
    """Where the replay stands, for the UI's replay bar."""

    playing: bool = False
    #: Index into SPEEDS.
    speed: int = 0
    #: Recorded time shown, and the newest step complete on every rank by then (-1: none).
    t: int = 0
    step: int = -1
    #: Newest step in the recording so far, and the time span read so far (ns).
    last_step: int = -1
    first_t: int = 0
    end_t: int = 0
    #: Share of the recording the index has read (1.0: all of it).
    indexed: float = 0.0
    following: bool = False
    at_end: bool = False
    #: Findings raised by T, and in the whole recording (so far).
    findings_now: int = 0
    findings_total: int = 0
    problems: tuple[str, ...] = ()
    #: One line on the last command that could not be done ("no finding after step 80").
    notice: str = ""

    @property
    def speed_label(self) -> str:
        s = SPEEDS[self.speed]
        return f"{s}x" if s else "max"


class ReplayFeed(SnapshotHandoff):
    """A snapshot source over a recording, with playback controls."""

    def __init__(self, index: RecordingIndex) -> None:
        super().__init__()
        self.index = index
        #: What the header names while nothing is shown yet.
        self.endpoint = index.run.path
        self.clock = ReplayClock()
        self.monitor = self._new_monitor()
        self._cursor: list[int] = []
        self._fds: dict[str, int] = {}
        self._commands: deque[tuple[str, Any]] = deque()
        self._stop = threading.Event()
        self.status = ReplayStatus(following=index.follow)
        self._playing = False
        self._speed = 0
        self._at_end = False
        self._notice = ""
        self._pending_step: int | None = None
        self._steps_key: tuple[int, bool] = (-1, False)
        self._steps_built = 0.0
        self._step_times: list[int] = []
        self._step_best: list[int] = []
        self.error = ""
        self._started = False
        self._pass = threading.Thread(target=index.run_pass, name="ddpscope-index", daemon=True)
        self._thread = threading.Thread(target=self._loop, name="ddpscope-replay", daemon=True)

    # --- the UI's side (any thread) -------------------------------------------------

    def request_stacks(self, rank: int) -> None:
        # A recording cannot be asked anything; the recorded stacks are shown as they are.
        self._commands.append(("notice", "a recording cannot be asked for fresh stacks"))

    def request_fingerprint(self, rank: int = -1) -> None:
        self._commands.append(("notice", "a recording cannot be asked for a fingerprint"))

    def play(self, playing: bool | None = None) -> None:
        """Play or pause (None: toggle)."""
        self._commands.append(("play", playing))

    def faster(self, delta: int) -> None:
        self._commands.append(("speed", delta))

    def step_by(self, delta: int) -> None:
        """Forward or back by whole steps (pauses)."""
        self._commands.append(("step_by", delta))

    def seek_step(self, step: int) -> None:
        self._commands.append(("seek_step", step))

    def to_finding(self, direction: int) -> None:
        """To the moment the next (1) or previous (-1) finding was raised."""
        self._commands.append(("finding", direction))

    def to_end(self) -> None:
        self._commands.append(("end", None))

    def to_start(self) -> None:
        self._commands.append(("start", None))

    def idle(self, timeout: float = 10.0) -> ReplayStatus:
        """Wait until every command sent so far is done; returns the status then."""
        done = threading.Event()
        self._commands.append(("mark", done))
        if not done.wait(timeout):
            raise TimeoutError("the replay did not get through its commands in time")
        return self.status

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            try:
                # The feed keeps every rank's file open, the index pass one more each.
                ensure_open_files(2 * len(self.index.run.files))
            except OSError as exc:
                self.error = str(exc.strerror)
                return
            self._pass.start()
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.index.stop()
        for t in (self._thread, self._pass):
            if t.is_alive():
                t.join(timeout=5.0)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ReplayFeed:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the thread ------------------------------------------------------------------

    def _loop(self) -> None:
        last = time.monotonic()
        try:
            self._wait_for_start()
            while not self._stop.is_set():
                now = time.monotonic()
                elapsed, last = now - last, now
                if not self._started and self.index.step_done and not self._commands:
                    self._show_start()
                    self._update_status()
                while self._commands:
                    self._do(*self._commands.popleft())
                if self._pending_step is not None and (
                    self.index.done or self._pending_step <= self.index.last_step()
                ):
                    step, self._pending_step = self._pending_step, None
                    self._go_step(step)
                    self._update_status()
                if self._playing:
                    self._advance(elapsed)
                elif self._at_end:
                    self._follow_end()
                want = self.take_request()
                if want is not None:
                    self._publish(want)
                self._stop.wait(FRAME_S)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            try:
                self._publish(self.take_request() or SnapshotRequest())
            except Exception:
                pass

    def _wait_for_start(self) -> None:
        # The first screen: the run's first step, done on every rank, as soon as
        # the pass has read that far (a run without steps: its first record).
        give_up = time.monotonic() + START_WAIT_S
        index = self.index
        while not index.done and not self._stop.is_set() and time.monotonic() < give_up:
            if index.step_done and index.records > index.ranks_expected * 4:
                break
            self._stop.wait(0.005)
        self._show_start()

    def _show_start(self) -> None:
        index = self.index
        first = min(index.step_done, default=None)
        start = index.step_done.get(first, index.first_t) if first is not None else index.first_t
        #: Whether the first screen stood at a step (a pass slower than
        #: START_WAIT_S had none yet: the loop shows it once there is one).
        self._started = first is not None or index.done
        self.clock.now = max(start, 0)
        self._rebuild(self.clock.now)

    def _do(self, command: str, arg: Any) -> None:
        if command == "mark":  # idle(): report, change nothing
            self._update_status()
            arg.set()
            return
        self._notice = ""
        self._started = True  # the user moved: no first screen to wait for any more
        if command == "play":
            self._playing = (not self._playing) if arg is None else bool(arg)
            if self._playing and self._at_last_record():
                self._notice = "at the end of the recording"
                self._playing = False
        elif command == "speed":
            self._speed = max(0, min(len(SPEEDS) - 1, self._speed + int(arg)))
        elif command == "step_by":
            self._playing = False
            self._go_step(self._step_at(self.clock.now) + int(arg))
        elif command == "seek_step":
            self._playing = False
            if int(arg) > self.index.last_step() and not self.index.done:
                # Not read yet: go there once the index has it.
                self._pending_step = int(arg)
                self._notice = f"step {arg}: still reading the recording"
            else:
                self._go_step(int(arg))
        elif command == "finding":
            self._playing = False
            self._go_finding(int(arg))
        elif command == "end":
            self._playing = False
            self._seek(self.index.t)
            self._at_end = True
        elif command == "start":
            self._playing = False
            self._seek(max(self.index.first_t, 0))
        elif command == "notice":
            self._notice = str(arg)
        self._update_status()

    # --- moving --------------------------------------------------------------------

    def _advance(self, elapsed: float) -> None:
        speed = SPEEDS[self._speed]
        target = self.clock.now + int(elapsed * 1e9 * speed) if speed else None
        # Never past what the index has read: playing faster than it reads waits for it.
        limit = self.index.t
        self._feed_until(limit if target is None else min(target, limit), FAST_RECORDS)
        if target is not None:
            self.clock.now = min(target, max(limit, self.clock.now))
        if self.index.done and self._at_last_record():
            self._playing = False
            self._at_end = True
        self._update_status()

    def _follow_end(self) -> None:
        # Standing at the end of a run still being written: keep up with it.
        if self.index.t > self.clock.now:
            self._feed_until(self.index.t, FAST_RECORDS)
            self._update_status()

    def _feed_until(self, t: int, budget: int) -> None:
        """Feed records up to time ``t`` (at most ``budget``); moves the clock along."""
        batch: list[tuple[int, int, Stream, int]] = []
        streams = self.index.streams
        while len(self._cursor) < len(streams):
            self._cursor.append(0)
        for i, s in enumerate(streams):
            start = self._cursor[i]
            stop = min(s.applied(t), len(s), start + budget)
            for pos in range(start, stop):
                batch.append((s.tmax[pos], i, s, pos))
        if not batch:
            return
        batch.sort(key=lambda e: (e[0], e[1]))
        batch = batch[:budget]
        for tm, i, s, pos in batch:
            msg = self._read(s, pos)
            self._cursor[i] = max(self._cursor[i], pos + 1)
            if msg is not None:
                self.clock.now = max(self.clock.now, tm)
                self.monitor.take(msg)
        if len(batch) == budget:
            self.clock.now = batch[-1][0]
        else:
            self.clock.now = max(self.clock.now, t)

    def _seek(self, t: int) -> None:
        t = max(self.index.first_t, min(t, self.index.t))
        self._at_end = False
        self._rebuild(t)

    def _rebuild(self, t: int) -> None:
        """A fresh monitor holding what a screen at ``t`` shows (see the module docstring)."""
        picks: list[tuple[int, int, Stream, int]] = []
        self._cursor = []
        for i, s in enumerate(self.index.streams):
            end = s.applied(t)
            self._cursor.append(end)
            first_step = bisect_left(s.step_pos, end) - WINDOW_STEPS
            begin = s.step_pos[first_step] if first_step > 0 else 0
            for kind, keep in KEEP_BEFORE.items():
                positions = s.by_kind.get(KIND_CODE[kind])
                if positions:
                    j = bisect_left(positions, begin)
                    picks.extend((s.tmax[p], i, s, p) for p in positions[max(0, j - keep) : j])
            picks.extend((s.tmax[p], i, s, p) for p in range(begin, end))
        self.monitor = self._new_monitor()
        self.clock.now = 0
        self._take(picks)
        # Older steps after newer ones: the run model files a late step in its
        # place (state.py), and nothing shown depends on the order steps came in.
        self._take(self._bucket_steps_before_window())
        self.clock.now = t
        self._fill_series(t)

    def _take(self, picks: list[tuple[int, int, Stream, int]]) -> None:
        """Feed the records in the order playing does: by time, then file, then position."""
        picks.sort(key=lambda e: (e[0], e[1], e[3]))
        for tm, _, s, pos in picks:
            msg = self._read(s, pos)
            if msg is not None:
                self.clock.now = max(self.clock.now, tm)
                self.monitor.take(msg)

    def _bucket_steps_before_window(self) -> list[tuple[int, int, Stream, int]]:
        """The step records before the window that the bucket view could still pick.

        None when the window already gives it all its steps: they are the newest
        there are, so older ones could not change it. Otherwise every rank's steps
        back to the view's reach (its scan, or the history's floor where that is
        nearer: bucketmatrix.py), up to each stream's cursor as _rebuild set it,
        so that it finds what playing to the seek's time found.
        """
        run = self.monitor.analysis.latest
        if run is None:
            return []
        extras = self.monitor.extras.setdefault(run.run_id, RunExtras())
        shown = bucket_matrix(run, extras.bucket_memo)
        if shown is not None and len(shown.steps) >= BUCKET_STEPS:
            return []
        reach = BUCKET_SCAN if run.history is None else min(BUCKET_SCAN, run.history + 1)
        picks: list[tuple[int, int, Stream, int]] = []
        for i, s in enumerate(self.index.streams):
            k = bisect_left(s.step_pos, self._cursor[i])
            for j in range(max(0, k - reach), k - WINDOW_STEPS):
                p = s.step_pos[j]
                picks.append((s.tmax[p], i, s, p))
        return picks

    def _fill_series(self, t: int) -> None:
        """The sparklines' last SERIES_LEN steps per rank, from the index, not decoded."""
        run = self.monitor.analysis.latest
        if run is None:
            return
        extras = self.monitor.extras.setdefault(run.run_id, RunExtras())
        by_rank: dict[int, list[tuple[int, float, float]]] = {}
        for s in self.index.streams:
            end = bisect_left(s.step_pos, s.applied(t))
            rows = by_rank.setdefault(s.rank, [])
            for k in range(max(0, end - SERIES_LEN), end):
                rows.append((s.tmax[s.step_pos[k]], s.step_ms[k], s.busy_ms[k]))
        for rank, rows in by_rank.items():
            if not rows:
                continue
            rows.sort(key=lambda r: r[0])
            extras.step[rank] = deque((r[1] for r in rows[-SERIES_LEN:]), maxlen=SERIES_LEN)
            extras.busy[rank] = deque((r[2] for r in rows[-SERIES_LEN:]), maxlen=SERIES_LEN)

    def _go_step(self, step: int) -> None:
        done = self.index.step_done
        if not done:
            self._notice = "no steps recorded"
            return
        steps = sorted(done)
        i = min(max(bisect_left(steps, step), 0), len(steps) - 1)
        if steps[i] != step:
            self._notice = f"step {step} is not in the recording; showing step {steps[i]}"
        self._seek(done[steps[i]])

    def _step_at(self, t: int) -> int:
        """The newest step complete on every rank by ``t`` (-1: none yet)."""
        index = self.index
        key = (index.records, index.done)
        now = time.monotonic()
        if key != self._steps_key and (index.done or now - self._steps_built > 0.5):
            # Rebuilt as the index grows (at most twice a second): status
            # updates ask this every frame, and a run has many thousand steps.
            pairs = sorted((when, step) for step, when in list(index.step_done.items()))
            self._step_times = [when for when, _ in pairs]
            self._step_best = list(accumulate((step for _, step in pairs), max))
            self._steps_key, self._steps_built = key, now
        i = bisect_right(self._step_times, t)
        return self._step_best[i - 1] if i else -1

    def _go_finding(self, direction: int) -> None:
        times = self.index.raised_times()
        now = self.clock.now
        if direction > 0:
            i = bisect_right(times, now)
            if i >= len(times):
                more = "" if self.index.done else " (the index is still reading)"
                self._notice = "no finding after this point" + more
                return
            self._seek(times[i])
        else:
            i = bisect_left(times, now)
            if i == 0:
                self._notice = "no finding before this point"
                return
            self._seek(times[i - 1])

    def _at_last_record(self) -> bool:
        return self.index.done and self.clock.now >= self.index.t

    # --- reading, building -----------------------------------------------------------

    def _read(self, stream: Stream, pos: int) -> Message | None:
        path = stream.file.path
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        offset = stream.offset[pos]
        head = os.pread(fd, RECORD_HEAD.size, offset)
        if len(head) < RECORD_HEAD.size:
            return None
        length, crc = RECORD_HEAD.unpack(head)
        if length > MAX_RECORD_BYTES:
            return None
        payload = os.pread(fd, length, offset + RECORD_HEAD.size)
        if len(payload) < length or crc32(payload) != crc:
            return None  # the pass read it whole: the file changed under us
        try:
            return decode(payload)
        except SchemaError:
            return None

    def _new_monitor(self) -> Monitor:
        # No detectors: findings come from the index's pass, raised at the
        # moment live detectors raised them, however the replay got here.
        self.clock.wall_offset = self._wall_offset()
        monitor = Monitor(detectors=[], clock=self.clock, measure_lag=False)
        old = getattr(self, "monitor", None)
        monitor.seq = old.seq if old is not None else 0  # snapshots keep counting up
        return monitor

    def _wall_offset(self) -> int:
        # The replay's clock is the first host's monotonic clock.
        return self.index.clocks.reference or 0

    def _update_status(self) -> None:
        index = self.index
        now = self.clock.now
        _version, findings = index.findings_at(min(now, index.t))
        self.status = replace(
            self.status,
            playing=self._playing,
            speed=self._speed,
            t=now,
            step=self._step_at(now),
            last_step=index.last_step(),
            first_t=max(index.first_t, 0),
            end_t=max(index.t, 0),
            indexed=index.progress,
            following=index.follow and not index.done,
            at_end=self._at_end or self._at_last_record(),
            findings_now=len(findings),
            findings_total=len(index.findings_at(index.t)[1]),
            problems=tuple(index.problems),
            notice=self._notice or (f"index failed: {index.error}" if index.error else ""),
        )

    def _publish(self, request: SnapshotRequest) -> None:
        self._update_status()
        index = self.index
        version, findings = index.findings_at(min(self.clock.now, index.t))
        note = ""
        if index.problems:
            note = f"{len(index.problems)} recording problem(s): {index.problems[0]}"
        gaps = sum(s.gaps_at(self.clock.now) for s in index.streams)
        stats = FeedStats(
            # "rx": every record of the run up to the moment shown, as a live
            # watcher would have counted them by then.
            received=sum(s.applied(self.clock.now) for s in index.streams),
            rate=-1.0,
            busy=0.0,
            error=self.error,
            note=note,
            gaps=gaps,
        )
        snap = self.monitor.build(request, stats, findings, version)
        self.hand_over(snap)
