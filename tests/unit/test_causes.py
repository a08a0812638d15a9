"""Findings that explain each other: a consequence points to its cause and stands below it.

First the book's mechanism (FindingBook.explain keeps a link true across a
detector's updates), then each rule of analysis/causes.py on hand-made
findings, then whole streams through the detectors: uneven inputs without Join
(the longer rank's extra forward, the shorter rank's exit) and a crash that
leaves a rank blocked in the script's all-reduce.
"""

from __future__ import annotations

from typing import Any

from ddpscope.analysis.causes import link_causes
from ddpscope.analysis.detectors.hang import HangDetector
from ddpscope.analysis.detectors.rank_exit import RankExitDetector
from ddpscope.analysis.detectors.recipe.collectives import CollectiveMismatchDetector
from ddpscope.analysis.detectors.sampling.uneven import UnevenInputsDetector
from ddpscope.analysis.engine import Analysis
from ddpscope.analysis.findings import Finding, FindingBook
from ddpscope.analysis.state import RunState
from ddpscope.schema import End, Message
from tests.support.synth import (
    RUN,
    SITE_LOSS,
    constant,
    feed,
    findings,
    heartbeat,
    lockstep,
    run_infos,
)
from tests.unit.test_detect_sampling import WORLD, B, Sim, uneven_plans

S = 1_000_000_000


def finding(
    kind: str, severity: str = "error", ranks: list[int] | None = None, **kw: Any
) -> Finding:
    values: dict[str, Any] = {
        "kind": kind,
        "severity": severity,
        "ranks": [0] if ranks is None else ranks,
        "step": 3,
        "message": f"{kind} happened.",
        "fix": f"fix the {kind}",
    }
    values.update(kw)
    return Finding(**values)


# --- the mechanism -------------------------------------------------------------------


def test_a_consequence_is_shown_at_info_with_its_cause_and_the_causes_fix() -> None:
    book = FindingBook()
    book.raise_or_update("loader0", finding("uneven_inputs"))
    c = book.raise_or_update("stuck", finding("rank0_only_collective", ranks=[1]))
    v = book.version
    assert book.explain(c.kind, "stuck", ("uneven_inputs", "loader0"), "Caused by X.", fix="F")
    assert book.version > v
    assert (c.severity, c.cause, c.own_severity) == ("info", ("uneven_inputs", "loader0"), "error")
    assert c.message == "rank0_only_collective happened. Caused by X." and c.fix == "F"
    assert c.to_json()["cause"] == {
        "kind": "uneven_inputs",
        "key": "loader0",
        "own_severity": "error",
    }
    assert c.to_json()["key"] == "stuck"
    # Explaining it again the same way changes nothing a reader sees.
    v = book.version
    assert not book.explain(c.kind, "stuck", ("uneven_inputs", "loader0"), "Caused by X.", fix="F")
    assert book.version == v


def test_the_link_survives_the_detectors_updates_and_can_be_undone() -> None:
    book = FindingBook()
    book.raise_or_update("run", finding("rank_exit"))
    book.raise_or_update("stuck", finding("rank0_only_collective", severity="warning"))
    book.explain("rank0_only_collective", "stuck", ("rank_exit", "run"), "Caused by a crash.")
    newer = finding("rank0_only_collective", message="blocked for 9 s.", fix="move it")
    c = book.raise_or_update("stuck", newer)
    # The detector raised it to an error; shown as info, with the note after its new text.
    assert c.severity == "info" and c.own_severity == "error"
    assert c.message == "blocked for 9 s. Caused by a crash." and c.fix == "move it"
    book.set_severity(c, "warning")  # a detector lowering its own level
    assert c.severity == "info" and c.own_severity == "warning"
    assert book.links() == {("rank0_only_collective", "stuck"): ("rank_exit", "run")}
    assert book.unexplain("rank0_only_collective", "stuck")
    assert (c.severity, c.message, c.cause) == ("warning", "blocked for 9 s.", None)
    assert c.to_json()["cause"] is None and book.links() == {}


def test_a_detector_changing_its_findings_level_is_a_change_a_ui_redraws_for() -> None:
    book = FindingBook()
    f = book.raise_or_update("1", finding("straggler", severity="warning"))
    v = book.version
    book.set_severity(f, "warning")  # the same level: nothing to redraw
    assert book.version == v
    book.set_severity(f, "info")
    assert f.severity == "info" and book.version > v


