"""``ddpscope compare`` on two real torchrun jobs, a healthy one and one with a straggler.

(On synthetic recordings with exact expected deltas: tests/unit/test_compare.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddpscope.analysis import compare
from tests.support import compare_before_streaming as before
from tests.support.torchrun import DEMO, ROOT, job_env, torchrun
from tests.unit.test_compare import fits, metric


@pytest.mark.torchrun
def test_a_straggling_job_is_slower_than_a_healthy_one(tmp_path: Path) -> None:
    base = ["--samples", "512", "--epochs", "2"]  # 16 steps per rank
    for name, extra in (("a", []), ("b", ["--slow-rank", "1", "--slow-ms", "40"])):
        env = job_env(
            DDPSCOPE_RECORD=str(tmp_path / name), DDPSCOPE_ENDPOINT=f"ipc://{tmp_path}/{name}.sock"
        )
        torchrun([str(DEMO), *base, *extra], env=env)

    def ddpscope_compare(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "ddpscope", "compare", *args]
        return subprocess.run(cmd, env=job_env(), capture_output=True, text=True, cwd=ROOT)

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    proc = ddpscope_compare(a, b, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    step = metric(doc, "step")
    # Rank 1 sleeps 40 ms a step; on a loaded 2-core machine healthy steps vary a lot,
    # so only the direction and a generous fraction of the sleep are asserted.
    assert step["b"] - step["a"] > 20, step
    assert doc["b"]["figures"]["spread"]["slowest_rank"] == 1
    waits = {r["rank"]: r["allreduce_wait_ms"] for r in doc["b"]["figures"]["ranks"]}
    assert waits[0] > 20 > waits[1], waits
    assert doc["a"]["setup"]["world_size"] == doc["b"]["setup"]["world_size"] == 2
    assert doc["b"]["figures"]["steps_used"] == 16 - compare.WARMUP_STEPS
    assert not [w for w in doc["warnings"] if "differs" in w], doc["warnings"]
    gate = ddpscope_compare(a, b, "--fail-on-regression", "50")
    assert gate.returncode == 1, gate.stdout + gate.stderr
    fits(gate.stdout)
    assert "verdict: FAIL" in gate.stdout
    assert ddpscope_compare(a, a, "--fail-on-regression", "0").returncode == 0
    # The streaming compare says what the in-memory one said, on real jobs' recordings.
    old = before.build(before.load(a, None), before.load(b, None), 50.0, ["step"], "warning")
    new = compare.build(compare.load(a, None), compare.load(b, None), 50.0, ["step"], "warning")
    assert json.loads(json.dumps(new)) == json.loads(json.dumps(old))
