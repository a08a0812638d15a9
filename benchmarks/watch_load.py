"""Does `ddpscope watch` keep up? A synthetic job (no torch) at a fixed pace, the real watcher.

For each world size: a publisher process (tests/support/wire.py) sends what N
ranks at 10 steps/s with 32 buckets would send (one step message per rank
per step, a heartbeat per rank per second, run info every 5 s); the watcher
runs as users run it, `python -m ddpscope watch`, on a pseudo-terminal at
200x50 (the dashboard: ranks, step-time sparklines and the bucket view all
drawn, the heaviest layout). Measured from outside the watcher process:

- CPU of the watcher (share of one core) and its RSS at the end;
- ingest: the header's own "rx N (M/s)" against what the publisher sends;
- lag: the header's "lag Xms" (message creation on the rank to ingestion),
  early in the run and late in it: keeping up means it does not grow;
- key presses: time from writing a key to the terminal until the screen
  shows its effect (space pauses: "PAUSED" appears; space resumes: "LIVE";
  2/1 switch views), median and worst of many presses.

    python -m benchmarks.watch_load                  # 256 and 1,024 ranks
    python -m benchmarks.watch_load --worlds 256 512 1024 2048 --seconds 30

Prints a Markdown table (and JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.table import print_rows
from benchmarks.watch_pty import Terminal

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = "tests.support.wire"  # run with -m from ROOT
LAG = re.compile(r"lag (\d+)ms")
RX = re.compile(r"rx ([\d.]+[kM]?) \(([\d.]+[kM]?)/s\)")
DROPPED = re.compile(r"dropped ([\d.]+[kM]?)")


def _num(text: str) -> float:
    scale = {"k": 1e3, "M": 1e6}.get(text[-1], 1.0)
    return float(text.rstrip("kM")) * scale


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["TERM"] = "xterm-256color"
    env.pop("DDPSCOPE_ENDPOINT", None)
    return env


def _press(term: Terminal, key: str, shows: str) -> float:
    mark = term.mark()
    sent = term.send(key)
    return term.wait_for(shows, since=mark, timeout=10) - sent


def _samples(term: Terminal, pattern: re.Pattern[str], since: int) -> list[str]:
    return [m.group(1) for m in pattern.finditer(term.text_since(since))]


def measure(
    world: int, seconds: float, rate: float, buckets: int, presses: int, decoders: int = 0
) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="ddpscope-bench-")
    endpoint = f"ipc://{tmp}/watch.sock"
    env = _env()
    watch = [sys.executable, "-m", "ddpscope", "watch", "--endpoint", endpoint]
    watch += ["--decoders", str(decoders)] if decoders else []
    term = Terminal(watch, env, size=(200, 50), cwd=str(ROOT))
    term.wait_for("listening on", timeout=30)
    pub = psutil.Popen(
        [sys.executable, "-m", SYNTHETIC, endpoint, "--world", str(world), "--buckets",
         str(buckets), "--rate", str(rate), "--seconds", str(seconds + 15)],
        env=env, cwd=ROOT,
    )  # fmt: skip
    watcher = psutil.Process(term.pid)
    try:
        term.wait_for(f"{world} ranks", timeout=60)
        time.sleep(3)  # past start-up: imports, first run info, first detectors
        start_mark = term.mark()
        cpu0, pub0, t0 = sum(watcher.cpu_times()[:2]), sum(pub.cpu_times()[:2]), time.monotonic()
        latencies: list[float] = []
        half = seconds / 2
        early_mark = term.mark()
        time.sleep(min(5.0, half))
        late_split = term.mark()
        # Presses spread over the middle of the run, while telemetry keeps coming.
        for i in range(presses):
            latencies.append(_press(term, " ", "PAUSED"))
            latencies.append(_press(term, " ", "LIVE"))
            key, shows = ("2", "busy ms") if i % 2 == 0 else ("1", "status")
            latencies.append(_press(term, key, shows))
            time.sleep(max(0.0, (seconds - 10) / presses - 0.3))
        late_mark = term.mark()
        remaining = seconds - (time.monotonic() - t0)
        time.sleep(max(5.0, remaining))
        elapsed = time.monotonic() - t0
        cpu = (sum(watcher.cpu_times()[:2]) - cpu0) / elapsed
        workers = watcher.children(recursive=True)
        workers_rss = sum(w.memory_info().rss for w in workers)
        pub_cpu = (sum(pub.cpu_times()[:2]) - pub0) / elapsed
        rss = watcher.memory_info().rss
        early_lags = [int(x) for x in _samples(term, LAG, early_mark)[: max(1, 10)]]
        late_text = term.text_since(late_mark)
        late_lags = [int(m.group(1)) for m in LAG.finditer(late_text)]
        rx = RX.findall(term.text_since(late_mark))
        drops = DROPPED.findall(term.text_since(start_mark))
        del late_split
    finally:
        pub.kill()
        pub.wait()
        term.close()
    expected_rate = world * rate + world  # steps + one heartbeat per rank per second
    return {
        "world": world,
        "seconds": round(elapsed, 1),
        "watcher_cpu_pct": round(100 * cpu),
        "publisher_cpu_pct": round(100 * pub_cpu),
        "watcher_rss_mb": round(rss / 2**20),
        "decoders": decoders,
        "decoders_rss_mb": round(workers_rss / 2**20),
        "sent_per_s": round(expected_rate),
        "ingested_per_s": round(statistics.median([_num(r) for _, r in rx])) if rx else None,
        "lag_ms_early": statistics.median(early_lags) if early_lags else None,
        "lag_ms_late": statistics.median(late_lags[-10:]) if late_lags else None,
        "lag_ms_late_max": max(late_lags[-10:]) if late_lags else None,
        "dropped": _num(drops[-1]) if drops else None,
        "key_ms_median": round(1000 * statistics.median(latencies), 1),
        "key_ms_p95": round(1000 * sorted(latencies)[int(0.95 * (len(latencies) - 1))], 1),
        "key_ms_max": round(1000 * max(latencies), 1),
        "presses": len(latencies),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--rate", type=float, default=10.0, help="steps per second")
    p.add_argument("--buckets", type=int, default=32)
    p.add_argument("--presses", type=int, default=10, help="rounds of 3 key presses")
    p.add_argument("--decoders", type=int, default=0, help="watch --decoders N")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = [
        measure(w, args.seconds, args.rate, args.buckets, args.presses, args.decoders)
        for w in args.worlds
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print_rows(rows, "load average before")


if __name__ == "__main__":
    main()
