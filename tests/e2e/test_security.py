"""Keys and the bind policy over real sockets: no open port without keys, wrong keys visible."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import stat
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from ddpscope.cli.main import main
from ddpscope.cli.run import build_env
from ddpscope.config import load
from ddpscope.hooks.publisher import Publisher
from ddpscope.schema import Heartbeat, Stacks
from ddpscope.transport.relay import Relay
from ddpscope.transport.security import (
    SecurityError,
    create_keypair,
    is_local,
    load_client_keys,
    load_server_keys,
)
from ddpscope.transport.subscriber import Subscriber


def _port_pair() -> int:
    """A free TCP port whose successor (the control port) is free too."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("0.0.0.0", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("0.0.0.0", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no free pair of ports")


def _rank(endpoint: str, rank: int = 3, **opts: str) -> Publisher:
    options = load({"endpoint": endpoint, "heartbeat_s": 0.2, **opts}, env={})
    return Publisher(options, "sec-run", rank, {"run_id": "sec-run", "rank": rank})


def _received(sub: Subscriber, seconds: float) -> list[object]:
    got: list[object] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        msg = sub.recv(50)
        if msg is not None:
            got.append(msg)
    return got


def _until(pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.05)


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    create_keypair(str(d))
    return d


def test_keys_command_writes_a_keypair_only_its_owner_can_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "keys"
    assert main(["keys", str(d)]) == 0
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for name in ("server.key", "server.key_secret"):
        assert stat.S_IMODE(os.stat(d / name).st_mode) == 0o600
    public, secret = zmq.auth.load_certificate(d / "server.key_secret")
    assert secret is not None and zmq.auth.load_certificate(d / "server.key") == (public, None)
    assert "DDPSCOPE_SERVER_KEY=" in capsys.readouterr().out
    assert main(["keys", str(d)]) == 2  # never overwrites a key silently
    assert "--force" in capsys.readouterr().err
    assert zmq.auth.load_certificate(d / "server.key_secret") == (public, secret)
    assert main(["keys", str(d), "--client", "node07"]) == 0
    assert stat.S_IMODE(os.stat(d / "node07.key_secret").st_mode) == 0o600
    assert load_server_keys(str(d)).clients_dir == str(d / "clients")


def test_a_secret_key_readable_by_others_is_refused(keys_dir: Path) -> None:
    os.chmod(keys_dir / "server.key_secret", 0o644)
    with pytest.raises(SecurityError, match="chmod 600"):
        load_server_keys(str(keys_dir))


def test_listening_beyond_loopback_without_keys_is_refused_with_how_to_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = _port_pair()
    with pytest.raises(SecurityError, match="ddpscope keys"):
        Subscriber(f"tcp://0.0.0.0:{port}")
    with pytest.raises(SecurityError, match="ddpscope keys"):
        Relay(f"tcp://0.0.0.0:{port}", f"ipc://{tmp_path}/w.sock")
    assert main(["watch", "--endpoint", f"tcp://0.0.0.0:{port}"]) == 2
    assert "refuses to listen on tcp://0.0.0.0" in capsys.readouterr().err
    relay = ["relay", "--listen", f"tcp://0.0.0.0:{port}", "--upstream", f"ipc://{tmp_path}/w"]
    assert main(relay) == 2
    assert "`ddpscope keys DIR`" in capsys.readouterr().err
    # Nothing was left listening by the refusals.
    with socket.socket() as s:
        s.bind(("0.0.0.0", port))
    # Loopback and ipc:// need no keys.
    assert is_local("tcp://127.0.0.1:1") and is_local("tcp://[::1]:1") and is_local("ipc:///x")
    assert not is_local("tcp://node07:1") and not is_local("tcp://*:1")
    Subscriber(f"tcp://127.0.0.1:{port}").close()


def test_with_keys_telemetry_and_requests_flow_beyond_loopback(keys_dir: Path) -> None:
    port = _port_pair()
    with Subscriber(f"tcp://0.0.0.0:{port}", keys=load_server_keys(str(keys_dir))) as sub:
        pub = _rank(f"tcp://127.0.0.1:{port}", server_key=str(keys_dir / "server.key"))
        pub.start()
        _until(lambda: any(isinstance(m, Heartbeat) for m in _received(sub, 0.2)))
        got = None
        deadline = time.monotonic() + 10
        while got is None and time.monotonic() < deadline:
            sub.request("stacks", target=3)
            got = next((m for m in _received(sub, 0.3) if isinstance(m, Stacks)), None)
        pub.close()
        sub.check_handshakes()
        assert got is not None
        assert pub.handshake_failures == 0 and sub.handshake_failures == 0


