"""Post-mortem at scale: report, export, compare and replay on a 1,024-rank recording.

Writes (once; kept with --dir) the synthetic recording of replay_open.py
(lockstep DDP from tests/support/synth.py, 8 buckets, a heartbeat every 10 steps, a
straggler from 60% of the run, the real RecordWriter, one file per rank) at
--world ranks x --steps steps, then runs each reader in a fresh process, timed
from the start of the work to its result, with that process's peak RSS
(``VmHWM``):

- report:  ``report.build(report.analyze(DIR))``, as ``ddpscope report --json``
- export:  ``ddpscope export DIR --format chrome-trace`` (with findings), to a file
- csv:     ``ddpscope export DIR --format csv``
- compare: ``ddpscope compare DIR DIR`` (both sides read and analysed)
- replay (first open, no index file): the first screen (every rank's row), then
  the whole index pass, which writes the index file
- replay (cached open): the first screen with the index file there, and the
  index loaded whole (every finding known, seeks anywhere)
- read only: every record scanned and CRC-checked; decoded too (no analysis):
  where the report's time goes
- stream: the report's merged stream alone (decode, each file's reorder
  window, the merge by time); analysis: that stream through the analysis
  (every detector, the ticks), without the report's own figures

MB/s is the recording's size over the reader's time; with --runs N, each
figure is the median of N fresh processes, with the range of the times.
Each reader's CPU seconds (user + system) are given too: on this shared
machine they move far less with the load than the wall time does.

--derive writes the recording with replay_open.write_derived instead (16
ranks simulated, the others repeating them under their own rank numbers: a
1,024 x 10,000 recording in under a minute instead of most of an hour).

    python -m benchmarks.postmortem_scale --world 1024 --steps 500      # JSON on stdout
    python -m benchmarks.postmortem_scale --dir /tmp/pm1024 --only report --runs 3
    python -m benchmarks.postmortem_scale --dir /tmp/pm10k --steps 10000 --derive \
        --only replay_first --only replay_cached

--sweep N [N ...] does it at each of those step counts (one derived recording
each, under --dir, deleted once measured unless --keep) and adds, per reader,
how its peak RSS grew per 1,000 steps between the first and the last: what a
reader holds that grows with the run, rather than with the ranks:

    python -m benchmarks.postmortem_scale --dir /tmp/pmsweep --sweep 1000 2000 4000 \
        --only replay_first --only report
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHAT = (
    "read",
    "decode",
    "stream",
    "analysis",
    "report",
    "export",
    "csv",
    "compare",
    "replay_first",
    "replay_cached",
)


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not counting
    the parent's image the process was forked from)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def one(what: str, directory: str) -> dict[str, float]:
    """Run one reader here; seconds and extra figures."""
    # Whether an index file was there when the reader began (export reads through it).
    there = any(Path(directory).rglob(".ddpscope-index"))
    began = time.perf_counter()
    out: dict[str, float] = {"index_there": float(there)}
    if what in ("read", "decode"):
        from ddpscope.record.reader import choose_run
        from ddpscope.schema import decode

        n = 0
        for rf in choose_run(directory).files:
            for payload in rf.records():
                if what == "decode":
                    decode(payload)
                n += 1
        out["records"] = n
    elif what in ("stream", "analysis"):
        from ddpscope.analysis.build import build_analysis
        from ddpscope.analysis.monitor import MAX_HISTORY
        from ddpscope.analysis.protocol import recorded
        from ddpscope.analysis.sources import fit_history, replay, run_shifts
        from ddpscope.record.collect import reading_recording
        from ddpscope.record.reader import choose_run
        from ddpscope.record.stream import RunStream

        run = choose_run(directory)
        shifts = run_shifts(run)
        with reading_recording():
            if what == "stream":
                out["records"] = sum(1 for _ in RunStream(run, shifts))
            else:
                analysis = build_analysis(recorded(False, None), None, history=MAX_HISTORY)
                replay(
                    RunStream(run, shifts),
                    analysis,
                    shifts=shifts,
                    on_feed=lambda msg, state: fit_history(state),
                )
    elif what == "report":
        from ddpscope.analysis import report

        doc = report.build(*report.analyze(directory))
        out["findings"] = len(doc["findings"])
    elif what in ("export", "csv", "compare"):
        from ddpscope.cli.main import main

        with tempfile.TemporaryDirectory() as tmp:
            if what == "compare":
                argv = ["compare", directory, directory, "--json"]
                with open(os.devnull, "w") as null:
                    saved, sys.stdout = sys.stdout, null
                    try:
                        code = main(argv)
                    finally:
                        sys.stdout = saved
            else:
                fmt = "chrome-trace" if what == "export" else "csv"
                target = os.path.join(tmp, "out")
                code = main(["export", directory, "--format", fmt, "-o", target])
                out["output_mb"] = round(os.path.getsize(target) / 2**20, 1)
        assert code in (0, 1), code
    else:
        from ddpscope.analysis.snapshot import SnapshotRequest
        from ddpscope.record.reader import find_runs
        from ddpscope.replay.index import RecordingIndex
        from ddpscope.replay.player import ReplayFeed

        world = int((Path(directory) / "complete").read_text().split()[0])
        feed = ReplayFeed(RecordingIndex(find_runs(directory)[-1]))
        feed.start()
        while True:  # the first screen: the run in the header, a row for every rank
            snap = feed.snapshot(SnapshotRequest(series=True))
            if snap.header is not None and len(snap.rows) >= world:
                break
            if time.perf_counter() - began > 600:
                raise SystemExit(f"no first screen: {len(snap.rows)} rows")
            time.sleep(0.01)
        out["first_screen_s"] = round(time.perf_counter() - began, 2)
        out["rss_first_screen_mb"] = round(peak_rss_mb())
        while not feed.index.done:
            time.sleep(0.05)
        out["cached"] = float(feed.index.cached)
        out["index_saved"] = float(feed.index.saved_to is not None)
        out["findings_at_end"] = len(feed.index.findings_at(feed.index.t)[1])
        feed.stop()
    out["seconds"] = round(time.perf_counter() - began, 2)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 2)
    out["peak_rss_mb"] = round(peak_rss_mb())
    return out


def measure(what: str, directory: Path, size_mb: float, no_index: bool = False) -> dict[str, float]:
    child = ["--dir", str(directory), "--child", what]
    if what == "replay_first" or (no_index and what != "replay_cached"):
        for old in directory.rglob(".ddpscope-index"):
            old.unlink()  # a first open has none (and writes it)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.postmortem_scale", *child],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")
    res: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    res["mb_per_s"] = round(size_mb / res["seconds"], 1)
    if what == "compare":
        res["mb_per_s"] = round(2 * size_mb / res["seconds"], 1)  # both sides read
    return res


def repeated(
    what: str, directory: Path, size_mb: float, runs: int, no_index: bool = False
) -> dict[str, object]:
    """``runs`` fresh processes: the median of each figure, and the seconds' range."""
    results = [measure(what, directory, size_mb, no_index) for _ in range(runs)]
    if runs == 1:
        return dict(results[0])
    out: dict[str, object] = {key: statistics.median(r[key] for r in results) for key in results[0]}
    out["runs"] = runs
    out["seconds_range"] = [min(r["seconds"] for r in results), max(r["seconds"] for r in results)]
    out["mb_per_s_range"] = [
        min(r["mb_per_s"] for r in results),
        max(r["mb_per_s"] for r in results),
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", help="where the recording is (written there if missing)")
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--buckets", type=int, default=8)
    ap.add_argument("--only", action="append", choices=WHAT, help="these readers (repeatable)")
    ap.add_argument("--runs", type=int, default=1, help="fresh processes per reader (median)")
    ap.add_argument("--derive", action="store_true", help="write it with write_derived (fast)")
    ap.add_argument(
        "--no-index",
        action="store_true",
        help="remove the index file before each reader (but replay_cached): export as without one",
    )
    ap.add_argument(
        "--sweep",
        type=int,
        nargs="+",
        metavar="STEPS",
        help="each of these step counts (derived recordings), and peak RSS growth per 1,000 steps",
    )
    ap.add_argument("--keep", action="store_true", help="--sweep: keep the recordings")
    ap.add_argument("--child", choices=WHAT, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args.child, args.dir)))
        return
    if args.sweep:
        print(json.dumps(sweep(args), indent=2))
        return
    print(
        json.dumps(
            measure_all(args, Path(args.dir or tempfile.mkdtemp(prefix="ddpscope-pm-"))), indent=2
        )
    )


