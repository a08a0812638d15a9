"""Runs, detectors and findings wired together: the one object a UI or report drives.

``feed(msg, rx_ns)`` routes a message to its run (by run id) and lets every
detector look at it; ``tick(now_ns)`` lets time-based detectors (hangs,
silent ranks) look at the clock. Live and replay call the same two methods;
``finish()`` once, when no more messages will come. The detectors come from
the caller (analysis/build.py puts the usual set together): the engine knows
only their protocol.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ddpscope.analysis.causes import link_causes
from ddpscope.analysis.findings import FindingBook
from ddpscope.analysis.protocol import LIVE, Detector, Mode
from ddpscope.analysis.state import RunState
from ddpscope.schema import Message

#: Runs a bounded (live) Analysis keeps. Each message may name a new run id, so
#: without a cap a peer sending ever new ids would grow memory without end;
#: real streams hold one run, or a few after elastic restarts.
MAX_RUNS = 16


class Analysis:
    def __init__(
        self, detectors: Iterable[Detector], history: int | None = 2048, mode: Mode = LIVE
    ) -> None:
        self.history = history
        #: Where the messages come from; the detectors were built for it.
        self.mode = mode
        self.runs: dict[str, RunState] = {}
        self.books: dict[str, FindingBook] = {}
        self._order: list[str] = []
        self.detectors = list(detectors)
        #: Per message type, the detectors that look at it, in their order.
        self._route: dict[type, list[Detector]] = {}
        #: finish() was called: the stream is over.
        self.finished = False
        #: Detector failures, by detector class name: a bug must not stop analysis.
        self.detector_errors: dict[str, str] = {}
        #: Messages every run refused, by reason, including those that would
        #: have started a run and so were not kept anywhere else.
        self.rejected: Counter[str] = Counter()
        #: Runs dropped to stay within MAX_RUNS (live only).
        self.runs_dropped = 0

    @property
    def latest(self) -> RunState | None:
        """The run that started most recently (the one a watcher follows)."""
        return self.runs[self._order[-1]] if self._order else None

    def book(self, run: RunState) -> FindingBook:
        return self.books[run.run_id]

    def feed(self, msg: Message, rx_ns: int) -> RunState:
        """Route ``msg`` to its run. The run returned is not kept when the
        message would have started it but was refused: a refused message
        must not become the newest run, the one a watcher follows."""
        run = self.runs.get(msg.run)
        if run is None:
            run = RunState(msg.run, self.history, totals=self.rejected)
            if not run.ingest(msg, rx_ns):
                return run
            self.runs[msg.run] = run
            self.books[msg.run] = FindingBook()
            self._order.append(msg.run)
            if self.history is not None and len(self.runs) > MAX_RUNS:
                self._drop_stalest_run()
            accepted = True
        else:
            accepted = run.ingest(msg, rx_ns)
        if accepted:
            book = self.books[msg.run]
            book.now_ns = run.now_ns
            route = self._route.get(type(msg))
            if route is None:
                route = self._route[type(msg)] = self._routed(type(msg))
            for det in route:
                try:
                    det.observe(run, msg, book)
                except Exception as exc:  # one broken detector must not blind the others
                    self.detector_errors[type(det).__name__] = f"{type(exc).__name__}: {exc}"
            if book.version != book.linked_version:
                self._link(run, book)
        return run

    def _routed(self, kind: type) -> list[Detector]:
        """The detectors that observe ``kind``: those that name it in ``observes``
        and those that name nothing (they see every message). Most detectors look
        at one or two kinds; calling every one of them for each step message was
        a tenth of the ingest thread at 4,096 ranks."""
        out = []
        for det in self.detectors:
            wanted = getattr(det, "observes", None)
            if wanted is None or issubclass(kind, tuple(wanted)):
                out.append(det)
        return out

    def _link(self, run: RunState, book: FindingBook) -> None:
        """Consequences point to their causes (analysis/causes.py); only after a change."""
        try:
            link_causes(run, book)
        except Exception as exc:
            book.linked_version = book.version  # retried at the next change, not every message
            self.detector_errors["causes"] = f"{type(exc).__name__}: {exc}"

    def _drop_stalest_run(self) -> None:
        newest = self._order[-1]
        stalest = min(
            (r for r in self.runs.values() if r.run_id != newest), key=lambda r: r.last_rx_ns
        )
        run_id = stalest.run_id
        del self.runs[run_id]
        del self.books[run_id]
        self._order.remove(run_id)
        self.runs_dropped += 1
        for det in self.detectors:
            try:
                det.reset(run_id)
            except Exception as exc:
                self.detector_errors[type(det).__name__] = f"{type(exc).__name__}: {exc}"

    def tick(self, now_ns: int) -> None:
        for run_id, run in self.runs.items():
            run.now_ns = max(run.now_ns, now_ns)
            book = self.books[run_id]
            book.now_ns = run.now_ns
            for det in self.detectors:
                try:
                    det.tick(run, book)
                except Exception as exc:
                    self.detector_errors[type(det).__name__] = f"{type(exc).__name__}: {exc}"
            if book.version != book.linked_version:
                self._link(run, book)

    def finish(self) -> None:
        """No more messages will come: every detector looks once more, knowing it."""
        if self.finished:
            return
        self.finished = True
        for run_id, run in self.runs.items():
            book = self.books[run_id]
            book.now_ns = run.now_ns
            for det in self.detectors:
                try:
                    det.finish(run, book)
                except Exception as exc:
                    self.detector_errors[type(det).__name__] = f"{type(exc).__name__}: {exc}"
            if book.version != book.linked_version:
                self._link(run, book)
