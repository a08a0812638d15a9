"""Recipe detectors on synthetic streams (no torch, no processes): each rule raises on the
fault it names and stays quiet on the healthy look-alike.

Streams are a few steps of lockstep DDP (tests/synth.py) plus the recipe messages a
rank's probe would send (ddpscope/hooks/recipe.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from ddpscope.analysis import report
from ddpscope.analysis.detectors.hang import HangDetector
from ddpscope.analysis.detectors.recipe.batchnorm import BatchNormDetector
from ddpscope.analysis.detectors.recipe.checkpoint import CheckpointDetector
from ddpscope.analysis.detectors.recipe.collectives import CollectiveMismatchDetector, blocked_in
from ddpscope.analysis.detectors.recipe.common import short_site
from ddpscope.analysis.detectors.recipe.dataparallel import DataParallelDetector
from ddpscope.analysis.detectors.recipe.device import DeviceDetector
from ddpscope.analysis.detectors.recipe.global_batch import GlobalBatchDetector
from ddpscope.analysis.detectors.recipe.process_group import ProcessGroupDetector
from ddpscope.analysis.detectors.recipe.setup import training_setup
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.protocol import Mode
from ddpscope.schema import (
    BatchInfo,
    Collectives,
    DataParallelSeen,
    End,
    Heartbeat,
    Message,
    RunInfo,
    SaveCall,
    Shutdown,
    Stacks,
    Step,
    decode,
    encode,
)
from tests.support.synth import (
    MS,
    RUN,
    constant,
    feed,
    findings,
    heartbeat,
    hparams,
    lockstep,
    record,
    run_infos,
)

S = 1_000_000_000
TRAIN = "/job/train.py"
WALL0 = 1_700_000_000_000_000_000


def batch(rank: int, size: int, *, t: int = 0, bn: int = 0, run: str = RUN) -> BatchInfo:
    names = [f"layer{i}.bn" for i in range(bn)]
    return BatchInfo(
        run=run, rank=rank, t=t, step=0, size=size, batchnorm=names, batchnorm_count=bn
    )


def save(rank: int, path: str, t: int, what: str = "other", key: str = "") -> SaveCall:
    return SaveCall(
        run=RUN, rank=rank, t=t, step=4, path=path, site=f"{TRAIN}:60 in save", what=what, key=key
    )


def snap(
    rank: int, step: int, t: int, counts: dict[tuple[str, str], int], *, final: bool = False
) -> Collectives:
    """Cumulative counts by (op, site) on the default group, or (op, "group|site")."""
    keys = sorted(counts)
    return Collectives(
        run=RUN,
        rank=rank,
        t=t,
        step=step,
        final=final,
        ops=[op for op, _ in keys],
        groups=[s.split("|")[0] if "|" in s else "" for _, s in keys],
        sites=[s.split("|")[-1] for _, s in keys],
        counts=[counts[k] for k in keys],
    )


def end(rank: int, step: int, t: int, reason: str = "exit") -> End:
    return End(run=RUN, rank=rank, t=t, reason=reason, step=step)


def shutdown(rank: int, step: int, t: int, alive: bool) -> Shutdown:
    return Shutdown(run=RUN, rank=rank, t=t, step=step, pg_initialized=alive)


def steps(world: int, n: int, **kw: Any) -> list[Message]:
    return lockstep(world, n, constant(), heartbeat_every=0, **kw)


def last_t(msgs: Sequence[Message]) -> int:
    return max(m.t for m in msgs)


def run_of(analysis: Analysis) -> Any:
    run = analysis.latest
    assert run is not None
    return run


# --- schema ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [
        batch(0, 32, bn=2),
        save(0, "/ckpt.pt", 5, what="ddp_state_dict", key="model"),
        snap(1, 4, 5, {("all_reduce", "a.py:1 in f"): 3}, final=True),
        DataParallelSeen(run=RUN, rank=0, step=0, site="", module="m.Net", inside_ddp=True),
        shutdown(0, 8, 9, alive=True),
    ],
)
def test_recipe_messages_survive_the_wire(msg: Message) -> None:
    assert decode(encode(msg)) == msg


def test_older_senders_run_info_reads_with_empty_recipe_fields() -> None:
    info = run_infos(1)[0]
    body = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
    for name in ("script", "cuda_visible", "device_expected", "device_uuid"):
        del body[name]
    import msgpack

    got = decode(msgpack.packb({**body, "k": "run_info"}))
    assert isinstance(got, RunInfo)
    assert (got.script, got.cuda_visible, got.device_expected, got.device_uuid) == ("", -1, "", "")


# --- global batch and lr ----------------------------------------------------------------


def setup_stream(
    world: int,
    size: int,
    lr: float,
    *,
    run: str = RUN,
    accum: int = 1,
    script: str = TRAIN,
    decayed: float | None = None,
    peak: float | None = None,
) -> list[Message]:
    """A run's start; a warm-up raises lr to ``peak`` by step 2, a schedule lowers it to
    ``decayed`` by step 3."""
    out: list[Message] = [*run_infos(world, run=run, script=script)]
    out += [batch(r, size, run=run, t=900 * MS) for r in range(world)]
    stepped = lockstep(world, 3, constant(), run=run, heartbeat_every=0)
    out += [
        dataclasses.replace(m, micro_batches=accum) if isinstance(m, Step) else m for m in stepped
    ]
    out += [hparams(r, 1, run=run, t=last_t(stepped) + r, lr=lr) for r in range(world)]
    for step, rate in ((2, peak), (3, decayed)):
        if rate is not None:
            t = last_t(out) + MS
            out += [hparams(r, step, run=run, t=t + r, lr=rate) for r in range(world)]
    return out


def test_training_setup_multiplies_batch_world_and_accumulation() -> None:
    analysis = feed(Analysis([]), setup_stream(4, 16, 0.1, accum=2))
    setup = training_setup(run_of(analysis))
    assert (setup.per_rank_batch, setup.accumulation, setup.global_batch) == (16, 2, 128)
    assert setup.exact and setup.lr == 0.1 and setup.optimizer == "SGD"
    assert (
        setup.text() == "global batch 128 = 16 per rank x 4 ranks x 2 accumulation steps · lr 0.1"
    )


def test_under_ddp_subgroups_the_global_batch_is_one_groups() -> None:
    # A 2-D layout: DDP groups {0, 2} and {1, 3}; a model-parallel pair shares its batch.
    stream = [
        dataclasses.replace(m, ddp={**m.ddp, "dp_ranks": [0, 2] if m.rank % 2 == 0 else [1, 3]})
        if isinstance(m, RunInfo)
        else m
        for m in setup_stream(4, 16, 0.1, accum=2)
    ]
    setup = training_setup(run_of(feed(Analysis([]), stream)))
    assert (setup.global_batch, setup.dp_size, setup.world_size) == (64, 2, 4)
    assert setup.text().startswith(
        "global batch 64 = 16 per rank x 2 ranks of one DDP group (4 in all) x 2 accumulation"
    )


def test_training_setup_keeps_the_starting_lr_and_shows_where_a_schedule_took_it() -> None:
    setup = training_setup(run_of(feed(Analysis([]), setup_stream(2, 16, 0.1, decayed=0.001))))
    assert (setup.lr, setup.lr_last) == (0.1, 0.001)
    assert setup.text() == "global batch 32 = 16 per rank x 2 ranks · lr 0.1 → 0.001"
    assert setup.to_json()["lr_last"] == 0.001


def test_training_setup_shows_the_peak_a_warm_up_rose_to() -> None:
    stream = setup_stream(2, 16, 0.01, peak=0.1, decayed=0.001)
    setup = training_setup(run_of(feed(Analysis([]), stream)))
    assert (setup.lr, setup.lr_last, setup.lr_peak) == (0.01, 0.001, 0.1)
    assert setup.text().endswith("· lr 0.01 → 0.001, peak 0.1")
    # A plain decay peaks where it starts: nothing more to say.
    decay = training_setup(run_of(feed(Analysis([]), setup_stream(2, 16, 0.1, decayed=0.01))))
    assert decay.lr_peak == 0.1 and decay.text().endswith("· lr 0.1 → 0.01")


def test_training_setup_estimates_from_the_ranks_it_has_heard() -> None:
    msgs = [m for m in setup_stream(4, 16, 0.1) if not (isinstance(m, BatchInfo) and m.rank)]
    setup = training_setup(run_of(feed(Analysis([]), msgs)))
    assert setup.global_batch == 64 and not setup.exact
    assert setup.text().startswith("global batch ~64 = 16 per rank x 4 ranks")


def test_training_setup_is_empty_before_anything_is_known() -> None:
    setup = training_setup(run_of(feed(Analysis([]), run_infos(2))))
    assert setup.global_batch is None and setup.lr is None and setup.text() == ""


def started_at(msg: Message, wall_ns: int) -> Message:
    """A run's messages as if it started at ``wall_ns`` (runs are ordered by start)."""
    return dataclasses.replace(msg, started_wall_ns=wall_ns) if isinstance(msg, RunInfo) else msg


