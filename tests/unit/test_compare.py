"""``ddpscope compare`` on recordings with known content (real jobs: tests/e2e/test_compare.py).

The synthetic recordings are written with the real RecordWriter and wire
encoding; their steps come from the lockstep simulation in ``synth``, so step
times, splits and all-reduce waits are exact and the expected deltas are too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from ddpscope.analysis import compare
from ddpscope.cli.compare import METRIC_CHOICES
from ddpscope.cli.main import main
from ddpscope.record import reader
from ddpscope.record.writer import RecordWriter
from ddpscope.schema import End, Message, Step, encode
from tests.support.synth import (
    MS,
    Phases,
    constant,
    lockstep,
    run_infos,
    straggler,
    with_collectives,
)
from tests.support.torchrun import ROOT

S = 1_000_000_000
WALL0 = 1_700_000_000 * S
DOC = (ROOT / "docs" / "compare.md").read_text()
#: Everything but "other" in synth's default phases, plus the 0.3 ms transfer the
#: lockstep simulation adds after the last bucket.
FIXED_MS = 8.3


def write_run(directory: Path, msgs: list[Message], run: str = "run", wall_ns: int = WALL0) -> Path:
    """One record file per rank, as ranks write them."""
    world = max(m.rank for m in msgs) + 1
    by_rank: dict[int, list[Message]] = {}
    for m in sorted(msgs, key=lambda m: m.t):
        by_rank.setdefault(m.rank, []).append(m)
    for rank, ms in by_rank.items():
        header = {"run_id": run, "rank": rank, "world_size": world, "host": "synth-host"}
        header |= {"pid": 1000 + rank, "wall_ns": wall_ns}
        w = RecordWriter(str(directory), run, rank, header)
        for seq, m in enumerate(ms):
            w.append(encode(dataclasses.replace(m, run=run, seq=seq)))
        w.close()
    return directory


def writers_gone(directory: Path) -> Path:
    """Files from another host unchanged for longer than the reader waits: their
    writers are gone, and the recording is read to its end."""
    old = time.time() - reader.STALE_S - 5
    for f in directory.rglob("*.ddps"):
        os.utime(f, (old, old))
    return directory


def job(
    step_ms: float = 10.0, steps: int = 40, world: int = 2, timing: Any = None
) -> list[Message]:
    """A finished run whose every step takes ``step_ms`` (the excess over FIXED_MS is "other")."""
    if timing is None:
        timing = constant(Phases(other=round((step_ms - FIXED_MS) * MS)))
    msgs: list[Message] = [*run_infos(world), *lockstep(world, steps, timing)]
    t = max(m.t for m in msgs)
    msgs += [End(run="x", rank=r, t=t + MS, reason="exit", step=steps) for r in range(world)]
    return msgs


def killed(steps: int = 30) -> list[Message]:
    """Rank 1 SIGKILLed; rank 0 completes one more step and fails on the lost peer."""
    msgs: list[Message] = [*run_infos(2), *lockstep(2, steps, constant())]
    t = max(m.t for m in msgs)
    last = next(m for m in msgs if isinstance(m, Step) and m.rank == 0 and m.step == steps - 1)
    msgs.append(dataclasses.replace(last, step=steps, t=t + 9 * MS, t_start=t, t_end=t + 9 * MS))
    error = "Traceback (most recent call last):\n  File x\nRuntimeError: Connection reset by peer\n"
    msgs.append(
        End(run="x", rank=0, t=t + 50 * MS, reason="exception", step=steps + 1, error=error)
    )
    return msgs


def cli(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["compare", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def as_json(*argv: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = cli(*argv, "--json", capsys=capsys)
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc


def metric(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in doc["metrics"] if r["name"] == name)


def fits(text: str) -> None:
    long = [ln for ln in text.splitlines() if len(ln) > compare.WIDTH]
    assert not long, long


@pytest.fixture
def ten_vs_twelve(tmp_path: Path) -> tuple[str, str]:
    return str(write_run(tmp_path / "a", job(10.0))), str(write_run(tmp_path / "b", job(12.0)))


# --- figures ---------------------------------------------------------------------


def test_twelve_ms_against_ten_is_plus_twenty_percent(
    ten_vs_twelve: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    doc = as_json(*ten_vs_twelve, capsys=capsys)
    step = metric(doc, "step")
    assert (step["a"], step["b"], step["delta"], step["delta_pct"]) == (10.0, 12.0, 2.0, 20.0)
    assert step["worse_pct"] == 20.0
    # The extra 2 ms is all "other"; the rest of the split did not move.
    assert metric(doc, "other")["delta"] == 2.0
    for name in ("data", "forward", "backward", "optimizer", "comm_wait"):
        assert metric(doc, name)["delta_pct"] == 0.0, name
    tp = metric(doc, "throughput")
    assert (tp["a"], tp["b"]) == (100.0, 83.333) and tp["worse_pct"] == 16.7
    assert doc["warnings"] == [] and doc["verdict"] is None
    code, out, _ = cli(*ten_vs_twelve, capsys=capsys)
    assert code == 0
    assert re.search(r"^  step\s+10\.00\s+12\.00\s+\+20\.0%", out, re.M), out
    assert "sample: A 38, B 38 steps per rank" in out
    fits(out)


@pytest.mark.parametrize(("pct", "code"), [("10", 1), ("19.9", 1), ("20", 0), ("25", 0)])
def test_fail_on_regression_trips_only_past_the_threshold(
    ten_vs_twelve: tuple[str, str], pct: str, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    got, out, err = cli(*ten_vs_twelve, "--fail-on-regression", pct, capsys=capsys)
    assert got == code, out + err
    assert f"verdict: {'FAIL' if code else 'PASS'}" in out


def test_other_metrics_can_be_gated(
    ten_vs_twelve: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    # Throughput is better when higher: 100 -> 83.3 steps/s is 16.7 % worse.
    args = [*ten_vs_twelve, "--fail-on-regression", "15"]
    assert cli(*args, "--metric", "throughput", capsys=capsys)[0] == 1
    assert cli(*args, "--metric", "backward", capsys=capsys)[0] == 0
    code, out, _ = cli(*args, "--metric", "backward", "--metric", "step", capsys=capsys)
    assert code == 1 and "backward: B +0.0% vs A, within 15%" in out
    assert cli(*ten_vs_twelve, "--metric", "step", capsys=capsys)[0] == 2  # gates nothing


def test_identical_runs_show_no_change_and_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write_run(tmp_path / "a", job(10.0))
    b = write_run(tmp_path / "b", job(10.0))
    doc = as_json(str(a), str(b), capsys=capsys)
    for row in doc["metrics"]:
        assert row["delta_pct"] == 0.0, row
    assert all(r["same"] for r in doc["setup"])
    assert doc["findings"]["kinds"] == []
    code, out, err = cli(str(a), str(b), "--fail-on-regression", "0", capsys=capsys)
    assert code == 0, out + err
    assert "findings: none on either side" in out


def test_warmup_steps_are_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Steps 0 and 1 take 200 ms more; throughput (which a median would not shield) is
    # still exactly 100 steps/s.
    steady = Phases(other=round(1.7 * MS))

    def timing(rank: int, step: int) -> Phases:
        return steady.plus(data=200 * MS) if step < 2 else steady

    a = write_run(tmp_path / "a", job(timing=timing))
    doc = as_json(str(a), str(a), capsys=capsys)
    fig = doc["a"]["figures"]
    assert fig["warmup_skipped"] == compare.WARMUP_STEPS == 2
    assert fig["steps_used"] == 38 and metric(doc, "throughput")["a"] == 100.0


def test_spread_and_waits_name_the_slow_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = constant(Phases(other=round(1.7 * MS)))
    slow = straggler(base, rank=1, extra_ns={"other": 5 * MS})
    a = write_run(tmp_path / "a", job(timing=base))
    b = write_run(tmp_path / "b", job(timing=slow))
    doc = as_json(str(a), str(b), capsys=capsys)
    assert doc["a"]["figures"]["spread"]["ratio"] == 1.0
    sp = doc["b"]["figures"]["spread"]
    assert (sp["slowest_rank"], sp["fastest_rank"]) == (1, 0)
    assert sp["slowest_own_ms"] - sp["fastest_own_ms"] == pytest.approx(5.0)
    waits = {r["rank"]: r["allreduce_wait_ms"] for r in doc["b"]["figures"]["ranks"]}
    assert waits[0] > 4.5 and waits[1] < 0.5  # rank 0 waits for rank 1, not the reverse
    code, out, _ = cli(str(a), str(b), capsys=capsys)
    assert code == 0
    assert re.search(r"rank spread \(own work\)\s+1\.00 r\d/r\d\s+1\.\d\d r1/r0", out), out
    fits(out)


def test_the_spread_names_the_slow_rank_when_the_others_wait_in_the_buffer_broadcast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slow = straggler(constant(), rank=1, extra_ns={"data": 5 * MS})
    msgs = with_collectives(job(timing=slow), sync_ns=MS // 2, wait_in_sync=True)
    a = write_run(tmp_path / "a", job(timing=constant()))
    b = write_run(tmp_path / "b", msgs)
    doc = as_json(str(a), str(b), capsys=capsys)
    sp = doc["b"]["figures"]["spread"]
    assert (sp["slowest_rank"], sp["fastest_rank"]) == (1, 0)
    assert sp["slowest_own_ms"] - sp["fastest_own_ms"] == pytest.approx(5.0)
    sync = {r["rank"]: r["split_ms"]["sync_wait"] for r in doc["b"]["figures"]["ranks"]}
    assert sync[0] - sync[1] > 4.5  # rank 0 waits for rank 1 in the broadcast


# --- findings --------------------------------------------------------------------


def test_findings_only_in_b_are_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = str(write_run(tmp_path / "a", job(10.0, steps=30)))
    b = str(writers_gone(write_run(tmp_path / "b", killed())))
    doc = as_json(a, b, capsys=capsys)
    assert "rank_exit" in doc["findings"]["only_b"]
    assert doc["findings"]["only_a"] == []
    row = next(r for r in doc["findings"]["kinds"] if r["kind"] == "rank_exit")
    assert row["a"] is None and row["b"]["severity"] == "error" and row["b"]["ranks"] == [1]
    code, out, _ = cli(a, b, "--fail-on-new", "error", capsys=capsys)
    assert code == 1
    assert re.search(r"^  rank_exit\s+-\s+error x1, rank 1\s+new in B$", out, re.M), out
    assert "findings new in B at error or above: rank_exit" in out
    fits(out)
    # The other way round, the finding is gone in B: nothing new, the gate passes.
    code, out, _ = cli(b, a, "--fail-on-new", "error", capsys=capsys)
    assert code == 0 and re.search(r"rank_exit\s+error x1, rank 1\s+-\s+gone in B", out)


# --- comparability and sample size -------------------------------------------------


def test_mismatched_world_size_is_warned_not_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write_run(tmp_path / "a", job(10.0, world=2))
    b = write_run(tmp_path / "b", job(10.0, world=4))
    code, out, err = cli(str(a), str(b), "--fail-on-regression", "10", capsys=capsys)
    assert code == 0, err
    assert "warnings (the comparison may mislead):" in out
    assert "world size differs: A 2, B 4" in out
    assert re.search(r"^  world size\s+2\s+4  differs$", out, re.M), out
    doc = as_json(str(a), str(b), capsys=capsys)
    assert metric(doc, "step")["b"] is not None
    assert not next(r for r in doc["setup"] if r["name"] == "world_size")["same"]


def test_few_steps_are_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write_run(tmp_path / "a", job(10.0, steps=8))
    code, out, _ = cli(str(a), str(a), capsys=capsys)
    assert code == 0
    assert "sample: A 6, B 6 steps per rank" in out
    assert "few steps: A 6, B 6 per rank after warm-up" in out


def test_gated_metric_without_a_value_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = write_run(tmp_path / "a", job(10.0, world=1))  # one rank: nobody to wait for
    code, _, err = cli(
        str(one), str(one), "--fail-on-regression", "5", "--metric", "allreduce_wait",
        capsys=capsys,
    )  # fmt: skip
    assert code == 3 and "cannot check allreduce_wait" in err


# --- run selection and unreadable input ----------------------------------------------


def test_one_directory_compares_its_two_newest_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for i, ms in enumerate((9.0, 10.0, 12.0)):
        write_run(tmp_path, job(ms), run=f"run-{i}", wall_ns=WALL0 + i * S)
    doc = as_json(str(tmp_path), capsys=capsys)
    assert (doc["a"]["run"]["id"], doc["b"]["run"]["id"]) == ("run-1", "run-2")
    assert metric(doc, "step")["delta_pct"] == 20.0
    doc = as_json(str(tmp_path), "--run-a", "run-0", "--run-b", "run-1", capsys=capsys)
    assert (metric(doc, "step")["a"], metric(doc, "step")["b"]) == (9.0, 10.0)
    doc = as_json(str(tmp_path), "--run-b", "run-1", capsys=capsys)
    assert doc["a"]["run"]["id"] == "run-0"


def test_unreadable_input_exits_3_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = write_run(tmp_path / "good", job(10.0))
    missing = tmp_path / "missing"
    code, out, err = cli(str(good), str(missing), capsys=capsys)
    assert code == 3 and out == "" and str(missing) in err
    bad = tmp_path / "bad" / "run"
    bad.mkdir(parents=True)
    (bad / "rank-00000-1.ddps").write_bytes(b"not a record at all")
    code, _, err = cli(str(tmp_path / "bad"), str(good), capsys=capsys)
    assert code == 3 and str(bad / "rank-00000-1.ddps") in err
    single = tmp_path / "single"
    write_run(single, job(10.0))
    code, _, err = cli(str(single), capsys=capsys)
    assert code == 3 and "comparing needs two" not in err and "none before" in err
    assert cli(str(good), str(good), "--run-b", "nope", capsys=capsys)[0] == 3


# --- the JSON and its documentation --------------------------------------------------


def _keys(value: Any) -> set[str]:
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(k)
            # `run` and each side's findings are report's objects (docs/report.md).
            if k not in ("run", "evidence") and not (k == "findings" and isinstance(v, list)):
                out |= _keys(v)
    elif isinstance(value, list):
        for v in value:
            out |= _keys(v)
    return out


def test_every_json_field_is_documented(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", job(10.0, steps=30))
    b = write_run(tmp_path / "b", killed())
    doc = compare.build(
        compare.load(str(a), None), compare.load(str(b), None), 10.0, ["step"], "warning"
    )
    assert doc["format"] == "ddpscope.compare" and doc["version"] == compare.VERSION == 1
    documented = set(re.findall(r"`([a-z_0-9]+)`", DOC))
    missing = sorted(_keys(doc) - documented)
    assert not missing, f"docs/compare.md does not document {missing}"
    for m in compare.METRIC_KEYS:
        assert f"`{m}`" in DOC
    assert METRIC_CHOICES == compare.METRIC_KEYS  # the parser's copy of the list
