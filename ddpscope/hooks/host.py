"""Host statistics for heartbeats (psutil), and device memory behind a hook."""

from __future__ import annotations

from collections.abc import Callable

import psutil

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
    def __init__(self, device_memory: DeviceMemory = no_device_memory) -> None:
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # prime: the first call always returns 0.0
        self.device_memory = device_memory

    def sample(self) -> dict[str, float | int]:
        try:
            with self._proc.oneshot():
                cpu = self._proc.cpu_percent(None)
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
