"""ddpscope.attach on real torchrun jobs (gloo, 2 ranks): every signal arrives and is right."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ddpscope.record import open_run
from ddpscope.schema import (
    BucketLayout,
    End,
    Fingerprint,
    Heartbeat,
    Message,
    RunInfo,
    SamplerPass,
    SamplerPassEnd,
    Step,
)
from tests.support.torchrun import DEMO, ROOT, job_env, torchrun

pytestmark = pytest.mark.torchrun

SAMPLES, BATCH = 256, 32  # 4 steps per epoch per rank with 2 ranks


def _run(tmp: Path, endpoint: str, *flags: str, nproc: int = 2, **env: str) -> dict[int, list]:
    rec = tmp / "rec"
    torchrun(
        [str(DEMO), "--samples", str(SAMPLES), "--batch", str(BATCH), *flags],
        nproc=nproc,
        env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint, **env),
    )
    recording = open_run(str(rec))
    assert recording.problems == []
    return recording.messages


def _of(msgs: list[Message], cls: type) -> list[Any]:
    return [m for m in msgs if isinstance(m, cls)]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, list], Path]:
    tmp = tmp_path_factory.mktemp("healthy")
    endpoint = f"ipc://{tmp}/s"
    log = tmp / "ddplog"
    msgs = _run(tmp, endpoint, "--epochs", "2", "--ddp-log", str(log), DDPSCOPE_CHECKSUM_EVERY="2")
    return msgs, log


def test_every_rank_sends_run_info_with_one_shared_run_id(healthy: Any) -> None:
    msgs, _ = healthy
    assert sorted(msgs) == [0, 1]
    infos = [_of(msgs[r], RunInfo)[0] for r in (0, 1)]
    assert infos[0].run == infos[1].run != ""
    assert [i.rank for i in infos] == [0, 1]
    for info in infos:
        assert info.world_size == 2 and info.backend == "gloo" and info.device == "cpu"
        assert info.ddp["bucket_cap_bytes"] == int(0.25 * 1024 * 1024)
        assert info.params[0][0] == "0.weight" and info.params[0][1] == [256, 64]


def test_steps_are_counted_once_each_and_phases_add_up(healthy: Any) -> None:
    msgs, _ = healthy
    for r in (0, 1):
        steps = _of(msgs[r], Step)
        assert [s.step for s in steps] == list(range(8))
        for s in steps:
            phases = s.data_ns + s.forward_ns + s.backward_ns + s.comm_wait_ns + s.optimizer_ns
            assert s.forward_ns > 0 and s.backward_ns > 0 and s.optimizer_ns > 0
            assert phases + s.other_ns == pytest.approx(s.t_end - s.t_start, abs=1000)
            assert s.micro_batches == 1 and s.optimizer_steps == 1
        assert [s.epoch for s in steps] == [0] * 4 + [1] * 4


def test_bucket_count_and_sizes_match_ddps_own_logging(healthy: Any) -> None:
    msgs, log = healthy
    for r in (0, 1):
        ddp = json.loads(Path(f"{log}.rank{r}").read_text())
        rebuilt = sorted(int(x) for x in str(ddp["rebuilt_bucket_sizes"]).split(","))
        layouts = _of(msgs[r], BucketLayout)
        final = layouts[-1]
        assert sorted(final.nbytes) == rebuilt
        # every parameter sits in exactly one bucket
        named = sorted(i for p in final.params for i in p)
        assert named == list(range(len(_of(msgs[r], RunInfo)[0].params)))
        # At defaults the comm hook goes in only where it fits the step: a
        # step either carries timings of every bucket or says it has none.
        for s in _of(msgs[r], Step):
            assert (s.b_every == 0) <= (not s.b_detail)
            if s.b_detail and s.step > 0:
                assert sorted(s.b_nbytes) == rebuilt


def test_every_bucket_is_timed_when_asked_and_matches_ddps_layout(
    tmp_path: Path, endpoint: str
) -> None:
    log = tmp_path / "ddplog"
    msgs = _run(
        tmp_path, endpoint, "--epochs", "1", "--ddp-log", str(log), DDPSCOPE_BUCKET_EVERY="1"
    )
    for r in (0, 1):
        ddp = json.loads(Path(f"{log}.rank{r}").read_text())
        rebuilt = sorted(int(x) for x in str(ddp["rebuilt_bucket_sizes"]).split(","))
        final = _of(msgs[r], BucketLayout)[-1]
        steps = _of(msgs[r], Step)
        assert all(s.b_detail and s.b_every == 1 for s in steps)
        for s in steps[1:]:  # step 0 ran before DDP rebuilt its buckets
            assert sorted(s.b_index) == sorted(final.index)
            assert sorted(s.b_nbytes) == rebuilt
            assert all(d > 0 for d in s.b_dur_ns)


def test_fingerprints_agree_across_ranks_on_a_healthy_run(healthy: Any) -> None:
    msgs, _ = healthy
    fps = [{f.step: f for f in _of(msgs[r], Fingerprint)} for r in (0, 1)]
    common = sorted(set(fps[0]) & set(fps[1]))
    assert 0 in common and len(common) >= 4
    for step in common:
        assert fps[0][step].params == fps[1][step].params
        assert fps[0][step].buffers == fps[1][step].buffers
    reasons = {f.reason for f in fps[0].values()}
    assert {"initial", "interval", "final"} <= reasons


def test_sampler_passes_match_what_distributed_sampler_yields(healthy: Any) -> None:
    from torch.utils.data import DistributedSampler

    msgs, _ = healthy
    for r in (0, 1):
        begins = _of(msgs[r], SamplerPass)
        ends = _of(msgs[r], SamplerPassEnd)
        assert [b.epoch for b in begins] == [0, 1]
        assert all(b.distributed and b.num_replicas == 2 and b.sampler_rank == r for b in begins)
        for b, e in zip(begins, ends, strict=True):
            sampler = DistributedSampler(range(SAMPLES), num_replicas=2, rank=r, seed=0)
            sampler.set_epoch(b.epoch)
            expected = list(iter(sampler))
            assert e.complete and e.count == len(expected) == b.expected
            assert e.head == expected[: len(e.head)]


def test_heartbeats_flow_with_host_stats_and_no_drops(healthy: Any) -> None:
    msgs, _ = healthy
    for r in (0, 1):
        beats = _of(msgs[r], Heartbeat)
        assert beats and all(b.rss_bytes > 0 for b in beats)
        assert beats[-1].dropped_queue == 0
        assert _of(msgs[r], End)[-1].reason == "exit"


def test_desync_on_one_rank_shows_in_its_fingerprints(tmp_path: Path, endpoint: str) -> None:
    msgs = _run(
        tmp_path,
        endpoint,
        "--epochs",
        "1",
        "--desync-rank",
        "1",
        "--desync-step",
        "1",
        DDPSCOPE_CHECKSUM_EVERY="1",
    )
    fps = [{f.step: f.params for f in _of(msgs[r], Fingerprint)} for r in (0, 1)]
    assert fps[0][1] == fps[1][1]  # taken after step 1, before the edit in step 2
    for step in (2, 3):
        differ = [
            i for i, (a, b) in enumerate(zip(fps[0][step], fps[1][step], strict=True)) if a != b
        ]
        assert differ == [0]  # only the edited tensor: its gradients are still averaged


@pytest.mark.parametrize(
    ("nproc", "flags", "env"),
    [
        (2, [], {}),
        # ddpscope's comm hook in DDP's place, 3 ranks: x / 3 and x * (1 / 3) differ in the
        # last bit, so the hook must scale as DDP's C++ path does (it divided: weights differed).
        (3, [], {"DDPSCOPE_BUCKET_EVERY": "1"}),
        # Gradients kept as views of the buckets: DDP's C++ path divides those in place.
        (3, ["--bucket-view", "--accum", "2"], {"DDPSCOPE_BUCKET_EVERY": "1"}),
        # Join(divide_by_initial_world_size=False) entered after the hook was registered:
        # DDP averages over the ranks not yet joined (rank 0 joins halfway), the hook too.
        (3, ["--uneven", "--join-divide-active"], {"DDPSCOPE_BUCKET_EVERY": "1"}),
    ],
    ids=[
        "2ranks-defaults",
        "3ranks-comm-hook",
        "3ranks-comm-hook-bucket-views",
        "3ranks-comm-hook-join-divide-active",
    ],
)
def test_final_weights_are_bit_identical_with_and_without_ddpscope(
    tmp_path: Path, endpoint: str, nproc: int, flags: list[str], env: dict[str, str]
) -> None:
    import torch

    base = ["--epochs", "1", *flags, "--save"]
    with_ = tmp_path / "with.pt"
    without = tmp_path / "without.pt"
    msgs = _run(tmp_path / "a", endpoint, *base, str(with_), nproc=nproc, **env)
    if env:
        assert all(s.b_every > 0 for s in _of(msgs[0], Step)), "the comm hook was not in"
    torchrun(
        [
            str(DEMO),
            "--samples",
            str(SAMPLES),
            "--batch",
            str(BATCH),
            "--no-attach",
            *base,
            str(without),
        ],
        nproc=nproc,
    )
    a, b = torch.load(with_), torch.load(without)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def fp16_unwatched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The weights the demo ends with under the fp16 hook without ddpscope: with
    --no-attach, fp16-before and fp16-after are one job (nothing between the two)."""
    import torch

    out = tmp_path_factory.mktemp("fp16") / "wo.pt"
    flags = ["--epochs", "1", "--comm-hook", "fp16-before", "--save", str(out)]
    torchrun([str(DEMO), "--samples", str(SAMPLES), "--batch", str(BATCH), "--no-attach", *flags])
    return dict(torch.load(out))


