"""A real 2-node job (two launchers, two relays, two "hosts" with unrelated monotonic
clocks) into one watcher: one run, both hosts, lined up, and nothing false raised."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from ddpscope.analysis.live import LiveFeed
from ddpscope.record.reader import find_runs
from ddpscope.replay.index import RecordingIndex
from ddpscope.replay.player import ReplayFeed
from tests.support.multinode import (
    DAY_NS,
    bucket_end_skew_ms,
    namespaces_work,
    run_two_nodes,
    shift_error_ns,
)

pytestmark = [
    pytest.mark.torchrun,
    pytest.mark.skipif(
        not namespaces_work(), reason="needs Linux time and UTS namespaces (unshare --time)"
    ),
]


def test_two_nodes_with_skewed_clocks_are_one_run_on_one_clock(
    tmp_path: Path, endpoint: str
) -> None:
    with LiveFeed(endpoint) as feed:
        # Every step's buckets timed (DDPSCOPE_BUCKET_EVERY=1): the alignment
        # check below compares the ranks' last all-reduce end step by step.
        nodes = run_two_nodes(
            tmp_path,
            endpoint,
            ["--epochs", "3", "--slow-rank", "1", "--slow-ms", "20"],
            DDPSCOPE_BUCKET_EVERY="1",
        )
        for out in nodes.outputs:
            assert out.returncode == 0 or "done:" in out.stdout, out.stderr[-3000:]
            assert "relaying this node's ranks" in out.stderr  # --nnodes=2: a relay per node
        live = feed.snapshot()
    # One run for both launchers (torchrun's rendezvous id), two hosts.
    runs = find_runs(str(nodes.record))
    assert [r.run_id for r in runs] == ["rdzv-mn"]
    headers = {rf.rank: rf.header for rf in runs[0].files}
    assert sorted(headers) == [0, 1] and headers[1]["host"] == "node-b"
    apart = (headers[1]["mono_ns"] - headers[0]["mono_ns"]) - (
        headers[1]["wall_ns"] - headers[0]["wall_ns"]
    )
    assert abs(apart - DAY_NS) < 10**9  # the second node's clock really is a day ahead

    # Live: both ranks of the one run, the straggler named, nothing about silence or hangs.
    assert live.header is not None and live.header.run_id == "rdzv-mn"
    assert set(live.header.hosts) == {headers[0]["host"], "node-b"}
    assert [r.step for r in live.rows] == [48, 48]
    assert not [f for f in live.findings if f.kind in ("hang", "rank_silent", "rank_exit")]

    # Report: the straggler, and nothing else at warning or above.
    report = subprocess.run(
        [sys.executable, "-m", "ddpscope", "report", str(nodes.record), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    doc = json.loads(report.stdout)
    serious = [
        (f["kind"], f["ranks"]) for f in doc["findings"] if f["severity"] in ("warning", "error")
    ]
    assert serious == [("straggler", [1])]

    # Aligned: the second host's shift is the namespace's day, to the microsecond
    # (wall clocks agree exactly here), and the collective's end, one instant on
    # both ranks, lands within a few ms (the collective's own skew on 2 busy cores).
    assert abs(shift_error_ns(nodes.record, DAY_NS)) < 1_000
    skew = bucket_end_skew_ms(nodes.record)
    assert len(skew) >= 40 and statistics.median(skew) < 10.0, skew

    # Replay: both ranks stand at the same step.
    replay = ReplayFeed(RecordingIndex(runs[0]))
    replay.start()
    try:
        replay.seek_step(20)
        for _ in range(200):
            status = replay.idle()
            if status.indexed >= 1.0:
                break
        replay.seek_step(20)
        assert replay.idle().step == 20
        assert [r.step for r in replay.snapshot().rows] == [21, 21]
    finally:
        replay.stop()