def test_only_existing_findings_are_linked() -> None:
    book = FindingBook()
    book.raise_or_update("stuck", finding("rank0_only_collective"))
    assert not book.explain("rank0_only_collective", "stuck", ("uneven_inputs", "x"), "n")
    assert not book.explain("hang", "run", ("rank0_only_collective", "stuck"), "n")
    assert book.get("rank0_only_collective", "stuck").severity == "error"  # type: ignore[union-attr]


# --- the rules ---------------------------------------------------------------------------


def linked(book: FindingBook) -> dict[tuple[str, str], tuple[str, str]]:
    link_causes(RunState(RUN), book)
    return book.links()


def uneven(short: list[int], confirmed: bool = True) -> Finding:
    return finding("uneven_inputs", ranks=short, evidence={"loader": 0, "confirmed": confirmed})


def test_the_longer_ranks_extra_forward_is_explained_by_uneven_inputs() -> None:
    book = FindingBook()
    book.raise_or_update("loader0", uneven([0]))
    ev = {"op": "ddp_buffers", "others": {"0": "ended (exit) at step 2"}}
    book.raise_or_update("stuck", finding("rank0_only_collective", ranks=[1], evidence=ev))
    assert linked(book) == {("rank0_only_collective", "stuck"): ("uneven_inputs", "loader0")}
    c = book.get("rank0_only_collective", "stuck")
    assert c is not None and c.severity == "info"
    assert "Caused by uneven_inputs (loader 0): rank 0 ran out of batches first" in c.message
    assert "extra forward broadcasts DDP's buffers" in c.message
    assert c.fix.startswith("Fix the cause, the uneven inputs: fix the uneven_inputs")
    u = book.get("uneven_inputs", "loader0")
    assert u is not None and u.severity == "error" and u.cause is None


def test_a_collective_of_the_short_rank_itself_is_not_explained_by_uneven_inputs() -> None:
    # Rank 0 ran out of batches *and* issues a barrier rank 1 never matches: a real
    # rank-0-only collective, not the extra forward of the longer rank.
    book = FindingBook()
    book.raise_or_update("loader0", uneven([0]))
    ev = {"op": "barrier", "others": {"1": "is waiting in all-reduce"}}
    book.raise_or_update("stuck", finding("rank0_only_collective", ranks=[0], evidence=ev))
    assert linked(book) == {}


def test_a_scripts_collective_unmatched_only_by_ranks_that_ran_out_is_explained() -> None:
    book = FindingBook()
    book.raise_or_update("loader0", uneven([0, 2]))
    ev = {"op": "all_reduce", "others": {"0": "ended (exit)", "2": "ended (exit)"}}
    book.raise_or_update("stuck", finding("rank0_only_collective", ranks=[1], evidence=ev))
    assert ("rank0_only_collective", "stuck") in linked(book)
    book.raise_or_update("stuck", finding("rank0_only_collective", ranks=[1], evidence={
        "op": "all_reduce", "others": {"0": "ended (exit)", "3": "waiting in all-reduce"},
    }))  # fmt: skip
    assert linked(book) == {}  # rank 3 had data and still never issued it: a real mismatch


def test_the_short_ranks_normal_exit_is_explained_once_uneven_inputs_are_confirmed() -> None:
    book = FindingBook()
    book.raise_or_update("loader0", uneven([0], confirmed=False))
    ev = {"stopped": {"0": {"how": "exit"}}, "others": {}}
    book.raise_or_update("run", finding("rank_exit", ranks=[0], evidence=ev))
    assert linked(book) == {}  # predicted only: the exit may have another reason
    book.raise_or_update("loader0", uneven([0], confirmed=True))
    assert linked(book) == {("rank_exit", "run"): ("uneven_inputs", "loader0")}
    r = book.get("rank_exit", "run")
    assert r is not None and r.severity == "info"
    assert "rank 0 ran out of batches and finished while the others still had data" in r.message


def _end_of_data_mismatch(book: FindingBook) -> None:
    """Without Join: rank 0 ran out and waits in its final barrier, rank 1 in its next forward."""
    blocked = {
        "0": {"op": "barrier", "at": "train.py:234 in main", "for_s": 5.2},
        "1": {"op": "ddp_buffers", "at": "train.py:259 in _train", "for_s": 5.2},
    }
    stuck = finding("rank0_only_collective", ranks=[0, 1], evidence={"blocked": blocked})
    book.raise_or_update("stuck", stuck)
    where = {
        "0": {"phase": "collective", "collective": {"op": "barrier", "class": "user"}},
        "1": {"phase": "collective", "collective": {"op": "broadcast", "class": "ddp"}},
    }
    book.raise_or_update("run", finding("hang", ranks=[0, 1], evidence={"where": where}))


