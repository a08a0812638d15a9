"""The Detector protocol as the analysis uses it: every default detector is built
for the analysis' mode and keeps it, forgets a run the analysis dropped
(``reset``), and hears once that the stream is over (``finish``). Also the
shape of the detectors package: no detector imports another, none reads files."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

import ddpscope.analysis.detectors as detectors_pkg
from ddpscope.analysis.build import build_analysis, default_detectors, end_of_stream
from ddpscope.analysis.engine import MAX_RUNS, Analysis
from ddpscope.analysis.findings import FindingBook
from ddpscope.analysis.protocol import LIVE, Detector, Mode, recorded
from ddpscope.analysis.state import RunState
from ddpscope.schema import Message
from tests.support.synth import (
    MS,
    constant,
    feed,
    findings,
    heartbeat,
    lockstep,
    run_infos,
    step_at,
)

S = 1_000_000_000
MODES = [LIVE, recorded(finished=True, hang_after_s=7.0), recorded(finished=False)]
PROTOCOL = ("kinds", "mode", "observe", "tick", "finish", "reset")


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m.source}-{m.hang_after_s}")
def test_every_default_detector_follows_the_protocol_and_keeps_its_mode(mode: Mode) -> None:
    dets = default_detectors(mode)
    names = [type(d).__name__ for d in dets]
    assert len(set(names)) == len(names) == 29
    for det in dets:
        assert isinstance(det, Detector), type(det).__name__
        assert det.mode is mode, type(det).__name__
        assert det.kinds and all(isinstance(k, str) and k for k in det.kinds)
        for member in PROTOCOL[2:]:
            assert callable(getattr(det, member)), (type(det).__name__, member)
    analysis = build_analysis(mode)
    assert analysis.mode is mode and all(d.mode is mode for d in analysis.detectors)


def test_a_class_without_finish_or_reset_is_not_a_detector() -> None:
    class Partial:
        kinds = ("partial",)
        mode = LIVE

        def observe(self, run: RunState, msg: Message, book: FindingBook) -> None: ...

        def tick(self, run: RunState, book: FindingBook) -> None: ...

    assert not isinstance(Partial(), Detector)


def gapped(msgs: list[Message], drop_every: int) -> list[Message]:
    """Sequence numbers that skip one in ``drop_every`` (a lossy wire, or re-sends
    that a recording does not keep)."""
    out: list[Message] = []
    seq: dict[int, int] = {}
    for i, m in enumerate(sorted(msgs, key=lambda m: m.t)):
        n = seq.get(m.rank, 0) + (2 if i % drop_every == drop_every - 1 else 1)
        seq[m.rank] = n
        out.append(dataclasses.replace(m, seq=n))
    return out


def fed(mode: Mode, msgs: list[Message]) -> Analysis:
    analysis = build_analysis(mode, history=2048)
    for m in msgs:
        analysis.feed(m, m.t)
    analysis.tick(max(m.t for m in msgs))
    return analysis


def test_the_mode_decides_whether_sequence_gaps_are_lost_messages() -> None:
    msgs = gapped([*run_infos(2), *lockstep(2, 200, constant())], drop_every=10)
    live = findings(fed(LIVE, msgs), "telemetry")
    assert live and "lost" in live[0].message and live[0].evidence["live"] is True
    assert findings(fed(recorded(finished=True), msgs), "telemetry") == []
    assert findings(fed(recorded(finished=False), msgs), "telemetry") == []


def hung(seconds: float) -> list[Message]:
    """Rank 1 stops before step 40's optimizer; rank 0 waits in the all-reduce of step 41."""
    msgs: list[Message] = [*run_infos(2), *lockstep(2, 40, constant())]
    t = max(m.t for m in msgs)
    msgs.append(step_at(0, 40, t + 2 * MS))
    for i in range(1, int(seconds) + 1):
        for r, (phase, step) in {0: ("allreduce", 41), 1: ("idle", 40)}.items():
            msgs.append(heartbeat(r, step, t + i * S + r, phase=phase, in_phase_s=float(i)))
    return sorted(msgs, key=lambda m: m.t)


def test_the_mode_hands_the_hang_limit_to_the_hang_detector() -> None:
    msgs = hung(4)
    assert findings(feed(build_analysis(LIVE), msgs, tick_every_ns=250 * MS), "hang") == []
    limited = feed(build_analysis(Mode("live", hang_after_s=2.0)), msgs, tick_every_ns=250 * MS)
    (f,) = findings(limited, "hang")
    assert f.ranks == [1] and f.evidence["threshold_s"] == 2
    assert "hang-after" in f.evidence["threshold_rule"]
    with pytest.raises(ValueError):
        Mode("finished", hang_after_s=0)


class Calls:
    """A detector that only writes down what the analysis called (the engine's side of
    the protocol, which the real detectors' tests cannot see)."""

    kinds = ("calls",)

    def __init__(self, mode: Mode = LIVE) -> None:
        self.mode = mode
        self.log: list[tuple[str, str]] = []

    def observe(self, run: RunState, msg: Message, book: FindingBook) -> None:
        pass

    def tick(self, run: RunState, book: FindingBook) -> None:
        pass

    def finish(self, run: RunState, book: FindingBook) -> None:
        self.log.append(("finish", run.run_id))

    def reset(self, run_id: str) -> None:
        self.log.append(("reset", run_id))


