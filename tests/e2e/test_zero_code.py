"""``ddpscope run``: real jobs whose scripts never call attach are watched all the same.

Each torchrun job costs several seconds on a small machine, so there are few
of them: the ``torchrun`` executable form, the ``python -m
torch.distributed.run`` form compared message for message with the one-line
install, and one plain single-process ``python`` job for the guard rails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ddpscope.record import open_run
from ddpscope.schema import BucketLayout, Fingerprint, Message, SamplerPassEnd, Step
from tests.support.torchrun import DEMO, ROOT, job_env, torchrun

DDPSCOPE_RUN = [sys.executable, "-m", "ddpscope", "run"]
JOB = [str(DEMO), "--epochs", "1", "--samples", "256"]
# Fingerprint on a fixed cadence: the automatic one depends on measured step time.
CADENCE = {"DDPSCOPE_CHECKSUM_EVERY": "2"}
EXPECTED_KINDS = {"run_info", "step", "buckets", "sampler_pass", "fingerprint", "heartbeat"}


def _messages(rec: Path) -> dict[int, list[Message]]:
    recording = open_run(str(rec))
    assert recording.problems == []
    return recording.messages


def _of(msgs: list[Message], cls: type) -> list[Any]:
    return [m for m in msgs if isinstance(m, cls)]


def _files_per_rank(rec: Path) -> Counter[int]:
    (run_dir,) = [p for p in rec.iterdir() if p.is_dir()]
    return Counter(int(p.name.split("-")[1]) for p in run_dir.glob("rank-*.ddps"))


def _content(msgs: list[Message]) -> dict[str, Any]:
    """What must not depend on how ddpscope was attached (timings of course do)."""
    return {
        "kinds": {m.KIND for m in msgs} - {"heartbeat"},  # heartbeats depend on run time
        "steps": [s.step for s in _of(msgs, Step)],
        "buckets": [
            (b.generation, b.step, b.index, b.nbytes, b.dtype, b.params)
            for b in _of(msgs, BucketLayout)
        ],
        # Steps timed per bucket under any sampling interval (a power of two up to 32).
        "bucket_use": [
            (s.layout, sorted(s.b_index)) for s in _of(msgs, Step) if s.step < 3 or s.step % 32 == 0
        ],
        "sampler": [(e.pass_id, e.count, e.digest, e.head) for e in _of(msgs, SamplerPassEnd)],
        "fingerprints": [(f.step, f.reason, f.params, f.buffers) for f in _of(msgs, Fingerprint)],
    }


@pytest.mark.torchrun
def test_torchrun_job_is_recorded_without_attach_in_the_script(
    tmp_path: Path, endpoint: str
) -> None:
    rec = tmp_path / "rec"
    torchrun_exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun_exe, "the torchrun console script sits beside the interpreter"
    # fp16-before: the script registers a comm hook right after building DDP; auto
    # attach came first, so the hook must be wrapped (timed), not left alone.
    cmd = [
        *DDPSCOPE_RUN,
        "--record",
        str(rec),
        "--",
        torchrun_exe,
        "--standalone",
        "--nproc_per_node=2",
        *JOB,
        "--no-attach",
        "--comm-hook",
        "fp16-before",
    ]
    proc = subprocess.run(
        cmd,
        env=job_env(DDPSCOPE_ENDPOINT=endpoint, **CADENCE),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "done: 4 steps on 2 ranks" in proc.stdout
    assert "warning" not in proc.stderr.lower(), proc.stderr[-4000:]
    assert _files_per_rank(rec) == {0: 1, 1: 1}  # ranks only: the agent built no DDP
    msgs = _messages(rec)
    assert sorted(msgs) == [0, 1]
    for rank in (0, 1):
        kinds = {m.KIND for m in msgs[rank]}
        assert kinds >= EXPECTED_KINDS, kinds
        steps = _of(msgs[rank], Step)
        assert [s.step for s in steps] == [0, 1, 2, 3]
        assert all(s.b_index and min(s.b_dur_ns) > 0 for s in steps)
    run_ids = {m.run for rank in msgs for m in msgs[rank]}
    assert len(run_ids) == 1


@pytest.mark.torchrun
def test_auto_attach_records_what_the_one_line_install_records(
    tmp_path: Path, endpoint: str
) -> None:
    auto, manual = tmp_path / "auto", tmp_path / "manual"
    torchrun(
        [*JOB, "--no-attach"],
        env=job_env(DDPSCOPE_ENDPOINT=endpoint, **CADENCE),
        prefix=[*DDPSCOPE_RUN, "--record", str(auto), "--"],
    )
    torchrun(
        JOB,
        env=job_env(
            DDPSCOPE_ENDPOINT=endpoint.replace(".sock", "-manual.sock"),
            DDPSCOPE_RECORD=str(manual),
            **CADENCE,
        ),
    )
    got, want = _messages(auto), _messages(manual)
    assert sorted(got) == sorted(want) == [0, 1]
    for rank in (0, 1):
        assert {m.KIND for m in got[rank]} >= EXPECTED_KINDS
        g, w = _content(got[rank]), _content(want[rank])
        # Make sure the comparison below compares something.
        assert g["steps"] == [0, 1, 2, 3] and g["buckets"] and g["sampler"]
        assert len({f[0] for f in g["fingerprints"]}) >= 2
        for key in w:
            assert g[key] == w[key], f"rank {rank}: {key} differs"


SINGLE = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
    import ddpscope.hooks.attach as attach_mod

    first = DDP(torch.nn.Linear(4, 4))
    handles = attach_mod.current_handles()
    assert [h.model for h in handles] == [first], handles
    first.register_comm_hook(None, default_hooks.allreduce_hook)
    assert getattr(first, "_ddpscope_comm").user_registered

    def broken(model, **options):
        raise RuntimeError("ddpscope bug")

    attach_mod.attach = broken
    for _ in range(2):
        model = DDP(torch.nn.Linear(4, 4))
        model(torch.randn(2, 4)).sum().backward()
    print("trained on", flush=True)
    dist.destroy_process_group()
    """
)


