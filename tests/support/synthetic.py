"""A synthetic DDP run published over real ZeroMQ: the watcher's tests and benchmarks, no torch.

:class:`SyntheticRun` computes the schema messages N ranks would send under a
simple timing model of synchronous DDP: every rank's step takes the same wall
time because the all-reduce evens them out; a slow rank computes longer, so
the others wait in their first bucket's all-reduce and the slow rank waits
least. Messages carry fixed sender clocks, so a run fed twice gives the same
snapshot.

:class:`Wire` publishes them the way ranks do (a PUB that connects to the
watcher's bound SUB) and waits for the watcher's subscription first, so no
message is lost to ZeroMQ's slow-joiner window. It also answers the
watcher's stack requests, as a real rank's publisher thread would.

``python tests/synthetic.py --world 256 --buckets 32 --rate 10 ENDPOINT``
publishes at a fixed pace until killed (used by benchmarks/watch_load.py).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from ddpscope.config import derive_control_endpoint
from ddpscope.schema import (
    BucketLayout,
    End,
    Heartbeat,
    Message,
    Request,
    RunInfo,
    SchemaError,
    Stacks,
    Step,
    decode,
    encode,
)

MS = 1_000_000
#: Sender clocks start here (monotonic) and at this wall time, for every rank.
T0_NS = 5_000 * 1_000_000_000
WALL0_NS = 1_700_000_000 * 1_000_000_000


@dataclass
class SyntheticRun:
    run_id: str = "synthetic-run"
    world: int = 4
    buckets: int = 8
    step_ms: float = 100.0
    slow_rank: int = -1
    slow_ms: float = 0.0
    #: Steps after which the slow rank starts being slow (its onset).
    slow_from: int = 0
    ranks_per_host: int = 8
    steps_per_epoch: int = 50
    #: Sender-side delay before a message is published (what the watcher sees as lag).
    send_delay_ms: float = 20.0
    #: The senders' monotonic clock at step 0, and the wall time it corresponds to.
    t0_ns: int = T0_NS
    wall0_ns: int = WALL0_NS
    _seq: dict[int, int] = field(default_factory=dict)

    def host(self, rank: int) -> str:
        return f"node{rank // self.ranks_per_host:02d}"

    def _env(self, rank: int, t: int) -> dict[str, Any]:
        seq = self._seq.get(rank, 0)
        self._seq[rank] = seq + 1
        return {"run": self.run_id, "rank": rank, "seq": seq, "t": t}

    def step_start(self, step: int) -> int:
        slowed = max(0, step - self.slow_from) if self.slow_rank >= 0 else 0
        return self.t0_ns + int((step * self.step_ms + slowed * self.slow_ms) * MS)

    def run_info(self, rank: int) -> RunInfo:
        return RunInfo(
            **self._env(rank, self.t0_ns),
            local_rank=rank % self.ranks_per_host,
            world_size=self.world,
            local_world_size=min(self.ranks_per_host, self.world),
            host=self.host(rank),
            pid=10_000 + rank,
            backend="gloo",
            device="cpu",
            versions={"torch": "2.13.0"},
            ddp={"bucket_cap_bytes": 1 << 20},
            params=[[f"layer{i}.weight", [64, 64], "float32", True] for i in range(self.buckets)],
            buffers=[],
            # The sender's wall clock is WALL0 when its monotonic clock reads T0,
            # minus the send delay, so the watcher measures exactly that delay as lag.
            wall_ns=self.wall0_ns - int(self.send_delay_ms * MS),
            mono_ns=self.t0_ns,
            started_wall_ns=self.wall0_ns - int(self.send_delay_ms * MS),
        )

    def layout(self, rank: int) -> BucketLayout:
        return BucketLayout(
            **self._env(rank, self.t0_ns),
            generation=1,
            step=0,
            index=list(range(self.buckets)),
            nbytes=[1 << 20] * self.buckets,
            dtype=["float32"] * self.buckets,
            params=[[i] for i in range(self.buckets)],
        )

    def _slow(self, rank: int, step: int) -> float:
        return self.slow_ms if rank == self.slow_rank and step >= self.slow_from else 0.0

    def step(self, rank: int, step: int) -> Step:
        extra = self.slow_ms if step >= self.slow_from and self.slow_rank >= 0 else 0.0
        wait = extra - self._slow(rank, step)  # the others wait for the slow rank
        base = self.step_ms
        t_start = self.step_start(step)
        t_end = t_start + int((base + extra) * MS)
        transfer = 1.0
        durs = [transfer + (wait if k == 0 else 0.0) for k in range(self.buckets)]
        return Step(
            **self._env(rank, t_end),
            step=step,
            t_start=t_start,
            t_end=t_end,
            data_ns=int(base * 0.1 * MS),
            forward_ns=int(base * 0.3 * MS),
            backward_ns=int(base * 0.45 * MS),
            optimizer_ns=int(base * 0.1 * MS),
            other_ns=int((base * 0.05 + self._slow(rank, step)) * MS),
            comm_wait_ns=int(wait * MS),
            micro_batches=1,
            optimizer_steps=1,
            epoch=step // self.steps_per_epoch,
            loader_pass=step // self.steps_per_epoch,
            layout=1,
            b_index=list(reversed(range(self.buckets))),
            b_nbytes=[1 << 20] * self.buckets,
            b_offset_ns=[int(base * 0.5 * MS) + k * MS for k in range(self.buckets)],
            b_dur_ns=[int(d * MS) for d in durs],
        )

    def heartbeat(self, rank: int, step: int, phase: str = "backward") -> Heartbeat:
        return Heartbeat(
            **self._env(rank, self.step_start(step)),
            phase=phase,
            step=step,
            bucket=-1,
            in_phase_s=0.01,
            cpu_pct=95.0 + rank % 5,
            rss_bytes=(900 + rank) * (1 << 20),
            threads=6,
        )

    def stacks(self, rank: int, step: int, reason: str = "request") -> Stacks:
        frames = [
            ["train.py", 120, "<module>"],
            ["train.py", 88, "train"],
            ["torch/nn/parallel/distributed.py", 1600, "forward"],
        ]
        return Stacks(
            **self._env(rank, self.step_start(step)),
            reason=reason,
            phase="allreduce",
            step=step,
            threads=[{"name": "MainThread", "ident": 1, "main": True, "frames": frames}],
        )

    def end(self, rank: int, step: int) -> End:
        return End(**self._env(rank, self.step_start(step)), reason="exit", step=step)

    def opening(self) -> list[Message]:
        return [m for r in range(self.world) for m in (self.run_info(r), self.layout(r))]

    def steps(self, first: int, last: int, heartbeat_every: int = 10) -> list[Message]:
        """Messages of steps ``first..last-1`` for every rank, with periodic heartbeats."""
        out: list[Message] = []
        for s in range(first, last):
            out.extend(self.step(r, s) for r in range(self.world))
            if (s + 1) % heartbeat_every == 0:
                out.extend(self.heartbeat(r, s + 1) for r in range(self.world))
        return out


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


if __name__ == "__main__":
    main()


@dataclass
class FrozenClock:
    """A watcher clock that moves only when told: snapshots become repeatable."""

    mono: int = T0_NS + 3_600 * 1_000_000_000
    wall: int = WALL0_NS + 3_600 * 1_000_000_000

    def mono_ns(self) -> int:
        return self.mono

    def wall_ns(self) -> int:
        return self.wall

    def advance(self, seconds: float) -> None:
        self.mono += int(seconds * 1e9)
        self.wall += int(seconds * 1e9)


def wait_received(feed: Any, count: int, timeout: float = 10.0) -> None:
    """Block until ``feed`` took ``count`` messages off the socket."""
    deadline = time.monotonic() + timeout
    while feed.received < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"feed received {feed.received} of {count} messages")
        time.sleep(0.005)


def clock_at(run: SyntheticRun, step: int) -> FrozenClock:
    """A frozen watcher clock reading the moment ``step`` starts on the senders' clocks."""
    mono = run.step_start(step)
    return FrozenClock(mono=mono, wall=run.wall0_ns + (mono - run.t0_ns))
