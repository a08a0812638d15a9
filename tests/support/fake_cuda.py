"""A stand-in for torch.cuda.Event(enable_timing=True), for CPU-only tests."""

from __future__ import annotations


class FakeEvent:
    """Completes when the test says so; device time is a settable number (ms)."""

    now_ms = 0.0

    def __init__(self) -> None:
        self.done = False
        self.at_ms = 0.0

    def record(self) -> None:
        self.done = False
        FakeEvent.now_ms += 1.5
        self.at_ms = FakeEvent.now_ms

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.at_ms - self.at_ms