def test_plain_python_process_attaches_and_survives_an_attach_failure(
    tmp_path: Path, endpoint: str
) -> None:
    rec = tmp_path / "rec"
    store = f"file://{tmp_path}/store"
    proc = subprocess.run(
        [*DDPSCOPE_RUN, "--record", str(rec), "--", sys.executable, "-c", SINGLE, store],
        env=job_env(DDPSCOPE_ENDPOINT=endpoint),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "trained on"
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "ddpscope bug" in warnings[0], proc.stderr
    assert "training continues" in warnings[0]
    assert _files_per_rank(rec) == {0: 1}


UNWRAPPED = ROOT / "tests" / "jobs" / "unwrapped_job.py"


@pytest.mark.torchrun
@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("bare", "so each rank trained its own copy of the model"),
        ("manual", "the job built none before it ended"),  # averaged by hand: no claim
        ("ddp", None),  # recorded: no closing line at all
    ],
)
def test_training_with_no_ddp_model_and_no_collective_is_said_at_the_end(
    tmp_path: Path, endpoint: str, mode: str, says: str | None
) -> None:
    # pytorch/examples' imagenet main.py on CPU: a process group and a
    # DistributedSampler, but the model is wrapped in DDP only on CUDA.
    rec = tmp_path / "rec"
    tmp = tmp_path / "tmp"  # this run's own temporary directory: other tests run beside it
    tmp.mkdir()
    cmd = [*DDPSCOPE_RUN, "--record", str(rec), "--", sys.executable, "-m",
           "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(UNWRAPPED),
           "--mode", mode]  # fmt: skip
    proc = subprocess.run(cmd, env=job_env(DDPSCOPE_ENDPOINT=endpoint, TMPDIR=str(tmp)),
                          capture_output=True, text=True, timeout=180, cwd=ROOT)  # fmt: skip
    # Gloo aborts a rank of the all-reducing job at teardown now and then, with or without
    # ddpscope ("terminate called without an active exception": 3 of 10 plain torchrun runs
    # before the job's final barrier, 1 of 44 after): its training was over by then.
    torn_down = "terminate called without an active exception" in proc.stderr
    assert proc.returncode == 0 or (mode == "manual" and torn_down), proc.stderr[-4000:]
    assert proc.stdout.count("done:") == 2, proc.stderr[-4000:]
    closing = [line for line in proc.stderr.splitlines() if "recorded nothing" in line]
    if says is None:
        assert closing == [] and _files_per_rank(rec) == {0: 1, 1: 1}
        return
    (line,) = closing
    assert says in line, line
    if mode == "bare":
        assert "Yet ranks 0, 1 stepped an optimizer (rank 0: 20 steps) in a process group " \
               "of 2 ranks with 0 collectives" in line  # fmt: skip
    # The notes went with the run: nothing left in the temporary directory.
    assert not list(tmp.glob("ddpscope-notes-*"))
