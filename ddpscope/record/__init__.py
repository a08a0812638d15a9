"""Recording a run to disk, and reading it back.

Layout: ``DIR/<run_id>/rank-00000-<pid>.ddps``, one append-only file per rank
process. See docs/record-format.md.
"""

from ddpscope.record.format import FORMAT_VERSION, MAGIC, RecordError
from ddpscope.record.reader import RankFile, Recording, RunDir, find_runs, open_run

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "RankFile",
    "RecordError",
    "Recording",
    "RunDir",
    "find_runs",
    "open_run",
]
