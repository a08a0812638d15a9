"""Relays under load: 1,024 synthetic ranks through 8 relays into one watcher, on one host.

Processes, all on loopback:

- the watcher: a real ``LiveFeed`` (the analysis with every default detector,
  a snapshot asked for twice a second as the UI does) on a ``Subscriber``
  bound at tcp://127.0.0.1; the Subscriber is wrapped to count, per rank, the
  messages that arrived (sequence numbers) and the lag of every step message
  from its creation on the rank to its ingestion (both clocks are this host's
  CLOCK_MONOTONIC, so no offset enters the figure);
- the relays: ``--relays`` ``ddpscope.transport.relay.Relay`` objects spread
  over ``--relay-procs`` processes, each listening on an ipc:// socket for its
  node's ranks, as ``ddpscope run`` sets them up, and forwarding to the watcher
  over tcp: decoding and checking every frame and sending batches (the
  default), or with ``--raw-relays`` passing frames on as they came (C proxies);
- the ranks: ``--procs`` processes, each simulating ``ranks / procs`` ranks on
  a timer, each rank with its own rank socket (``sockets.rank_publisher``:
  XPUB, NODROP, sends with DONTWAIT, a refused send counted) connected to its
  node's relay. Per rank: run info and bucket layout at start, a ``Step``
  (``--buckets`` buckets, encoded with ``schema.encode``) every 1/``rate`` s,
  all ranks of the job at once as synchronous DDP does, a heartbeat per
  second, run info re-sent every 5 s.

It reports messages/s sent and ingested, messages lost (per-rank sequence
gaps at the watcher, and sends the ranks' sockets refused), the watcher's CPU
(share of one core, and CPU seconds per message ingested in the window: what
a loaded machine cannot change) and RSS, the relays' CPU per message, the
load average, and the lag (median, 99th percentile, worst) over the measured
window (after a 5 s warm-up).

    python -m benchmarks.relay_load                       # 1,024 ranks, 8 relays, 30 s
    python -m benchmarks.relay_load --ranks 256 --relays 2 --seconds 20
    python -m benchmarks.relay_load --json
    python -m benchmarks.relay_load --ranks 4096 --relays 32 --procs 8 --decoders 3
    python -m benchmarks.relay_load --bucket-every 32     # bucket detail as ranks sample it
    python -m benchmarks.relay_load --raw-relays --decoders 2   # relays as proxies (before)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path
from typing import Any

import psutil
import zmq

from benchmarks.table import print_rows
from ddpscope.schema import (
    BucketLayout,
    Heartbeat,
    Message,
    RunInfo,
    Step,
    encode,
)

ROOT = Path(__file__).resolve().parents[1]

RUN = "relay-load"
WARMUP_S = 5.0
MS = 1_000_000
#: Steps that always carry bucket detail (hooks/steps.py's _MAP_STEPS).
MAP_STEPS = 3


# --- ranks ---------------------------------------------------------------------


class _Rank:
    __slots__ = ("rank", "seq", "sock")

    def __init__(self, rank: int, sock: zmq.Socket) -> None:
        self.rank = rank
        self.sock = sock
        self.seq = 0

    def env(self, resend: bool = False) -> dict[str, Any]:
        if resend:
            return {"run": RUN, "rank": self.rank, "seq": -1, "t": time.monotonic_ns()}
        seq, self.seq = self.seq, self.seq + 1
        return {"run": RUN, "rank": self.rank, "seq": seq, "t": time.monotonic_ns()}


def _run_info(r: _Rank, world: int, per_node: int, buckets: int, resend: bool) -> RunInfo:
    return RunInfo(
        **r.env(resend),
        local_rank=r.rank % per_node,
        world_size=world,
        local_world_size=per_node,
        host=f"node{r.rank // per_node:02d}",
        pid=100_000 + r.rank,
        backend="nccl",
        device=f"cuda:{r.rank % 8}",
        versions={"torch": "2.13.0"},
        ddp={"bucket_cap_bytes": 25 << 20},
        params=[[f"layer{i}.weight", [1024, 1024], "float32", True] for i in range(buckets)],
        buffers=[],
        wall_ns=time.time_ns(),
        mono_ns=time.monotonic_ns(),
        started_wall_ns=time.time_ns(),
    )


def role_ranks(args: argparse.Namespace) -> None:
    from ddpscope.transport.sockets import rank_publisher

    relays: list[str] = args.relay_endpoints.split(",")
    per_node = args.world // len(relays)
    ctx = zmq.Context()
    ranks = []
    for rank in range(args.first, args.first + args.count):
        sock = rank_publisher(ctx, relays[rank // per_node], sndhwm=10_000)
        ranks.append(_Rank(rank, sock))
    for r in ranks:  # the relay's subscription: from here on nothing is discarded
        if not r.sock.poll(30_000):
            raise SystemExit(f"rank {r.rank}: relay never subscribed")
        r.sock.recv()
    print("ready", flush=True)
    refused = 0

    def send(r: _Rank, msg: Message) -> None:
        nonlocal refused
        try:
            r.sock.send(encode(msg), zmq.DONTWAIT)
        except zmq.Again:
            refused += 1

    b = args.buckets
    index = list(reversed(range(b)))
    nbytes = [4 << 20] * b
    offsets = [50 * MS + k * MS for k in range(b)]
    durs = [1 * MS] * b
    period = 1.0 / args.rate
    delay = args.start_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    start = time.monotonic()
    layout = {
        "generation": 1,
        "step": 0,
        "index": list(range(b)),
        "nbytes": nbytes,
        "dtype": ["float32"] * b,
        "params": [[i] for i in range(b)],
    }
    timing = {
        "data_ns": 5 * MS,
        "forward_ns": 30 * MS,
        "backward_ns": 45 * MS,
        "optimizer_ns": 10 * MS,
        "other_ns": 5 * MS,
        "comm_wait_ns": 2 * MS,
        "micro_batches": 1,
        "optimizer_steps": 1,
        "epoch": 0,
        "loader_pass": 0,
        "layout": 1,
        "b_index": index,
        "b_nbytes": nbytes,
        "b_offset_ns": offsets,
        "b_dur_ns": durs,
    }
    every = max(1, args.bucket_every)
    timing["b_every"] = every
    # Between two timed steps a rank sends no bucket arrays (hooks/steps.py).
    untimed = {**timing, "b_detail": False, "b_index": [], "b_nbytes": []}
    untimed.update(b_offset_ns=[], b_dur_ns=[])
    beat = {"phase": "forward", "bucket": -1, "in_phase_s": 0.01, "cpu_pct": 99.0}
    beat.update(rss_bytes=2 << 30, threads=8)
    for r in ranks:
        send(r, _run_info(r, args.world, per_node, b, False))
        send(r, BucketLayout(**r.env(), **layout))
    step, next_beat, next_resend = 0, start + 1.0, start + 5.0
    late = 0.0
    while True:
        due = start + (step + 1) * period
        now = time.monotonic()
        if due - start > args.seconds:
            break
        if due > now:
            time.sleep(due - now)
        else:
            late = max(late, now - due)
        t_end = time.monotonic_ns()
        t_start = t_end - int(period * 1e9)
        fields = timing if step < MAP_STEPS or step % every == 0 else untimed
        for r in ranks:
            send(r, Step(**r.env(), step=step, t_start=t_start, t_end=t_end, **fields))
        step += 1
        now = time.monotonic()
        if now >= next_beat:
            next_beat += 1.0
            for r in ranks:
                send(r, Heartbeat(**r.env(), step=step, **beat))
        if now >= next_resend:
            next_resend += 5.0
            for r in ranks:
                send(r, _run_info(r, args.world, per_node, b, True))
    elapsed = time.monotonic() - start
    time.sleep(1.0)  # let the sockets hand over what they hold
    out = {
        "first": args.first,
        "sent": {r.rank: r.seq for r in ranks},
        "refused": refused,
        "steps": step,
        "elapsed_s": elapsed,
        "worst_late_s": late,
    }
    print(json.dumps(out), flush=True)
    ctx.destroy(linger=0)


# --- relays --------------------------------------------------------------------


def role_relays(args: argparse.Namespace) -> None:
    from ddpscope.transport.relay import Relay

    eps = args.relay_endpoints.split(",")
    relays = [Relay(ep, args.upstream, decode=not args.raw_relays) for ep in eps]
    for r in relays:
        r.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    progress = Path(args.out + ".progress")
    print("ready", flush=True)
    while not stop.wait(0.5):
        # Messages the relays took from the ranks so far (their CPU per message).
        progress.write_text(str(sum(r.stats().received for r in relays)))
    stats = [r.stats() for r in relays]
    for r in relays:
        r.close()
    out = {"received": [s.received for s in stats], "rejected": [s.rejected for s in stats]}
    print(json.dumps(out), flush=True)


# --- watcher -------------------------------------------------------------------


def role_watcher(args: argparse.Namespace) -> None:
    from ddpscope.analysis.live import LiveFeed
    from ddpscope.transport.subscriber import Subscriber

    sub = Subscriber(args.endpoint)
    got: dict[int, int] = {}
    lag_at = array("d")
    lags = array("d")
    feed = LiveFeed(args.endpoint, subscriber=sub, freeze_gc=True, decoders=args.decoders)
    take_batch = feed.monitor.take_batch

    def counting(msgs: list[Message]) -> None:
        """Sequence numbers and step lag, per message once the analysis has taken
        its turn's messages (after the decode, wherever that ran): each lag runs
        to the end of its batch, so it errs long, never short."""
        take_batch(msgs)
        now = time.monotonic_ns()
        for msg in msgs:
            if msg.seq >= 0:
                got[msg.rank] = got.get(msg.rank, 0) + 1
            if type(msg) is Step:
                lag_at.append(now / 1e9)
                lags.append((now - msg.t) / 1e9)

    feed.monitor.take_batch = counting  # type: ignore[method-assign]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    health: list[dict[str, Any]] = []
    progress = Path(args.out + ".progress")
    with feed:
        print("ready", flush=True)
        while not stop.wait(0.5):
            progress.write_text(str(sub.received))
            try:
                h = feed.snapshot().health
            except TimeoutError:
                continue
            health.append(
                {
                    "t": time.monotonic(),
                    "rate": getattr(h, "rate", -1),
                    "dropped": getattr(h, "dropped", -1),
                    "lag_s": getattr(h, "lag_s", -1),
                    "busy": getattr(h, "busy", -1),
                }
            )
    out = {
        "got": got,
        "received": sub.received,
        "rejected": sum(sub.rejected.values()),
        "lag_at": list(lag_at),
        "lag": list(lags),
        "health": health,
    }
    Path(args.out).write_text(json.dumps(out))


# --- the orchestra -------------------------------------------------------------


def _spawn(role: str, *extra: str) -> psutil.Popen:
    # As a module from the root, as the benchmark itself runs, so its imports resolve.
    cmd = [sys.executable, "-m", "benchmarks.relay_load", "--role", role, *extra]
    return psutil.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)


def _ready(proc: psutil.Popen, what: str) -> None:
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise SystemExit(f"{what} did not start: {line!r}")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="ddpscope-relay-load-")
    port = args.port
    watcher_ep = f"tcp://127.0.0.1:{port}"
    relay_eps = ",".join(f"ipc://{tmp}/relay-{i}.sock" for i in range(args.relays))
    out_file = os.path.join(tmp, "watcher.json")
    watcher = _spawn(
        "watcher", "--endpoint", watcher_ep, "--out", out_file, "--decoders", str(args.decoders)
    )
    _ready(watcher, "watcher")
    eps = relay_eps.split(",")
    raw = ["--raw-relays"] if args.raw_relays else []
    relay_procs = []
    for i in range(args.relay_procs):
        mine = ",".join(eps[i :: args.relay_procs])
        if mine:
            out = ["--out", os.path.join(tmp, f"relays-{i}")]
            relay_procs.append(
                _spawn("relays", "--relay-endpoints", mine, "--upstream", watcher_ep, *raw, *out)
            )
    for p in relay_procs:
        _ready(p, "relays")
    start_at = time.monotonic() + 6.0 + args.ranks / 256
    per_proc = args.ranks // args.procs
    common = ["--relay-endpoints", relay_eps, "--world", str(args.ranks), "--rate", str(args.rate)]
    common += ["--buckets", str(args.buckets), "--seconds", str(args.seconds)]
    common += ["--bucket-every", str(args.bucket_every)]
    common += ["--start-at", str(start_at), "--count", str(per_proc)]
    ranks = [_spawn("ranks", *common, "--first", str(i * per_proc)) for i in range(args.procs)]
    for p in ranks:
        _ready(p, "ranks")
    late_start = time.monotonic() - start_at
    time.sleep(max(0.0, start_at - time.monotonic()) + WARMUP_S)
    w = psutil.Process(watcher.pid)
    procs = {"watcher": w}
    for i, p in enumerate(relay_procs):
        procs[f"relays{i}"] = psutil.Process(p.pid)
    for i, child in enumerate(w.children(recursive=True)):  # the decode workers
        procs[f"decoder{i}"] = child
    cpu0 = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
    rank_cpu0 = sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in ranks)
    progress = Path(out_file + ".progress")
    relay_progress = [Path(tmp, f"relays-{i}.progress") for i in range(len(relay_procs))]

    def relayed() -> int:
        return sum(int(p.read_text() or 0) for p in relay_progress if p.exists())

    ingested0 = int(progress.read_text() or 0)
    relayed0 = relayed()
    load0 = os.getloadavg()
    t0 = time.monotonic()
    rss_peak = decoders_rss_peak = 0
    window_end = start_at + args.seconds
    workers = [p for k, p in procs.items() if k.startswith("decoder")]
    while time.monotonic() < window_end:
        rss_peak = max(rss_peak, w.memory_info().rss)
        decoders_rss_peak = max(decoders_rss_peak, sum(p.memory_info().rss for p in workers))
        time.sleep(0.5)
    elapsed = time.monotonic() - t0
    cpu_s = {k: sum(p.cpu_times()[:2]) - cpu0[k] for k, p in procs.items()}
    ingested = int(progress.read_text() or 0) - ingested0
    load1 = os.getloadavg()
    cpu = {k: v / elapsed for k, v in cpu_s.items()}
    rank_cpu = (sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in ranks) - rank_cpu0) / (
        elapsed
    )
    rss_end = w.memory_info().rss
    reports = [json.loads(p.stdout.readline()) for p in ranks]
    for p in ranks:
        p.wait()
    # What is still queued reaches the watcher: wait until its count stands still.
    last, still_since, drain_start = -1, time.monotonic(), time.monotonic()
    while time.monotonic() - still_since < args.drain and time.monotonic() - drain_start < 300:
        time.sleep(0.5)
        now = int(progress.read_text() or 0)
        if now != last:
            last, still_since = now, time.monotonic()
    drained_s = time.monotonic() - drain_start - args.drain
    # CPU per message from the window's start to the backlog's end: a starved
    # watcher works through its backlog here, and every message is counted once.
    cpu_all = {k: sum(p.cpu_times()[:2]) - cpu0[k] for k, p in procs.items()}
    ingested_all = int(progress.read_text() or 0) - ingested0
    relayed_all = relayed() - relayed0
    relay_report: dict[str, list[int]] = {"received": [], "rejected": []}
    for p in relay_procs:
        p.terminate()
        said = json.loads(p.stdout.readline() or "{}")
        p.wait()
        for k in relay_report:
            relay_report[k] += said.get(k, [])
    watcher.terminate()
    watcher.wait()
    seen = json.loads(Path(out_file).read_text())
    got = {int(k): v for k, v in seen["got"].items()}
    sent = {int(k): v for rep in reports for k, v in rep["sent"].items()}
    lost_per_rank = {r: n - got.get(r, 0) for r, n in sent.items()}
    measured = [
        lag
        for at, lag in zip(seen["lag_at"], seen["lag"], strict=True)
        if start_at + WARMUP_S <= at <= window_end
    ]
    total_sent = sum(sent.values())
    health = [h for h in seen["health"] if start_at + WARMUP_S <= h["t"] <= window_end]
    return {
        "ranks": args.ranks,
        "relays": args.relays,
        "rank_procs": args.procs,
        "rate": args.rate,
        "buckets": args.buckets,
        "bucket_every": args.bucket_every,
        "seconds": args.seconds,
        "ranks_late_start_s": round(late_start, 2),
        "sent_msgs": total_sent,
        "sent_per_s": round(total_sent / args.seconds),
        "received_msgs": seen["received"],
        "ingest_per_s_median": round(statistics.median(h["rate"] for h in health))
        if health
        else None,
        "lost_msgs": sum(lost_per_rank.values()),
        "ranks_with_loss": sum(1 for v in lost_per_rank.values() if v),
        "send_refused": sum(rep["refused"] for rep in reports),
        "relay_received": sum(relay_report["received"]),
        "watcher_dropped_health": health[-1]["dropped"] if health else None,
        "watcher_cpu_pct": round(100 * cpu["watcher"]),
        "watcher_busy_median": round(statistics.median(h["busy"] for h in health), 2)
        if health
        else None,
        "relays_cpu_pct": round(100 * sum(v for k, v in cpu.items() if k.startswith("relays"))),
        "relays_decode": not args.raw_relays,
        "relay_rejected": sum(relay_report["rejected"]),
        "ingested_in_window": ingested,
        "ingested_window_to_drained": ingested_all,
        "watcher_cpu_us_per_msg": round(1e6 * cpu_all["watcher"] / ingested_all, 1)
        if ingested_all
        else None,
        "watcher_and_workers_cpu_us_per_msg": round(
            1e6 * sum(v for k, v in cpu_all.items() if not k.startswith("relays")) / ingested_all,
            1,
        )
        if ingested_all
        else None,
        "relays_cpu_us_per_msg": round(
            1e6 * sum(v for k, v in cpu_all.items() if k.startswith("relays")) / relayed_all, 1
        )
        if relayed_all
        else None,
        "load_avg_1min_start_end": [round(load0[0], 1), round(load1[0], 1)],
        "decoders": args.decoders,
        "decoders_cpu_pct": round(100 * sum(v for k, v in cpu.items() if k.startswith("decoder"))),
        "decoders_rss_mb_peak": round(decoders_rss_peak / 2**20),
        "rank_procs_cpu_pct": round(100 * rank_cpu),
        "watcher_rss_mb_end": round(rss_end / 2**20),
        "watcher_rss_mb_peak": round(rss_peak / 2**20),
        "lag_ms_median": round(1000 * statistics.median(measured), 1) if measured else None,
        "lag_ms_p99": round(1000 * _pct(measured, 0.99), 1) if measured else None,
        "lag_ms_max": round(1000 * max(measured), 1) if measured else None,
        "rank_tick_worst_late_ms": round(1000 * max(rep["worst_late_s"] for rep in reports), 1),
        "backlog_drained_s": round(max(0.0, drained_s), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["watcher", "relays", "ranks"], help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--relays", type=int, default=8)
    p.add_argument("--relay-procs", type=int, default=4, help="processes the relays run in")
    p.add_argument(
        "--raw-relays",
        action="store_true",
        help="relays pass frames on undecoded (ZeroMQ proxies), as before batches",
    )
    p.add_argument("--procs", type=int, default=4, help="processes simulating the ranks")
    p.add_argument("--rate", type=float, default=10.0, help="steps per second per rank")
    p.add_argument("--buckets", type=int, default=32)
    p.add_argument(
        "--bucket-every",
        type=int,
        default=1,
        help="bucket detail every N steps, as ranks sample it (1: every step, the heaviest)",
    )
    p.add_argument(
        "--decoders", type=int, default=0, help="the watcher's decode workers (watch --decoders)"
    )
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument(
        "--drain", type=float, default=2.0, help="the watcher is done when idle this long"
    )
    p.add_argument("--port", type=int, default=25557)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", action="store_true")
    # role arguments
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--relay-endpoints", help=argparse.SUPPRESS)
    p.add_argument("--upstream", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "ranks":
        return role_ranks(args)
    if args.role == "relays":
        return role_relays(args)
    if args.role == "watcher":
        return role_watcher(args)
    rows = [measure(args) for _ in range(args.repeat)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print_rows(rows, "load average")


if __name__ == "__main__":
    main()
