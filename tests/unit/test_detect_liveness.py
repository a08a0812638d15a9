"""Hang, rank_exit and telemetry detectors on synthetic streams (no torch, no processes).

Each stream is a few seconds of lockstep DDP (tests/synth.py) followed by what
the scenario needs: heartbeats of ranks stuck in a phase, End messages, gaps.
Ticks come with the heartbeats (once per simulated second), as in a replay.
"""

from __future__ import annotations

from typing import Any

import pytest

from ddpscope.analysis.build import end_of_stream
from ddpscope.analysis.detectors.hang import HANG_COLD_S, HANG_OWN_WORK_S, HangDetector
from ddpscope.analysis.detectors.rank_exit import RankExitDetector
from ddpscope.analysis.detectors.telemetry import TelemetryDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.position import FLUSH_MAX_S, Where
from ddpscope.analysis.protocol import LIVE, Mode, recorded
from ddpscope.analysis.wording import error_line, ranks_text
from ddpscope.hooks.tickpace import TICK_MAX_S
from ddpscope.schema import End, Message, Stacks, Step
from tests.support.synth import (
    MS,
    RUN,
    SITE_BARRIER,
    SITE_LOSS,
    Phases,
    constant,
    feed,
    findings,
    heartbeat,
    lockstep,
    run_infos,
    sequenced,
    step_at,
)

S = 1_000_000_000
TICK = 250 * MS

TRACEBACK = """Traceback (most recent call last):
  File "/job/train.py", line 90, in <module>
    main()
  File "/job/train.py", line 40, in main
    loss = step(batch)
ValueError: batch 17 has NaN labels
"""


def detectors(**hang: Any) -> list[Any]:
    return [HangDetector(Mode(**hang)), RankExitDetector(), TelemetryDetector()]


def run_steps(world: int = 2, steps: int = 40, **kw: Any) -> list[Message]:
    """Run info plus ``steps`` lockstep steps; steps take about 8 ms."""
    return [*run_infos(world), *lockstep(world, steps, constant(), **kw)]


def end_of(msgs: list[Message]) -> int:
    return max(m.t for m in msgs)


def stuck(
    phases: dict[int, tuple[str, int]],
    start: int,
    seconds: float,
    bucket: int = 3,
    every: int = S,
    colls: dict[int, tuple[str, str, str]] | None = None,
    runnable: dict[int, float] | None = None,
    io: dict[int, tuple[str, str]] | None = None,
    moved: dict[int, int] | None = None,
) -> list[Message]:
    """Heartbeats of ranks stuck from ``start`` on: rank -> (phase, step count); ranks in
    phase "collective" say which one in ``colls``: rank -> (op, class, site); ranks in
    ``runnable`` send their training thread's runnable time, growing at that share;
    ranks in ``io`` are blocked on a regular file: rank -> (call, path); ranks in
    ``moved`` send the bytes/s their process moves."""
    out: list[Message] = []
    t = start + every
    while t <= start + int(seconds * S):
        for r, (phase, step) in phases.items():
            op, cls, site = (colls or {}).get(r, ("", "", ""))
            share = (runnable or {}).get(r)
            extra = {} if share is None else {"runnable_ns": S + int(share * (t - start))}
            if r in (io or {}):
                extra["io_op"], extra["io_path"] = (io or {})[r]
            if r in (moved or {}):
                extra["moved_bps"] = (moved or {})[r]
            out.append(
                heartbeat(
                    r,
                    step,
                    t,
                    phase=phase,
                    in_phase_s=(t - start) / S,
                    bucket=bucket if phase == "allreduce" else -1,
                    coll_op=op,
                    coll_class=cls,
                    coll_site=site,
                    **extra,
                )
            )
        t += every
    return out


BROADCAST = ("broadcast", "ddp", "")
LOSS = ("all_reduce", "user", SITE_LOSS)
BARRIER = ("barrier", "user", SITE_BARRIER)


def busy(ranks: list[int], step: int, start: int, seconds: float, phases=("eval", "idle")):
    """Heartbeats of ranks doing work of their own: the phase changes between beats."""
    out: list[Message] = []
    for i in range(1, int(seconds) + 1):
        t = start + i * S
        for r in ranks:
            out.append(heartbeat(r, step, t, phase=phases[i % len(phases)], in_phase_s=0.05))
    return out


#: The innermost frames of a main thread waiting for its DataLoader's next batch.
IN_DATALOADER = [
    ["/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", 733, "__next__"],
    ["/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", 1482, "_next_data"],
    ["/usr/lib/python3.11/multiprocessing/queues.py", 113, "get"],
]


def stacks(
    rank: int, t: int, step: int, phase: str = "idle", inner: list[list[Any]] | None = None
) -> Stacks:
    frames = [
        ["/job/train.py", 211, "<module>"],
        ["/job/train.py", 162, "_train"],
        *(inner or [["/job/train.py", 207, "_inject"]]),
    ]
    helper = [["/usr/lib/python3.11/threading.py", 320, "wait"]]
    return Stacks(
        run=RUN,
        rank=rank,
        t=t,
        reason="stuck",
        phase=phase,
        step=step,
        threads=[
            {"name": "MainThread", "ident": 1, "main": True, "frames": frames},
            {"name": "pin_memory", "ident": 2, "main": False, "frames": helper},
        ],
    )


def end(rank: int, step: int, t: int, reason: str = "exit", error: str = "") -> End:
    return End(run=RUN, rank=rank, t=t, reason=reason, step=step, error=error)


def analyze(msgs: list[Message], **hang: Any) -> Analysis:
    msgs = sorted(msgs, key=lambda m: m.t)
    analysis = feed(Analysis(detectors(**hang), history=2048), msgs, tick_every_ns=TICK)
    analysis.tick(end_of(msgs))  # as a replay does at the end of the recording
    return analysis


def kinds(analysis: Analysis) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for f in findings(analysis):
        out.setdefault(f.kind, []).append(f)
    return out


def hung_run(seconds: float, with_stack: bool = True) -> list[Message]:
    """Rank 1 stops before its optimizer step 40; rank 0 finishes it and waits in step 41."""
    msgs = run_steps(steps=40)
    t = end_of(msgs)
    msgs.append(step_at(0, 40, t + 2 * MS))
    msgs += stuck({0: ("allreduce", 41), 1: ("idle", 40)}, t, seconds)
    if with_stack:
        msgs.append(stacks(1, t + 3 * S + 5, step=40))
    return msgs


# --- hang ----------------------------------------------------------------------


def test_hang_names_the_rank_behind_with_its_stack() -> None:
    analysis = analyze(hung_run(12))
    (f,) = kinds(analysis)["hang"]
    assert f.severity == "error" and f.active
    assert f.ranks == [1]
    assert f.step == 40
    ev = f.evidence
    assert ev["behind"] == [1]
    assert ev["where"]["1"]["phase"] == "idle" and ev["where"]["1"]["step"] == 40
    assert ev["where"]["0"] == {
        "phase": "allreduce",
        "step": 41,
        "bucket": 3,
        "in_phase_s": pytest.approx(12, abs=1),
        "heard_s_ago": 0.0,
    }
    assert ev["stack"]["at"] == "/job/train.py:207 in _inject"
    assert ev["stack"]["current"] is True
    assert "_inject" in ev["stack"]["frames"][-1]
    assert "rank 1 is behind" in f.message and "_inject" in f.message
    assert "rank 0 is waiting in all-reduce (bucket 3) at step 41" in f.message
    assert ev["threshold_s"] == 5.0  # 10 x ~9 ms median is below the 5 s floor
    assert "rank_exit" not in kinds(analysis)


