"""``ddpscope report DIR``: diagnose a recorded run, as text or JSON, with an exit code for CI.

Thin on purpose: reading, analysis and rendering live in
:mod:`ddpscope.analysis.report` (imported inside ``run`` so that building the
parser stays fast). docs/report.md documents the output.
"""

from __future__ import annotations

import argparse
import json
import sys

from ddpscope.cli.common import EXIT_UNREADABLE, describe_error, positive_seconds

#: Exit status when --fail-on is given and a finding at that level exists.
EXIT_FINDINGS = 1


class ReportCommand:
    name = "report"
    help = "diagnose a recorded run: per-rank table and findings (text or --json)"
    description = (
        "Replay the recording in DIR (as given to `ddpscope run --record` or DDPSCOPE_RECORD; a "
        "run directory works too) through every detector and print what they found, most "
        "severe first, after a per-rank table of step times. The newest run is reported unless "
        "--run names another; the others are listed. A run still being written (a live or "
        "hung job) is read as far as it goes."
    )
    epilog = """\
examples:
  ddpscope report runs/
  ddpscope report runs/ --json > report.json
  ddpscope report runs/ --fail-on warning       # in CI: fail the job on any warning
  ddpscope report runs/ --hang-after 30         # call a stall of 30 s a hang

exit status:
  0  report printed (and, with --fail-on, nothing at that level or above)
  1  --fail-on LEVEL given and a finding at LEVEL or above exists
  2  bad arguments
  3  DIR missing, holding no ddpscope recording, or only unreadable files
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("dir", metavar="DIR", help="record directory or run directory")
        parser.add_argument("--run", metavar="ID", help="run id (default: the newest run)")
        parser.add_argument(
            "--json", action="store_true", help="print one JSON object (docs/report.md)"
        )
        parser.add_argument(
            "--fail-on",
            choices=["warning", "error"],
            help="exit 1 when a finding at this level or above exists",
        )
        parser.add_argument(
            "--hang-after",
            metavar="S",
            type=positive_seconds,
            help="seconds without progress that make a hang (default: from step times, "
            "at least 5 s)",
        )

    def run(self, args: argparse.Namespace) -> int:
        from ddpscope.analysis import report, report_text
        from ddpscope.record.reader import RecordError

        try:
            analysis, recording, runs = report.analyze(
                args.dir, args.run, hang_after_s=args.hang_after
            )
        except (RecordError, OSError) as exc:
            print(f"ddpscope report: {describe_error(exc)}", file=sys.stderr)
            return EXIT_UNREADABLE
        result = report.build(analysis, recording, runs)
        if args.json:
            if result["other_runs"]:
                print(
                    f"ddpscope report: {args.dir} holds {len(runs)} runs; reporting "
                    f"{result['run']['id']} ({result['run']['selected']}); --run ID for another",
                    file=sys.stderr,
                )
            sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")
        else:
            sys.stdout.write(report_text.render_text(result))
        sys.stdout.flush()
        if args.fail_on and report.fails(result, args.fail_on):
            return EXIT_FINDINGS
        return 0