@pytest.mark.parametrize("when", ["fp16-before", "fp16-after"])
def test_user_fp16_comm_hook_keeps_working_and_is_timed(
    tmp_path: Path, endpoint: str, when: str, fp16_unwatched: dict[str, Any]
) -> None:
    import torch

    out_with = tmp_path / "w.pt"
    flags = ["--epochs", "1", "--comm-hook", when, "--save"]
    msgs = _run(tmp_path / "a", endpoint, *flags, str(out_with))
    a, b = torch.load(out_with), fp16_unwatched
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = _of(msgs[0], Step)
    assert steps and all(bool(s.b_dur_ns) == s.b_detail for s in steps)
    assert any(s.b_detail for s in steps)


def test_gradient_accumulation_and_skipped_steps_keep_the_count(
    tmp_path: Path, endpoint: str
) -> None:
    msgs = _run(
        tmp_path, endpoint, "--epochs", "1", "--batch", "16", "--accum", "2", "--skip-every", "3"
    )
    for r in (0, 1):
        steps = _of(msgs[r], Step)
        assert [s.step for s in steps] == list(range(4))  # 8 micro-batches / 2
        assert all(s.micro_batches == 2 for s in steps)
        assert [s.optimizer_steps for s in steps] == [1, 1, 0, 1]


