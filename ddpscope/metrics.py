"""The OpenMetrics (Prometheus) endpoint: ``--metrics HOST:PORT`` on watch, run and relay.

Off by default. When on, a cluster's Prometheus scrapes per-rank step time,
all-reduce and collective wait, data wait, messages lost, and the findings
active right now, from the process that already sees every rank (the
watcher) or a node's ranks (a relay).

The exposition is prometheus-client's own; this module only says what the
figures are. They are taken on the thread that owns the analysis (the
watcher's ingest thread, the relay's housekeeping thread) at most once a
second, into a frozen :class:`Frame` swapped in by one reference; a scrape,
on the HTTP server's thread, reads whichever frame is current and never
touches the analysis itself, so it needs no lock and costs ingest nothing.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpscope.analysis.findings import FindingBook
    from ddpscope.analysis.state import RunState

#: Steps a rank's figures average over (the ranks table's rows use as many).
RECENT_STEPS = 5
#: Figures are taken at most this often; Prometheus scrapes every 15-60 s.
EVERY_S = 1.0


class MetricsAddressError(ValueError):
    """``--metrics`` was given something that is not HOST:PORT."""


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6; port 0: any free one) as (host, port)."""
    hint = f"--metrics wants HOST:PORT (e.g. 127.0.0.1:9464), got {text!r}"
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise MetricsAddressError(hint)
    port = int(port_text)
    if port > 65535:
        raise MetricsAddressError(f"{hint}: port {port} is beyond 65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise MetricsAddressError(f"{hint}: {host!r} is not an IPv6 address") from None
    elif ":" in host or any(c.isspace() for c in host):
        raise MetricsAddressError(hint)
    return host, port


@dataclass(frozen=True, slots=True)
class RankFigures:
    rank: int
    host: str
    #: Steps completed; means over the last RECENT_STEPS steps, in seconds (-1: no step).
    steps: int
    step_s: float
    wait_s: float
    data_s: float
    #: Messages lost: sequence gaps plus what the rank dropped from its own queue or socket.
    dropped: int


@dataclass(frozen=True, slots=True)
class Frame:
    run_id: str = ""
    ranks: tuple[RankFigures, ...] = ()
    #: Active findings: (kind, severity, ranks named).
    findings: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
    received: int = 0
    rejected: int = 0
    #: Median delay from a message's creation to its ingestion (-1: unknown).
    lag_s: float = -1.0


def rank_figures(run: RunState) -> tuple[RankFigures, ...]:
    """Each rank's figures from the run's bounded history (oldest steps never read)."""
    out = []
    for r in sorted(run.ranks):
        view = run.ranks[r]
        n = step = wait = data = 0
        for s in islice(reversed(view.steps), RECENT_STEPS):
            n += 1
            step += s.t_end - s.t_start
            wait += s.comm_wait_ns + s.sync_wait_ns + s.coll_wait_ns
            data += s.data_ns
        hb = view.heartbeat
        lost = view.missing + (hb.dropped_queue + hb.dropped_send if hb is not None else 0)
        scale = 1e9 * n
        out.append(
            RankFigures(
                rank=r,
                host=view.info.host if view.info is not None else "",
                steps=view.step_count,
                step_s=step / scale if n else -1.0,
                wait_s=wait / scale if n else -1.0,
                data_s=data / scale if n else -1.0,
                dropped=lost,
            )
        )
    return tuple(out)


def active_findings(book: FindingBook | None) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    if book is None:
        return ()
    return tuple((f.kind, f.severity, tuple(f.ranks)) for f in book.sorted() if f.active)


class _Collector:
    """Turns the current frame into metric families at scrape time."""

    def __init__(self, source: MetricsServer) -> None:
        self._source = source

    def describe(self) -> list[Any]:
        return []  # families depend on the frame: nothing to pre-register

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        frame = self._source.frame
        role = self._source.role
        per_rank = ["run", "rank", "host"]
        step = GaugeMetricFamily(
            "ddpscope_step_seconds",
            f"Mean step time over each rank's last {RECENT_STEPS} steps",
            labels=per_rank,
        )
        wait = GaugeMetricFamily(
            "ddpscope_wait_seconds",
            "Mean time a step was blocked in gradient all-reduce and other collectives",
            labels=per_rank,
        )
        data = GaugeMetricFamily(
            "ddpscope_data_wait_seconds", "Mean time a step waited for its data", labels=per_rank
        )
        steps = CounterMetricFamily("ddpscope_steps", "Steps each rank completed", labels=per_rank)
        lost = CounterMetricFamily(
            "ddpscope_dropped_messages",
            "Telemetry lost per rank (sequence gaps and the rank's own drops)",
            labels=per_rank,
        )
        for f in frame.ranks:
            labels = [frame.run_id, str(f.rank), f.host]
            if f.step_s >= 0:
                step.add_metric(labels, f.step_s)
                wait.add_metric(labels, f.wait_s)
                data.add_metric(labels, f.data_s)
            steps.add_metric(labels, f.steps)
            lost.add_metric(labels, f.dropped)
        yield from (step, wait, data, steps, lost)
        by_kind = GaugeMetricFamily(
            "ddpscope_findings_active",
            "Findings active now, by kind and severity",
            labels=["run", "kind", "severity"],
        )
        on_rank = GaugeMetricFamily(
            "ddpscope_rank_findings_active",
            "Active findings naming each rank (ranks named by none are left out)",
            labels=["run", "rank"],
        )
        counts: dict[tuple[str, str], int] = {}
        named: dict[int, int] = {}
        for kind, severity, ranks in frame.findings:
            counts[(kind, severity)] = counts.get((kind, severity), 0) + 1
            for r in ranks:
                named[r] = named.get(r, 0) + 1
        for (kind, severity), n in sorted(counts.items()):
            by_kind.add_metric([frame.run_id, kind, severity], n)
        for r, n in sorted(named.items()):
            on_rank.add_metric([frame.run_id, str(r)], n)
        yield from (by_kind, on_rank)
        received = CounterMetricFamily(
            "ddpscope_messages_received", f"Telemetry messages the {role} received"
        )
        received.add_metric([], frame.received)
        rejected = CounterMetricFamily(
            "ddpscope_messages_rejected", f"Messages the {role} refused (undecodable, absurd)"
        )
        rejected.add_metric([], frame.rejected)
        yield from (received, rejected)
        if frame.lag_s >= 0:
            yield GaugeMetricFamily(
                "ddpscope_lag_seconds",
                "Median delay from a message's creation on its rank to its ingestion",
                value=frame.lag_s,
            )


class MetricsServer:
    """An HTTP server with one registry: ours (no process or platform collectors).

    Binds at construction, so a taken port is the caller's error at start-up
    (OSError), never a thread dying later. ``update`` is for the owning thread.
    """

    def __init__(self, address: str, role: str = "watcher") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        host, port = parse_address(address)
        self.role = role
        #: The figures a scrape serves; replaced whole by ``publish``.
        self.frame = Frame()
        self._next = 0.0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        try:
            self._server, self._thread = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {address}: {exc.strerror or exc}") from exc
        bound = self._server.server_address
        self.host, self.port = str(bound[0]), int(bound[1])
        self._closed = threading.Event()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def due(self, now: float | None = None) -> bool:
        """Whether a new frame is wanted (at most once per EVERY_S)."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return False
        self._next = now + EVERY_S
        return True

    def publish(self, frame: Frame) -> None:
        self.frame = frame

    def update(
        self,
        run: RunState | None,
        book: FindingBook | None = None,
        *,
        received: int = 0,
        rejected: int = 0,
        lag_s: float = -1.0,
    ) -> None:
        """Take the figures of ``run`` now (on the thread that owns it)."""
        if run is None:
            self.publish(Frame(received=received, rejected=rejected, lag_s=lag_s))
            return
        self.publish(
            Frame(
                run_id=run.run_id,
                ranks=rank_figures(run),
                findings=active_findings(book),
                received=received,
                rejected=rejected,
                lag_s=lag_s,
            )
        )

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


class StreamFigures:
    """What a relay knows of its node's ranks: their messages in a bounded run
    model, no detectors (a straggler or a desync is a judgement across every
    rank, which only the watcher sees)."""

    def __init__(self) -> None:
        from ddpscope.analysis.engine import Analysis

        self.analysis = Analysis([], history=RECENT_STEPS + 3)
        self.received = 0
        self.rejected = 0

    def take(self, raw: bytes) -> None:
        from ddpscope.schema import SchemaError, decode

        self.received += 1
        try:
            msg = decode(raw)
        except SchemaError:
            self.rejected += 1
            return
        self.analysis.feed(msg, time.monotonic_ns())

    def publish(self, server: MetricsServer) -> None:
        rejected = self.rejected + sum(self.analysis.rejected.values())
        server.update(self.analysis.latest, None, received=self.received, rejected=rejected)


def open_metrics(address: str | None, role: str) -> MetricsServer | None:
    """The server for ``--metrics`` (None when not asked for)."""
    return MetricsServer(address, role) if address else None