def settled(analysis: Analysis, msgs: list[Message]) -> Analysis:
    """Feed, ticking every 100 ms, and once more at the end as a replay does."""
    feed(analysis, msgs, tick_every_ns=100 * MS)
    analysis.tick(last_t(msgs))
    return analysis


def two_runs(first: list[Message], second: list[Message]) -> Analysis:
    later = [dataclasses.replace(m, t=m.t + 100 * S) for m in second]
    later = [started_at(m, WALL0 + 100 * S) for m in later]
    return settled(Analysis([GlobalBatchDetector()]), [*first, *later])


def test_world_size_changed_with_the_same_lr_is_an_info_finding() -> None:
    analysis = two_runs(setup_stream(2, 32, 0.05, run="a"), setup_stream(4, 32, 0.05, run="b"))
    (f,) = findings(analysis, "global_batch")
    assert f.severity == "info" and "from 2 to 4 ranks" in f.message
    assert "64 to 128 samples" in f.message and "x2 under the linear scaling rule" in f.fix
    assert f.evidence["previous_run"] == "a"
    assert analysis.books["a"].get("global_batch", "world") is None


@pytest.mark.parametrize(
    ("second", "why"),
    [
        (dict(world=4, size=32, lr=0.1), "lr scaled with the world"),
        (dict(world=4, size=16, lr=0.05), "per-rank batch halved: same global batch"),
        (dict(world=2, size=32, lr=0.05), "same world size"),
        (dict(world=4, size=32, lr=0.05, script="/job/other.py"), "another script"),
    ],
)
def test_no_global_batch_finding_when_the_change_was_matched(
    second: dict[str, Any], why: str
) -> None:
    world, size, lr = second.pop("world"), second.pop("size"), second.pop("lr")
    analysis = two_runs(
        setup_stream(2, 32, 0.05, run="a"), setup_stream(world, size, lr, run="b", **second)
    )
    assert findings(analysis, "global_batch") == [], why


