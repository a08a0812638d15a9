"""The rank's publisher thread over real ZeroMQ sockets and real files."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import zmq

from ddpscope.config import load
from ddpscope.hooks.publisher import Publisher
from ddpscope.record import open_run
from ddpscope.schema import End, Heartbeat, Stacks, decode
from ddpscope.transport.subscriber import Subscriber


def _publisher(endpoint: str, tmp_path: Path | None = None, **opts: object) -> Publisher:
    options = load({"endpoint": endpoint, "heartbeat_s": 0.2, **opts}, env={})
    if tmp_path is not None:
        options = load(
            {"endpoint": endpoint, "heartbeat_s": 0.2, "record": str(tmp_path), **opts}, env={}
        )
    return Publisher(options, "run-x", 3, {"run_id": "run-x", "rank": 3})


def _wait_for(sub: Subscriber, pred, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = sub.recv(100)
        if msg is not None and pred(msg):
            return msg
    raise AssertionError("expected message never arrived")


def test_posted_items_arrive_decoded_with_sequence_numbers(endpoint: str) -> None:
    with Subscriber(endpoint) as sub:
        pub = _publisher(endpoint)
        pub.start()
        _wait_for(sub, lambda m: isinstance(m, Heartbeat))  # the connection is up
        pub.post("end", 0, {"reason": "close", "step": 41})
        msg = _wait_for(sub, lambda m: isinstance(m, End))
        assert msg.run == "run-x" and msg.rank == 3 and msg.step == 41
        pub.close()


def test_heartbeats_carry_phase_and_host_stats(endpoint: str) -> None:
    with Subscriber(endpoint) as sub:
        pub = _publisher(endpoint)
        pub.state.enter("backward")
        pub.state.step = 12
        pub.start()
        hb = _wait_for(sub, lambda m: isinstance(m, Heartbeat))
        assert hb.phase == "backward" and hb.step == 12
        assert hb.rss_bytes > 0 and hb.threads >= 2
        pub.close()


def test_full_queue_drops_and_counts_instead_of_growing(endpoint: str) -> None:
    pub = _publisher(endpoint, queue_size=16)  # thread not started: nothing drains
    for i in range(100):
        pub.post("end", 0, {"reason": "x", "step": i})
    assert len(pub._queue) == 16
    assert pub.dropped_queue == 84
    pub.close()


def test_nobody_listening_never_blocks_and_records_everything(
    tmp_path: Path, endpoint: str
) -> None:
    pub = _publisher(endpoint, tmp_path)
    pub.start()
    t0 = time.monotonic()
    for i in range(2000):
        pub.post("end", 0, {"reason": "x", "step": i})
        if i % 200 == 0:
            time.sleep(0.06)  # let the thread drain so the queue never fills
    posting = time.monotonic() - t0
    pub.close()
    assert posting < 5.0
    rec = open_run(str(tmp_path))
    steps = [m.step for m in rec.messages[3] if isinstance(m, End) and m.reason == "x"]
    assert steps == list(range(2000))


def test_frozen_watcher_makes_sends_drop_and_count(endpoint: str) -> None:
    """A subscriber that never reads (like a SIGSTOPped watcher) fills the pipe."""
    with Subscriber(endpoint) as sub:
        pub = _publisher(endpoint, sndhwm=10)
        pub.start()
        _wait_for(sub, lambda m: isinstance(m, Heartbeat))
        big = "x" * 200_000
        for i in range(400):
            pub.post("end", 0, {"reason": big, "step": i})
            time.sleep(0.002)
        deadline = time.monotonic() + 10
        while pub.dropped_send == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pub.dropped_send > 0
        pub.close()


def test_stack_request_is_answered_with_every_thread(endpoint: str) -> None:
    with Subscriber(endpoint) as sub:
        pub = _publisher(endpoint)
        pub.start()
        _wait_for(sub, lambda m: isinstance(m, Heartbeat))
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:
            sub.request("stacks", target=3)
            msg = sub.recv(300)
            if isinstance(msg, Stacks):
                got = msg
        assert got is not None and got.reason == "request"
        assert any(t["main"] for t in got.threads)
        assert any("test_stack_request" in f[2] for t in got.threads for f in t["frames"])
        pub.close()


def test_request_for_another_rank_is_ignored_and_garbage_counted(endpoint: str) -> None:
    with Subscriber(endpoint) as sub:
        pub = _publisher(endpoint)
        pub.start()
        _wait_for(sub, lambda m: isinstance(m, Heartbeat))
        for _ in range(5):
            sub.request("stacks", target=7)
            sub._ctl.send(b"\xc1 not msgpack")
            time.sleep(0.1)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            msg = sub.recv(100)
            assert not isinstance(msg, Stacks)
        assert pub.rejected_requests > 0
        pub.close()


def test_stuck_phase_sends_stacks_once(endpoint: str) -> None:
    with Subscriber(endpoint) as sub:
        pub = _publisher(endpoint, stacks_after_s=0.3)
        pub.state.enter("allreduce")
        pub.start()
        msg = _wait_for(sub, lambda m: isinstance(m, Stacks))
        assert msg.reason == "stuck" and msg.phase == "allreduce"
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert not isinstance(sub.recv(100), Stacks)
        pub.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_never_touches_the_parents_socket_or_file(
    tmp_path: Path, endpoint: str
) -> None:
    pub = _publisher(endpoint, tmp_path)
    pub.start()
    pid = os.fork()
    if pid == 0:  # child: posting must be a no-op, exiting must not assert
        try:
            pub.post("end", 0, {"reason": "child", "step": 1})
            pub.close()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    pub.post("end", 0, {"reason": "parent", "step": 2})
    pub.close()
    msgs = open_run(str(tmp_path)).messages[3]
    reasons = [m.reason for m in msgs if isinstance(m, End)]
    assert "child" not in reasons and "parent" in reasons


def test_close_is_fast_and_idempotent(endpoint: str) -> None:
    pub = _publisher(endpoint)
    pub.start()
    t0 = time.monotonic()
    pub.close()
    pub.close()
    assert time.monotonic() - t0 < 3.0


def test_an_item_that_never_finishes_cannot_stall_the_queue(endpoint: str) -> None:
    pub = _publisher(endpoint)
    pub.post("fingerprint", 0, None, lambda payload, force: None)
    pub.post("end", 0, {"reason": "after", "step": 1})
    pub._drain(force=False)
    assert len(pub._queue) == 2  # waits while the first is not ready...
    pub._drain(force=True)
    assert len(pub._queue) == 0  # ...and gives it up when forced
    assert pub.dropped_queue == 1
    pub.close()


def test_first_messages_wait_for_the_watchers_subscription_instead_of_being_lost(
    endpoint: str,
) -> None:
    with Subscriber(endpoint) as sub:
        pub = _publisher(endpoint)
        for i in range(50):  # before the thread runs: the very first messages of a run
            pub.post("end", 0, {"reason": "early", "step": i})
        pub.start()
        got: list[int] = []
        deadline = time.monotonic() + 10
        while len(got) < 50 and time.monotonic() < deadline:
            msg = sub.recv(100)
            if isinstance(msg, End) and msg.reason == "early":
                got.append(msg.seq)
        pub.close()
    assert got == list(range(50))  # seq 0 on: nothing lost to the connection's first moment
    assert pub.subscriptions >= 1


class _LateSubscriber:
    """A bound peer that connects at once but subscribes only when told: what a
    watcher whose handshake is slow on a loaded host looks like to a rank."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XSUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)

    def subscribe(self) -> None:
        self.sock.send(b"\x01")  # XSUB: a subscription to every topic

    def early_seqs(self, n: int, timeout: float = 10.0) -> list[int]:
        got: list[int] = []
        deadline = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            if self.sock.poll(100):
                msg = decode(self.sock.recv())
                if isinstance(msg, End) and msg.reason == "early":
                    got.append(msg.seq)
        return got

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _connected_with_early_posts(endpoint: str, n: int) -> Publisher:
    """A started publisher with ``n`` first messages, once its peer's connection is up."""
    pub = _publisher(endpoint)
    for i in range(n):
        pub.post("end", 0, {"reason": "early", "step": i})
    pub.start()
    deadline = time.monotonic() + 10
    while not pub._hold.peer and time.monotonic() < deadline:
        time.sleep(0.01)
    hs = pub.handshakes
    assert pub._hold.peer, (pub.error, pub._thread.is_alive(), hs.succeeded, hs.failures)
    return pub