def test_join_shadow_all_reduces_do_not_count_as_steps(tmp_path: Path, endpoint: str) -> None:
    msgs = _run(tmp_path, endpoint, "--epochs", "1", "--uneven", DDPSCOPE_HEARTBEAT_S="0.2")
    steps0, steps1 = _of(msgs[0], Step), _of(msgs[1], Step)
    assert len(steps0) == 2 and len(steps1) == 4  # rank 0 got half the data
    assert max(h.join_shadow for h in _of(msgs[0], Heartbeat)) > 0
    assert max(h.join_shadow for h in _of(msgs[1], Heartbeat)) == 0
    assert [s.step for s in steps1] == list(range(4))


def test_dataloader_workers_started_by_fork_are_harmless(tmp_path: Path, endpoint: str) -> None:
    msgs = _run(tmp_path, endpoint, "--epochs", "2", "--workers", "2")
    for r in (0, 1):
        assert len(_of(msgs[r], Step)) == 8
        assert [e.complete for e in _of(msgs[r], SamplerPassEnd)] == [True, True]


def test_world_size_one_works(tmp_path: Path, endpoint: str) -> None:
    msgs = _run(tmp_path, endpoint, "--epochs", "1", nproc=1)
    assert sorted(msgs) == [0]
    assert len(_of(msgs[0], Step)) == SAMPLES // BATCH


def test_rank_killed_with_sigkill_leaves_a_readable_file(tmp_path: Path, endpoint: str) -> None:
    rec = tmp_path / "rec"
    proc = torchrun(
        [
            str(DEMO),
            "--samples",
            str(SAMPLES),
            "--batch",
            "8",
            "--epochs",
            "1",
            # killed well after the publisher's first flush (it wakes every 50 ms)
            "--step-sleep-ms",
            "20",
            "--kill-rank",
            "1",
            "--kill-step",
            "8",
        ],
        env=job_env(DDPSCOPE_RECORD=str(rec), DDPSCOPE_ENDPOINT=endpoint),
        check=False,
        timeout=240,
    )
    assert proc.returncode != 0
    recording = open_run(str(rec))
    kinds = Counter(type(m).__name__ for m in recording.messages[1])
    assert kinds["RunInfo"] == 1 and kinds["Step"] >= 5
    assert all("truncated" in p for p in recording.problems)
    assert not any(isinstance(m, End) for m in recording.messages[1])
    # the survivor says how it ended: gloo's error reached it (an exception
    # with the traceback), or torchrun's SIGTERM did first
    (end,) = [m for m in recording.messages[0] if isinstance(m, End)]
    assert end.reason in ("exception", "signal") and end.error