def test_hang_is_raised_once_the_limit_passes_not_before() -> None:
    msgs = hung_run(20)
    t0 = end_of(run_steps(steps=40))
    early = analyze([m for m in msgs if m.t <= t0 + 4 * S])
    assert "hang" not in kinds(early)
    late = analyze([m for m in msgs if m.t <= t0 + 6 * S])
    assert kinds(late)["hang"][0].ranks == [1]


def test_hang_without_stack_says_how_to_get_one() -> None:
    (f,) = kinds(analyze(hung_run(10, with_stack=False)))["hang"]
    assert f.evidence["stack"] is None
    assert "py-spy dump --pid 1001 on synth-host" in f.fix
    assert "DDPSCOPE_STACKS_AFTER_S" in f.fix


def test_hang_after_overrides_the_derived_limit() -> None:
    assert "hang" not in kinds(analyze(hung_run(10), hang_after_s=30))
    (f,) = kinds(analyze(hung_run(4), hang_after_s=2))["hang"]
    assert f.evidence["threshold_s"] == 2 and "hang-after" in f.evidence["threshold_rule"]
    with pytest.raises(ValueError):
        HangDetector(Mode(hang_after_s=0))


def test_hang_then_resume_is_kept_as_a_warning() -> None:
    msgs = hung_run(8)
    t = end_of(msgs)
    msgs += [step_at(1, 40, t + MS), step_at(0, 41, t + 2 * MS), step_at(1, 41, t + 2 * MS)]
    msgs += lockstep(2, 5, constant(), first_step=42, start_ns=t + 3 * MS)
    (f,) = kinds(analyze(msgs))["hang"]
    assert not f.active and f.severity == "warning"
    assert "progress resumed after" in f.message
    assert f.ranks == [1]


# --- hangs in any collective ------------------------------------------------------


def test_a_data_stall_while_the_other_waits_in_the_buffer_broadcast_is_a_hang() -> None:
    """BatchNorm: rank 0 blocks in the next forward's buffer broadcast, not in all-reduce."""
    msgs = run_steps(steps=6, buffers=True)
    t = end_of(msgs)
    msgs += stuck({0: ("collective", 6), 1: ("data", 6)}, t, 12, colls={0: BROADCAST})
    msgs.append(stacks(1, t + 3 * S, step=6, phase="data", inner=IN_DATALOADER))
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.severity == "error" and f.ranks == [1] and f.step == 6
    assert "rank 1 is behind, loading data (waiting for its DataLoader) at step 6" in f.message
    assert "at /job/train.py:162 in _train" in f.message
    assert "rank 0 is waiting in broadcast (DDP buffers) at step 6 for 12.0 s" in f.message
    ev = f.evidence
    assert ev["where"]["0"]["collective"] == {"op": "broadcast", "class": "ddp", "site": ""}
    assert ev["where"]["1"]["phase"] == "data" and "collective" not in ev["where"]["1"]
    assert ev["stack"]["at"] == "/job/train.py:162 in _train"
    assert "DataLoader worker" in f.fix


def test_a_rank_stuck_between_steps_outside_its_dataloader_is_said_to_be_in_its_own_code() -> None:
    # Phase "data" runs from a step's end to the next forward; a checkpoint callback
    # or a sleep between steps is in it too. A current stack without DataLoader
    # frames says it is not getting a batch.
    msgs = run_steps(steps=6, buffers=True)
    t = end_of(msgs)
    msgs += stuck({0: ("collective", 6), 1: ("data", 6)}, t, 12, colls={0: BROADCAST})
    msgs.append(stacks(1, t + 3 * S, step=6, phase="data"))
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [1]
    assert "rank 1 is behind, between steps (in its own code" in f.message
    assert "at /job/train.py:207 in _inject" in f.message
    assert f.evidence["where"]["1"]["phase"] == "data"  # the telemetry as it came
    assert f.evidence["stack"]["in_dataloader"] is False
    assert f.fix.startswith("Rank 1 is between steps in its own code")
    assert "DataLoader worker that died" not in f.fix


def test_every_rank_in_the_same_all_reduce_is_a_collective_that_never_completes() -> None:
    # PowerSGD's hook on gloo deadlocks so: three ranks at step 10, bucket 3, none behind.
    msgs = run_steps(world=3, steps=10)
    t = end_of(msgs)
    msgs += stuck({r: ("allreduce", 10) for r in range(3)}, t, 12)
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [0, 1, 2]
    assert "every rank waits in the same collective (waiting in all-reduce (bucket 3)" in f.message
    assert "mismatched collectives" not in f.message
    assert f.fix.startswith("All ranks reached this collective and wait in it")


def test_ranks_waiting_in_different_collectives_launched_mismatched_ones() -> None:
    msgs = run_steps(steps=20, loss_allreduce=True)
    t = end_of(msgs)
    msgs += stuck({0: ("collective", 20), 1: ("allreduce", 20)}, t, 10, colls={0: LOSS})
    (f,) = kinds(analyze(msgs))["hang"]
    assert "not all in the same one: they launched mismatched collectives" in f.message
    assert not f.fix.startswith("All ranks reached this collective")


def test_a_rank_between_steps_while_the_other_waits_in_the_loss_all_reduce() -> None:
    msgs = run_steps(steps=20, loss_allreduce=True)
    t = end_of(msgs)
    msgs += stuck({0: ("collective", 20), 1: ("idle", 20)}, t, 10, colls={0: LOSS})
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [1]
    assert "rank 1 is behind, between steps (in its own code" in f.message
    assert f"rank 0 is waiting in all_reduce at {SITE_LOSS} at step 20" in f.message
    assert f.evidence["groups"][0]["collective"] == f"all_reduce at {SITE_LOSS}"
    assert "between steps in its own code" in f.fix


def test_no_hang_while_the_waiter_is_blocked_less_than_the_limit() -> None:
    msgs = run_steps(steps=20, buffers=True)
    t = end_of(msgs)
    msgs += stuck({0: ("collective", 20), 1: ("data", 20)}, t, 4, colls={0: BROADCAST})
    assert "hang" not in kinds(analyze(msgs))


def test_a_rank_in_another_collective_than_the_majority_is_named_not_called_behind() -> None:
    """It may be ahead: on uneven data the rank with one batch more waits in its
    gradient all-reduce while the others wait past their loop."""
    msgs = run_steps(world=3, steps=20, buffers=True)
    t = end_of(msgs)
    phases = {0: ("collective", 20), 1: ("collective", 20), 2: ("collective", 20)}
    colls = {0: BROADCAST, 1: BROADCAST, 2: BARRIER}
    (f,) = kinds(analyze(msgs + stuck(phases, t, 10, colls=colls)))["hang"]
    assert f.ranks == [2]
    assert "rank 2 is at another collective than the others, waiting in barrier" in f.message
    assert "behind" not in f.message
    assert {g["collective"] for g in f.evidence["groups"]} == {
        "broadcast (DDP buffers)",
        f"barrier at {SITE_BARRIER}",
    }


