"""``ddpscope export`` as its own process: on a real 2-rank torchrun job, and without torch.

(Exported recordings written with RecordWriter, checked event by event and row
by row: tests/unit/test_export.py, whose readers of a trace these tests share.)
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from ddpscope.record.reader import open_run
from ddpscope.schema import Heartbeat, RunInfo, Step
from tests.support.synth import MS
from tests.support.torchrun import DEMO, ROOT, job_env, torchrun
from tests.unit.test_export import assert_nested, events, healthy, thread_names, us, write_run


def test_export_never_imports_torch_or_textual(tmp_path: Path) -> None:
    run = write_run(tmp_path, healthy(steps=3))
    code = (
        "import sys\nfrom ddpscope.cli.main import main\n"
        f"assert main(['export', {str(run)!r}, '--format', 'chrome-trace', '-o', "
        f"{str(tmp_path / 't.json')!r}]) == 0\n"
        "bad = [m for m in ('torch', 'textual') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=job_env(), capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.torchrun
def test_export_of_a_real_two_rank_job_matches_its_recording(tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    torchrun(
        [str(DEMO), "--samples", "256", "--epochs", "2"],
        # Every bucket timed, so the trace has all-reduce spans on every step.
        env=job_env(
            DDPSCOPE_RECORD=str(rec),
            DDPSCOPE_ENDPOINT=f"ipc://{tmp_path}/s.sock",
            DDPSCOPE_BUCKET_EVERY="1",
        ),
    )
    trace, table = tmp_path / "run.json", tmp_path / "steps.csv"
    for fmt, out in (("chrome-trace", trace), ("csv", table)):
        proc = subprocess.run(
            [sys.executable, "-m", "ddpscope", "export", str(rec), "--format", fmt, "-o", str(out)],
            env=job_env(), capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    recording = open_run(str(rec))
    steps = [m for ms in recording.messages.values() for m in ms if isinstance(m, Step)]
    assert sorted(Counter(s.rank for s in steps).values()) == [8, 8]
    doc = json.loads(trace.read_text())
    assert_nested(doc)
    assert len(events(doc, "X", "step")) == len(steps)
    assert len(events(doc, "X", "allreduce")) == sum(len(s.b_index) for s in steps) > 0
    beats = [m for ms in recording.messages.values() for m in ms if isinstance(m, Heartbeat)]
    assert 0 < len(events(doc, "C")) <= 2 * len(beats)
    # Steps sit where each rank's run_info anchor puts them.
    base = doc["otherData"]["base_wall_ns"]
    offset = {
        r: next(m.wall_ns - m.mono_ns for m in ms if isinstance(m, RunInfo))
        for r, ms in recording.messages.items()
    }
    names = thread_names(doc)
    trace_steps = {
        (int(names[e["pid"], e["tid"]].split()[1]), e["args"]["step"]): e
        for e in events(doc, "X", "step")
    }
    for s in steps:
        e = trace_steps[s.rank, s.step]
        assert e["ts"] == pytest.approx(us(s.t_start + offset[s.rank] - base), abs=1e-3)
    # Aligned clocks agree with physics: an all-reduce of a bucket completes on
    # every rank only after the last rank launched it.
    spans: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events(doc, "X", "allreduce"):
        if e["args"].get("completed", True):
            spans[e["args"]["step"], e["args"]["bucket"]].append((e["ts"], e["ts"] + e["dur"]))
    pairs = [v for v in spans.values() if len(v) == 2]
    assert pairs
    for v in pairs:
        assert min(end for _, end in v) >= max(begin for begin, _ in v) - 1000  # 1 ms slack
    rows = list(csv.DictReader(table.open(newline="")))
    assert len(rows) == len(steps)
    by_key = {(s.rank, s.step): s for s in steps}
    for row in rows:
        s = by_key[int(row["rank"]), int(row["step"])]
        assert float(row["step_ms"]) == pytest.approx((s.t_end - s.t_start) / MS)
        assert int(row["buckets"]) == len(s.b_index)