def test_end_of_stream_finishes_every_run_once_and_a_dropped_run_is_reset() -> None:
    calls = Calls()
    analysis = build_analysis(recorded(finished=False), [calls], history=2048)
    assert isinstance(calls, Detector)
    for i in range(MAX_RUNS + 1):
        for m in run_infos(2, run=f"r{i}", t=i * S):
            analysis.feed(m, m.t)
    assert calls.log == [("reset", "r0")] and "r0" not in analysis.runs
    end_of_stream(analysis)
    end_of_stream(analysis)  # a second end (a reader that ends twice) changes nothing
    finished = [run for what, run in calls.log if what == "finish"]
    assert sorted(finished) == sorted(analysis.runs) and len(finished) == MAX_RUNS
    assert analysis.mode.source == "finished"


def test_finish_is_what_names_a_rank_killed_without_an_end_message() -> None:
    # Rank 1's record stops at step 2 while rank 0 went on (and waited for it for two
    # seconds): only once the stream is over is its missing end message a kill rather
    # than one still on its way.
    msgs = [*run_infos(2), *lockstep(2, 2, constant())]
    t = max(m.t for m in msgs)
    msgs += [step_at(0, 2, t + 10 * MS), step_at(0, 3, t + 30 * MS)]
    msgs += [heartbeat(0, 4, t + k * S, phase="allreduce") for k in (1, 2)]
    analysis = feed(build_analysis(recorded(finished=False)), msgs, tick_every_ns=250 * MS)
    analysis.tick(max(m.t for m in msgs))
    assert findings(analysis, "rank_exit") == []
    end_of_stream(analysis)
    (f,) = findings(analysis, "rank_exit")
    assert f.ranks == [1] and f.severity == "warning"


def holds(obj: Any, run_id: str, depth: int = 3) -> bool:
    """Whether ``obj`` keeps anything under ``run_id`` in its dicts or sets (a few levels down)."""
    if depth == 0:
        return False
    if isinstance(obj, dict):
        return run_id in obj or any(holds(v, run_id, depth - 1) for v in obj.values())
    if isinstance(obj, (set, frozenset)):
        return run_id in obj
    fields = getattr(obj, "__dict__", None)
    return fields is not None and any(holds(v, run_id, depth - 1) for v in fields.values())


def busy_run(run: str, start: int) -> list[Message]:
    msgs: list[Message] = [*run_infos(2, run=run, t=start)]
    msgs += lockstep(2, 12, constant(), run=run, start_ns=start + MS)
    return msgs


def test_every_default_detector_forgets_a_run_the_analysis_dropped() -> None:
    analysis = build_analysis(LIVE, history=2048)
    feed(analysis, busy_run("r0", 0), tick_every_ns=250 * MS)
    keepers = {type(d).__name__ for d in analysis.detectors if holds(d, "r0")}
    # The detectors that keep something per run do so for this one (else the check
    # below proves nothing about them).
    assert {"StragglerDetector", "HangDetector", "RankExitDetector", "TelemetryDetector"} <= (
        keepers
    )
    for i in range(1, MAX_RUNS + 1):
        feed(analysis, busy_run(f"r{i}", i * 10 * S), tick_every_ns=250 * MS)
    assert "r0" not in analysis.runs and analysis.runs_dropped == 1
    assert [type(d).__name__ for d in analysis.detectors if holds(d, "r0")] == []
    assert analysis.detector_errors == {}


# --- the package's shape -----------------------------------------------------------

PACKAGE = Path(detectors_pkg.__file__).parent
#: Modules of the package that are not detectors: what detectors of one group share.
HELPERS = {
    "sampling/ledger.py",
    "sampling/overlap.py",
    "recipe/common.py",
    "recipe/setup.py",
    # The gradients' sizes, for gradients_reduced_twice and forward_bypasses_ddp.
    "recipe/grads.py",
    # The per-rank step detectors' shell (eval_mode_training, optimizer_not_stepping).
    "perrank.py",
    # The straggler detector's: the CPU-contention rule, its findings' figures, and
    # its windows of step ratios.
    "contention.py",
    "slow_evidence.py",
    "ratios.py",
}


def modules() -> dict[str, ast.Module]:
    return {
        str(p.relative_to(PACKAGE)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))
    }


def imported(tree: ast.Module) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def as_module(path: str) -> str:
    name = "ddpscope.analysis.detectors." + path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def test_no_detector_module_imports_another_detector_module() -> None:
    mods = modules()
    detector_modules = {
        as_module(p) for p in mods if p not in HELPERS and not p.endswith("__init__.py")
    }
    assert len(detector_modules) == 29  # one module per default detector
    for path, tree in mods.items():
        others = imported(tree) & (detector_modules - {as_module(path)})
        assert not others, f"{path} imports {sorted(others)}"
        if path.endswith("__init__.py"):
            assert not imported(tree), f"{path} imports: it should only describe its package"


def test_no_detector_reads_files() -> None:
    for path, tree in modules().items():
        names = imported(tree)
        assert not {n for n in names if n.startswith("ddpscope.record")}, path
        assert not names & {"os", "pathlib", "io", "glob", "shutil"}, path
        calls = {
            n.func.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        assert "open" not in calls, path


def test_each_default_detector_lives_in_its_own_module() -> None:
    homes = [type(d).__module__ for d in default_detectors()]
    assert len(set(homes)) == len(homes)
    assert all(not h.endswith(("ledger", "overlap", "common", "setup")) for h in homes)


def test_no_detector_bumps_the_books_version_itself() -> None:
    # An edit in place goes through FindingBook.changed, which also stamps when.
    for path, tree in modules().items():
        bumps = [
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, (ast.AugAssign, ast.Assign))
            and any(
                isinstance(t, ast.Attribute) and t.attr == "version"
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            )
        ]
        assert not bumps, f"{path} sets the book's version at lines {bumps}"