def test_a_waiting_rank_a_step_short_of_the_others_is_behind() -> None:
    """Every rank waits, rank 2 at another collective and one step short: it is
    behind (the step count says so), not only apart."""
    msgs = run_steps(world=3, steps=20, buffers=True)
    t = end_of(msgs)
    msgs = [m for m in msgs if not (isinstance(m, Step) and m.rank == 2 and m.step == 19)]
    phases = {0: ("collective", 20), 1: ("collective", 20), 2: ("collective", 19)}
    colls = {0: BROADCAST, 1: BROADCAST, 2: BARRIER}
    (f,) = kinds(analyze(msgs + stuck(phases, t, 10, colls=colls)))["hang"]
    assert f.ranks == [2]
    assert "rank 2 is behind, waiting in barrier" in f.message


def test_a_stall_at_step_3_after_slow_warm_up_steps_is_called_within_seconds() -> None:
    """A first step that compiles and a second that rebuilds buckets must not set the
    limit of the steps after them (10 x their median would be minutes)."""
    warm = Phases(data=MS, forward=20 * S, backward=10 * S, optimizer=MS, other=0)

    def timing(rank: int, step: int) -> Phases:
        return warm if step < 2 else Phases()

    msgs = [*run_infos(2), *lockstep(2, 3, timing, buffers=True)]
    t = end_of(msgs)
    msgs += stuck({0: ("collective", 3), 1: ("data", 3)}, t, 7, colls={0: BROADCAST})
    analysis = analyze(msgs)
    (f,) = kinds(analysis)["hang"]
    assert f.ranks == [1] and f.evidence["threshold_s"] == 5.0
    early = analyze([m for m in msgs if m.t <= t + 4 * S])
    assert "hang" not in kinds(early)


def test_a_stall_during_warm_up_uses_the_shorter_warm_up_step() -> None:
    warm = Phases(data=MS, forward=2 * S, backward=MS, optimizer=MS, other=0)
    msgs = [*run_infos(2), *lockstep(2, 2, constant(warm), buffers=True)]
    t = end_of(msgs)
    msgs += stuck({0: ("collective", 2), 1: ("forward", 2)}, t, 25, colls={0: BROADCAST})
    hang = HangDetector()
    analysis = feed(Analysis([hang], history=2048), sorted(msgs, key=lambda m: m.t), TICK)
    limit, why = hang.threshold(analysis.latest)
    assert limit == pytest.approx(20.0, abs=0.1) and "warm-up" in why
    (f,) = kinds(analysis)["hang"]
    assert f.ranks == [1] and "rank 1 is behind, in its forward" in f.message


@pytest.mark.parametrize("limit", [2.0, 10.0])
def test_a_configured_limit_is_kept_from_the_first_steps(limit: float) -> None:
    """--hang-after: the hang is named once the stall passes it, whatever the history."""
    msgs = run_steps(steps=3, buffers=True)
    t = end_of(msgs)
    msgs += stuck({0: ("collective", 3), 1: ("data", 3)}, t, limit + 3, colls={0: BROADCAST})
    stalled = analyze([m for m in msgs if m.t <= t + int((limit + 1.5) * S)], hang_after_s=limit)
    (f,) = kinds(stalled)["hang"]
    assert f.ranks == [1] and f.evidence["threshold_s"] == limit
    before = analyze([m for m in msgs if m.t <= t + int((limit - 0.5) * S)], hang_after_s=limit)
    assert "hang" not in kinds(before)


def test_a_set_up_barrier_while_rank_0_prepares_data_is_not_a_hang() -> None:
    # `if rank == 0: download(); dist.barrier()` before the first step, for 2 minutes.
    msgs: list[Message] = list(run_infos(2))
    msgs += stuck({0: ("idle", 0), 1: ("collective", 0)}, 0, 120, colls={1: BARRIER})
    assert "hang" not in kinds(analyze(msgs))
    # The same wait in the barrier once training runs is one.
    later = run_steps(steps=20)
    t = end_of(later)
    later += stuck({0: ("idle", 20), 1: ("collective", 20)}, t, 10, colls={1: BARRIER})
    assert kinds(analyze(later))["hang"][0].ranks == [0]


def test_before_the_first_step_a_wait_in_ddps_broadcast_still_counts() -> None:
    msgs: list[Message] = list(run_infos(2))
    msgs += stuck({0: ("collective", 0), 1: ("data", 0)}, 0, 70, colls={0: BROADCAST})
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [1] and f.evidence["threshold_s"] == HANG_COLD_S


def test_a_final_checkpoint_while_the_others_wait_in_a_barrier_ends_as_info() -> None:
    # After the last step rank 0 writes a checkpoint for 20 s; rank 1 waits in the final
    # barrier. It looks like a hang until both ranks end normally: then the job is done.
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck({0: ("idle", 20), 1: ("collective", 20)}, t, 20, colls={1: BARRIER})
    during = analyze(msgs)
    assert kinds(during)["hang"][0].severity == "error"
    t_end = t + 20 * S + 5 * MS
    msgs += [end(0, 20, t_end), end(1, 20, t_end + 300 * MS)]
    found = kinds(analyze(msgs))
    (f,) = found["hang"]
    assert f.severity == "info" and not f.active
    assert "every rank finished normally" in f.message
    assert f.evidence["resolved"] == "finished normally"
    assert "rank_exit" not in found


def test_a_checkpoint_written_mid_run_while_the_other_waits_in_a_barrier_is_no_hang() -> None:
    # Rank 0 in torch.save for 20 s at step 20 (slow storage), rank 1 in the barrier
    # after it; then training goes on. With ~8 ms steps the limit is 5 s.
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck({0: ("save", 20), 1: ("collective", 20)}, t, 20, colls={1: BARRIER})
    assert "hang" not in kinds(analyze(msgs))
    t_back = t + 20 * S + 5 * MS
    msgs += [step_at(0, 20, t_back), step_at(1, 20, t_back + MS)]
    assert "hang" not in kinds(analyze(msgs))


def test_a_checkpoint_write_that_never_returns_is_a_hang_naming_the_save() -> None:
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    long = HANG_OWN_WORK_S + 10
    msgs += stuck(
        {0: ("save", 20), 1: ("collective", 20)}, t, long, every=10 * S, colls={1: BARRIER}
    )
    before = [m for m in msgs if m.t <= t + int((HANG_OWN_WORK_S - 10) * S)]
    assert "hang" not in kinds(analyze(before))
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.severity == "error" and f.ranks == [0]
    assert "rank 0 is behind, saving a checkpoint (in torch.save)" in f.message
    assert f.fix.startswith("Rank 0 has been inside torch.save for minutes")


def test_a_rank_computing_alone_while_the_other_waits_in_a_barrier_is_no_hang() -> None:
    # Rank 0 evaluates model.module by itself for 20 s after step 20 (its phase stays
    # "data": no DDP forward), its training thread on a CPU 95% of the time; rank 1
    # waits in the barrier after the evaluation. Then training goes on.
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck(
        {0: ("data", 20), 1: ("collective", 20)},
        t,
        20,
        colls={1: BARRIER},
        runnable={0: 0.95, 1: 0.0},
    )
    assert "hang" not in kinds(analyze(msgs))
    t_back = t + 20 * S + 5 * MS
    msgs += [step_at(0, 20, t_back), step_at(1, 20, t_back + MS)]
    assert "hang" not in kinds(analyze(msgs))


