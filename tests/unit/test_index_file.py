"""The replay's index file: built once beside a finished recording, then loaded.

Recordings are written here with the real RecordWriter (tests/synth.py's
lockstep DDP, a straggler); each replay index is the real one, run in this
thread.
"""

from __future__ import annotations

import os
import random
import socket
import tracemalloc
from bisect import bisect_right
from pathlib import Path

import pytest

from ddpscope.analysis import digest
from ddpscope.analysis.digest import analysis_digest
from ddpscope.record import index as index_file
from ddpscope.record.reader import find_runs
from ddpscope.replay import index as replay_index
from ddpscope.replay.index import RecordingIndex
from ddpscope.schema import End, Message
from tests.support.synth import MS, Phases, healthy, lockstep, run_infos, straggler
from tests.unit.test_report import write_run

BASE = Phases(data=8 * MS, forward=22 * MS, backward=45 * MS, optimizer=7 * MS, other=3 * MS)


ROOT_BEFORE = digest._ROOT


def recording(directory: Path, steps: int = 200) -> Path:
    timing = straggler(healthy(random.Random(2), BASE), rank=1, start=steps // 2, factor=1.6)
    msgs: list[Message] = [*run_infos(2), *lockstep(2, steps, timing, heartbeat_every=5)]
    t = max(m.t for m in msgs)
    msgs += [End(run="x", rank=r, t=t + MS, reason="exit", step=steps) for r in range(2)]
    return write_run(directory, msgs)


def indexed(run: Path, **kw: object) -> RecordingIndex:
    ix = RecordingIndex(find_runs(str(run))[-1], **kw)  # type: ignore[arg-type]
    ix.run_pass()
    assert ix.done and ix.error == "", ix.error
    return ix


def same_pass(a: RecordingIndex, b: RecordingIndex) -> None:
    """Everything the player reads of an index is the same in both."""
    for sa, sb in zip(a.streams, b.streams, strict=True):
        for name in ("tmax", "offset", "step_pos", "step_ms", "busy_ms", "gap_t", "gap_n"):
            assert getattr(sa, name) == getattr(sb, name), name
        assert sa.by_kind == sb.by_kind
    assert a.step_done == b.step_done
    assert (a.first_t, a.t, a.records, a.ranks_expected) == (
        b.first_t,
        b.t,
        b.records,
        b.ranks_expected,
    )
    assert a.raised_times() == b.raised_times()
    assert [(m.t, m.version, m.findings) for m in a.moments] == [
        (m.t, m.version, m.findings) for m in b.moments
    ]
    for t in (a.first_t, (a.first_t + a.t) // 2, a.t):
        assert a.findings_at(t) == b.findings_at(t)


def test_a_finished_recording_is_indexed_once_then_loaded(tmp_path: Path) -> None:
    run = recording(tmp_path)
    first = indexed(run)
    assert not first.cached and first.saved_to == str(run / index_file.NAME)
    assert any(m.findings for m in first.moments)  # the straggler was raised
    again = indexed(run)
    assert again.cached
    same_pass(first, again)


def test_a_changed_file_makes_the_index_stale(tmp_path: Path) -> None:
    run = recording(tmp_path)
    indexed(run)
    f = sorted(run.glob("*.ddps"))[0]
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    again = indexed(run)
    assert not again.cached and again.saved_to is not None
    assert indexed(run).cached  # rebuilt for the files as they are now


def test_an_index_an_older_ddpscope_wrote_is_rebuilt_quietly(tmp_path: Path) -> None:
    # What an older index holds may be counted otherwise (version 2's gaps):
    # out of date, like one of changed files, and no problem of the recording.
    run = recording(tmp_path)
    indexed(run)
    path = run / index_file.NAME
    data = bytearray(path.read_bytes())
    older = index_file.VERSION - 1
    data[len(index_file.MAGIC) : len(index_file.MAGIC) + 2] = older.to_bytes(2, "little")
    path.write_bytes(bytes(data))
    again = indexed(run)
    assert not again.cached and again.problems == []
    assert again.saved_to is not None and indexed(run).cached


def test_a_foreign_or_damaged_index_is_named_and_rebuilt(tmp_path: Path) -> None:
    run = recording(tmp_path)
    fresh = indexed(run, cache=False)
    for junk in (b"not an index at all", None):
        path = run / index_file.NAME
        if junk is None:  # a real index with one byte of its meta flipped
            indexed(run)
            data = bytearray(path.read_bytes())
            data[20] ^= 0xFF
            junk = bytes(data)
        path.write_bytes(junk)
        again = indexed(run)
        assert not again.cached
        assert any("not a usable index" in p for p in again.problems), again.problems
        same_pass(fresh, again)


def test_an_index_of_other_settings_is_not_used(tmp_path: Path) -> None:
    run = recording(tmp_path)
    indexed(run)
    assert not indexed(run, hang_after_s=3.0).cached  # findings depend on the hang limit


def test_an_index_made_by_other_analysis_code_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same version string, another detector: its findings must not be shown.
    run = recording(tmp_path)
    indexed(run)
    monkeypatch.setattr(replay_index, "analysis_digest", lambda: "0123456789abcdef")
    again = indexed(run)
    assert not again.cached and again.problems == []
    assert indexed(run).cached


def test_the_analysis_digest_follows_the_analysis_sources(tmp_path: Path) -> None:
    assert len(analysis_digest()) == 16 and analysis_digest() == analysis_digest()
    digest.analysis_digest.cache_clear()
    try:
        ours = analysis_digest()
        digest._ROOT = str(tmp_path)  # type: ignore[attr-defined]
        (tmp_path / "analysis").mkdir()
        for name in ("schema.py", "schema_codec.py", "analysis/straggler.py"):
            (tmp_path / name).write_text("x = 1\n")
        digest.analysis_digest.cache_clear()
        other = analysis_digest()
        (tmp_path / "analysis" / "straggler.py").write_text("x = 2\n")
        digest.analysis_digest.cache_clear()
        assert len({ours, other, analysis_digest()}) == 3
    finally:
        digest._ROOT = ROOT_BEFORE  # type: ignore[attr-defined]
        digest.analysis_digest.cache_clear()


def test_where_the_run_directory_cannot_take_it_the_user_cache_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = recording(tmp_path / "rec")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (run / index_file.NAME).mkdir()  # the name taken: nothing can be renamed onto it
    first = indexed(run)
    assert first.saved_to is not None and first.saved_to.startswith(str(tmp_path / "cache"))
    again = indexed(run)
    assert again.cached
    same_pass(first, again)


def test_a_run_still_being_written_is_not_saved(tmp_path: Path) -> None:
    steps = 40
    msgs: list[Message] = [*run_infos(2), *lockstep(2, steps, healthy(random.Random(1), BASE))]
    # This process writes it: its pid is alive, so the run is not finished.
    run = write_run(tmp_path, msgs, host=socket.gethostname(), pid=os.getpid())
    ix = indexed(run)
    assert ix.saved_to is None and not (run / index_file.NAME).exists()


def test_opening_an_index_reads_its_meta_not_its_arrays(tmp_path: Path) -> None:
    # A 1,024-rank x 10,000-step run's index holds ~450 MB of arrays: an open that
    # read them would cost that memory before the first screen.
    from array import array

    run = tmp_path / "run"
    run.mkdir()
    big = array("q", range(2_000_000))  # 16 MB
    assert index_file.save(str(run), {"files": []}, {"big": big, "d": array("d", [0.5, 2.0])})
    tracemalloc.start()
    try:
        meta, arrays, notes = index_file.load(str(run))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert meta is not None and notes == []
    assert peak < 1 << 20, peak
    got = arrays["big"]
    assert len(got) == len(big) and got == big
    assert (got[0], got[1_234_567], list(got[-2:])) == (0, 1_234_567, [1_999_998, 1_999_999])
    assert bisect_right(got, 1_000_000) == 1_000_001
    assert list(arrays["d"]) == [0.5, 2.0]
    with pytest.raises(TypeError):
        got[0] = 1  # read-only: the file is never written through the map