def test_first_sends_wait_past_the_grace_for_a_connected_watcher_that_subscribes_late(
    endpoint: str,
) -> None:
    late = _LateSubscriber(endpoint)
    try:
        pub = _connected_with_early_posts(endpoint, 50)  # connected, not subscribed
        time.sleep(1.5)  # three times the grace a peer that never connects gets
        assert pub.sent == 0, "still held for the connected peer"
        late.subscribe()
        got = late.early_seqs(50)
        pub.close()
    finally:
        late.close()
    assert got == list(range(50))


def test_a_rank_closing_before_a_connected_watcher_subscribed_waits_for_it_briefly(
    endpoint: str,
) -> None:
    """A job shorter than the hold: the whole run in the first second."""
    late = _LateSubscriber(endpoint)
    try:
        pub = _connected_with_early_posts(endpoint, 16)
        subscriber = threading.Timer(0.4, late.subscribe)
        subscriber.start()
        pub.close()  # before the subscription: it waits for it, at most a second
        subscriber.join()
        got = late.early_seqs(16)
    finally:
        late.close()
    assert got == list(range(16))


def test_a_watcher_that_never_comes_delays_the_first_sends_only_briefly(
    tmp_path: Path, endpoint: str
) -> None:
    pub = _publisher(endpoint, tmp_path)
    pub.post("end", 0, {"reason": "early", "step": 0})
    pub.start()
    deadline = time.monotonic() + 5
    while pub.sent == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pub.sent > 0 and pub.subscriptions == 0
    pub.close()
    ends = [m.reason for m in open_run(str(tmp_path)).messages[3] if isinstance(m, End)]
    assert ends[0] == "early"


