"""A checkpoint uploaded over the network mid-run, on a real 2-rank torchrun job.

Rank 0 PUTs 32 MB to an HTTP server in this process from a worker thread
while its training thread waits on the future, and rank 1 waits in a barrier:
a training thread neither computing nor in a file, for longer than the hang
limit these ~10 ms steps give (5 s). Both sides of the rule: an upload that
streams is work, not a hang; one whose server stops reading moves nothing,
and is a hang naming rank 0 until it goes on.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpscope.analysis.findings import Finding
from ddpscope.analysis.sources import analyze_recording
from ddpscope.record.reader import open_run
from ddpscope.schema import Heartbeat
from tests.support.torchrun import ROOT, job_env, one_cpu, torchrun

pytestmark = pytest.mark.torchrun

JOB = ROOT / "tests" / "jobs" / "upload_job.py"
CHUNK = 64 * 1024
RATE = 3 << 20  # bytes/s: 32 MB take ~11 s


class Server:
    """Answers one HTTP PUT, reading its body at RATE, after ``stall_s`` of not reading
    once the first MB is in."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/ckpt"
        self.received = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            head, _, body = head.partition(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))  # fmt: skip
            got, stalled, start = len(body), False, time.monotonic()
            while got < length:
                if not stalled and got >= 1 << 20 and self.stall_s:
                    stalled = True
                    time.sleep(self.stall_s)
                    start = time.monotonic() - got / RATE
                chunk = conn.recv(min(CHUNK, length - got))
                if not chunk:
                    return
                got += len(chunk)
                ahead = got / RATE - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
            self.received = got
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    def close(self) -> None:
        self.thread.join(60)
        self.sock.close()


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server(stall_s=request.param)
    yield s
    s.close()


def _hangs(rec: Path) -> list[Finding]:
    analysis, recording = analyze_recording(str(rec))
    assert recording.problems == [] and analysis.detector_errors == {}
    assert analysis.latest is not None
    return analysis.book(analysis.latest).of_kind("hang")


def _upload(rec: Path, endpoint: str, server: Server) -> float:
    """Run the job; the seconds rank 0 took to upload."""
    proc = torchrun(
        [str(JOB), "--url", server.url],
        env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint),
        prefix=one_cpu(),
    )
    assert proc.stdout.count("done:") == 2, proc.stdout[-2000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("rank 0 uploaded")]
    assert ": 200 in " in line and server.received == 32 << 20, line
    return float(line.split(" in ")[1].split()[0])


@pytest.mark.parametrize("server", [0.0], indirect=True)
def test_a_checkpoint_uploading_for_longer_than_the_hang_limit_is_no_hang(
    tmp_path: Path, endpoint: str, server: Server
) -> None:
    rec = tmp_path / "rec"
    took = _upload(rec, endpoint, server)
    assert took > 8, took  # past the 5 s limit by a margin
    beats = [m for m in open_run(str(rec)).messages[0] if isinstance(m, Heartbeat)]
    moving = [m.moved_bps for m in beats if m.moved_bps >= 0]
    # Rank 0 was seen moving close to the server's pace while it waited.
    assert moving and max(moving) > RATE / 2, moving
    assert _hangs(rec) == []


@pytest.mark.parametrize("server", [12.0], indirect=True)
def test_an_upload_whose_server_stops_reading_is_a_hang_naming_the_uploader(
    tmp_path: Path, endpoint: str, server: Server
) -> None:
    rec = tmp_path / "rec"
    took = _upload(rec, endpoint, server)
    assert took > 12, took
    (hang,) = _hangs(rec)
    assert hang.ranks == [0], hang.message
    # It came back once the server read again: kept as a warning, with the stall.
    assert hang.severity == "warning" and hang.evidence["resolved"] == "progress resumed"
    assert hang.evidence["threshold_s"] < hang.evidence["stalled_s"] < took + 2
