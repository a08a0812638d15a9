"""The wire of a synthetic run: publish it to a watcher over real ZeroMQ, as ranks do.

:class:`Wire` publishes messages the way ranks do (a PUB that connects to the
watcher's bound SUB) and waits for the watcher's subscription first, so no
message is lost to ZeroMQ's slow-joiner window. It also answers the
watcher's stack requests, as a real rank's publisher thread would. The
messages come from :class:`tests.support.synth.SyntheticRun`.

``python -m tests.support.wire --world 256 --buckets 32 --rate 10 ENDPOINT``
(from the repository root) publishes at a fixed pace until killed (used by
benchmarks/watch_load.py).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import zmq

from ddpscope.config import derive_control_endpoint
from ddpscope.schema import Message, Request, SchemaError, decode, encode
from tests.support.synth import SyntheticRun


class Wire:
    """A PUB that connects to the watcher and answers its requests, like a rank's publisher."""

    def __init__(self, endpoint: str, control_endpoint: str | None = None) -> None:
        self.ctx = zmq.Context()
        # XPUB is a PUB that also hears subscriptions: when the watcher's
        # subscription arrives, the pipe is up and nothing sent after is lost.
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 1_000_000)
        self.pub.connect(endpoint)
        self.ctl = self.ctx.socket(zmq.SUB)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.setsockopt(zmq.SUBSCRIBE, b"")
        self.ctl.connect(control_endpoint or derive_control_endpoint(endpoint))
        self.sent = 0
        self.requests: list[Request] = []

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        if not self.pub.poll(int(timeout * 1000)):
            raise TimeoutError("the watcher never subscribed")
        self.pub.recv()

    def send(self, messages: list[Message]) -> None:
        for m in messages:
            self.pub.send(encode(m))
        self.sent += len(messages)

    def send_raw(self, payload: bytes) -> None:
        self.pub.send(payload)
        self.sent += 1

    def poll_requests(self, timeout_ms: int = 0) -> list[Request]:
        got = []
        while self.ctl.poll(timeout_ms):
            timeout_ms = 0
            try:
                msg = decode(self.ctl.recv())
            except SchemaError:
                continue
            if isinstance(msg, Request):
                got.append(msg)
        self.requests.extend(got)
        return got

    def answer_stacks(self, run: SyntheticRun, step: int) -> int:
        """Answer pending stack requests with stacks for the ranks asked; returns how many."""
        answered = 0
        for req in self.poll_requests():
            if req.what != "stacks":
                continue
            targets = range(run.world) if req.target < 0 else [req.target]
            self.send([run.stacks(r, step) for r in targets])
            answered += len(targets)
        return answered

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pace(run: SyntheticRun, wire: Wire, rate: float, seconds: float = 0.0) -> int:
    """Publish steps at ``rate`` steps/s (slower with a slow rank) for ``seconds`` (0: forever).

    Sender clocks are the real clocks here, so the watcher's lag figure is real.
    Returns the number of steps sent.
    """
    run.step_ms = 1000.0 / rate
    run.send_delay_ms = 0.0
    run.t0_ns, run.wall0_ns = time.monotonic_ns(), time.time_ns()
    start = run.t0_ns / 1e9
    wire.send(run.opening())
    next_resend = start + 5.0
    next_beat = start
    step = 0
    while seconds <= 0 or time.monotonic() - start < seconds:
        delay = start + (run.step_start(step + 1) - run.t0_ns) / 1e9 - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        wire.send([run.step(r, step) for r in range(run.world)])  # step ends now
        step += 1
        now = time.monotonic()
        if now >= next_beat:
            next_beat = now + 1.0
            wire.send([run.heartbeat(r, step) for r in range(run.world)])
        if now >= next_resend:
            next_resend = now + 5.0
            wire.send([run.run_info(r) for r in range(run.world)])
        wire.answer_stacks(run, step)
    return step


def main() -> None:
    p = argparse.ArgumentParser(description="publish a synthetic DDP run at a fixed pace")
    p.add_argument("endpoint")
    p.add_argument("--world", type=int, default=256)
    p.add_argument("--buckets", type=int, default=32)
    p.add_argument("--rate", type=float, default=10.0, help="steps per second")
    p.add_argument("--seconds", type=float, default=0.0, help="0: until killed")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=30.0)
    p.add_argument("--run-id", default=f"synthetic-{int(time.time())}")
    args = p.parse_args()
    run = SyntheticRun(
        run_id=args.run_id,
        world=args.world,
        buckets=args.buckets,
        slow_rank=args.slow_rank,
        slow_ms=args.slow_ms if args.slow_rank >= 0 else 0.0,
    )
    with Wire(args.endpoint) as wire:
        wire.wait_subscribed(timeout=30)
        pace(run, wire, args.rate, args.seconds)


def wait_received(feed: Any, count: int, timeout: float = 10.0) -> None:
    """Block until ``feed`` took ``count`` messages off the socket."""
    deadline = time.monotonic() + timeout
    while feed.received < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"feed received {feed.received} of {count} messages")
        time.sleep(0.005)


if __name__ == "__main__":
    main()
