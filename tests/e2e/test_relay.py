"""Relays over real sockets: ranks -> relay -> watcher, requests back, recording at the relay."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ddpscope.cli.run import torchrun_nnodes, wants_relay
from ddpscope.config import load
from ddpscope.hooks.publisher import Publisher
from ddpscope.record import open_run
from ddpscope.schema import End, Heartbeat, Message, Stacks, Step
from ddpscope.transport.relay import Relay
from ddpscope.transport.subscriber import Subscriber
from tests.support.synth import SyntheticRun
from tests.support.torchrun import DEMO, ROOT, job_env, torchrun

ENVELOPE = {f.name for f in dataclasses.fields(Message)}
RUN = "relay-run"


def _fields(msg: Message) -> dict[str, Any]:
    """A message's own fields, as a rank's hooks post them to the publisher."""
    return {k: v for k, v in dataclasses.asdict(msg).items() if k not in ENVELOPE}


def _rank(endpoint: str, rank: int, record: str = "") -> Publisher:
    opts = load({"endpoint": endpoint, "heartbeat_s": 0.2, "record": record}, env={})
    return Publisher(opts, RUN, rank, {"run_id": RUN, "rank": rank})


def _wait_subscribed(relay: Relay, watcher: Subscriber, timeout: float = 10.0) -> None:
    """Until the watcher's subscription has reached the relay (the watcher must poll)."""
    deadline = time.monotonic() + timeout
    while relay.stats().subscriptions == 0:
        assert time.monotonic() < deadline, "the watcher's subscription never reached the relay"
        watcher.recv(20)


def _collect(watcher: Subscriber, done: Any, timeout: float = 20.0) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while not done(got):
        assert time.monotonic() < deadline, f"watcher got {len(got)} messages, not all"
        msg = watcher.recv(100)
        if msg is not None:
            got.append(msg)
    return got


def _ended(ranks: range) -> Any:
    return lambda got: {m.rank for m in got if isinstance(m, End)} >= set(ranks)


def test_ranks_through_a_relay_reach_the_watcher_with_nothing_lost(tmp_path: Path) -> None:
    up, local = f"ipc://{tmp_path}/watcher.sock", f"ipc://{tmp_path}/relay.sock"
    synth = SyntheticRun(run_id=RUN, world=4, buckets=8)
    with Subscriber(up) as watcher, Relay(local, up) as relay:
        _wait_subscribed(relay, watcher)
        ranks = [_rank(local, r) for r in range(4)]
        for pub in ranks:
            pub.start()
        for step in range(250):
            for r, pub in enumerate(ranks):
                pub.post("step", 0, _fields(synth.step(r, step)))
            if step % 50 == 0:
                time.sleep(0.05)
        for pub in ranks:
            pub.close()
        got = _collect(watcher, _ended(range(4)))
        stats = relay.stats()
    for r, pub in enumerate(ranks):
        mine = [m for m in got if m.rank == r]
        assert [m.step for m in mine if isinstance(m, Step)] == list(range(250))
        # Every message the rank sent, from its first: nothing lost on either hop.
        assert sorted(m.seq for m in mine if m.seq >= 0) == list(range(pub._seq))
        assert pub.dropped_send == 0 and pub.dropped_queue == 0
    assert stats.received >= 4 * 250 and stats.subscriptions >= 1


