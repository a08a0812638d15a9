"""torch's composable replicate() (torchtitan's data-parallel path) on real torchrun jobs.

The demo with ``--api replicate``: the loop calls the user's module, whose
first forward builds the DDP inside. Healthy, a 3-rank BatchNorm CNN with
fork workers, accumulation through ``set_requires_gradient_sync`` and a
logged loss all-reduce raises nothing above info (BatchNorm's statistics
differ by design: replicate() syncs parameters only). With no code change
(``ddpscope run``, the script never calls attach) a straggler is named, and
the DDP replicate() builds over a bare parameter list is not attached as a
model of its own; a rank's edited weights are a desync.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddpscope.record import open_run
from ddpscope.schema import DDP_API_REPLICATE, RunInfo
from tests.support.frameworks import assert_phases_add_up
from tests.support.recorded import brief, of_kind, serious, steps_of
from tests.support.recorded import report_json as report
from tests.support.torchrun import DEMO, ROOT, job_env, one_cpu, torchrun

pytestmark = pytest.mark.torchrun

REPLICATE = ["--api", "replicate", "--samples", "384"]


def _models(rec: Path) -> set[int]:
    return {m.model for msgs in open_run(str(rec)).messages.values() for m in msgs}


def test_a_healthy_replicated_cnn_raises_nothing_but_its_own_statistics(
    tmp_path: Path, endpoint: str
) -> None:
    rec = tmp_path / "rec"
    flags = ["--model", "cnn", "--accum", "2", "--loss-allreduce", "--workers", "2"]
    torchrun(
        [str(DEMO), *REPLICATE, *flags, "--epochs", "2"],
        nproc=3,
        env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint),
        timeout=240,
        prefix=one_cpu(),
    )
    doc = report(rec)
    assert serious(doc) == [], brief(doc["findings"])
    (f,) = of_kind(doc, "desync")
    assert f["severity"] == "info" and f["evidence"]["api"] == DDP_API_REPLICATE
    steps = steps_of(rec)
    # 384 samples, 3 ranks, batch 32: 4 batches a rank an epoch, 2 micro-batches a step.
    assert {r: len(ss) for r, ss in steps.items()} == {0: 4, 1: 4, 2: 4}
    assert all(s.micro_batches == 2 for ss in steps.values() for s in ss)
    assert_phases_add_up(steps)
    assert {s.epoch for s in steps[0]} == {0, 1}
    info = next(m for m in open_run(str(rec)).messages[0] if isinstance(m, RunInfo))
    assert info.params[0][0] == "features.0.weight"


def test_a_straggler_is_named_with_no_code_change(tmp_path: Path, endpoint: str) -> None:
    rec = tmp_path / "rec"
    cmd = [
        sys.executable,
        "-m",
        "ddpscope",
        "run",
        "--record",
        str(rec),
        "--",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=3",
        str(DEMO),
        *REPLICATE,
        "--no-attach",
        "--epochs",
        "6",
        "--slow-rank",
        "2",
        "--slow-ms",
        "60",
    ]
    proc = subprocess.run(
        cmd,
        env=job_env(DDPSCOPE_ENDPOINT=endpoint),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "warning" not in proc.stderr.lower(), proc.stderr[-4000:]
    assert _models(rec) == {0}  # the module, not also the DDP replicate() built inside
    doc = report(rec)
    found = serious(doc)
    assert [(f["kind"], f["ranks"]) for f in found] == [("straggler", [2])], brief(found)
    assert found[0]["evidence"]["grown_phases"][0] == "other"
    assert_phases_add_up(steps_of(rec))


def test_weights_edited_on_one_rank_are_a_desync(tmp_path: Path, endpoint: str) -> None:
    rec = tmp_path / "rec"
    torchrun(
        [str(DEMO), *REPLICATE, "--epochs", "2", "--desync-rank", "1", "--desync-step", "2"],
        nproc=3,
        env=job_env(
            DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint, DDPSCOPE_CHECKSUM_EVERY="1"
        ),
        timeout=240,
    )
    doc = report(rec)
    found = serious(doc)
    assert [f["kind"] for f in found] == ["desync"], brief(found)
    f = found[0]
    assert f["severity"] == "error" and f["ranks"] == [1]
    assert f["evidence"]["names"] == ["0.weight"] and f["step"] == 3
