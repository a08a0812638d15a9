"""``ddpscope export DIR --format chrome-trace|csv``: a recorded run for other tools.

Picks the run as ``ddpscope report`` does and says the same things about the
input: unreadable input is exit 3 with the path on stderr, damage inside a
file it could read (a torn tail) is a note on stderr and the rest is
exported. The formats live in :mod:`ddpscope.export` (imported inside
``run``); docs/export.md documents them.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, TextIO

from ddpscope.cli.common import EXIT_UNREADABLE, describe_error

if TYPE_CHECKING:  # the real imports wait for run(): building the parser stays fast
    from ddpscope.analysis.engine import Analysis
    from ddpscope.analysis.findings import Finding
    from ddpscope.export import Readable, Timeline
    from ddpscope.export.spooled import SpooledSteps

#: Exit status when the output file cannot be written.
EXIT_UNWRITABLE = 1

FORMATS = ("chrome-trace", "csv")


class ExportCommand:
    name = "export"
    help = "write a recorded run as a Chrome trace (Perfetto) or a CSV table"
    description = (
        "Write the recording in DIR (as given to `ddpscope run --record` or DDPSCOPE_RECORD; "
        "a run directory works too) for other tools: --format chrome-trace for "
        "ui.perfetto.dev or chrome://tracing (steps, phases and bucket all-reduces per rank, "
        "CPU and memory counters, findings, every rank on one clock), --format csv for "
        "pandas (one row per rank per step). The newest run is exported unless --run names "
        "another. Problems with the recording (a torn tail) are noted on stderr."
    )
    epilog = """\
examples:
  ddpscope export runs/ --format chrome-trace -o run.json   # open it in ui.perfetto.dev
  ddpscope export runs/ --format csv -o steps.csv
  ddpscope export runs/ --format csv | head                  # CSV to stdout

exit status:
  0  written (notes about the recording, if any, on stderr)
  1  the output file cannot be written
  2  bad arguments
  3  DIR missing, holding no ddpscope recording, or only unreadable files
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("dir", metavar="DIR", help="record directory or run directory")
        parser.add_argument(
            "--format", required=True, choices=FORMATS, help="what to write (docs/export.md)"
        )
        parser.add_argument(
            "-o",
            "--output",
            metavar="FILE",
            default="-",
            help="file to write (default: stdout, also with -)",
        )
        parser.add_argument("--run", metavar="ID", help="run id (default: the newest run)")
        parser.add_argument(
            "--no-findings",
            action="store_true",
            help="chrome-trace: skip the analysis (faster; no finding events)",
        )

    def run(self, args: argparse.Namespace) -> int:
        from ddpscope.analysis import report
        from ddpscope.record.collect import reading_recording
        from ddpscope.record.reader import RecordError, choose_run, find_runs
        from ddpscope.record.stream import LazyRecording

        findings: list[Finding] = []
        analysis = None
        summary = None
        try:
            if args.format == "chrome-trace" and not args.no_findings:
                analysis, summary, runs = report.analyze(args.dir, args.run)
                findings = _findings(analysis, summary.run.run_id)
                run = summary.run
            else:
                runs = find_runs(args.dir)
                run = choose_run(args.dir, args.run)
            # Read rank by rank as it is written out: never the whole run in memory.
            recording = LazyRecording(run)
        except (RecordError, OSError) as exc:
            _say(describe_error(exc))
            return EXIT_UNREADABLE
        if len(runs) > 1 and args.run is None:
            _say(
                f"{args.dir} holds {len(runs)} runs; exporting the newest, "
                f"{recording.run.run_id}; --run ID for another"
            )
        from ddpscope.export import Timeline
        from ddpscope.export.indexed import indexed

        # The analysis' pass, or a current index file, gives what the timeline needs;
        # otherwise it reads every file once (and their problems are known).
        scans = summary.stream.earliest() if summary is not None else None
        kinds = frozenset(("step",) if args.format == "csv" else ("step", "heartbeat"))
        fast = indexed(run, kinds)
        spooled = None
        if fast is not None:
            recording = fast
            scans = scans if scans is not None else fast.scans()
        elif args.format == "csv":
            from ddpscope.export.spooled import SpooledSteps

            # One read of every file instead of two (the timeline's, then the rows').
            try:
                with reading_recording():
                    spooled = SpooledSteps(recording)
            except OSError as exc:
                _say(describe_error(exc))
                return EXIT_UNREADABLE
            scans = spooled.scans
        timeline = Timeline(recording, scans)
        for problem in (
            report.problems(summary if summary is not None else recording, analysis)
            + timeline.notes
        ):
            _say(f"note: {problem}")
        try:
            with reading_recording():
                written = _write(args, recording, findings, timeline, spooled)
        except BrokenPipeError:
            raise  # `| head`: main() treats the reader going away as success
        except OSError as exc:
            _say(f"cannot write {args.output}: {exc.strerror or exc}")
            return EXIT_UNWRITABLE
        finally:
            if spooled is not None:
                spooled.close()
        if args.output != "-":
            _say(f"run {recording.run.run_id}: wrote {written} to {args.output}")
        return 0


def _findings(analysis: Analysis, run_id: str) -> list[Finding]:
    book = analysis.books.get(run_id)
    if book is None and analysis.books:
        # The files' run id differs from the messages' (a renamed directory):
        # the busiest run of the analysis is this one.
        busiest = max(analysis.runs.values(), key=lambda r: r.received)
        book = analysis.books[busiest.run_id]
    # Oldest first, the order they were raised in.
    return sorted(book, key=lambda f: f.serial) if book is not None else []


def _write(
    args: argparse.Namespace,
    recording: Readable,
    findings: list[Finding],
    timeline: Timeline,
    spooled: SpooledSteps | None = None,
) -> str:
    if args.output == "-":
        return _emit(args.format, recording, findings, timeline, sys.stdout, spooled)
    if os.path.exists(args.output) and not os.path.isfile(args.output):
        # A pipe or a device (/dev/stdout): written in place, never replaced.
        with open(args.output, "w", encoding="utf-8", newline="") as out:
            return _emit(args.format, recording, findings, timeline, out, spooled)
    # Written aside and renamed, so that a failed export never leaves half a file
    # where a previous good one was.
    partial = f"{args.output}.partial-{os.getpid()}"
    try:
        with open(partial, "w", encoding="utf-8", newline="") as out:
            written = _emit(args.format, recording, findings, timeline, out, spooled)
        os.replace(partial, args.output)
    except BaseException:
        try:
            os.unlink(partial)
        except OSError:
            pass
        raise
    return written


def _emit(
    fmt: str,
    recording: Readable,
    findings: list[Finding],
    timeline: Timeline,
    out: TextIO,
    spooled: SpooledSteps | None = None,
) -> str:
    if fmt == "csv":
        from ddpscope.export.table import write_csv

        n = write_csv(recording, out, timeline, spooled.figures if spooled else None)
        return f"{n} rows"
    from ddpscope.export.chrome import write_chrome_trace

    stats = write_chrome_trace(recording, out, findings, timeline)
    return (
        f"{stats.events} events ({stats.steps} steps, {stats.buckets} bucket all-reduces, "
        f"{stats.findings} findings)"
    )


def _say(text: str) -> None:
    print(f"ddpscope export: {text}", file=sys.stderr)
