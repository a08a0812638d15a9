"""A checkpoint on slow storage, on a real 2-rank torchrun job (gloo, CPU).

Rank 0 is put in a cgroup v1 blkio group that lets it write 512 KiB/s to
the disk under the checkpoint, so DCP's fsync of its ~4 MB shard blocks
for seconds in a real system call on a real file, as on a network file
system, while rank 1 waits in DCP's collectives. A healthy job: nothing
may be raised, and the waiting must be seen as the file it is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpscope.analysis.sources import analyze_recording
from ddpscope.record.reader import open_run
from ddpscope.schema import Heartbeat
from tests.support.torchrun import ROOT, job_env, torchrun

pytestmark = pytest.mark.torchrun

JOB = ROOT / "tests" / "jobs" / "slow_storage_job.py"
BLKIO = Path("/sys/fs/cgroup/blkio")
RATE = 512 * 1024  # bytes/s


def _disk(path: Path) -> str:
    """``major:minor`` of the whole disk under ``path`` (blkio throttles disks, not partitions)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dev = Path("/sys/dev/block") / dev
    if (sys_dev / "partition").exists():
        return (sys_dev.resolve().parent / "dev").read_text().strip()
    return dev


@pytest.fixture
def throttled(tmp_path: Path) -> Iterator[Path]:
    """A blkio cgroup writing at RATE to the disk under tmp_path."""
    group = BLKIO / f"ddpscope-test-{os.getpid()}-{tmp_path.name}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a blkio cgroup here (cgroup v1 and root needed): {exc}")
    try:
        (group / "blkio.throttle.write_bps_device").write_text(f"{_disk(tmp_path)} {RATE}\n")
        yield group
    except OSError as exc:
        pytest.skip(f"cannot throttle the disk under {tmp_path}: {exc}")
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (BLKIO / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        group.rmdir()


def test_a_checkpoint_flushed_for_seconds_to_slow_storage_is_no_hang(
    tmp_path: Path, endpoint: str, throttled: Path
) -> None:
    rec = tmp_path / "rec"
    ckpt = tmp_path / "ckpt"
    proc = torchrun(
        [str(JOB), "--checkpoint", str(ckpt), "--throttle", str(throttled)],
        env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint),
    )
    assert proc.stdout.count("done:") == 2, proc.stdout[-2000:]
    # The save really was slow: longer than the hang limit these ~10 ms steps give (5 s).
    saves = [float(s) for s in re.findall(r"rank 0 saved step \d+ in ([\d.]+) s", proc.stdout)]
    assert len(saves) == 2 and min(saves) > 6, proc.stdout
    beats = [m for m in open_run(str(rec)).messages[0] if isinstance(m, Heartbeat)]
    flushing = {(m.io_op, Path(m.io_path).parent.parent) for m in beats if m.io_op}
    assert ("sync", ckpt) in flushing, flushing
    analysis, recording = analyze_recording(str(rec))
    assert recording.problems == [] and analysis.detector_errors == {}
    run = analysis.latest
    assert run is not None
    found = analysis.book(run).sorted()
    said = [f"{f.kind} {f.severity}: {f.message}" for f in found]
    assert not [f for f in found if f.kind == "hang" or f.severity != "info"], said
