"""Evidence laid out as tables (analysis/evidence.py): pure functions, no app."""

from __future__ import annotations

from ddpscope.analysis.evidence import EvidenceTable, EvidenceText, layout, table_text


def test_scalars_are_key_value_rows_and_rank_maps_share_one_table_with_a_column_per_rank() -> None:
    facts, ranks = layout(
        {"stalled_s": 70.0, "behind": [1], "steps_in_pass": {"0": 40, "1": 38}, "skew": {"1": 2}}
    )
    assert facts == EvidenceTable("", ("", ""), (("stalled_s", "70"), ("behind", "1")))
    assert isinstance(ranks, EvidenceTable)
    assert ranks.columns == ("rank", "0", "1")
    assert ranks.rows == (("steps_in_pass", "40", "38"), ("skew", "", "2"))


def test_records_keyed_by_rank_put_ranks_across_and_other_records_down() -> None:
    where, phases = layout(
        {
            "where": {"1": {"phase": "data", "step": 6}, "0": {"phase": "collective", "step": 7}},
            "phases_ms": {"data": {"rank": 20.5, "others": 0.5}, "forward": {"rank": 1.5}},
        }
    )
    assert isinstance(where, EvidenceTable) and isinstance(phases, EvidenceTable)
    assert where.columns == ("rank", "0", "1")
    assert where.rows == (("phase", "collective", "data"), ("step", "7", "6"))
    assert phases.columns == ("", "rank", "others")
    assert phases.rows == (("data", "20.5", "0.5"), ("forward", "1.5", ""))


def test_tracebacks_and_frame_lists_are_text_blocks_keeping_their_last_lines() -> None:
    trace = "\n".join(f"line {i}" for i in range(30))
    stack = ["/job/train.py:50 in main", "/job/data.py:207 in __next__"]
    facts, frames, error = layout({"stack": {"at": stack[-1], "frames": stack}, "error": trace})
    assert facts == EvidenceTable("", ("", ""), (("stack.at", stack[-1]),))
    assert frames == EvidenceText("stack.frames", tuple(stack))
    assert isinstance(error, EvidenceText) and error.lines[-1] == "line 29"
    assert len(error.lines) == 12 and "last 12 lines" in error.title


def test_beyond_eight_ranks_the_table_says_how_many_more() -> None:
    (table,) = layout({"counts": {str(r): r for r in range(20)}})
    assert isinstance(table, EvidenceTable)
    assert table.columns[-1] == "7" and table.more == "12 more ranks"
    text = table_text(table)
    assert text[0].split() == ["rank", *map(str, range(8))] and text[-1] == "(12 more ranks)"


def test_a_rank_list_kept_short_says_how_many_it_stands_for() -> None:
    # A straggler in a 256-rank job: 16 of its 255 waiting ranks are kept; shown
    # as they were, "0, 1, ..., 11 (+4)" read as 16 waiting ranks.
    (facts,) = layout({"waiting_ranks": list(range(16)), "waiting_ranks_count": 255})
    assert isinstance(facts, EvidenceTable)
    assert facts.rows == (("waiting_ranks", ", ".join(map(str, range(12))) + " (+243)"),)
    (alone,) = layout({"ranks_count": 3})
    assert alone.rows == (("ranks_count", "3"),)  # no list beside it: a fact of its own