@pytest.mark.parametrize("share", [0.0, 0.2])
def test_a_rank_blocked_in_its_own_code_while_the_other_waits_is_a_hang(share: float) -> None:
    # The same wait, rank 0 asleep or blocked on I/O or a lock most of the time.
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck(
        {0: ("data", 20), 1: ("collective", 20)},
        t,
        8,
        colls={1: BARRIER},
        runnable={0: share, 1: 0.0},
    )
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [0] and f.severity == "error"
    assert "computing" not in f.message and f.evidence["computing"] == {}


def test_a_rank_computing_past_the_own_work_limit_is_a_hang() -> None:
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck(
        {0: ("idle", 20), 1: ("collective", 20)},
        t,
        HANG_OWN_WORK_S + 10,
        every=10 * S,
        colls={1: BARRIER},
        runnable={0: 1.0},
    )
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [0] and f.evidence["stalled_s"] >= HANG_OWN_WORK_S
    # Said as what it does, not by the phase it was last in ("between steps").
    assert "rank 0 is behind, computing outside any collective at step 20" in f.message
    assert "runnable 100% of the last heartbeat interval" in f.message
    assert f.evidence["computing"] == {"0": 1.0}
    assert f.fix.startswith("Rank 0 has been computing outside any collective for over 5")


CHECKPOINT = "/ckpt/epoch=3-step=20.ckpt"


@pytest.mark.parametrize("op", ["write", "sync", "close", "read"])
def test_a_rank_blocked_on_a_file_while_the_other_waits_is_no_hang(op: str) -> None:
    # Rank 0 writes a checkpoint outside torch.save (Lightning through fsspec, DCP's
    # fsync) to slow storage for 40 s between steps, asleep in the system call
    # (runnable 0%); rank 1 waits in the barrier after it. Then training goes on.
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck(
        {0: ("data", 20), 1: ("collective", 20)},
        t,
        40,
        colls={1: BARRIER},
        runnable={0: 0.0, 1: 0.0},
        io={0: (op, CHECKPOINT)},
    )
    assert "hang" not in kinds(analyze(msgs))
    t_back = t + 40 * S + 5 * MS
    msgs += [step_at(0, 20, t_back), step_at(1, 20, t_back + MS)]
    assert "hang" not in kinds(analyze(msgs))


def test_a_rank_blocked_on_a_pipe_or_asleep_is_still_a_hang_at_the_usual_limit() -> None:
    # The same wait with no file named (a DataLoader queue, a lock, a sleep): the
    # step-time limit, not the time a checkpoint gets.
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck({0: ("data", 20), 1: ("collective", 20)}, t, 8, colls={1: BARRIER},
                  runnable={0: 0.0, 1: 0.0})  # fmt: skip
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [0] and f.evidence["stalled_s"] < 10
    assert "file_io" not in f.evidence["where"]["0"]


@pytest.mark.parametrize(
    ("op", "said", "hint"),
    [
        ("write", f"writing {CHECKPOINT}", "blocked writing"),
        ("sync", f"flushing to storage {CHECKPOINT}", "blocked writing"),
        ("read", f"reading {CHECKPOINT}", "blocked reading"),
    ],
)
def test_a_file_operation_that_never_returns_is_a_hang_naming_the_file(
    op: str, said: str, hint: str
) -> None:
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck(
        {0: ("data", 20), 1: ("collective", 20)},
        t,
        HANG_OWN_WORK_S + 10,
        every=10 * S,
        colls={1: BARRIER},
        runnable={0: 0.0, 1: 0.0},
        io={0: (op, CHECKPOINT)},
    )
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [0] and f.evidence["stalled_s"] >= HANG_OWN_WORK_S
    # Said as what it does, not as the phase it was last in ("loading data").
    assert f"rank 0 is behind, {said} at step 20" in f.message
    assert "loading data" not in f.message.split(";")[0]
    assert f.evidence["where"]["0"]["file_io"] == {"op": op, "path": CHECKPOINT}
    assert f.evidence["computing"] == {}
    assert f.fix.startswith(f"Rank 0 has been {hint} {CHECKPOINT} for over 5 minutes")


#: An upload's pace (bytes/s) and ddpscope's own traffic during a stall.
UPLOADING = 8_000_000
OWN_TRAFFIC = 4_000


def test_a_rank_waiting_on_its_upload_threads_while_the_other_waits_is_no_hang() -> None:
    # Rank 0 uploads a checkpoint for 60 s between steps: boto3's threads send, its
    # training thread sleeps on their futures (runnable 0%, no file); rank 1 waits.
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck({0: ("idle", 20), 1: ("collective", 20)}, t, 60, colls={1: BARRIER},
                  runnable={0: 0.0, 1: 0.0}, moved={0: UPLOADING, 1: OWN_TRAFFIC})  # fmt: skip
    assert "hang" not in kinds(analyze(msgs))


@pytest.mark.parametrize("rate", [-1, 0, OWN_TRAFFIC])
def test_a_rank_whose_process_moves_nothing_is_a_hang_at_the_usual_limit(rate: int) -> None:
    # The same wait once the upload stalls (or the rank sleeps on a lock): only
    # ddpscope's own heartbeat traffic, or no measurement at all.
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck({0: ("idle", 20), 1: ("collective", 20)}, t, 8, colls={1: BARRIER},
                  runnable={0: 0.0, 1: 0.0}, moved={0: rate})  # fmt: skip
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [0] and f.evidence["stalled_s"] < 10
    assert "moving" not in f.message


def test_a_waiting_ranks_traffic_does_not_excuse_the_rank_behind() -> None:
    # Rank 1 waits in the barrier while a thread of its own uploads; rank 0, behind,
    # sleeps: rank 1's bytes say nothing about rank 0.
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck({0: ("idle", 20), 1: ("collective", 20)}, t, 8, colls={1: BARRIER},
                  runnable={0: 0.0, 1: 0.0}, moved={1: UPLOADING})  # fmt: skip
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [0]


def test_an_upload_that_outlasts_the_own_work_limit_is_a_hang_that_says_so() -> None:
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck({0: ("idle", 20), 1: ("collective", 20)}, t, HANG_OWN_WORK_S + 10,
                  every=10 * S, colls={1: BARRIER}, runnable={0: 0.0, 1: 0.0},
                  moved={0: UPLOADING})  # fmt: skip
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [0] and f.evidence["stalled_s"] >= HANG_OWN_WORK_S
    assert "its process moving 8.0 MB/s" in f.message
    assert f.evidence["where"]["0"]["moved_bps"] == UPLOADING
    assert "moved_bps" not in f.evidence["where"]["1"]  # waiting: its traffic is not counted
    assert f.fix.startswith("Rank 0 has been waiting on its own threads for over 5 minutes")


def test_a_normal_exit_that_leaves_another_rank_waiting_is_still_a_rank_exit() -> None:
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck({0: ("idle", 20), 1: ("collective", 20)}, t, 10, colls={1: BARRIER})
    msgs.append(end(0, 20, t + 10 * S + MS))
    msgs += stuck({1: ("collective", 20)}, t + 10 * S, 15, colls={1: BARRIER})
    found = kinds(analyze(msgs))
    (h,) = found["hang"]
    assert h.severity == "error" and not h.active and h.evidence["resolved"] == "a rank ended"
    (f,) = found["rank_exit"]
    assert f.ranks == [0] and f.severity == "error"