def test_a_primed_previous_run_is_compared_like_one_seen_live() -> None:
    earlier = feed(Analysis([]), setup_stream(2, 32, 0.05, run="a"))
    det = GlobalBatchDetector()
    det.prime(run_of(earlier))
    later = [started_at(m, WALL0 + S) for m in setup_stream(1, 32, 0.05, run="b")]
    analysis = settled(Analysis([det]), later)
    (f,) = findings(analysis, "global_batch")
    assert "from 2 to 1 ranks" in f.message


@pytest.mark.parametrize("decayed", [None, 0.005], ids=["constant-lr", "lr-schedule"])
def test_the_report_compares_the_starting_lr_of_the_previous_recording(
    tmp_path: Any, decayed: float | None
) -> None:
    # The earlier run's scheduler lowered its lr; the later run, on twice the ranks, starts
    # at the same lr and is read only up to its first hyperparameters: both start at 0.05.
    record(tmp_path, setup_stream(2, 32, 0.05, run="a", decayed=decayed), run="a")
    later = [dataclasses.replace(m, t=m.t + 100 * S) for m in setup_stream(4, 32, 0.05, run="b")]
    record(tmp_path, [started_at(m, WALL0 + 100 * S) for m in later], run="b")
    analysis, _, _ = report.analyze(str(tmp_path), run_id="b")
    (f,) = findings(analysis, "global_batch")
    assert "stayed 0.05" in f.message
    assert f.evidence["previous"]["lr"] == 0.05
    assert f.evidence["previous"]["lr_last"] == (decayed or 0.05)


def test_the_report_compares_with_the_previous_recording_of_the_script(tmp_path: Any) -> None:
    # The detector reads no files: the report reads the earlier recording (analysis/prior.py).
    record(tmp_path, setup_stream(2, 32, 0.05, run="a"), run="a")
    later = [dataclasses.replace(m, t=m.t + 100 * S) for m in setup_stream(4, 32, 0.05, run="b")]
    record(tmp_path, [started_at(m, WALL0 + 100 * S) for m in later], run="b")
    analysis, _, _ = report.analyze(str(tmp_path), run_id="b")
    (f,) = findings(analysis, "global_batch")
    assert f.evidence["previous_run"] == "a" and "from 2 to 4 ranks" in f.message


# --- checkpoints -------------------------------------------------------------------------


def checkpoint_analysis(msgs: Sequence[Message], hosts: list[str] | None = None) -> Analysis:
    infos = run_infos(2)
    if hosts:
        infos = [dataclasses.replace(i, host=h) for i, h in zip(infos, hosts, strict=True)]
    return feed(Analysis([CheckpointDetector()]), [*infos, *msgs])


def test_two_ranks_writing_one_checkpoint_path_is_a_warning() -> None:
    analysis = checkpoint_analysis([save(0, "/ck/last.pt", 10), save(1, "/ck/last.pt", 11)])
    (f,) = findings(analysis, "checkpoint_all_ranks")
    assert f.severity == "warning" and f.ranks == [0, 1]
    assert "/ck/last.pt" in f.message and "job/train.py:60 (in save)" in f.message
    assert f.evidence["same_host"] is True


