"""``torch.utils.data.random_split`` without a seeded generator, the classic cause
of overlapping shards: each rank splits differently, so their "train" subsets
overlap. A real 2-rank job (tests/jobs/split_job.py), seeded and unseeded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.frameworks import SPLIT, record
from tests.support.recorded import brief, serious
from tests.support.recorded import report_json as report

pytestmark = pytest.mark.torchrun


@pytest.mark.parametrize("fixed", [False, True], ids=["unseeded", "seeded"])
def test_random_split_without_a_generator_is_named_as_the_overlap_cause(
    tmp_path: Path, endpoint: str, fixed: bool
) -> None:
    rec = record(tmp_path, endpoint, SPLIT, *(["--fixed"] if fixed else []))
    found = serious(report(rec))
    if fixed:
        assert found == [], brief(found)
        return
    assert [(f["kind"], f["ranks"]) for f in found] == [("shard_overlap", [0, 1])], brief(found)
    assert "random_split" in found[0]["message"]
    assert "generator=torch.Generator().manual_seed(" in found[0]["fix"]
    assert found[0]["evidence"]["overlap"]["subset_index_lists"] == 2