def test_a_rank_waiting_in_a_collective_for_a_crashed_peer_is_a_rank_exit_not_a_hang() -> None:
    msgs = run_steps(steps=10, loss_allreduce=True)
    t = end_of(msgs)
    msgs.append(end(1, 10, t + MS, "exception", TRACEBACK))
    msgs += stuck({0: ("collective", 10)}, t, 10, colls={0: LOSS})
    found = kinds(analyze(msgs))
    assert "hang" not in found
    (f,) = found["rank_exit"]
    assert f.ranks == [1]


STATIC_GRAPH_ASSERT = TRACEBACK.rsplit("\n", 2)[0] + (
    '\nRuntimeError: expect_autograd_hooks_ INTERNAL ASSERT FAILED at "/x/torch/csrc/distributed'
    '/c10d/reducer.cpp":1732, please report a bug to PyTorch. \n'
)


@pytest.mark.parametrize("static_graph", [True, False])
def test_ddps_autograd_hook_assert_under_a_static_graph_is_told_the_setting_to_change(
    static_graph: bool,
) -> None:
    # torch asks for a bug report; with static_graph=True the way out is the setting
    # (no_sync accumulation, or two backwards through one forward). Without it the
    # same words name no known cause, and the fix stays the traceback's.
    msgs = [*run_infos(2, ddp={"static_graph": static_graph}), *lockstep(2, 1, constant())]
    t = end_of(msgs)
    msgs += [end(r, 1, t + MS * (r + 1), "exception", STATIC_GRAPH_ASSERT) for r in range(2)]
    (f,) = kinds(analyze(msgs))["rank_exit"]
    assert "expect_autograd_hooks_" in f.message
    if static_graph:
        assert "static_graph=True" in f.fix and "no_sync()" in f.fix
    else:
        assert "static_graph" not in f.fix and "traceback" in f.fix


def test_the_assert_named_is_what_torch_raises_for_a_static_graph_under_no_sync(
    world_of_one: None,
) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(4, 4), static_graph=True)
    with pytest.raises(RuntimeError, match="expect_autograd_hooks_"), model.no_sync():
        model(torch.randn(2, 4)).sum().backward()


def _load_error(load: Any) -> str:
    """The end message's text for the RuntimeError ``load()`` raises, as a rank sends it."""
    from ddpscope.hooks.crashstacks import bounded_traceback

    try:
        load()
    except RuntimeError as e:
        return bounded_traceback(type(e), e, e.__traceback__)
    raise AssertionError("the state_dict loaded")


@pytest.mark.parametrize("saved_from", ["wrapper", "plain"])
def test_a_state_dict_that_misses_the_module_prefix_is_told_which_side_has_it(
    world_of_one: None, saved_from: str
) -> None:
    # The most asked DDP checkpoint error, with torch's real text: a checkpoint of
    # the wrapper loaded into the plain model, or the reverse. 150 layers make each
    # key list longer than the whole traceback an end message carries.
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(2, 2)] * 150))
    if saved_from == "wrapper":
        error = _load_error(lambda: model.module.load_state_dict(model.state_dict()))
    else:
        error = _load_error(lambda: model.load_state_dict(model.module.state_dict()))
    assert len(error) <= 4000
    msgs = [*run_infos(2), *lockstep(2, 1, constant())]
    t = end_of(msgs)
    msgs += [end(r, 1, t + MS * (r + 1), "exception", error) for r in range(2)]
    (f,) = kinds(analyze(msgs))["rank_exit"]
    assert "Error(s) in loading state_dict for " in f.message and ": Missing key(s)" in f.message
    if saved_from == "wrapper":
        assert "saved from the DDP wrapper" in f.fix
        assert "consume_prefix_in_state_dict_if_present" in f.fix
    else:
        assert "ddp_model.module.load_state_dict(state)" in f.fix


def test_a_state_dict_error_without_the_prefix_keeps_the_tracebacks_fix() -> None:
    error = TRACEBACK.rsplit("\n", 2)[0] + (
        "\nRuntimeError: Error(s) in loading state_dict for Net:\n"
        "\tsize mismatch for fc.weight: copying a param with shape torch.Size([4, 2]).\n"
    )
    msgs = [*run_infos(2), *lockstep(2, 1, constant())]
    msgs.append(end(0, 1, end_of(msgs) + MS, "exception", error))
    (f,) = kinds(analyze(msgs))["rank_exit"]
    assert "size mismatch for fc.weight" in f.message
    assert "module." not in f.fix and "traceback" in f.fix


def test_all_ranks_in_all_reduce_at_different_buckets() -> None:
    msgs = run_steps(world=4, steps=30)
    t = end_of(msgs)
    for r in range(4):
        msgs += stuck({r: ("allreduce", 30)}, t, 10, bucket=2 if r == 3 else 5)
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [3]
    assert {g["bucket"] for g in f.evidence["groups"]} == {2, 5}


def test_rank_without_telemetry_is_named_when_everyone_else_waits() -> None:
    msgs = [m for m in run_steps(world=3, steps=30) if m.rank != 2]
    t = end_of(msgs)
    msgs += stuck({0: ("allreduce", 30), 1: ("allreduce", 30)}, t, 10)
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.ranks == [2] and f.evidence["no_telemetry"] == [2]
    assert "sends no telemetry" in f.message


def test_cold_start_limit_before_the_first_step() -> None:
    msgs: list[Message] = list(run_infos(2))
    msgs += stuck({0: ("allreduce", 0), 1: ("forward", 0)}, 0, 40)
    assert "hang" not in kinds(analyze(msgs))  # first steps compile; ranks differ by seconds
    msgs = list(run_infos(2)) + stuck({0: ("allreduce", 0), 1: ("forward", 0)}, 0, 65)
    (f,) = kinds(analyze(msgs))["hang"]
    assert f.evidence["threshold_s"] == HANG_COLD_S and f.ranks == [1]


def test_no_hang_on_a_healthy_run() -> None:
    assert kinds(analyze(run_steps(world=4, steps=300))) == {}


def test_no_hang_after_the_run_ended() -> None:
    msgs = run_steps(steps=40)
    t = end_of(msgs)
    msgs += [end(r, 40, t + (r + 1) * MS) for r in range(2)]
    analysis = analyze(msgs)
    for dt in (10, 60, 600):
        analysis.tick(t + dt * S)
    assert kinds(analysis) == {}


def test_no_hang_on_slow_steps_that_progress() -> None:
    slow = Phases(data=500 * MS, forward=2 * S, backward=4 * S, optimizer=500 * MS, other=0)
    msgs = [*run_infos(2), *lockstep(2, 20, constant(slow), heartbeat_every=0)]
    # Heartbeats every second, as ranks send them; phases change within each 7 s step.
    msgs += busy([0, 1], 0, 0, end_of(msgs) / S, phases=("data", "forward", "backward"))
    assert kinds(analyze(msgs)) == {}


def test_no_hang_on_a_second_long_step_of_the_same_kind() -> None:
    """A checkpoint on rank 0 inside the loop every N steps: the first one's length
    raises the limit, so the next one is not called a hang again."""
    msgs = run_steps(steps=30)
    for first_step in (30, 41):
        t = end_of(msgs)
        msgs += stuck({0: ("data", first_step), 1: ("allreduce", first_step)}, t, 20)
        t_end = t + 20 * S + MS
        msgs += [step_at(r, first_step, t_end, dur=20 * S) for r in (0, 1)]
        msgs += lockstep(2, 10, constant(), first_step=first_step + 1, start_ns=t_end + MS)
    hang = HangDetector()
    analysis = feed(Analysis([hang], history=2048), msgs, TICK)
    analysis.tick(end_of(msgs))
    assert hang.threshold(analysis.latest)[0] == pytest.approx(40.0)
    (f,) = kinds(analysis)["hang"]
    assert f.evidence["episodes"] == 1 and f.step == 30  # the first checkpoint only
    assert f.severity == "warning" and not f.active