def sweep(args: argparse.Namespace) -> dict[str, object]:
    """``measure_all`` at each of ``args.sweep`` steps, then each reader's growth."""
    import shutil

    base = Path(args.dir or tempfile.mkdtemp(prefix="ddpscope-pm-sweep-"))
    args.derive = True  # 1,024 x 4,000 simulated would take most of an hour to write
    runs: dict[int, dict[str, object]] = {}
    for steps in sorted(args.sweep):
        args.steps = steps
        directory = base / str(steps)
        directory.mkdir(parents=True, exist_ok=True)
        try:
            runs[steps] = measure_all(args, directory)
        finally:
            if not args.keep:
                shutil.rmtree(directory, ignore_errors=True)
        print(steps, json.dumps(runs[steps]), file=sys.stderr, flush=True)
    low, high = min(runs), max(runs)
    growth: dict[str, float] = {}
    for what in args.only or WHAT:
        a, b = runs[low][what], runs[high][what]
        assert isinstance(a, dict) and isinstance(b, dict)
        if high > low:
            per = (b["peak_rss_mb"] - a["peak_rss_mb"]) * 1000 / (high - low)
            growth[what] = round(per, 1)
    return {"runs": runs, "peak_rss_mb_per_1000_steps": growth}


def measure_all(args: argparse.Namespace, directory: Path) -> dict[str, object]:
    """The recording of ``args`` in ``directory`` (written unless there), every reader."""
    from benchmarks.replay_open import write_derived, write_recording

    out: dict[str, object] = {"world": args.world, "steps": args.steps, "buckets": args.buckets}
    stamp = directory / "complete"
    want = f"{args.world} {args.steps} {args.buckets}{' derived' if args.derive else ''}\n"
    if not stamp.exists() or stamp.read_text() != want:
        for old in directory.rglob("*.ddps"):
            old.unlink()
        began = time.perf_counter()
        write = write_derived if args.derive else write_recording
        write(directory, args.world, args.steps, args.buckets)
        stamp.write_text(want)
        out["write_s"] = round(time.perf_counter() - began, 1)
    size_mb = sum(p.stat().st_size for p in directory.rglob("*.ddps")) / 2**20
    out["recording_mb"] = round(size_mb)
    for what in args.only or WHAT:
        out[what] = repeated(what, directory, size_mb, args.runs, args.no_index)
        print(what, json.dumps(out[what]), file=sys.stderr, flush=True)
    out["dir"] = str(directory)
    out["cpu_count"] = os.cpu_count()
    return out


if __name__ == "__main__":
    main()