def test_relay_started_before_the_watcher_absorbs_what_ranks_send(tmp_path: Path) -> None:
    up, local = f"ipc://{tmp_path}/watcher.sock", f"ipc://{tmp_path}/relay.sock"
    synth = SyntheticRun(run_id=RUN, world=2, buckets=4)
    rec = tmp_path / "rec"
    relay = Relay(local, up, record=str(rec))
    relay.start()
    ranks = [_rank(local, r) for r in range(2)]
    try:
        for pub in ranks:
            pub.start()
        for step in range(300):  # no watcher anywhere yet
            for r, pub in enumerate(ranks):
                pub.post("step", 0, _fields(synth.step(r, step)))
            if step % 50 == 0:
                time.sleep(0.05)
        deadline = time.monotonic() + 10
        while relay.stats().received < 600:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert all(pub.dropped_send == 0 and pub.subscriptions >= 1 for pub in ranks)
        assert relay.stats().subscriptions == 0  # nobody upstream: the relay took it all
        with Subscriber(up) as watcher:  # a late watcher still gets the live stream
            beats = _collect(watcher, lambda got: {m.rank for m in got} >= {0, 1})
            assert all(isinstance(m, Heartbeat) for m in beats)
        for pub in ranks:
            pub.close()
        relay.settle()
    finally:
        relay.close()
    recording = open_run(str(rec), RUN)
    assert recording.problems == []
    for r, pub in enumerate(ranks):
        msgs = recording.messages[r]
        assert [m.step for m in msgs if isinstance(m, Step)] == list(range(300))
        assert [m.seq for m in msgs] == list(range(pub._seq))


def test_relay_records_each_rank_as_the_rank_records_itself(tmp_path: Path) -> None:
    up, local = f"ipc://{tmp_path}/watcher.sock", f"ipc://{tmp_path}/relay.sock"
    synth = SyntheticRun(run_id=RUN, world=3, buckets=4)
    own, at_relay = tmp_path / "own", tmp_path / "relay"
    with Relay(local, up, record=str(at_relay)) as relay:
        ranks = [_rank(local, r, record=str(own)) for r in range(3)]
        for r, pub in enumerate(ranks):
            pub.post("run_info", 0, _fields(synth.run_info(r)))
            pub.post("buckets", 0, _fields(synth.layout(r)))
            pub.start()
        for step in range(40):
            for r, pub in enumerate(ranks):
                pub.post("step", 0, _fields(synth.step(r, step)))
        time.sleep(0.5)  # a heartbeat or two
        for pub in ranks:
            pub.close()
        relay.settle()
    theirs, ours = open_run(str(own), RUN), open_run(str(at_relay), RUN)
    assert ours.problems == [] and sorted(ours.messages) == [0, 1, 2]
    for r in range(3):
        assert ours.messages[r] == theirs.messages[r]
        assert ours.messages[r][-1].KIND == "end"
    by_rank = {f.rank: f.header for f in ours.run.files}
    assert by_rank[1]["pid"] == synth.run_info(1).pid and by_rank[1]["host"] == "node00"
    assert by_rank[1]["recorded_by"].startswith("relay ")


def test_a_request_passes_back_through_the_relay_to_a_rank(tmp_path: Path) -> None:
    up, local = f"ipc://{tmp_path}/watcher.sock", f"ipc://{tmp_path}/relay.sock"
    with Subscriber(up) as watcher, Relay(local, up) as relay:
        pub = _rank(local, 5)
        pub.start()
        _collect(watcher, lambda got: any(isinstance(m, Heartbeat) for m in got))
        got: Stacks | None = None
        deadline = time.monotonic() + 10
        while got is None and time.monotonic() < deadline:
            watcher.request("stacks", target=5)
            msg = watcher.recv(300)
            if isinstance(msg, Stacks):
                got = msg
        pub.close()
        assert relay.stats().requests >= 1
    assert got is not None and got.rank == 5 and got.reason == "request"


