"""SamplerProbe with DataLoader workers forked from the rank: only the rank posts.

(The probe on real DataLoaders and samplers in one process: tests/unit/test_samplers.py.)
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ddpscope.hooks.samplers import SamplerProbe
from tests.unit.test_samplers import digest_of, dist_sampler


class Tensors(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if torch.utils.data.get_worker_info() is not None:
            # Workers inherit the patched DataLoader; iterating one there must not post.
            list(DataLoader(range(3), batch_size=2))
        return torch.tensor([i])


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
@pytest.mark.parametrize("persistent", [True, False])
def test_forked_workers_record_every_pass_from_the_parent_only(
    tmp_path: Path, persistent: bool
) -> None:
    log = tmp_path / "posts"

    def post(kind: str, fields: dict[str, Any]) -> None:
        # An O_APPEND file, so a post from a forked worker would show up here.
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {kind} {fields.get('count', '')} {fields.get('digest', '')}\n")

    probe = SamplerProbe(post, lambda: 0, lambda: True)
    probe.install()
    try:
        sampler = dist_sampler(64, 2, 1, seed=9)
        twin = dist_sampler(64, 2, 1, seed=9)
        loader = DataLoader(
            Tensors(),
            batch_size=4,
            sampler=sampler,
            num_workers=2,
            persistent_workers=persistent,
            multiprocessing_context="fork",
        )
        got, want = [], []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            twin.set_epoch(epoch)
            got.append(torch.cat(list(loader)).flatten().tolist())
            want.append(list(twin))
        del loader
    finally:
        probe.uninstall()
    assert got == want
    lines = [line.split() for line in log.read_text().splitlines()]
    assert {pid for pid, *_ in lines} == {str(os.getpid())}
    ends = [rest for _, kind, *rest in lines if kind == "sampler_pass_end"]
    # Prefetched batches are included: the digest is that of the whole shard.
    assert ends == [["32", str(digest_of(w))] for w in want]