def test_no_hang_during_a_long_evaluation() -> None:
    msgs = run_steps(steps=40)
    t = end_of(msgs)
    msgs += busy([0, 1], 40, t, 60)
    assert kinds(analyze(msgs)) == {}


def test_no_hang_while_one_rank_evaluates_and_the_other_waits() -> None:
    msgs = run_steps(steps=40)
    t = end_of(msgs)
    msgs += busy([1], 40, t, 60)
    msgs += stuck({0: ("allreduce", 40)}, t, 60)
    assert kinds(analyze(msgs)) == {}


def test_no_hang_when_every_rank_is_in_its_own_code() -> None:
    """A slow first batch, a checkpoint on every rank: nobody waits for anybody."""
    msgs = run_steps(steps=40)
    t = end_of(msgs)
    msgs += stuck({0: ("data", 40), 1: ("data", 40)}, t, 120)
    assert kinds(analyze(msgs)) == {}


# --- rank_exit -----------------------------------------------------------------


def killed_then_peer_failed() -> list[Message]:
    """What a SIGKILLed rank leaves: no End; the other finishes a step, then fails."""
    msgs = run_steps(steps=3)
    t = end_of(msgs)
    msgs.append(step_at(0, 3, t + 5 * MS))
    gloo = TRACEBACK.replace(
        "ValueError: batch 17 has NaN labels", "RuntimeError: Connection reset"
    )
    msgs.append(end(0, 4, t + 60 * MS, "exception", gloo + "\nAt:\n  /x/comm.py(44): _done\n"))
    return msgs


def test_rank_killed_mid_run_post_mortem() -> None:
    analysis = finish(analyze(killed_then_peer_failed()))
    (f,) = kinds(analysis)["rank_exit"]
    assert f.severity == "error" and f.ranks == [1] and f.step == 3
    assert "without an end message" in f.message and "rank 0 then failed too" in f.message
    assert f.evidence["stopped"]["1"]["how"] == "vanished"
    assert f.evidence["others"]["0"]["error"] == "RuntimeError: Connection reset"
    assert "dmesg" in f.fix
    assert "hang" not in kinds(analysis)


def test_a_killed_rank_is_named_live_once_silent_for_the_limit() -> None:
    msgs = killed_then_peer_failed()
    analysis = analyze(msgs)
    # 55 ms after its last message rank 1's own end could still be on its way.
    assert [f.ranks for f in kinds(analysis)["rank_exit"]] == [[0]]
    analysis.tick(end_of(msgs) + 6 * S)
    (f,) = kinds(analysis)["rank_exit"]
    assert f.ranks == [1] and f.evidence["stopped"]["1"]["how"] == "vanished"
    assert "rank 0 then failed too" in f.message


def test_a_last_step_that_arrives_after_the_others_end_is_no_exit() -> None:
    """Live, a healthy end: rank 0's last step and End reach the watcher, a tick
    passes, then rank 1's last step and End arrive together (another relay, a
    publisher tick behind). Rank 1 was one step short for that tick, never gone."""
    msgs = run_steps(steps=47)
    t = end_of(msgs)
    tail = sequenced(
        [
            *msgs,
            step_at(0, 47, t + 10 * MS),
            end(0, 48, t + 12 * MS),
            step_at(1, 47, t + 300 * MS),
            end(1, 48, t + 302 * MS),
        ]
    )[-4:]
    analysis = feed(Analysis(detectors(), history=2048), msgs, tick_every_ns=TICK)
    for m in tail[:2]:
        analysis.feed(m, m.t)
    analysis.tick(t + 250 * MS)
    for m in tail[2:]:
        analysis.feed(m, m.t)
    analysis.tick(t + 500 * MS)
    assert kinds(finish(analysis)) == {}


def test_a_rank_starved_past_the_limit_that_comes_back_to_end_is_downgraded() -> None:
    """Rank 1's last step and End come 6 s after rank 0's: named once silent for the
    limit, then its goodbye shows it was alive all along."""
    msgs = run_steps(steps=47)
    t = end_of(msgs)
    msgs += [step_at(0, 47, t + 10 * MS), end(0, 48, t + 12 * MS)]
    analysis = analyze(msgs)
    analysis.tick(t + 6 * S)
    (f,) = kinds(analysis)["rank_exit"]
    assert f.active and f.ranks == [1] and "stopped at step 47" in f.message
    for m in sequenced([*msgs, step_at(1, 47, t + 6 * S + MS), end(1, 48, t + 6 * S + 2 * MS)])[
        -2:
    ]:
        analysis.feed(m, m.t)
    analysis.tick(t + 6 * S + 250 * MS)
    (f,) = kinds(finish(analysis))["rank_exit"]
    assert not f.active and f.severity == "warning" and "spoke again" in f.message


def killed_no_end() -> list[Message]:
    """Rank 1 SIGKILLed with steps still in its queue; rank 0 waits for it in an
    all-reduce for seconds, then is killed too (no End from either)."""
    msgs = run_steps(steps=2)
    t = end_of(msgs)
    msgs += [step_at(0, 2, t + 10 * MS), step_at(0, 3, t + 30 * MS)]
    msgs += [heartbeat(0, 4, t + k * S, phase="allreduce") for k in (1, 2)]
    return msgs


def killed_together() -> list[Message]:
    """Every rank SIGKILLed at once (a time limit, ``kill -9`` of the job): each file
    stops at its publisher's last write, rank 1's a tick before rank 0's."""
    msgs = run_steps(steps=2)
    t = end_of(msgs)
    return [*msgs, step_at(0, 2, t + 10 * MS), step_at(0, 3, t + 30 * MS)]


def finish(analysis: Analysis) -> Analysis:
    end_of_stream(analysis)
    return analysis


def test_killed_without_any_end_message_names_the_first_record_to_stop() -> None:
    analysis = analyze(killed_no_end())
    assert "rank_exit" not in kinds(analysis)  # the stream may still be coming in
    (f,) = kinds(finish(analysis))["rank_exit"]
    assert f.severity == "warning" and f.ranks == [1] and f.step == 2
    assert "left no end message and its record stops first" in f.message
    assert "most likely died first" in f.message
    assert f.evidence["stopped"]["1"]["certain"] is False
    assert f.evidence["others"]["0"]["state"].startswith("stopped without an end message")


def test_ranks_killed_together_are_not_named_for_a_flush_apart() -> None:
    # Rank 0's record holds two steps more than rank 1's, 30 ms on: rank 1 took part
    # in both (their all-reduces needed it), its publisher had not written them yet.
    analysis = finish(analyze(killed_together()))
    assert "rank_exit" not in kinds(analysis)


def killed_together_slow_heartbeat(heartbeat_s: float, gap_s: float) -> list[Message]:
    """The whole job killed at once, heartbeats every ``heartbeat_s``: rank 1's record
    stops at its last heartbeat, ``gap_s`` before rank 0's last step (rank 1 finished
    that step too, its publisher had not written it yet)."""
    infos = run_infos(2, options={"heartbeat_s": heartbeat_s})
    msgs = [*infos, *lockstep(2, 2, constant())]
    t = end_of(msgs)
    msgs.append(heartbeat(1, 2, t + 10 * MS, phase="forward"))
    return [*msgs, step_at(0, 2, t + 10 * MS + int(gap_s * S))]


