"""Host statistics for heartbeats (psutil), and device memory behind a hook."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil

#: Shortest interval a CPU share is measured over. The kernel counts a process's CPU
#: time in clock ticks (10 ms): over a few milliseconds (the heartbeat at attach, the
#: last one at exit) one tick more or less reads as hundreds of percent.
MIN_CPU_INTERVAL_S = 0.25

#: Returns (allocated, reserved) bytes of the rank's GPU, or (-1, -1).
DeviceMemory = Callable[[], tuple[int, int]]


def no_device_memory() -> tuple[int, int]:
    return (-1, -1)


def device_memory_for(device: str) -> DeviceMemory:
    """The reader of the memory torch's allocator holds on ``device``: a GPU's, else none."""
    if not device.startswith("cuda"):
        return no_device_memory
    import torch

    dev = torch.device(device)

    def read() -> tuple[int, int]:
        return (torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev))

    return read


class HostProbe:
    """The rank process's CPU share, memory and threads, read on the publisher thread.

    The CPU share is the process's CPU time over wall time since the last
    reading at least :data:`MIN_CPU_INTERVAL_S` old (100 = one core busy); a sample
    sooner than that repeats it, and -1 means none measured yet.
    """

    def __init__(self, device_memory: DeviceMemory = no_device_memory) -> None:
        self._proc = psutil.Process()
        self.device_memory = device_memory
        self._cpu_pct = -1.0
        try:
            self._cpu_at = (time.monotonic(), self._cpu_s())
        except psutil.Error:
            self._cpu_at = (time.monotonic(), -1.0)

    def _cpu_s(self) -> float:
        t = self._proc.cpu_times()
        return float(t.user + t.system)

    def _cpu_share(self) -> float:
        now, used = time.monotonic(), self._cpu_s()
        since, before = self._cpu_at
        if now - since >= MIN_CPU_INTERVAL_S:
            if before >= 0:
                self._cpu_pct = 100.0 * max(0.0, used - before) / (now - since)
            self._cpu_at = (now, used)
        return self._cpu_pct

    def sample(self) -> dict[str, float | int]:
        try:
            with self._proc.oneshot():
                cpu = self._cpu_share()
                rss = self._proc.memory_info().rss
                threads = self._proc.num_threads()
        except psutil.Error:
            cpu, rss, threads = -1.0, -1, -1
        alloc, reserved = self.device_memory()
        return {
            "cpu_pct": float(cpu),
            "rss_bytes": int(rss),
            "threads": int(threads),
            "cuda_allocated": int(alloc),
            "cuda_reserved": int(reserved),
        }