def test_hung_rank_keeps_heartbeating_and_sends_its_stacks(tmp_path: Path, endpoint: str) -> None:
    from ddpscope.schema import Stacks

    msgs = _run(
        tmp_path,
        endpoint,
        "--epochs",
        "1",
        "--hang-rank",
        "1",
        "--hang-step",
        "1",
        "--hang-s",
        "5",
        DDPSCOPE_STACKS_AFTER_S="2",
        DDPSCOPE_HEARTBEAT_S="0.25",
    )
    stuck = {r: [s for s in _of(msgs[r], Stacks) if s.reason == "stuck"] for r in (0, 1)}
    # the sleeper is caught in user code, inside the demo's fault injector
    sleeper = stuck[1][0]
    assert sleeper.phase == "idle" and sleeper.step == 1
    main = next(t for t in sleeper.threads if t["main"])
    assert main["frames"][-1][2] == "_inject"
    # the rank waiting for it is blocked in the gradient all-reduce
    assert stuck[0] and stuck[0][0].phase == "allreduce"
    beats = [h for h in _of(msgs[1], Heartbeat) if h.phase == "idle" and h.step == 1]
    assert max(h.in_phase_s for h in beats) > 3  # heartbeats kept flowing during the hang


SUBSCRIBER = """
import sys
from ddpscope.transport.subscriber import Subscriber
with Subscriber(sys.argv[1]) as sub:
    print("ready", flush=True)
    while True:
        msg = sub.recv(100)
        if msg is not None:
            print(msg.KIND, flush=True)
"""


def test_frozen_watcher_costs_dropped_messages_not_a_stuck_job(
    tmp_path: Path, endpoint: str
) -> None:
    import os
    import signal
    import subprocess
    import sys

    watcher = subprocess.Popen(
        [sys.executable, "-c", SUBSCRIBER, endpoint],
        stdout=subprocess.PIPE,
        text=True,
        env=job_env(),
    )
    try:
        assert watcher.stdout is not None
        assert watcher.stdout.readline().strip() == "ready"
        rec = tmp_path / "rec"
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                str(DEMO),
                "--samples",
                "512",
                "--batch",
                "32",
                "--epochs",
                "2",
                "--step-sleep-ms",
                "250",
            ],
            env=job_env(
                DDPSCOPE_RECORD=str(rec),
                DDPSCOPE_ENDPOINT=endpoint,
                DDPSCOPE_SNDHWM="2",
                DDPSCOPE_HEARTBEAT_S="0.01",
                DDPSCOPE_RESEND_S="0.01",
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while watcher.stdout.readline().strip() != "step":
            pass  # the watcher is subscribed and receiving: now freeze it mid-run
        os.kill(watcher.pid, signal.SIGSTOP)
        assert job.wait(timeout=180) == 0
    finally:
        os.kill(watcher.pid, signal.SIGCONT)
        watcher.kill()
        watcher.wait()
    msgs = open_run(str(rec)).messages
    for r in (0, 1):
        assert len(_of(msgs[r], Step)) == 16  # the record is complete regardless
        final = _of(msgs[r], Heartbeat)[-1]
        assert final.dropped_send > 0 and final.dropped_queue == 0


def test_the_comm_hooks_callbacks_make_no_python_thread_state_per_bucket(endpoint: str) -> None:
    # Each thread state the process group's threads made took the interpreter's head
    # lock without the GIL: a DataLoader forking its workers at that instant left a
    # worker deadlocked in PyOS_AfterFork_Child on CPython < 3.12 (a 3-rank job hung
    # at an epoch's start). Before: 84-90 made in 20 steps of 4 buckets.
    proc = torchrun(
        [str(ROOT / "tests" / "jobs" / "thread_states_job.py")],
        env=job_env(DDPSCOPE_ENDPOINT=endpoint, DDPSCOPE_BUCKET_EVERY="1"),
    )
    # Not line by line: unbuffered, the ranks' lines can interleave mid-line.
    made = [int(n) for n in re.findall(r"thread states made: (\d+)", proc.stdout)]
    assert len(made) == 2, proc.stdout[-2000:]
    # At most one per thread of the process group (gloo's), on its first callback.
    assert max(made) <= 4, made