def test_without_join_the_mismatch_at_the_end_of_the_data_is_the_uneven_inputs() -> None:
    book = FindingBook()
    book.raise_or_update("loader0", uneven([0], confirmed=False))
    book.now_ns = 5
    _end_of_data_mismatch(book)
    book.now_ns = 10
    timeouts = {"stopped": {"0": {"how": "exception"}, "1": {"how": "exception"}}}
    book.raise_or_update("run", finding("rank_exit", ranks=[0, 1], evidence=timeouts))
    cause = ("uneven_inputs", "loader0")
    assert linked(book) == {
        ("rank0_only_collective", "stuck"): cause,
        ("hang", "run"): cause,
        ("rank_exit", "run"): cause,
    }
    stuck, hang = book.get("rank0_only_collective", "stuck"), book.get("hang", "run")
    assert stuck is not None and "rank 0 ran out of batches and went on" in stuck.message
    assert "while rank 1 still trains" in stuck.message
    assert hang is not None and hang.severity == "info" and "never issues" in hang.message


def test_the_same_mismatch_under_join_or_led_by_a_long_rank_is_not_the_uneven_inputs() -> None:
    book = FindingBook()
    joined = finding("uneven_inputs", ranks=[0], evidence={"loader": 0, "join": True})
    book.raise_or_update("loader0", joined)
    _end_of_data_mismatch(book)
    assert linked(book) == {}
    # rank 1 (it had data) is the one outside its training step: a real mismatch
    book = FindingBook()
    book.raise_or_update("loader0", uneven([1], confirmed=False))
    _end_of_data_mismatch(book)
    assert linked(book) == {}


def test_exits_before_the_mismatch_hang_are_not_its_consequence() -> None:
    book = FindingBook()
    book.raise_or_update("loader0", uneven([0], confirmed=False))
    crashed = {"stopped": {"1": {"how": "exception"}}}
    book.now_ns = 5
    book.raise_or_update("run", finding("rank_exit", ranks=[1], evidence=crashed))
    book.now_ns = 10
    _end_of_data_mismatch(book)
    assert ("rank_exit", "run") not in linked(book)


def test_a_crash_is_never_explained_by_uneven_inputs() -> None:
    book = FindingBook()
    book.raise_or_update("loader0", uneven([0]))
    ev = {"stopped": {"0": {"how": "exception"}}, "others": {}}
    book.raise_or_update("run", finding("rank_exit", ranks=[0], evidence=ev))
    assert linked(book) == {}


def test_a_short_rank_raising_in_its_first_step_after_running_out_is_explained() -> None:
    # accelerate with even_batches=False on 2 ranks: rank 1 ran out after 15 steps, its
    # next epoch's RNG broadcast met rank 0's gradient all-reduce, and it raised on the
    # bytes it got. A rank that raises later, or one that had data, stands on its own.
    def book_with(step: int, ranks: list[int]) -> FindingBook:
        book = FindingBook()
        ev = {"loader": 0, "confirmed": True, "ran_out_at_step": {"1": 15}}
        book.raise_or_update("loader0", finding("uneven_inputs", ranks=[1], evidence=ev))
        stopped = {str(r): {"how": "exception", "step": step} for r in ranks}
        book.raise_or_update(
            "run", finding("rank_exit", ranks=ranks, evidence={"stopped": stopped})
        )
        return book

    book = book_with(15, [1])
    assert linked(book) == {("rank_exit", "run"): ("uneven_inputs", "loader0")}
    r = book.get("rank_exit", "run")
    assert r is not None and r.severity == "info" and "first step after running out" in r.message
    assert linked(book_with(16, [1])) != {}  # within the step it went on to
    assert linked(book_with(40, [1])) == {}  # much later: another reason
    assert linked(book_with(15, [0, 1])) == {}  # rank 0 had data


