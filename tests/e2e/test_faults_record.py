"""Recording under faults: a disk that fills up mid-run, a record directory
that cannot be written at start, a writer killed mid-stream. Training goes
on, live telemetry too; a file that stopped stays readable up to its last
whole record.

The full disk is real: a tmpfs of a few pages, mounted for the test (needs
root, as CI runs; skipped with the reason otherwise).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpscope.record import open_run
from ddpscope.record.reader import RankFile
from ddpscope.record.writer import RecordWriter
from ddpscope.schema import Step
from ddpscope.transport.subscriber import Subscriber
from tests.support.faults import DDPSCOPE, read_back, torchrun_demo
from tests.support.torchrun import ROOT, job_env, teardown_abort_only


def _mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode})")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real filesystem of 64 KiB, full after a few dozen records."""
    where = tmp_path / "small"
    _mount_tmpfs(where, "size=64k")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def read_only_fs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "ro"
    _mount_tmpfs(where, "ro,size=64k")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_leaves_the_file_ending_on_a_whole_record(small_fs: Path) -> None:
    writer = RecordWriter(str(small_fs), "full", 0, {"run_id": "full", "rank": 0})
    payload = os.urandom(1000)  # pages are 4096 bytes: most records straddle two
    written = 0
    with pytest.raises(OSError) as failed:
        for _ in range(1000):
            writer.append(payload)
            written += 1
    assert failed.value.errno == errno.ENOSPC
    writer.close()
    rf = RankFile(writer.path)
    assert list(rf.records()) == [payload] * written
    assert rf.problems == []  # no torn record at the tail


def _collect(endpoint: str, stop: threading.Event, steps: Counter[int]) -> threading.Thread:
    sub = Subscriber(endpoint)

    def run() -> None:
        with sub:
            while not stop.is_set():
                msg = sub.recv(100)
                if isinstance(msg, Step):
                    steps[msg.rank] += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _job(record: Path, endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = job_env(DDPSCOPE_RECORD=str(record), DDPSCOPE_ENDPOINT=endpoint)
    return subprocess.run(
        torchrun_demo(*args), env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )


@pytest.mark.torchrun
def test_a_disk_full_mid_run_stops_recording_with_one_warning_and_training_goes_on(
    small_fs: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/w.sock"
    live: Counter[int] = Counter()
    stop = threading.Event()
    listener = _collect(endpoint, stop, live)
    try:
        proc = _job(small_fs, endpoint, "--epochs", "8")  # ~75 KiB a rank: twice the disk
    finally:
        stop.set()
        listener.join(timeout=10)
    assert proc.returncode == 0 or teardown_abort_only(proc), proc.stderr[-3000:]
    assert "done: 128 steps on 2 ranks" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "stopped recording" in line]
    assert warnings and "No space left on device" in warnings[0]
    assert len(warnings) == len({w.split("rank ")[1].split()[0] for w in warnings})  # one a rank
    rec = read_back(small_fs)  # both files whole, up to their last record
    recorded = {r: sum(isinstance(m, Step) for m in msgs) for r, msgs in rec.messages.items()}
    assert max(recorded.values()) < 128  # the disk did fill up, on both ranks
    assert live == {0: 128, 1: 128}  # the live stream had every step


@pytest.mark.torchrun
def test_ranks_that_cannot_create_their_record_train_unrecorded_with_one_warning(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    endpoint = f"ipc://{tmp_path}/w.sock"
    live: Counter[int] = Counter()
    stop = threading.Event()
    listener = _collect(endpoint, stop, live)
    try:
        proc = _job(blocker / "rec", endpoint, "--epochs", "1")
    finally:
        stop.set()
        listener.join(timeout=10)
    assert proc.returncode == 0 or teardown_abort_only(proc), proc.stderr[-3000:]
    assert "done: 16 steps on 2 ranks" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "is not recording" in line]
    assert sorted(w.split("rank ")[1].split()[0] for w in warnings) == ["0", "1"], proc.stderr
    assert "Traceback" not in proc.stderr
    assert live == {0: 16, 1: 16}  # unrecorded, still watched


def _run_into(record: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    marker = tmp_path / "launched"
    return subprocess.run(
        [*DDPSCOPE, "run", "--headless", "--record", str(record), "--", sys.executable, "-c",
         f"open({str(marker)!r}, 'w').close()"],
        env=job_env(), capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip


def test_run_into_a_record_dir_below_a_file_is_an_error_before_the_job_starts(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = _run_into(blocker / "rec", tmp_path)
    assert proc.returncode == 2
    assert f"cannot record into {blocker / 'rec'}: Not a directory" in proc.stderr
    assert not (tmp_path / "launched").exists()


def test_run_into_a_read_only_record_dir_is_an_error_before_the_job_starts(
    read_only_fs: Path, tmp_path: Path
) -> None:
    proc = _run_into(read_only_fs, tmp_path)
    assert proc.returncode == 2
    assert f"cannot record into {read_only_fs}: Read-only file system" in proc.stderr
    assert not (tmp_path / "launched").exists()


def test_file_of_a_sigkilled_writer_reads_back(tmp_path: Path) -> None:
    """A process killed mid-stream leaves every whole record readable."""
    script = textwrap.dedent(
        f"""
        import os, signal
        from ddpscope.record.writer import RecordWriter
        from ddpscope.schema import Heartbeat, encode
        w = RecordWriter({str(tmp_path)!r}, "killed", 0, {{"run_id": "killed", "rank": 0}})
        for i in range(200):
            w.append(encode(Heartbeat(run="killed", rank=0, seq=i, phase="forward", step=i,
                                      bucket=-1, in_phase_s=0.0, cpu_pct=0.0, rss_bytes=0,
                                      threads=1)))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT)
    assert proc.returncode == -9
    rec = open_run(str(tmp_path))
    assert [m.seq for m in rec.messages[0]] == list(range(200))