def test_relay_command_runs_until_signalled_and_reports(tmp_path: Path) -> None:
    up, local = f"ipc://{tmp_path}/watcher.sock", f"ipc://{tmp_path}/relay.sock"
    rec = tmp_path / "rec"
    env = job_env()
    cmd = [sys.executable, "-m", "ddpscope", "relay", "--upstream", up, "--listen", local]
    proc = subprocess.Popen(
        [*cmd, "--record", str(rec), "--stats-every", "0.3"],
        env=env,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        assert "forwarding to" in proc.stderr.readline()
        pub = _rank(local, 0)
        pub.start()
        pub.post("end", 0, {"reason": "x", "step": 1})
        time.sleep(0.8)
        pub.close()
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "messages from ranks" in err and "recorded" in err
    assert [m.reason for m in open_run(str(rec), RUN).messages[0] if isinstance(m, End)] == [
        "x",
        "close",
    ]


def test_run_starts_a_relay_for_multi_node_torchrun_launches() -> None:
    py = [sys.executable, "-m", "torch.distributed.run"]
    assert torchrun_nnodes(["torchrun", "--nnodes=2", "--nproc_per_node=8", "t.py"]) == 2
    assert torchrun_nnodes([*py, "--nnodes", "1:4", "t.py"]) == 4
    assert torchrun_nnodes(["torchrun", "--standalone", "t.py", "--nnodes=9"]) == 1
    assert torchrun_nnodes(["python", "t.py", "--nnodes=2"]) == 1
    assert wants_relay(["torchrun", "--nnodes=2", "t.py"], {})
    assert not wants_relay(["torchrun", "--nnodes=2", "t.py"], {"DDPSCOPE_RELAY": "0"})
    assert wants_relay(["python", "t.py"], {"DDPSCOPE_RELAY": "1"})
    assert not wants_relay(["torchrun", "--nnodes=2", "t.py"], {}, flag=False)
    assert not wants_relay(["torchrun", "--standalone", "t.py"], {})


@pytest.mark.torchrun
def test_torchrun_job_reaches_the_watcher_through_the_relay_of_ddpscope_run(
    tmp_path: Path,
) -> None:
    up = f"ipc://{tmp_path}/watcher.sock"
    rec = tmp_path / "rec"
    got: list[Message] = []
    stop = threading.Event()
    with Subscriber(up) as watcher:

        def collect() -> None:
            while not stop.is_set():
                msg = watcher.recv(50)
                if msg is not None:
                    got.append(msg)

        thread = threading.Thread(target=collect)
        thread.start()
        try:
            prefix = [sys.executable, "-m", "ddpscope", "run", "--relay", "--headless"]
            proc = torchrun(
                [str(DEMO), "--epochs", "1", "--samples", "256"],
                env=job_env(DDPSCOPE_HEARTBEAT_S="0.2"),
                prefix=[*prefix, "--record", str(rec), "--endpoint", up, "--"],
            )
            deadline = time.monotonic() + 5
            while not {m.rank for m in got if isinstance(m, End)} >= {0, 1}:
                assert time.monotonic() < deadline, "no end message from every rank"
                time.sleep(0.05)
        finally:
            stop.set()
            thread.join()
    assert "relaying this node's ranks to " + up in proc.stderr
    recorded = open_run(str(rec)).messages
    for rank in (0, 1):
        live = [m for m in got if m.rank == rank]
        assert [s.step for s in live if isinstance(s, Step)] == [0, 1, 2, 3]
        # Everything the rank recorded reached the watcher through the relay.
        assert sorted(m.seq for m in live if m.seq >= 0) == [m.seq for m in recorded[rank]]


def test_a_flood_of_run_ids_cannot_make_a_recording_relay_open_a_file_for_each(
    tmp_path: Path,
) -> None:
    from ddpscope.schema import Heartbeat, encode
    from ddpscope.transport import relay as relay_mod

    recorder = relay_mod.NodeRecorder(str(tmp_path), "relay test")
    for i in range(relay_mod.MAX_STREAMS + 50):
        beat = Heartbeat(
            run=f"flood-{i}",
            rank=0,
            seq=0,
            t=1,
            phase="x",
            step=0,
            bucket=-1,
            in_phase_s=0.0,
            cpu_pct=0.0,
            rss_bytes=0,
            threads=1,
        )
        recorder.add(encode(beat))
    recorder.close()
    assert recorder.rejected == 50 and "not recorded" in recorder.error
    assert len(list(tmp_path.rglob("*.ddps"))) == relay_mod.MAX_STREAMS


def test_a_relay_refuses_malformed_frames_from_its_side_and_passes_every_good_one(
    tmp_path: Path,
) -> None:
    import msgpack
    import zmq

    up, local = f"ipc://{tmp_path}/watcher.sock", f"ipc://{tmp_path}/relay.sock"
    synth = SyntheticRun(run_id=RUN, world=2, buckets=8)
    ctx = zmq.Context()
    hostile = ctx.socket(zmq.PUB)
    hostile.setsockopt(zmq.LINGER, 1000)
    try:
        with Subscriber(up) as watcher, Relay(local, up) as relay:
            _wait_subscribed(relay, watcher)
            hostile.connect(local)
            ranks = [_rank(local, r) for r in range(2)]
            for pub in ranks:
                pub.start()
            time.sleep(0.3)  # the relay's subscription reaches the hostile PUB
            bad = [
                b"\xc1 not msgpack",
                msgpack.packb({"k": "step", "v": 1, "run": RUN, "rank": "zero"}),
                msgpack.packb(["ddpscope-batch", 1, b"", "forged", [[], []], []]),
            ]
            for step in range(50):
                for r, pub in enumerate(ranks):
                    pub.post("step", 0, _fields(synth.step(r, step)))
                hostile.send(bad[step % len(bad)])
            for pub in ranks:
                pub.close()
            got = _collect(watcher, _ended(range(2)))
            relay.settle()
            stats = relay.stats()
    finally:
        ctx.destroy(linger=0)
    for r, pub in enumerate(ranks):
        mine = [m for m in got if m.rank == r]
        assert [m.step for m in mine if isinstance(m, Step)] == list(range(50))
        assert sorted(m.seq for m in mine if m.seq >= 0) == list(range(pub._seq))
    assert stats.rejected == 50 and stats.batches >= 1
    # (A step missing its fields; the forged batch is no rank's message: not a map.)
    assert {reason for reason, _ in stats.rejected_reasons} == {
        "not a msgpack message",
        "step",
        "not a map",
    }
    assert stats.last_error.startswith("refused from the ranks: ")
    assert sum(watcher.rejected.values()) == 0  # nothing malformed got past the relay


def test_a_relay_forwarding_raw_frames_still_delivers_everything(tmp_path: Path) -> None:
    up, local = f"ipc://{tmp_path}/watcher.sock", f"ipc://{tmp_path}/relay.sock"
    synth = SyntheticRun(run_id=RUN, world=2, buckets=8)
    with Subscriber(up) as watcher, Relay(local, up, decode=False) as relay:
        _wait_subscribed(relay, watcher)
        ranks = [_rank(local, r) for r in range(2)]
        for pub in ranks:
            pub.start()
        for step in range(30):
            for r, pub in enumerate(ranks):
                pub.post("step", 0, _fields(synth.step(r, step)))
        for pub in ranks:
            pub.close()
        got = _collect(watcher, _ended(range(2)))
        stats = relay.stats()
    for r, pub in enumerate(ranks):
        assert sorted(m.seq for m in got if m.rank == r and m.seq >= 0) == list(range(pub._seq))
    assert watcher.batches == 0 and stats.batches == 0 and stats.received >= 60


def test_a_watcher_refuses_a_batch_from_a_foreign_sender_and_says_whose(tmp_path: Path) -> None:
    import msgpack
    import zmq

    from ddpscope.transport.batch import FINGERPRINT, TAG

    up = f"ipc://{tmp_path}/watcher.sock"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 1000)
    try:
        with Subscriber(up) as watcher:
            pub.connect(up)
            foreign = msgpack.packb([TAG, 1, b"\x01" * 8, "relay elsewhere:7", [[], []], []])
            deadline = time.monotonic() + 10
            while not watcher.rejected:
                assert time.monotonic() < deadline, "the foreign batch never arrived"
                pub.send(foreign)
                watcher.recv(100)
    finally:
        ctx.destroy(linger=0)
    assert set(watcher.rejected) == {"relay batch"}
    assert "relay elsewhere:7" in watcher.last_error
    assert (
        "another ddpscope build" in watcher.last_error and FINGERPRINT.hex() in watcher.last_error
    )