def test_a_collective_only_the_short_ranks_wait_in_is_explained_by_the_uneven_inputs() -> None:
    # Ranks 1 and 2 ran out and wait in the next epoch's first collective; rank 0, still
    # training, is named among the others (waiting in its all-reduce).
    book = FindingBook()
    book.raise_or_update("loader0", uneven([1, 2], confirmed=False))
    blocked = {q: {"op": "broadcast", "at": "random.py:136 in sync", "for_s": 5.0} for q in "12"}
    ev = {"blocked": blocked, "others": {"0": "is waiting in all-reduce (bucket 0)"}}
    book.raise_or_update("stuck", finding("rank0_only_collective", ranks=[1, 2], evidence=ev))
    assert linked(book) == {("rank0_only_collective", "stuck"): ("uneven_inputs", "loader0")}
    c = book.get("rank0_only_collective", "stuck")
    assert c is not None and "ranks 1, 2 ran out of batches and went on" in c.message
    ev["others"] = {"0": "is waiting in all-reduce", "2": "ended (exit)"}
    book = FindingBook()
    book.raise_or_update("loader0", uneven([1, 2], confirmed=False))
    blocked.pop("2")
    book.raise_or_update("stuck", finding("rank0_only_collective", ranks=[1], evidence=ev))
    assert linked(book) == {}  # a short rank among those that never issued it: not this


def test_a_rank_blocked_with_a_crashed_peer_is_explained_by_rank_exit() -> None:
    book = FindingBook()
    ev = {"stopped": {"2": {"how": "exception"}}, "others": {}}
    book.raise_or_update("run", finding("rank_exit", ranks=[2], evidence=ev))
    stuck = {"op": "all_reduce", "others": {"2": "ended (exception) at step 10"}}
    book.raise_or_update("stuck", finding("rank0_only_collective", ranks=[0, 1], evidence=stuck))
    assert linked(book) == {("rank0_only_collective", "stuck"): ("rank_exit", "run")}
    c = book.get("rank0_only_collective", "stuck")
    assert c is not None and c.severity == "info"
    assert "Caused by rank_exit: rank 2 stopped (see rank_exit), so ranks 0, 1 wait" in c.message
    assert c.fix == "Fix the first failure: fix the rank_exit"


def test_a_rank_blocked_while_a_live_rank_never_issued_it_stands_on_its_own() -> None:
    book = FindingBook()
    ev = {"stopped": {"2": {"how": "exception"}}, "others": {}}
    book.raise_or_update("run", finding("rank_exit", ranks=[2], evidence=ev))
    stuck = {"op": "barrier", "others": {"1": "is waiting in all-reduce (bucket 2)"}}
    book.raise_or_update("stuck", finding("rank0_only_collective", ranks=[0], evidence=stuck))
    assert linked(book) == {}


def test_a_peer_that_died_later_of_the_collective_timeout_does_not_explain_it() -> None:
    # Rank 0 alone in a barrier while rank 1 waits in all-reduce; both then die of the
    # collective timeout. The mismatch came first: it stays the error.
    book = FindingBook()
    ev = {"stopped": {"1": {"how": "exception"}}, "others": {"0": {"state": "running"}}}
    book.raise_or_update("run", finding("rank_exit", ranks=[1], evidence=ev))
    stuck = {"op": "barrier", "others": {"1": "is waiting in all-reduce (bucket 4) at step 4"}}
    book.raise_or_update("stuck", finding("rank0_only_collective", ranks=[0], evidence=stuck))
    assert linked(book) == {}


def test_a_resumed_stall_of_the_straggler_is_explained_by_it_until_a_new_hang() -> None:
    book = FindingBook()
    book.raise_or_update("1", finding("straggler", severity="warning", ranks=[1]))
    hang = finding("hang", severity="warning", ranks=[1], active=False)
    hang.evidence = {"resolved": "progress resumed"}
    book.raise_or_update("run", hang)
    assert linked(book) == {("hang", "run"): ("straggler", "1")}
    h = book.get("hang", "run")
    assert h is not None and h.severity == "info" and "Caused by the straggler" in h.message
    # A new episode: the run stopped again; that stands as the error it is.
    book.raise_or_update("run", finding("hang", ranks=[1], evidence={}))
    assert linked(book) == {}
    assert h.severity == "error" and h.cause is None and "straggler" not in h.message


def test_a_resumed_stall_of_another_rank_is_not_the_stragglers() -> None:
    book = FindingBook()
    book.raise_or_update("1", finding("straggler", severity="warning", ranks=[1]))
    hang = finding("hang", severity="warning", ranks=[0], active=False)
    hang.evidence = {"resolved": "progress resumed"}
    book.raise_or_update("run", hang)
    assert linked(book) == {}