def test_one_path_on_different_hosts_is_only_info() -> None:
    msgs = [save(0, "/local/ck.pt", 10), save(1, "/local/ck.pt", 11)]
    (f,) = findings(checkpoint_analysis(msgs, hosts=["a", "b"]), "checkpoint_all_ranks")
    assert f.severity == "info" and "shared filesystem" in f.message


def test_rank0_only_and_per_rank_paths_are_healthy() -> None:
    msgs = [save(0, "/ck/last.pt", 10), save(0, "/ck/r0.pt", 11), save(1, "/ck/r1.pt", 12)]
    assert findings(checkpoint_analysis(msgs), "checkpoint_all_ranks") == []


def test_saving_the_ddp_wrappers_state_dict_names_the_prefix_as_info() -> None:
    # PyTorch's DDP tutorial and ImageNet example save it and resume into the
    # wrapper, which works: a note on where it fails, not a warning.
    msgs = [save(0, "/ck/last.pt", 10, what="ddp_state_dict", key="model")]
    (f,) = findings(checkpoint_analysis(msgs), "checkpoint_all_ranks")
    assert f.ranks == [0] and f.severity == "info"
    assert "'module.' prefix" in f.message and "under key 'model'" in f.message
    assert "loads back into a DDP-wrapped model" in f.message
    assert "model.module.state_dict()" in f.fix


def test_saving_the_ddp_wrapper_itself_is_named_as_a_warning() -> None:
    (f,) = findings(
        checkpoint_analysis([save(0, "/m.pt", 10, what="ddp_module")]), "checkpoint_all_ranks"
    )
    assert "wrapper itself" in f.message and f.severity == "warning"


# --- collectives: counts -----------------------------------------------------------------

AR0 = ("all_reduce", f"{TRAIN}:120 in log_metrics")
BAR = ("barrier", f"{TRAIN}:140 in save")


def counted(
    world: int,
    n_steps: int,
    snaps: list[Collectives],
    tail: Sequence[Message] = (),
    **kw: Any,
) -> Analysis:
    """Lockstep steps with each snapshot placed where a rank sends it: right after it
    closed its ``step``-th step, before the next one."""
    base: list[Message] = [*run_infos(world), *steps(world, n_steps, **kw)]
    closed = {(m.rank, m.step + 1): m.t for m in base if isinstance(m, Step)}
    placed = [dataclasses.replace(s, t=closed[(s.rank, s.step)] + 1) for s in snaps]
    msgs = sorted([*base, *placed], key=lambda m: m.t)
    return feed(Analysis([CollectiveMismatchDetector()]), [*msgs, *tail], tick_every_ns=1)


def test_a_collective_counted_on_rank0_only_at_two_snapshots_is_an_error() -> None:
    analysis = counted(
        2, 6, [snap(0, 2, 0, {AR0: 2}), snap(0, 4, 0, {AR0: 4})]
    )  # rank 1 never counted anything: no messages from it
    (f,) = findings(analysis, "rank0_only_collective")
    assert f.severity == "error" and f.ranks == [0] and f.step == 2
    assert (
        "issued 4 more calls of torch.distributed.all_reduce() than rank 1 by step 4" in f.message
    )
    assert "job/train.py:120 (in log_metrics)" in f.message
    assert f.evidence["counts"] == {"0": 4, "1": 0}
    assert f.evidence["sites"] == {"0": [AR0[1]]}


def test_a_steady_offset_is_a_boundary_not_a_fault() -> None:
    # Rank 0 calls its barrier just before the optimizer step, rank 1 just after: rank 1's
    # count trails by one at every snapshot, yet the order of collectives matches.
    snaps = [snap(0, n, 0, {BAR: n}) for n in (1, 2, 4)]
    snaps += [snap(1, n, 0, {BAR: n - 1}) for n in (2, 4)]
    assert findings(counted(2, 6, snaps), "rank0_only_collective") == []


def test_equal_counts_at_different_sites_match() -> None:
    snaps = [
        snap(0, 1, 0, {AR0: 1}),
        snap(1, 1, 0, {("all_reduce", f"{TRAIN}:99 in other_branch"): 1}),
        snap(0, 2, 0, {AR0: 2}),
        snap(1, 2, 0, {("all_reduce", f"{TRAIN}:99 in other_branch"): 2}),
    ]
    assert findings(counted(2, 4, snaps), "rank0_only_collective") == []


def test_subgroup_collectives_are_compared_among_members_only() -> None:
    pair = ("all_reduce", f"0,1|{TRAIN}:77 in pipeline")
    snaps = [snap(r, n, 0, {pair: n}) for n in (1, 2, 4) for r in (0, 1)]
    assert findings(counted(4, 6, snaps), "rank0_only_collective") == []