def test_records_are_written_at_once_while_sends_wait_for_a_subscriber(
    tmp_path: Path, endpoint: str
) -> None:
    """A rank killed in its first half second must still leave what it did on disk."""
    pub = _publisher(endpoint, tmp_path)
    pub.start()
    pub.post("end", 0, {"reason": "early", "step": 0})
    deadline = time.monotonic() + 0.4  # inside the grace period: nobody has subscribed
    found: list[str] = []
    while not found and time.monotonic() < deadline:
        time.sleep(0.02)
        runs = list(tmp_path.rglob("*.ddps"))
        if runs:
            found = [
                m.reason for m in open_run(str(tmp_path)).messages.get(3, []) if isinstance(m, End)
            ]
    held_sends = pub.sent
    pub.close()
    assert found == ["early"], "the record was written during the grace period"
    assert held_sends == 0, "while the sends still waited for a subscriber"


def test_a_flood_of_stack_requests_is_answered_at_most_twice_a_second(endpoint: str) -> None:
    with Subscriber(endpoint) as sub:
        pub = _publisher(endpoint)
        pub.start()
        _wait_for(sub, lambda m: isinstance(m, Heartbeat))
        began = time.monotonic()
        while time.monotonic() - began < 1.0:
            sub.request("stacks")
            time.sleep(0.005)
        answers = 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            msg = sub.recv(50)
            answers += isinstance(msg, Stacks) and msg.reason == "request"
        pub.close()
    assert 1 <= answers <= 3
    assert pub.throttled_requests > 50
