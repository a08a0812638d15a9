"""`--metrics HOST:PORT`: the OpenMetrics endpoint, scraped over real HTTP and parsed
with prometheus-client's own parser, behind a real watcher feed and a real relay."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddpscope.analysis.detectors.straggler import StragglerDetector
from ddpscope.analysis.live import LiveFeed
from ddpscope.cli.main import build_parser
from ddpscope.cli.watch import open_feed
from ddpscope.config import load
from ddpscope.metrics import MetricsAddressError, MetricsServer, parse_address
from ddpscope.transport.relay import Relay
from ddpscope.transport.subscriber import Subscriber
from tests.support.synth import SyntheticRun
from tests.support.torchrun import ROOT, job_env
from tests.support.wire import Wire, wait_received

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(server: MetricsServer) -> tuple[Samples, set[str]]:
    with urllib.request.urlopen(server.url, timeout=5) as reply:
        assert reply.status == 200
        body = reply.read().decode()
    samples: Samples = {}
    names = set()
    for family in text_string_to_metric_families(body):
        names.add(family.name)
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, names


def _scrape_until(server: MetricsServer, ready: Callable[[Samples], bool]) -> Samples:
    """Figures are taken once a second: scrape until they show what was sent."""
    deadline = time.monotonic() + 15
    while True:
        samples, _ = _scrape(server)
        if ready(samples):
            return samples
        assert time.monotonic() < deadline, f"never ready; last scrape: {sorted(samples)[:8]}"
        time.sleep(0.2)


def _received(samples: Samples) -> float | None:
    return samples.get(("ddpscope_messages_received_total", ()))


def _rank(run: SyntheticRun, r: int) -> tuple[tuple[str, str], ...]:
    return (("host", run.host(r)), ("rank", str(r)), ("run", run.run_id))


def _straggler() -> list:
    return [StragglerDetector()]


def test_a_scrape_of_the_watcher_has_per_rank_waits_drops_and_the_active_straggler(
    endpoint: str,
) -> None:
    run = SyntheticRun(world=4, buckets=6, slow_rank=3, slow_ms=60)
    sent = run.opening() + run.steps(0, 60)
    # One step of rank 1 lost on the way: a gap in its sequence numbers.
    lost = next(
        m for m in sent if getattr(m, "step", -1) == 30 and m.rank == 1 and m.KIND == "step"
    )
    sent.remove(lost)
    server = MetricsServer("127.0.0.1:0")
    with (
        Wire(endpoint) as wire,
        LiveFeed(endpoint, detectors=_straggler(), metrics=server) as feed,
    ):
        wire.wait_subscribed()
        wire.send(sent)
        wait_received(feed, len(sent))
        # A frame is taken once a second: the one that shows the straggler may
        # predate the last messages, so wait for one taken after all of them.
        got = _scrape_until(
            server,
            lambda s: (
                ("ddpscope_rank_findings_active", (("rank", "3"), ("run", run.run_id))) in s
                and _received(s) == len(sent)
            ),
        )
    for r in range(4):
        assert got[("ddpscope_step_seconds", _rank(run, r))] == pytest.approx(0.160)
        assert got[("ddpscope_data_wait_seconds", _rank(run, r))] == pytest.approx(0.010)
        assert got[("ddpscope_steps_total", _rank(run, r))] == 60
    # The fast ranks wait 60 ms per step for the slow one; it waits for nobody.
    assert got[("ddpscope_wait_seconds", _rank(run, 0))] == pytest.approx(0.060)
    assert got[("ddpscope_wait_seconds", _rank(run, 3))] == 0
    assert got[("ddpscope_dropped_messages_total", _rank(run, 1))] == 1
    assert got[("ddpscope_dropped_messages_total", _rank(run, 0))] == 0
    assert _by_kind(got) == {"straggler": 1}
    assert got[("ddpscope_messages_received_total", ())] == len(sent)
    _assert_closed(server)


def _by_kind(got: Samples) -> dict[str, float]:
    return {
        dict(labels)["kind"]: v
        for (name, labels), v in got.items()
        if name == "ddpscope_findings_active"
    }


def _assert_closed(server: MetricsServer) -> None:
    """The endpoint closes with its owner: nothing is left listening."""
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), 1):
        pass


def test_a_relay_serves_its_node_ranks_figures_and_no_findings(tmp_path, endpoint: str) -> None:
    run = SyntheticRun(world=4, buckets=6, slow_rank=2, slow_ms=40)
    sent = run.opening() + run.steps(0, 20)
    listen = f"ipc://{tmp_path}/relay.sock"
    server = MetricsServer("127.0.0.1:0", role="relay")
    with Subscriber(endpoint), Relay(listen, endpoint, metrics=server), Wire(listen) as wire:
        wire.wait_subscribed()  # the relay subscribes to everything itself
        wire.send(sent)
        got = _scrape_until(
            server,
            lambda s: (
                s.get(("ddpscope_steps_total", _rank(run, 3))) == 20 and _received(s) == len(sent)
            ),
        )
    assert got[("ddpscope_step_seconds", _rank(run, 0))] == pytest.approx(0.140)
    assert got[("ddpscope_wait_seconds", _rank(run, 0))] == pytest.approx(0.040)
    assert got[("ddpscope_wait_seconds", _rank(run, 2))] == 0
    assert got[("ddpscope_messages_received_total", ())] == len(sent)
    assert _by_kind(got) == {}  # findings are the watcher's, which sees every rank
    _assert_closed(server)


def test_metrics_are_off_unless_asked_for(endpoint: str) -> None:
    for command in ("watch", "run", "relay"):
        argv = [command, "--upstream", endpoint] if command == "relay" else [command]
        args, _ = build_parser().parse_known_args(argv)
        assert args.metrics is None, command
    feed, _ = open_feed(load(env={"DDPSCOPE_ENDPOINT": endpoint}))
    with feed:
        assert feed.metrics is None


@pytest.mark.parametrize(
    "text",
    ["9464", "localhost", "localhost:", ":9464", "host:port", "::1:9464", "h:70000", "a b:1"],
)
def test_an_address_that_is_not_host_port_is_refused_with_the_form_it_wants(text: str) -> None:
    with pytest.raises(MetricsAddressError, match="HOST:PORT"):
        parse_address(text)


def test_host_port_forms_that_are_taken() -> None:
    assert parse_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_address("[::1]:0") == ("::1", 0)
    assert parse_address("node-3.cluster:9100") == ("node-3.cluster", 9100)


def test_a_port_already_taken_is_a_clear_error_at_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            MetricsServer(f"127.0.0.1:{port}")


@pytest.mark.parametrize("command", ["watch", "relay", "run"])
def test_the_commands_refuse_a_bad_metrics_address_before_starting(
    command: str, endpoint: str
) -> None:
    argv = {
        "watch": ["watch", "--endpoint", endpoint],
        "relay": ["relay", "--upstream", endpoint, "--listen", endpoint + "-relay"],
        "run": ["run", "--endpoint", endpoint, "--record", "", "--", sys.executable, "-c", "1"],
    }[command]
    proc = subprocess.run(
        [sys.executable, "-m", "ddpscope", *argv, "--metrics", "nowhere"]
        if command != "run"
        else [sys.executable, "-m", "ddpscope", *argv[:5], "--metrics", "nowhere", *argv[5:]],
        cwd=ROOT,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--metrics wants HOST:PORT" in proc.stderr and "'nowhere'" in proc.stderr