def test_with_a_majority_the_odd_rank_out_is_named() -> None:
    # Rank 2 calls its barrier twice per step, the others once.
    snaps = [snap(r, n, 0, {BAR: n * (2 if r == 2 else 1)}) for n in (1, 2, 4) for r in range(4)]
    (f,) = findings(counted(4, 6, snaps), "rank0_only_collective")
    assert f.ranks == [2] and f.step == 1 and f.last_step == 4  # raised at 2, updated at 4
    assert "issued 4 more calls of torch.distributed.barrier() than rank 0 by step 4" in f.message


def test_shutdown_counts_name_a_rank_that_called_more_than_the_clean_exits() -> None:
    # Rank 0 all-reduced a final metric alone; rank 1 exited, rank 0 then failed in it.
    base = [*run_infos(2), *steps(2, 4)]
    t = last_t(base)
    tail: list[Message] = [
        shutdown(1, 4, t + 1, alive=False),
        end(1, 4, t + 2),
        snap(0, 4, t + 3, {AR0: 1}, final=True),
        shutdown(0, 4, t + 4, alive=True),
        end(0, 4, t + 5, reason="exception"),
    ]
    analysis = feed(Analysis([CollectiveMismatchDetector()]), [*base, *tail], tick_every_ns=1)
    (f,) = findings(analysis, "rank0_only_collective")
    assert f.ranks == [0] and "by the end of the run" in f.message and f.evidence["final"]


def test_ranks_that_all_failed_are_not_compared_at_shutdown() -> None:
    # Both timed out inside different collectives: their counts are cut short.
    base = [*run_infos(2), *steps(2, 4)]
    t = last_t(base)
    tail: list[Message] = [
        snap(0, 4, t + 1, {AR0: 1}, final=True),
        end(0, 4, t + 2, reason="exception"),
        snap(1, 4, t + 3, {BAR: 1}, final=True),
        end(1, 4, t + 4, reason="exception"),
    ]
    analysis = feed(Analysis([CollectiveMismatchDetector()]), [*base, *tail], tick_every_ns=1)
    assert findings(analysis, "rank0_only_collective") == []


def test_buffer_broadcast_totals_match_when_an_evaluation_forward_replaces_a_training_one() -> None:
    train = ("ddp_buffers", "(training forwards)")
    evaluation = ("ddp_buffers", f"{TRAIN}:200 in evaluate")
    snaps = [
        snap(0, 4, 0, {train: 3, evaluation: 1}),
        snap(1, 4, 0, {train: 4}),
        snap(0, 8, 0, {train: 7, evaluation: 1}),
        snap(1, 8, 0, {train: 8}),
    ]
    assert findings(counted(2, 10, snaps), "rank0_only_collective") == []


@pytest.mark.parametrize("join", [False, True])
def test_buffer_broadcast_counts_are_not_compared_when_the_steps_ran_under_join(
    join: bool,
) -> None:
    # Under Join the ranks' buffer broadcasts need not pair up one to one (a joined rank
    # shadows them outside any forward); the steps' own Join flag says so before any
    # rank has run out and shadowed an all-reduce.
    train = ("ddp_buffers", "(training forwards)")
    snaps = [
        snap(0, 2, 0, {train: 2}),
        snap(1, 2, 0, {train: 3}),
        snap(0, 4, 0, {train: 4}),
        snap(1, 4, 0, {train: 6}),
    ]
    found = findings(counted(2, 6, snaps, join=join), "rank0_only_collective")
    assert (found == []) is join


def test_a_rank_that_joined_early_is_not_compared_after_its_last_step() -> None:
    # Uneven inputs under Join: rank 0 ran out of data after 2 steps and shadowed rank 1's
    # collectives (buffer broadcasts outside any forward, not counted) until rank 1 finished.
    train = ("ddp_buffers", "(training forwards)")
    base: list[Message] = [*run_infos(2)]
    stepped = steps(2, 4)
    base += [m for m in stepped if m.rank == 1 or getattr(m, "step", 0) < 2]
    t = last_t(base)
    tail: list[Message] = [
        snap(0, 1, 0, {train: 1}),
        snap(1, 1, 0, {train: 1}),
        snap(0, 2, 0, {train: 2}),
        snap(1, 2, 0, {train: 2}),
        snap(1, 4, 0, {train: 4}),
        heartbeat(0, 2, t + 1, phase="join", join_shadow=6),
        snap(0, 2, t + 2, {train: 2}, final=True),
        shutdown(0, 2, t + 3, alive=False),
        end(0, 2, t + 4),
        snap(1, 4, t + 5, {train: 4}, final=True),
        shutdown(1, 4, t + 6, alive=False),
        end(1, 4, t + 7),
    ]
    tail = [dataclasses.replace(m, t=m.t or t) for m in tail]
    analysis = feed(Analysis([CollectiveMismatchDetector()]), [*base, *tail], tick_every_ns=1)
    assert findings(analysis, "rank0_only_collective") == []


