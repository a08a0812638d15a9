"""``ddpscope compare DIR_A [DIR_B]``: two recorded runs side by side, with an exit code for CI.

Thin on purpose: reading, figures and rendering live in
:mod:`ddpscope.analysis.compare` (imported inside ``run`` so that building
the parser stays fast). docs/compare.md documents the output.
"""

from __future__ import annotations

import argparse
import json
import sys

from ddpscope.cli.common import EXIT_UNREADABLE, describe_error, positive_seconds

#: Exit status when a --fail-on-* gate is given and tripped.
EXIT_REGRESSION = 1

#: Keep in step with ddpscope.analysis.compare.METRIC_KEYS (not imported: it pulls
#: in the analysis code, and the parser is built for every subcommand).
METRIC_CHOICES = (
    "step", "data", "forward", "backward", "comm_wait", "sync_wait", "coll_wait", "optimizer",
    "other", "allreduce_wait", "bucket_allreduce", "throughput", "spread",
)  # fmt: skip


def _percent(text: str) -> float:
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


class CompareCommand:
    name = "compare"
    help = "compare two recorded runs: step time and split, all-reduce wait, findings"
    description = (
        "Read two recorded runs as `ddpscope report` does and print them side by side: median "
        "step time and its split, all-reduce wait, bucket all-reduce time, throughput, the "
        "spread between ranks, the setup of each run, and which kinds of findings appear only "
        "in A, only in B, or in both. Deltas are B against A. With two directories, each "
        "side is the newest run in its directory unless --run-a/--run-b name another; with "
        "one directory, B is its newest run and A the run before it. Runs that do different "
        "work per step (world size, model, batch) are compared anyway, with a warning."
    )
    epilog = """\
examples:
  ddpscope compare baseline/ candidate/
  ddpscope compare runs/                                # the two newest runs in runs/
  ddpscope compare runs/ runs/ --run-a ID1 --run-b ID2
  ddpscope compare base/ new/ --fail-on-regression 10   # CI: B's step time 10% worse fails
  ddpscope compare base/ new/ --fail-on-regression 5 --metric step --metric allreduce_wait
  ddpscope compare base/ new/ --fail-on-new error       # CI: a new error-level finding fails
  ddpscope compare base/ new/ --json > compare.json

exit status:
  0  comparison printed (and no gate given, or every gate passed)
  1  --fail-on-regression: a --metric of B is worse than A's by more than PCT percent;
     or --fail-on-new: B has a finding kind at that level that A does not have
  2  bad arguments
  3  a directory missing, holding no ddpscope recording or only unreadable files, no
     second run to compare with, or a gated metric that one side has no value for
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("dir_a", metavar="DIR_A", help="baseline: record or run directory")
        parser.add_argument(
            "dir_b",
            metavar="DIR_B",
            nargs="?",
            help="candidate (default: DIR_A again, comparing its two newest runs)",
        )
        parser.add_argument("--run-a", metavar="ID", help="run id in DIR_A (default: newest)")
        parser.add_argument("--run-b", metavar="ID", help="run id in DIR_B (default: newest)")
        parser.add_argument(
            "--json", action="store_true", help="print one JSON object (docs/compare.md)"
        )
        parser.add_argument(
            "--fail-on-regression",
            metavar="PCT",
            type=_percent,
            help="exit 1 when B is worse than A by more than PCT percent on a --metric",
        )
        parser.add_argument(
            "--metric",
            action="append",
            choices=METRIC_CHOICES,
            metavar="NAME",
            help="metric checked by --fail-on-regression, repeatable (default: step): "
            + ", ".join(METRIC_CHOICES),
        )
        parser.add_argument(
            "--fail-on-new",
            choices=["warning", "error"],
            help="exit 1 when B has a finding kind at this level or above that A has not",
        )
        parser.add_argument(
            "--hang-after",
            metavar="S",
            type=positive_seconds,
            help="seconds without progress that make a hang (as in `ddpscope report`)",
        )

    def run(self, args: argparse.Namespace) -> int:
        from ddpscope.analysis import compare, compare_text
        from ddpscope.record.reader import RecordError

        if args.metric and args.fail_on_regression is None:
            print("ddpscope compare: --metric needs --fail-on-regression PCT", file=sys.stderr)
            return 2
        metrics = tuple(dict.fromkeys(args.metric or ["step"]))
        try:
            (dir_a, run_a), (dir_b, run_b) = compare.pick(
                args.dir_a, args.dir_b, args.run_a, args.run_b
            )
            a = compare.load(dir_a, run_a, args.hang_after)
            b = compare.load(dir_b, run_b, args.hang_after)
        except (RecordError, OSError) as exc:
            print(f"ddpscope compare: {describe_error(exc)}", file=sys.stderr)
            return EXIT_UNREADABLE
        doc = compare.build(a, b, args.fail_on_regression, metrics, args.fail_on_new)
        if args.json:
            sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
        else:
            sys.stdout.write(compare_text.render_text(doc))
        sys.stdout.flush()
        verdict = doc["verdict"]
        if verdict is None:
            return 0
        if verdict["unknown"]:
            print(
                "ddpscope compare: cannot check "
                + ", ".join(verdict["unknown"])
                + ": no value on one side (no completed step after warm-up, or a single rank)",
                file=sys.stderr,
            )
            return EXIT_UNREADABLE
        return EXIT_REGRESSION if verdict["result"] == "fail" else 0