def test_the_kill_together_window_follows_the_runs_heartbeat() -> None:
    # At 3 s heartbeats a rank's last written message can be ~3 s old when it dies.
    quiet = finish(analyze(killed_together_slow_heartbeat(3.0, gap_s=3.2)))
    assert "rank_exit" not in kinds(quiet)
    # Past a heartbeat and two flushes, the survivor outlived it.
    (f,) = kinds(finish(analyze(killed_together_slow_heartbeat(3.0, gap_s=3.8))))["rank_exit"]
    assert f.ranks == [1] and "most likely died first" in f.message
    # At the default 1 s heartbeat the 3.2 s gap is no kill-together.
    (f,) = kinds(finish(analyze(killed_together_slow_heartbeat(1.0, gap_s=3.2))))["rank_exit"]
    assert f.ranks == [1]


def test_the_kill_together_window_is_one_flush_of_the_publishers_tick() -> None:
    assert FLUSH_MAX_S == TICK_MAX_S


def test_a_rank_outlived_by_one_that_said_how_it_ended_is_named() -> None:
    # torchrun stops the others with SIGTERM: ddpscope's handler records why.
    msgs = killed_together()
    msgs.append(end(0, 4, end_of(msgs) + 40 * MS, reason="signal", error="SIGTERM"))
    (f,) = kinds(finish(analyze(msgs)))["rank_exit"]
    assert f.severity == "warning" and f.ranks == [1] and f.step == 2
    assert "most likely died first" in f.message


def test_killed_so_early_its_record_is_empty() -> None:
    """The victim's publisher never wrote a message; the other rank trained with it."""
    msgs = [m for m in killed_no_end() if m.rank == 0]  # rank 0's run info says world 2
    analysis = analyze(msgs)
    assert analysis.detector_errors == {}
    (f,) = kinds(finish(analysis))["rank_exit"]
    assert f.ranks == [1] and f.severity == "warning" and "record is empty" in f.message


def test_heartbeat_counts_name_the_rank_that_fell_behind() -> None:
    """Both last steps lost; rank 0's heartbeats show it got further, and lived on."""
    msgs = run_steps(steps=2)
    t = end_of(msgs)
    msgs += [heartbeat(1, 2, t + 2 * MS, phase="allreduce"), heartbeat(0, 3, t + 6 * MS)]
    msgs += [heartbeat(0, 4, t + 2 * S, phase="allreduce")]
    (f,) = kinds(finish(analyze(msgs)))["rank_exit"]
    assert f.ranks == [1] and f.step == 2


def test_whole_job_killed_in_step_with_each_other_is_not_blamed_on_anyone() -> None:
    msgs = run_steps(steps=20)
    assert kinds(finish(analyze(msgs))) == {}


def test_ctrl_c_on_every_rank_is_not_a_rank_exit() -> None:
    msgs = run_steps(steps=10)
    t = end_of(msgs)
    ki = "Traceback (most recent call last):\n  File x\nKeyboardInterrupt\n"
    msgs += [end(r, 10, t + MS * (r + 1), "exception", ki) for r in range(2)]
    assert kinds(finish(analyze(msgs))) == {}


def test_rank_silent_while_the_others_wait() -> None:
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck({0: ("allreduce", 20)}, t, 12)
    analysis = analyze(msgs)
    (f,) = kinds(analysis)["rank_exit"]
    assert f.ranks == [1] and f.evidence["stopped"]["1"]["how"] == "vanished"
    assert "hang" not in kinds(analysis)


def test_short_silence_is_not_an_exit() -> None:
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck({0: ("allreduce", 20)}, t, 3)
    assert "rank_exit" not in kinds(analyze(msgs))


def test_silent_rank_that_comes_back_is_downgraded() -> None:
    msgs = run_steps(steps=20)
    t = end_of(msgs)
    msgs += stuck({0: ("allreduce", 20)}, t, 8)
    msgs += lockstep(2, 5, constant(), first_step=20, start_ns=t + 8 * S + MS)
    (f,) = kinds(analyze(msgs))["rank_exit"]
    assert f.severity == "warning" and not f.active
    assert "spoke again" in f.message


def test_rank_raised_while_the_other_waits() -> None:
    msgs = run_steps(steps=10)
    t = end_of(msgs)
    msgs.append(end(1, 10, t + MS, "exception", TRACEBACK))
    msgs += stuck({0: ("allreduce", 10)}, t, 10)
    (f,) = kinds(analyze(msgs))["rank_exit"]
    assert f.ranks == [1]
    assert "Rank 1 raised ValueError: batch 17 has NaN labels at step 10" in f.message
    assert f.evidence["stopped"]["1"]["error"] == TRACEBACK
    assert "traceback" in f.fix


def test_rank_exited_early_while_the_other_waits() -> None:
    msgs = run_steps(steps=10)
    t = end_of(msgs)
    msgs.append(end(0, 10, t + MS))
    msgs += stuck({1: ("allreduce", 10)}, t, 10)
    (f,) = kinds(analyze(msgs))["rank_exit"]
    assert f.ranks == [0] and "exited normally at step 10" in f.message
    assert "Join" in f.fix


def test_every_rank_raising_is_reported() -> None:
    msgs = run_steps(steps=10)
    t = end_of(msgs)
    msgs += [end(r, 10, t + MS * (r + 1), "exception", TRACEBACK) for r in range(2)]
    (f,) = kinds(analyze(msgs))["rank_exit"]
    assert f.ranks == [0, 1] and "Ranks 0, 1 raised ValueError" in f.message


def test_a_later_different_error_is_a_consequence() -> None:
    msgs = run_steps(steps=10)
    t = end_of(msgs)
    msgs.append(end(1, 10, t + MS, "exception", TRACEBACK))
    msgs.append(end(0, 10, t + 9 * MS, "exception", "RuntimeError: Connection closed by peer"))
    (f,) = kinds(analyze(msgs))["rank_exit"]
    assert f.ranks == [1] and "rank 0 then failed too, a consequence" in f.message
    assert f.evidence["others"]["0"]["consequence_of"] == 1  # points to the first failure


@pytest.mark.parametrize("gap_ms", [10, 1000])
def test_consequences_that_differ_among_themselves_are_still_consequences(gap_ms: int) -> None:
    # Found on a real 3-rank job: rank 1 raised, ranks 0 and 2 then lost their
    # connection, each naming its own peer port. Rank 0's error differs from rank
    # 2's, but both come after rank 1's: rank 0 is not a first failure. With a
    # gap, the analysis first sees rank 1 raise while nobody went further yet;
    # the message must follow what came after.
    msgs = run_steps(world=3, steps=10)
    t = end_of(msgs)
    msgs.append(end(1, 10, t + MS, "exception", TRACEBACK))
    msgs += [step_at(r, 10, t + gap_ms * MS) for r in (0, 2)]
    lost = "RuntimeError: Connection closed by peer [127.0.0.1]:{}. This is typically caused"
    msgs.append(end(0, 11, t + (gap_ms + 10) * MS, "exception", lost.format(32436)))
    msgs.append(end(2, 11, t + (gap_ms + 11) * MS, "exception", lost.format(52112)))
    (f,) = kinds(analyze(msgs))["rank_exit"]
    assert f.ranks == [1], f.message
    assert "while ranks 0, 2 went on (to step 11); ranks 0, 2 then failed too" in f.message
    assert {q: e["consequence_of"] for q, e in f.evidence["others"].items()} == {"0": 1, "2": 1}