def test_wrong_server_key_gets_nothing_through_is_counted_and_never_blocks_training(
    tmp_path: Path, keys_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = tmp_path / "other"
    create_keypair(str(wrong))
    port = _port_pair()
    caplog.set_level(logging.WARNING, logger="ddpscope")
    with Subscriber(f"tcp://0.0.0.0:{port}", keys=load_server_keys(str(keys_dir))) as sub:
        pub = _rank(f"tcp://127.0.0.1:{port}", server_key=str(wrong))
        pub.start()
        t0 = time.monotonic()
        for i in range(2000):
            pub.post("end", 0, {"reason": "x", "step": i})
            if i % 500 == 0:
                time.sleep(0.06)
        assert time.monotonic() - t0 < 2.0  # posting never waits on the network
        assert _received(sub, 1.5) == []
        _until(lambda: pub.handshake_failures > 0)
        assert "DDPSCOPE_SERVER_KEY" in pub.error
        sub.check_handshakes()
        assert sub.handshake_failures > 0
        assert "key" in sub.handshakes.last_error
        t1 = time.monotonic()
        pub.close()
        assert time.monotonic() - t1 < 3.0
    assert pub.dropped_queue == 0
    assert any("handshake" in r.getMessage() and "rank 3" in r.getMessage() for r in caplog.records)


def test_a_rank_without_keys_is_refused_by_a_watcher_with_keys(keys_dir: Path) -> None:
    port = _port_pair()
    with Subscriber(f"tcp://0.0.0.0:{port}", keys=load_server_keys(str(keys_dir))) as sub:
        pub = _rank(f"tcp://127.0.0.1:{port}")
        pub.start()
        _until(lambda: pub.handshake_failures > 0)
        assert _received(sub, 0.5) == []
        pub.close()
    # Which event libzmq reports first varies (a mechanism mismatch, or a dropped
    # handshake); both tell the user which variable to set.
    assert "DDPSCOPE_SERVER_KEY" in pub.handshakes.last_error


def test_an_allow_list_admits_only_the_listed_clients(keys_dir: Path) -> None:
    assert main(["keys", str(keys_dir), "--client", "node01"]) == 0
    port = _port_pair()
    keys = load_server_keys(str(keys_dir))
    assert keys.clients_dir is not None
    with Subscriber(f"tcp://127.0.0.1:{port}", keys=keys) as sub:
        server = str(keys_dir / "server.key")
        listed = _rank(
            f"tcp://127.0.0.1:{port}",
            1,
            server_key=server,
            client_key=str(keys_dir / "node01.key_secret"),
        )
        stranger = _rank(f"tcp://127.0.0.1:{port}", 2, server_key=server)
        listed.start()
        stranger.start()
        _until(lambda: stranger.handshake_failures > 0)
        ranks = {getattr(m, "rank", -1) for m in _received(sub, 1.0)}
        listed.close()
        stranger.close()
    assert ranks == {1}
    assert "allow-list" in stranger.handshakes.last_error


def test_a_relay_forwards_to_a_keyed_watcher_and_counts_a_wrong_key(
    tmp_path: Path, keys_dir: Path
) -> None:
    wrong = tmp_path / "other"
    create_keypair(str(wrong))
    port = _port_pair()
    up = f"tcp://127.0.0.1:{port}"
    good_local, bad_local = f"ipc://{tmp_path}/good.sock", f"ipc://{tmp_path}/bad.sock"
    with Subscriber(f"tcp://0.0.0.0:{port}", keys=load_server_keys(str(keys_dir))) as sub:
        good = Relay(good_local, up, upstream_keys=load_client_keys(str(keys_dir)))
        bad = Relay(bad_local, up, upstream_keys=load_client_keys(str(wrong / "server.key")))
        with good, bad:
            ranks = [_rank(good_local, 1), _rank(bad_local, 2)]
            for pub in ranks:
                pub.start()
            got = _received(sub, 1.5)
            _until(lambda: bad.stats().upstream_handshake_failures > 0)
            for pub in ranks:
                pub.close()
            assert good.stats().upstream_handshake_failures == 0
    assert {getattr(m, "rank", -1) for m in got} == {1}
    assert all(pub.handshake_failures == 0 for pub in ranks)  # ranks to relays: no keys needed


def test_run_gives_ranks_the_public_key_of_the_keys_it_watches_with(keys_dir: Path) -> None:
    env = build_env({"DDPSCOPE_KEYS": str(keys_dir)}, record="")
    assert env["DDPSCOPE_SERVER_KEY"] == str(keys_dir / "server.key")
    assert load(env=env).client_keys() is not None


def test_the_watchers_health_line_says_when_peers_fail_the_handshake(keys_dir: Path) -> None:
    from ddpscope.analysis.live import LiveFeed

    port = _port_pair()
    endpoint = f"tcp://0.0.0.0:{port}"
    sub = Subscriber(endpoint, keys=load_server_keys(str(keys_dir)))
    with LiveFeed(endpoint, detectors=[], subscriber=sub) as feed:
        pub = _rank(f"tcp://127.0.0.1:{port}")  # no keys at all
        pub.start()
        try:
            _until(lambda: "failed the handshake" in feed.snapshot().health.detector_note)
        finally:
            pub.close()


def test_key_material_given_inline_never_reaches_run_info() -> None:
    pytest.importorskip("torch")
    from ddpscope.hooks.runinfo import public_options

    inline = "x" * 40  # a Z85 key given as text rather than as a path
    opts = dataclasses.replace(load({}, env={}), server_key=inline, client_key=inline)
    shown = public_options(opts)
    assert shown["server_key"] == shown["client_key"] == "(set)"
    assert inline not in repr(shown)