# --- collectives: stacks -------------------------------------------------------------------

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
DDP_PY = "/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py"
WRAPPER = "/venv/lib/python3.11/site-packages/ddpscope/hooks/recipe.py"


def frames_in(op: str, func: str = "_epoch_end", line: int = 224) -> list[list[Any]]:
    return [
        [TRAIN, 300, "<module>"],
        [TRAIN, 150, "main"],
        [TRAIN, line, func],
        [WRAPPER, 610, "wrapper"],
        ["/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", 83, "wrapper"],
        [C10D, 5356, op],
    ]


def test_blocked_in_reads_the_op_and_the_scripts_call_site() -> None:
    assert blocked_in(frames_in("barrier")) == ("barrier", f"{TRAIN}:224 in _epoch_end")
    nested = [*frames_in("all_gather_object"), [C10D, 3000, "all_gather"]]
    assert blocked_in(nested) == ("all_gather_object", f"{TRAIN}:224 in _epoch_end")
    ddp = [
        [TRAIN, 40, "evaluate"],
        ["/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", 1775, "_call_impl"],
        [DDP_PY, 1660, "forward"],
        [DDP_PY, 1781, "_pre_forward"],
        [DDP_PY, 2405, "_sync_buffers"],
    ]
    assert blocked_in(ddp) == ("ddp_buffers", f"{TRAIN}:40 in evaluate")
    assert blocked_in([[TRAIN, 10, "main"], [TRAIN, 20, "sleepy"]]) is None
    assert blocked_in([[DDP_PY, 1, "forward"]]) is None


def stuck_stream(
    rank0: tuple[str, list[list[Any]] | None],
    rank1: tuple[str, list[list[Any]] | None],
    secs: int = 10,
) -> list[Message]:
    """Four steps, then each rank in one phase for ``secs`` with heartbeats each second;
    a stack dump (when given) two seconds in."""
    base = [*run_infos(2), *steps(2, 4)]
    t0 = last_t(base)
    out: list[Message] = list(base)
    for r, (phase, frames) in enumerate((rank0, rank1)):
        for s in range(secs + 1):
            out.append(heartbeat(r, 4, t0 + s * S + r, phase=phase, in_phase_s=float(s), bucket=2))
        if frames is not None:
            thread = {"name": "MainThread", "ident": 1, "main": True, "frames": frames}
            out.append(
                Stacks(
                    run=RUN, rank=r, t=t0 + 2 * S + 10 + r, reason="stuck", phase=phase, step=4,
                    threads=[thread],
                )
            )  # fmt: skip
    out.sort(key=lambda m: m.t)
    return out


def stuck_analysis(msgs: list[Message]) -> Analysis:
    return feed(
        Analysis([HangDetector(Mode(hang_after_s=4)), CollectiveMismatchDetector()]),
        msgs,
        tick_every_ns=250 * MS,
    )


def test_a_rank_blocked_in_a_barrier_while_the_other_waits_in_allreduce_is_named() -> None:
    analysis = stuck_analysis(stuck_stream(("data", frames_in("barrier")), ("allreduce", None)))
    (f,) = findings(analysis, "rank0_only_collective")
    assert f.ranks == [0] and f.severity == "error" and f.step == 4
    assert "torch.distributed.barrier() at job/train.py:224 (in _epoch_end)" in f.message
    assert "rank 1 is waiting in all-reduce (bucket 2) at step 4" in f.message
    assert "the pattern behind the hang" in f.message
    assert f.evidence["blocked"]["0"]["at"] == f"{TRAIN}:224 in _epoch_end"
    assert findings(analysis, "hang")  # the hang detector saw the stall too


def test_a_rank_still_running_its_own_code_may_yet_join_the_collective() -> None:
    # Rank 1 writes a slow checkpoint before its own barrier: rank 0 just waits.
    analysis = stuck_analysis(stuck_stream(("data", frames_in("barrier")), ("data", None)))
    assert findings(analysis, "rank0_only_collective") == []


def test_ranks_blocked_in_the_same_collective_match_each_other() -> None:
    stream = stuck_stream(
        ("data", frames_in("barrier")), ("data", frames_in("barrier", "main", 160))
    )
    assert findings(stuck_analysis(stream), "rank0_only_collective") == []


def test_two_ranks_in_different_collectives_are_both_named() -> None:
    stream = stuck_stream(
        ("data", frames_in("all_reduce")), ("data", frames_in("barrier", "main", 165))
    )
    (f,) = findings(stuck_analysis(stream), "rank0_only_collective")
    assert f.ranks == [0, 1] and "no majority tells which" in f.message


def test_a_short_wait_in_a_collective_is_not_a_mismatch() -> None:
    stream = stuck_stream(("data", frames_in("barrier")), ("allreduce", None), secs=3)
    assert findings(stuck_analysis(stream), "rank0_only_collective") == []


