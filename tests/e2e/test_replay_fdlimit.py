"""Replay keeps every rank's file open: a run with more ranks than the open-file soft limit.

A default shell allows 1,024 open files while the hard limit is far higher, so
a 1,024-rank recording would fail there. Each test runs the replay in a child
process whose limits are set before it starts, on a 60-rank recording.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from ddpscope.schema import End
from tests.support import synth
from tests.support.rankfiles import RankFiles
from tests.support.terminal import Terminal

WORLD = 60
STEPS = 20

CHILD = """
import sys, time
from ddpscope.record.reader import find_runs
from ddpscope.replay.index import RecordingIndex
from ddpscope.replay.player import ReplayFeed
feed = ReplayFeed(RecordingIndex(find_runs(sys.argv[1])[-1], cache=False))
feed.start()
limit = time.monotonic() + 60
while not feed.error and not feed.index.done and time.monotonic() < limit:
    time.sleep(0.05)
if not feed.error:
    feed.to_end()
    status = feed.idle()
    print("last step", status.last_step, "ranks", len(feed.snapshot().rows))
feed.stop()
print("error:", feed.error)
"""


@pytest.fixture(scope="module")
def wide_recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("wide")
    files = RankFiles(directory, synth.RUN)
    files.write(synth.run_infos(WORLD))
    msgs = synth.lockstep(WORLD, STEPS, synth.constant(), buckets=2)
    files.write(msgs)
    end = max(m.t for m in msgs) + synth.MS
    files.write(
        [End(run=synth.RUN, rank=r, t=end, step=STEPS, reason="exit") for r in range(WORLD)]
    )
    files.close()
    return directory


def _replay_with_limits(directory: Path, soft: int, hard: int) -> str:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory)],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_more_rank_files_than_the_soft_limit_replay_whole(wide_recording: Path) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4 * WORLD:
        pytest.skip(f"the hard open-file limit here ({hard}) leaves no room to raise into")
    out = _replay_with_limits(wide_recording, soft=40, hard=hard)
    assert f"last step {STEPS - 1} ranks {WORLD}" in out
    assert "error: \n" in out


def test_a_hard_limit_too_low_is_said_with_the_number_needed(wide_recording: Path) -> None:
    out = _replay_with_limits(wide_recording, soft=40, hard=40)
    assert f"needs {2 * WORLD} open files" in out
    assert f"ulimit -n {2 * WORLD + 64}" in out


def test_replay_in_a_terminal_says_the_limit_before_drawing_and_exits_1(
    wide_recording: Path,
) -> None:
    command = f"ulimit -n 40; exec {sys.executable} -m ddpscope replay {wide_recording}"
    term = Terminal(["bash", "-c", command], dict(os.environ), (100, 30))
    try:
        assert term.exit_status() == 1
        term.read_for(0.2)
        text = " ".join(term.text.split())  # the terminal wraps the line
        assert f"ddpscope replay: this needs {2 * WORLD} open files" in text
    finally:
        term.close()