# --- whole streams -------------------------------------------------------------------------


def detectors() -> list[Any]:
    return [
        UnevenInputsDetector(),
        CollectiveMismatchDetector(),
        RankExitDetector(),
        HangDetector(),
    ]


def blocked(rank: int, step: int, start: int, seconds: int, op: str, cls: str, site: str):  # type: ignore[no-untyped-def]
    return [
        heartbeat(
            rank,
            step,
            start + i * S,
            run=RUN,
            phase="collective",
            in_phase_s=float(i),
            coll_op=op,
            coll_class=cls,
            coll_site=site,
        )
        for i in range(1, seconds + 1)
    ]


def by_kind(analysis: Analysis) -> dict[str, Finding]:
    out = {}
    for f in findings(analysis):
        assert f.kind not in out, f"two {f.kind} findings"
        out[f.kind] = f
    return out


def test_uneven_inputs_without_join_is_one_error_and_its_consequences_point_to_it() -> None:
    # Rank 0 has 2 batches, rank 1 has 4: rank 0 exits after its 2 steps; rank 1's
    # third forward blocks in DDP's buffer broadcast, which nobody answers.
    sim = Sim(WORLD)
    sim.epoch(uneven_plans({0: 64, 1: 128}), B, stall={1: 2})
    sim.exit(0)
    msgs: list[Message] = [*sim.msgs, *blocked(1, 2, S, 12, "broadcast", "ddp", "")]
    analysis = Analysis(detectors(), history=None)
    feed(analysis, msgs, tick_every_ns=S // 4)
    found = by_kind(analysis)
    assert [f.kind for f in findings(analysis) if f.severity == "error"] == ["uneven_inputs"]
    u = found["uneven_inputs"]
    assert u.ranks == [0] and u.cause is None
    extra = found["rank0_only_collective"]
    assert extra.ranks == [1] and extra.severity == "info" and extra.own_severity == "error"
    assert extra.cause == ("uneven_inputs", "loader0")
    assert "Caused by uneven_inputs (loader 0)" in extra.message
    assert "Join" in extra.fix and "if rank == 0" not in extra.fix
    gone = found["rank_exit"]
    assert gone.ranks == [0] and gone.severity == "info"
    assert gone.cause == ("uneven_inputs", "loader0")
    assert "hang" not in found


def test_the_same_extra_forward_without_uneven_inputs_stays_an_error() -> None:
    # Even data, but rank 1 runs a forward of the DDP model after rank 0 finished
    # (evaluation on rank 1 only): a real unmatched collective.
    sim = Sim(WORLD)
    sim.epoch(uneven_plans({0: 128, 1: 128}), B)
    sim.exit(0)
    msgs: list[Message] = [*sim.msgs, *blocked(1, 4, S, 12, "broadcast", "ddp", "")]
    analysis = feed(Analysis(detectors(), history=None), msgs, tick_every_ns=S // 4)
    c = by_kind(analysis)["rank0_only_collective"]
    assert c.severity == "error" and c.cause is None


def test_a_rank_left_in_the_loss_all_reduce_by_a_crashed_peer_points_to_the_crash() -> None:
    msgs: list[Message] = [*run_infos(3), *lockstep(3, 10, constant(), loss_allreduce=True)]
    t = max(m.t for m in msgs)
    err = "Traceback (most recent call last):\n  File x\nValueError: bad batch\n"
    msgs.append(End(run=RUN, rank=2, t=t + 1, reason="exception", step=10, error=err))
    for r in (0, 1):
        msgs += blocked(r, 10, t, 12, "all_reduce", "user", SITE_LOSS)
    analysis = feed(Analysis(detectors(), history=None), sorted(msgs, key=lambda m: m.t), S // 4)
    found = by_kind(analysis)
    assert [f.kind for f in findings(analysis) if f.severity == "error"] == ["rank_exit"]
    assert found["rank_exit"].ranks == [2]
    c = found["rank0_only_collective"]
    assert c.ranks == [0, 1] and c.severity == "info" and c.cause == ("rank_exit", "run")
    assert "Caused by rank_exit: rank 2 stopped" in c.message
    assert c.fix.startswith("Fix the first failure")


def test_undoing_a_link_keeps_what_the_detector_wrote_in_place_since() -> None:
    book = FindingBook()
    book.raise_or_update("1", finding("straggler", severity="warning", ranks=[1]))
    h = book.raise_or_update("run", finding("hang", severity="warning", ranks=[1]))
    book.explain("hang", "run", ("straggler", "1"), "Caused by the straggler.", fix="F")
    h.message += " Then a rank ended."  # as HangDetector does when the episode ends
    book.unexplain("hang", "run")
    assert h.message == "hang happened. Then a rank ended." and h.fix == "fix the hang"


def _desync(ranks: list[int], step: int = 16, key: str = "params") -> Finding:
    return finding("desync", ranks=ranks, step=step, evidence={"minority_ranks": ranks}, key=key)


def test_a_desync_after_a_hyperparameter_mismatch_of_its_ranks_is_its_consequence() -> None:
    # nanoGPT with lr doubled on rank 1: the mismatch at step 1, the replicas apart at 16.
    book = FindingBook()
    book.raise_or_update("optimizer 0 lr", finding("hyperparam_mismatch", ranks=[0, 1], step=1))
    d = book.raise_or_update("params", _desync([0, 1]))
    assert linked(book) == {("desync", "params"): ("hyperparam_mismatch", "optimizer 0 lr")}
    assert d.severity == "info" and d.own_severity == "error"
    assert "Caused by hyperparam_mismatch (optimizer 0 lr)" in d.message
    assert d.fix == "Fix the cause: fix the hyperparam_mismatch"


def test_a_desync_of_other_ranks_another_model_or_earlier_stands_on_its_own() -> None:
    book = FindingBook()
    book.raise_or_update("lr", finding("hyperparam_mismatch", ranks=[3], step=5))
    book.raise_or_update("params", _desync([2]))  # rank 2 drifted: not the lr's rank 3
    book.raise_or_update("params:1", _desync([3], key="params:1"))  # model 1: lr is model 0's
    book.raise_or_update("buffers", _desync([3], key="buffers"))  # buffers: no optimizer
    assert linked(book) == {}
    book2 = FindingBook()
    book2.raise_or_update("lr", finding("hyperparam_mismatch", ranks=[3], step=20))
    book2.raise_or_update("params", _desync([3], step=16))  # apart before the lr differed
    assert linked(book2) == {}


def _lr_mismatch(groups: list[list[int]], count_extra: int = 0) -> Finding:
    values = [
        {"value": 0.001 * (i + 1), "ranks": g, "count": len(g) + (count_extra if i == 0 else 0)}
        for i, g in enumerate(groups)
    ]
    return finding("hyperparam_mismatch", ranks=groups[-1], evidence={"values": values})


def test_an_lr_that_differs_exactly_as_the_loader_lengths_do_is_the_uneven_inputs() -> None:
    # A cosine schedule sized from len(loader): 24 batches on rank 0, 27 on ranks 1, 2.
    book = FindingBook()
    ev = {"loader": 0, "confirmed": True, "batches_per_epoch": {"0": 24, "1": 27, "2": 27}}
    book.raise_or_update("loader0", finding("uneven_inputs", ranks=[0], evidence=ev))
    book.raise_or_update("lr", _lr_mismatch([[1, 2], [0]]))
    assert linked(book) == {("hyperparam_mismatch", "lr"): ("uneven_inputs", "loader0")}
    h = book.get("hyperparam_mismatch", "lr")
    assert h is not None and h.severity == "info"
    assert (
        "Caused by uneven_inputs (loader 0): lr differs across ranks just as their batches per "
        "epoch do (24 on rank 0; 27 on ranks 1, 2)"
    ) in h.message


def test_an_lr_that_splits_the_ranks_otherwise_stands_on_its_own() -> None:
    ev = {"loader": 0, "batches_per_epoch": {"0": 24, "1": 27, "2": 27, "3": 27}}
    for groups in ([[0, 1, 2], [3]], [[1, 2], [0, 3]], [[0], [1], [2, 3]]):
        book = FindingBook()
        book.raise_or_update("loader0", finding("uneven_inputs", ranks=[0], evidence=ev))
        book.raise_or_update("lr", _lr_mismatch(groups))
        assert linked(book) == {}, groups
    # A group listed only in part (a large world) is not judged.
    book = FindingBook()
    book.raise_or_update("loader0", finding("uneven_inputs", ranks=[0], evidence=ev))
    book.raise_or_update("lr", _lr_mismatch([[1, 2, 3], [0]], count_extra=5))
    assert linked(book) == {}