def test_no_exit_finding_when_rank_0_saves_after_the_others_ended() -> None:
    msgs = run_steps(steps=10)
    t = end_of(msgs)
    msgs += [end(r, 10, t + MS) for r in (1, 2) if r < 2]
    msgs += stuck({0: ("data", 10)}, t, 60)
    msgs.append(end(0, 10, t + 61 * S))
    assert kinds(analyze(msgs)) == {}


def test_no_exit_finding_under_join() -> None:
    """Rank 0 ran out of data and shadows all-reduces (Join) while rank 1 steps on."""
    msgs = run_steps(steps=8)
    t = end_of(msgs)
    for i in range(4):
        msgs.append(step_at(1, 8 + i, t + (i + 1) * 10 * MS))
        msgs.append(heartbeat(0, 8, t + (i + 1) * 10 * MS, phase="join", in_phase_s=i * 0.01))
    msgs += [end(0, 8, t + 50 * MS), end(1, 12, t + 51 * MS)]
    analysis = analyze(msgs)
    analysis.tick(t + 30 * S)
    assert kinds(analysis) == {}


def test_disabled_rank_is_telemetry_not_an_exit() -> None:
    msgs = run_steps(steps=10)
    t = end_of(msgs)
    msgs.append(end(1, 5, t - 40 * MS, "disabled", "RuntimeError: encode failed"))
    msgs += lockstep(2, 3, constant(), first_step=10, start_ns=t + MS)
    found = kinds(analyze(msgs))
    assert "rank_exit" not in found
    (f,) = found["telemetry"]
    assert f.severity == "warning" and f.ranks == [1]
    assert "turned itself off on rank 1" in f.message and "encode failed" in f.message


# --- telemetry -----------------------------------------------------------------


def feed_with_gaps(msgs: list[Message], drop_every: int, live: bool = True) -> Analysis:
    """Feed with sequence numbers that skip one in ``drop_every`` (a lossy wire)."""
    import dataclasses

    mode = LIVE if live else recorded(finished=True)
    analysis = Analysis([TelemetryDetector(mode)], history=2048, mode=mode)
    seq: dict[int, int] = {}
    for i, m in enumerate(sorted(msgs, key=lambda m: m.t)):
        n = seq.get(m.rank, 0) + (2 if drop_every and i % drop_every == drop_every - 1 else 1)
        seq[m.rank] = n
        analysis.feed(dataclasses.replace(m, seq=n), m.t)
    analysis.tick(end_of(msgs))
    return analysis


def test_a_few_drops_on_a_live_watcher_are_info() -> None:
    (f,) = kinds(feed_with_gaps(run_steps(steps=500), drop_every=400))["telemetry"]
    assert f.severity == "info" and f.evidence["lost"] >= 1
    assert "lost between the ranks and this watcher" in f.message


def test_many_drops_are_a_warning() -> None:
    (f,) = kinds(feed_with_gaps(run_steps(steps=200), drop_every=10))["telemetry"]
    assert f.severity == "warning" and f.evidence["lost_share"] > 0.05
    assert "SNDHWM" in f.fix


def test_sequence_gaps_in_a_recording_are_not_drops() -> None:
    assert kinds(feed_with_gaps(run_steps(steps=200), drop_every=10, live=False)) == {}


def test_queue_drops_are_missing_from_the_recording_too() -> None:
    msgs = run_steps(steps=100)
    t = end_of(msgs)
    msgs.append(heartbeat(0, 100, t + 1, dropped_queue=30))
    msgs.append(heartbeat(1, 100, t + 1, dropped_send=500))
    (f,) = kinds(feed_with_gaps(msgs, 0, live=False))["telemetry"]
    assert f.severity == "warning" and f.ranks == [0]
    assert "publisher queue was full" in f.message and "QUEUE_SIZE" in f.fix
    assert "not delivered to a live watcher (the recording has them)" in f.message


def test_send_drops_alone_in_a_recording_are_info() -> None:
    msgs = run_steps(steps=50)
    msgs.append(heartbeat(1, 50, end_of(msgs) + 1, dropped_send=7))
    (f,) = kinds(feed_with_gaps(msgs, 0, live=False))["telemetry"]
    assert f.severity == "info" and f.evidence["lost"] == 0


def test_silent_ranks_after_the_grace_period() -> None:
    msgs = [m for m in [*run_infos(4), *lockstep(4, 20, constant())] if m.rank < 2]
    t = end_of(msgs)
    analysis = analyze(msgs + busy([0, 1], 20, t, 5, phases=("data", "forward")))
    assert "telemetry" not in kinds(analysis)  # 5 s: ranks may still be starting
    analysis = analyze(msgs + busy([0, 1], 20, t, 20, phases=("data", "forward")))
    (f,) = kinds(analysis)["telemetry"]
    assert f.severity == "warning" and f.ranks == [2, 3]
    assert "Ranks 2, 3 of the 4" in f.message


def test_rejected_messages() -> None:
    msgs = run_steps(steps=200)
    msgs.append(heartbeat(7, 200, end_of(msgs) + 1))  # world size is 2
    (f,) = kinds(analyze(msgs))["telemetry"]
    assert f.severity == "info" and f.evidence["rejected"] == {"rank outside the world": 1}


def test_closed_handle_while_the_run_goes_on() -> None:
    msgs = run_steps(steps=10)
    t = end_of(msgs)
    msgs.append(end(1, 10, t + MS, "close"))
    msgs += [step_at(0, 10 + i, t + (i + 2) * 10 * MS) for i in range(5)]
    found = kinds(analyze(msgs))
    (f,) = found["telemetry"]
    assert f.severity == "info" and "handle was closed" in f.message
    assert "rank_exit" not in found


# --- helpers ---------------------------------------------------------------------


def test_ranks_text() -> None:
    assert ranks_text([]) == ""
    assert ranks_text([3, 0, 1, 2, 9, 11, 10]) == "0-3, 9-11"
    assert ranks_text([5, 0, 1]) == "0, 1, 5"


def test_error_line_finds_the_exception_not_the_trailing_frames() -> None:
    assert error_line(TRACEBACK) == "ValueError: batch 17 has NaN labels"
    torch_style = TRACEBACK + "\nAt:\n  /x/comm.py(44): _bucket_done\n"
    assert error_line(torch_style) == "ValueError: batch 17 has NaN labels"
    assert error_line("...cut\n  File x\nKeyError: 'lr'\n\nAt:\n  y(1): z") == "KeyError: 'lr'"
    assert error_line("") == ""


def test_a_rank_waiting_in_an_untimed_all_reduce_is_described_without_a_bucket() -> None:
    timed = Where(rank=1, phase="allreduce", step=3, bucket=4, in_phase_s=11.0, heard_s=0.5)
    untimed = Where(rank=1, phase="allreduce", step=3, bucket=-1, in_phase_s=11.0, heard_s=0.5)
    assert timed.describe() == "waiting in all-reduce (bucket 4) at step 3 for 11.0 s"
    # DDP's C++ path (no comm hook): the heartbeat's bucket is -1, never shown.
    assert untimed.describe() == "waiting in all-reduce at step 3 for 11.0 s"
