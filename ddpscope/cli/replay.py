"""``ddpscope replay DIR``: a recorded run in the watch UI, with play, seek and jump keys.

Reading, indexing and playing live in :mod:`ddpscope.replay` and the UI in
:mod:`ddpscope.ui.replay`, both imported inside ``run`` so that building the
parser stays fast. docs/replay.md describes the keys and what a replay shows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ddpscope.cli.common import EXIT_UNREADABLE, positive_seconds

#: A run whose files changed this recently, without an end from every rank, is
#: taken to be still running and is followed.
FRESH_S = 10.0


class ReplayCommand:
    name = "replay"
    help = "play a recorded run back in the watch UI (seek, jump to findings)"
    description = (
        "Open the recording in DIR (as given to `ddpscope run --record` or DDPSCOPE_RECORD; a run "
        "directory works too) in the same UI as `ddpscope watch`, fed from the files: play at 1x "
        "to 64x or as fast as it reads, step, jump to a step, to the next finding, to the end. "
        "The findings are the ones live detectors raised, at the moment they raised them. The "
        "newest run is opened unless --run names another (--list shows them). Truncated, "
        "missing or foreign rank files are named in the health line and read around."
    )
    epilog = """\
examples:
  ddpscope replay runs/                 # the newest run
  ddpscope replay runs/ --list          # the runs there
  ddpscope replay runs/ --run 20261130-101500-ab12cd34 --at 500
  ddpscope replay runs/ --follow        # a run still being written: follow its end

exit status:
  0  the UI was closed (or --list printed the runs)
  1  more rank files than the open-file limit allows (the message says how to raise it)
  2  bad arguments, or no terminal to draw on
  3  DIR missing, holding no ddpscope recording, or only unreadable files
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("dir", metavar="DIR", help="record directory or run directory")
        parser.add_argument("--run", metavar="ID", help="run id (default: the newest run)")
        parser.add_argument("--list", action="store_true", help="list the runs in DIR and exit")
        parser.add_argument("--at", metavar="STEP", type=int, help="open at this step")
        parser.add_argument(
            "--hang-after",
            metavar="S",
            type=positive_seconds,
            help="seconds without progress that make a hang, as for `ddpscope report` "
            "(default: from step times, at least 5 s)",
        )
        follow = parser.add_mutually_exclusive_group()
        follow.add_argument(
            "--follow",
            action="store_true",
            default=None,
            help="keep reading as the files grow (default: when the run looks unfinished)",
        )
        follow.add_argument("--no-follow", dest="follow", action="store_false")

    def run(self, args: argparse.Namespace) -> int:
        from ddpscope.record import RecordError
        from ddpscope.record.reader import choose_run, find_runs

        try:
            if args.list:
                for r in find_runs(args.dir):
                    ranks = ", ".join(map(str, r.ranks)) or "none readable"
                    print(f"{r.run_id}  {len(r.files)} file(s), ranks {ranks}  {r.path}")
                    for p in r.problems:
                        print(f"    {p}")
                return 0
            chosen = choose_run(args.dir, args.run)
        except RecordError as exc:
            print(f"ddpscope replay: {exc}", file=sys.stderr)
            return EXIT_UNREADABLE
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            print(
                "ddpscope replay: needs a terminal; for text use `ddpscope report` or "
                "`ddpscope dump`",
                file=sys.stderr,
            )
            return 2
        follow = looks_unfinished(chosen) if args.follow is None else args.follow
        return play(chosen, follow, args.at, args.hang_after)


def looks_unfinished(run: object) -> bool:
    """Files touched in the last FRESH_S seconds: the job is probably still writing."""
    from ddpscope.record.reader import RunDir

    assert isinstance(run, RunDir)
    newest = 0.0
    for rf in run.files:
        try:
            newest = max(newest, os.path.getmtime(rf.path))
        except OSError:
            pass
    return time.time() - newest < FRESH_S


def play(run: object, follow: bool, at_step: int | None, hang_after_s: float | None = None) -> int:
    from ddpscope.cli.lifeline import Lifeline
    from ddpscope.cli.watch import run_app, terminal_fd
    from ddpscope.record.fdlimit import ensure_open_files
    from ddpscope.record.reader import RunDir
    from ddpscope.replay.index import RecordingIndex
    from ddpscope.replay.player import ReplayFeed
    from ddpscope.ui.replay import ReplayApp

    assert isinstance(run, RunDir)
    try:
        # Before the UI takes the terminal: said there, the reason would be lost.
        ensure_open_files(2 * len(run.files))
    except OSError as exc:
        print(f"ddpscope replay: {exc.strerror}", file=sys.stderr)
        return 1
    log = os.path.join(run.path, "job.log")  # where `ddpscope run` keeps the job's output
    feed = ReplayFeed(RecordingIndex(run, follow=follow, hang_after_s=hang_after_s))
    with feed, Lifeline(terminal_fd=terminal_fd()) as lifeline:
        if at_step is not None:
            feed.seek_step(at_step)
        run_app(ReplayApp(feed, log_path=log if os.path.exists(log) else None), lifeline)
        problems = list(feed.index.problems)
    for p in problems:
        print(f"ddpscope replay: {p}", file=sys.stderr)
    return lifeline.exit_status() if lifeline.stopping else 0
