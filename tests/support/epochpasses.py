"""Passes over a DataLoader drawn in this process as a training thread draws them, for
the repeated-epoch check (hooks/loaderwait.py): the unit and the real-workers tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils.data import DataLoader

from ddpscope.hooks import loaderwait


@contextmanager
def drawing() -> Iterator[None]:
    """This thread draws as a training loop does, with the comparison installed."""
    loaderwait.install()
    loaderwait.pass_repeat = None
    try:
        yield
    finally:
        loaderwait.uninstall()


def repeats(loader: DataLoader, dataset: Any, passes: int = 3) -> list[object]:
    """What each pass's 4th batch left in ``pass_repeat``, ``set_epoch(epoch)`` called
    before each pass (the step's close takes it: reset after each)."""
    seen = []
    for epoch in range(passes):
        dataset.set_epoch(epoch)
        for _ in loader:
            pass
        seen.append(loaderwait.pass_repeat)
        loaderwait.pass_repeat = None
    return seen