def test_a_rank_blocked_after_the_others_exited_is_named() -> None:
    base = stuck_stream(("data", frames_in("all_reduce")), ("allreduce", None))
    rank1_gone = [m for m in base if not (m.rank == 1 and m.t > last_t(base) - 9 * S)]
    rank1_gone.append(end(1, 4, last_t(base) - 9 * S))
    rank1_gone.sort(key=lambda m: m.t)
    (f,) = findings(stuck_analysis(rank1_gone), "rank0_only_collective")
    assert f.ranks == [0] and "rank 1 ended (exit) at step 4" in f.message


def in_collective(msgs: list[Message], rank: int, op: str, cls: str, site: str) -> list[Message]:
    """The stream with ``rank``'s heartbeats in phase "collective" saying which one."""
    return [
        dataclasses.replace(m, coll_op=op, coll_class=cls, coll_site=site)
        if isinstance(m, Heartbeat) and m.rank == rank and m.phase == "collective"
        else m
        for m in msgs
    ]


def test_a_rank_in_the_scripts_barrier_is_named_from_its_heartbeat_alone() -> None:
    # No stack yet: the heartbeat says which collective the rank is blocked in.
    stream = stuck_stream(("collective", None), ("allreduce", None))
    stream = in_collective(stream, 0, "barrier", "user", f"{TRAIN}:61 in train")
    (f,) = findings(stuck_analysis(stream), "rank0_only_collective")
    assert f.ranks == [0] and f.evidence["op"] == "barrier"
    assert "torch.distributed.barrier() at job/train.py:61 (in train)" in f.message
    assert "rank 1 is waiting in all-reduce (bucket 2) at step 4" in f.message


def test_a_rank_in_ddps_buffer_broadcast_after_the_other_exited_is_named() -> None:
    base = in_collective(
        stuck_stream(("collective", None), ("allreduce", None)), 0, "broadcast", "ddp", ""
    )
    rank1_gone = [m for m in base if not (m.rank == 1 and m.t > last_t(base) - 9 * S)]
    rank1_gone.append(end(1, 4, last_t(base) - 9 * S))
    rank1_gone.sort(key=lambda m: m.t)
    (f,) = findings(stuck_analysis(rank1_gone), "rank0_only_collective")
    assert f.ranks == [0] and f.evidence["op"] == "ddp_buffers"
    assert "Rank 0 has been blocked" in f.message and "a forward of the DDP model" in f.message


def test_a_rank_heard_in_a_barrier_only_before_the_other_exited_is_not_named() -> None:
    # End of a healthy job: rank 1 waited in the final barrier while rank 0 saved a
    # checkpoint; rank 0 arrived, the barrier completed and rank 0's end message came in
    # before rank 1 sent another heartbeat (or its own end).
    base = in_collective(
        stuck_stream(("data", None), ("collective", None)),
        1,
        "barrier",
        "user",
        f"{TRAIN}:61 in train",
    )
    t = last_t(base)
    finished = [*base, end(0, 4, t + 300 * MS), end(1, 4, t + 900 * MS)]  # a tick between
    assert findings(stuck_analysis(finished), "rank0_only_collective") == []
    # Still heard in the barrier after rank 0 ended: it is blocked there.
    late = [m for m in base if m.t <= t - 6 * S]
    late.append(end(0, 4, t - 6 * S + 1))
    late += [m for m in base if m.t > t - 6 * S and m.rank == 1]
    (f,) = findings(stuck_analysis(sorted(late, key=lambda m: m.t)), "rank0_only_collective")
    assert f.ranks == [1] and "rank 0 ended (exit)" in f.message


def test_ranks_in_one_buffer_broadcast_or_join_agreement_match() -> None:
    both = stuck_stream(("collective", None), ("collective", None))
    for r in (0, 1):
        both = in_collective(both, r, "broadcast", "ddp", "")
    assert findings(stuck_analysis(both), "rank0_only_collective") == []
    # Join's per-forward agreement runs on every rank, like the gradient all-reduce.
    join = in_collective(
        stuck_stream(("collective", None), ("allreduce", None)), 0, "all_reduce", "ddp", ""
    )
    assert findings(stuck_analysis(join), "rank0_only_collective") == []


# --- DataParallel, BatchNorm, process group ---------------------------------------------------


def test_dataparallel_inside_ddp_is_a_warning() -> None:
    seen = [
        DataParallelSeen(run=RUN, rank=r, t=5, step=0, site="", module="app.Net", inside_ddp=True)
        for r in (0, 1)
    ]
    analysis = feed(Analysis([DataParallelDetector()]), [*run_infos(2), *seen])
    (f,) = findings(analysis, "dataparallel")
    assert f.severity == "warning" and f.ranks == [0, 1]
    assert "wrap nn.DataParallel (around Net) inside their DDP model" in f.message
    assert "device_ids=[local_rank]" in f.fix


