"""docs/findings.md stays the reference for every finding kind the detectors can raise."""

from __future__ import annotations

import re

import pytest

from ddpscope.analysis.build import default_detectors
from tests.support.torchrun import ROOT

DOC = (ROOT / "docs" / "findings.md").read_text()
KINDS = sorted({k for det in default_detectors() for k in det.kinds})
PARTS = ("**Severity:**", "**What it means.**", "**Example:**", "**Evidence:**", "**Fix:**")


def sections() -> dict[str, str]:
    """Body of each ``## `kind` `` section, by kind."""
    out: dict[str, str] = {}
    for m in re.finditer(r"^## `([a-z0-9_]+)`\n(.*?)(?=^## |\Z)", DOC, re.M | re.S):
        out[m.group(1)] = m.group(2)
    return out


def test_the_recipe_kinds_are_registered_in_the_default_detectors() -> None:
    recipe = {
        "global_batch",
        "checkpoint_all_ranks",
        "rank0_only_collective",
        "dataparallel",
        "batchnorm_small_batch",
        "no_destroy_process_group",
        "device_mismatch",
        "accumulate_without_no_sync",
    }
    assert recipe <= set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_every_declared_kind_has_a_complete_entry(kind: str) -> None:
    body = sections().get(kind)
    assert body is not None, f"docs/findings.md has no '## `{kind}`' section"
    for part in PARTS:
        assert part in body, f"{kind}: no {part} in its section"
    example = body.split("**Example:**", 1)[1].split("**Evidence:**", 1)[0]
    assert "\n> " in example, f"{kind}: the example is not a quoted message"


def test_no_entry_describes_a_kind_no_detector_raises() -> None:
    assert sorted(sections()) == KINDS


def test_the_summary_table_lists_every_kind_once() -> None:
    table = re.findall(r"^\| \[`([a-z0-9_]+)`\]\(#\1\) \|", DOC, re.M)
    assert table == [k for k in table if k in KINDS] and sorted(table) == KINDS
