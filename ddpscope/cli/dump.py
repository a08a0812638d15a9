"""``ddpscope dump DIR``: print what a recording holds, for debugging and tests.

By default a short summary per rank (messages per kind, steps, how the rank
ended, problems such as a torn tail); with ``--json`` one JSON object per
message, the same fields as on the wire (``k`` is the kind). Reads through
:mod:`ddpscope.record.reader`, so it sees exactly what report and replay see.

Exit status: 0 when everything could be read (a truncated tail is a finding,
not a failure: a killed rank leaves one); 3 when DIR, a file in it or the
asked-for run or rank cannot be read; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from ddpscope.cli.common import EXIT_UNREADABLE, describe_error
from ddpscope.record.reader import RankFile, RecordError, Recording, RunDir, open_run
from ddpscope.schema import MESSAGE_TYPES, End, Message, Step


def load(path: str, run_id: str | None) -> Recording:
    """A recording from a record directory, a run directory or one rank file."""
    if os.path.isfile(path):
        if run_id is not None:
            raise RecordError(f"{path}: --run applies to a directory, not to one rank file")
        rf = RankFile(path)
        messages = list(rf.messages())
        messages.sort(key=lambda m: m.seq)
        run = RunDir(path=os.path.dirname(path), run_id=rf.run_id, files=[rf])
        return Recording(run=run, messages={rf.rank: messages}, problems=list(rf.problems))
    return open_run(path, run_id)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    return repr(value)


def message_json(msg: Message) -> str:
    return json.dumps({"k": msg.KIND, **dataclasses.asdict(msg)}, default=_jsonable)


def selected(rec: Recording, rank: int | None, kind: str | None) -> Iterator[Message]:
    for r in sorted(rec.messages):
        if rank is not None and r != rank:
            continue
        for msg in rec.messages[r]:
            if kind is None or kind == msg.KIND:
                yield msg


def _ranks_text(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in ranks) or "none"


def summary(rec: Recording, rank: int | None, kind: str | None, out: TextIO) -> None:
    run = rec.run
    world: set[int] = set()
    for f in run.files:
        size = f.header.get("world_size")
        if isinstance(size, int):
            world.add(size)
    world_text = f" of world size {'/'.join(str(w) for w in sorted(world))}" if world else ""
    print(f"run {run.run_id}  {run.path}", file=out)
    print(f"  ranks {_ranks_text(run.ranks)}{world_text}", file=out)
    files_of: dict[int, list[RankFile]] = collections.defaultdict(list)
    for f in run.files:
        files_of[f.rank].append(f)
    for r in sorted(rec.messages):
        if rank is not None and r != rank:
            continue
        msgs = [m for m in rec.messages[r] if kind is None or kind == m.KIND]
        _rank_summary(r, files_of[r], msgs, out)
    if rec.problems:
        print("problems:", file=out)
        for problem in rec.problems:
            print(f"  - {problem}", file=out)


def _rank_summary(rank: int, files: list[RankFile], msgs: list[Message], out: TextIO) -> None:
    hosts = sorted({str(f.header.get("host", "?")) for f in files})
    pids = [str(f.header.get("pid", "?")) for f in files]
    names = ", ".join(os.path.basename(f.path) for f in files)
    print(f"rank {rank}: host {', '.join(hosts)}, pid {', '.join(pids)} ({names})", file=out)
    counts = collections.Counter(m.KIND for m in msgs)
    # Schema order, so two dumps line up when diffed.
    per_kind = ", ".join(f"{k} {counts[k]}" for k in MESSAGE_TYPES if counts[k])
    print(f"  messages {len(msgs)}: {per_kind or '-'}", file=out)
    steps = [m.step for m in msgs if isinstance(m, Step)]
    if steps:
        print(f"  steps {len(steps)} (first {min(steps)}, last {max(steps)})", file=out)
    ends = [m for m in msgs if isinstance(m, End)]
    if ends:
        end = ends[-1]
        error = f": {end.error.strip().splitlines()[-1]}" if end.error.strip() else ""
        print(f"  ended: {end.reason} at step {end.step}{error}", file=out)


class DumpCommand:
    name = "dump"
    help = "print a recording: a per-rank summary, or every message as JSON"
    description = (
        "Print the recording in DIR (as given to `ddpscope run --record` or "
        "DDPSCOPE_RECORD; a run directory or a single rank file also work). The newest "
        "run is shown unless --run names another."
    )
    epilog = """\
exit status:
  0  read in full (truncated tails are listed as problems, not failures)
  2  bad arguments
  3  unreadable or foreign input, or no such run or rank
"""

    def __init__(self) -> None:
        self._parser: argparse.ArgumentParser | None = None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        self._parser = parser
        parser.add_argument("dir", metavar="DIR", help="record directory, run directory or file")
        parser.add_argument("--run", metavar="ID", help="run id (default: the newest run)")
        parser.add_argument("--rank", metavar="R", type=int, help="only this rank")
        parser.add_argument(
            "--kind",
            metavar="KIND",
            help=f"only messages of this kind ({', '.join(MESSAGE_TYPES)})",
        )
        parser.add_argument("--json", action="store_true", help="print one JSON object per message")

    def run(self, args: argparse.Namespace) -> int:
        if args.kind is not None and args.kind not in MESSAGE_TYPES:
            if self._parser is not None:
                self._parser.print_usage(sys.stderr)
            kinds = ", ".join(MESSAGE_TYPES)
            print(
                f"ddpscope dump: error: unknown kind {args.kind!r} (kinds: {kinds})",
                file=sys.stderr,
            )
            return 2
        try:
            rec = load(args.dir, args.run)
        except (RecordError, OSError) as exc:
            print(f"ddpscope dump: {describe_error(exc)}", file=sys.stderr)
            return EXIT_UNREADABLE
        if args.rank is not None and args.rank not in rec.messages:
            print(
                f"ddpscope dump: {rec.run.path}: no rank {args.rank} in run {rec.run.run_id} "
                f"(ranks: {_ranks_text(sorted(rec.messages))})",
                file=sys.stderr,
            )
            return EXIT_UNREADABLE
        out = sys.stdout
        if args.json:
            for msg in selected(rec, args.rank, args.kind):
                out.write(message_json(msg) + "\n")
            for problem in rec.problems:
                print(f"ddpscope dump: {problem}", file=sys.stderr)
        else:
            summary(rec, args.rank, args.kind, out)
        out.flush()
        # Files that could not be opened at all: say so in the status too.
        return EXIT_UNREADABLE if rec.run.problems else 0