def test_dataparallel_built_in_the_loop_names_its_site() -> None:
    seen = DataParallelSeen(
        run=RUN,
        rank=0,
        t=5,
        step=3,
        site=f"{TRAIN}:12 in teacher",
        module="app.T",
        device_ids=[0, 1],
    )
    (f,) = findings(feed(Analysis([DataParallelDetector()]), [*run_infos(2), seen]), "dataparallel")
    assert "at job/train.py:12 (in teacher)" in f.message and "GPUs [0, 1]" in f.message


@pytest.mark.parametrize(
    ("world", "size", "bn", "raised"),
    [
        (2, 8, 3, True),
        (2, 15, 1, True),
        (2, 16, 3, False),  # at the threshold: enough samples
        (2, 8, 0, False),  # no BatchNorm (or only SyncBatchNorm)
        (1, 8, 3, False),  # one rank: SyncBatchNorm would not help
    ],
)
def test_batchnorm_with_a_small_per_rank_batch_is_info_only(
    world: int, size: int, bn: int, raised: bool
) -> None:
    msgs = [*run_infos(world), *(batch(r, size, bn=bn, t=5) for r in range(world))]
    got = findings(feed(Analysis([BatchNormDetector()]), msgs), "batchnorm_small_batch")
    assert bool(got) == raised
    for f in got:
        assert f.severity == "info" and "convert_sync_batchnorm" in f.fix
        assert f.evidence["per_rank_batch"] == {str(r): size for r in range(world)}


def test_exiting_with_the_process_group_alive_is_info() -> None:
    msgs = [
        *run_infos(2),
        shutdown(0, 8, 10, alive=True),
        end(0, 8, 11),
        shutdown(1, 8, 12, alive=False),
        end(1, 8, 13),
    ]
    (f,) = findings(feed(Analysis([ProcessGroupDetector()]), msgs), "no_destroy_process_group")
    assert f.severity == "info" and f.ranks == [0] and "destroy_process_group" in f.fix


def test_an_exception_exit_is_left_to_rank_exit() -> None:
    msgs = [*run_infos(2), shutdown(0, 3, 10, alive=True), end(0, 3, 11, reason="exception")]
    assert findings(feed(Analysis([ProcessGroupDetector()]), msgs)) == []


# --- devices ------------------------------------------------------------------------------


def gpu_infos(devices: list[tuple[str, str, str]], host: str = "node1") -> list[RunInfo]:
    """(device, expected, uuid) per rank."""
    return [
        dataclasses.replace(
            info, host=host, device=d, device_expected=e, device_uuid=u, cuda_visible=len(devices)
        )
        for info, (d, e, u) in zip(run_infos(len(devices)), devices, strict=True)
    ]


def test_two_ranks_on_one_gpu_is_an_error_and_the_misplaced_rank_a_warning() -> None:
    infos = gpu_infos([("cuda:0", "cuda:0", "GPU-a"), ("cuda:0", "cuda:1", "GPU-a")])
    got = {f.severity: f for f in findings(feed(Analysis([DeviceDetector()]), infos))}
    shared, misplaced = got["error"], got["warning"]
    assert shared.ranks == [0, 1] and "share one GPU (cuda:0, GPU-a)" in shared.message
    assert misplaced.ranks == [1] and "expected cuda:1" in misplaced.message
    assert "set_device" in shared.fix


def test_one_gpu_per_rank_through_cuda_visible_devices_is_healthy() -> None:
    infos = gpu_infos([("cuda:0", "cuda:0", "GPU-a"), ("cuda:0", "cuda:0", "GPU-b")])
    assert findings(feed(Analysis([DeviceDetector()]), infos)) == []


def test_the_same_gpu_uuid_on_two_hosts_is_not_sharing() -> None:
    a = gpu_infos([("cuda:0", "cuda:0", "GPU-a"), ("cuda:1", "cuda:1", "GPU-b")], host="n1")
    b = [dataclasses.replace(i, rank=i.rank + 2, host="n2") for i in a]
    infos = [dataclasses.replace(i, world_size=4) for i in [*a, *b]]
    assert findings(feed(Analysis([DeviceDetector()]), infos)) == []


def test_cpu_ranks_have_no_device_to_mismatch() -> None:
    assert findings(feed(Analysis([DeviceDetector()]), run_infos(2))) == []


# --- helpers ------------------------------------------------------------------------------


def test_short_site_keeps_the_last_directory_and_the_function() -> None:
    assert short_site("/a/b/demos/train.py:12 in main") == "demos/train.py:12 (in main)"
    assert short_site("(training forwards)") == "(training forwards)"
