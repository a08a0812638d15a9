"""A DDP job under ddpscope's comm hook that counts the Python thread states made.

Each one the process group's threads make (to run a Python callback) takes the
interpreter's head lock without the GIL: a fork at that instant deadlocks the
child on CPython < 3.12 (gh-112275). Printed per rank: how many thread states
were made over 20 steps after the warm-up. Run with DDPSCOPE_BUCKET_EVERY=1.
"""

from __future__ import annotations

import ctypes
import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope

_api = ctypes.pythonapi
_api.PyThreadState_Get.restype = ctypes.c_void_p
_api.PyThreadState_GetID.restype = ctypes.c_uint64
_api.PyThreadState_GetID.argtypes = [ctypes.c_void_p]


def next_serial() -> int:
    """The serial of a fresh thread state: one more than every one made before."""
    out: list[int] = []
    t = threading.Thread(
        target=lambda: out.append(_api.PyThreadState_GetID(_api.PyThreadState_Get()))
    )
    t.start()
    t.join()
    return out[0]


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    # Four buckets: one callback each per step.
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)), bucket_cap_mb=0.001)
    ddpscope.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 32)
    for i in range(40):
        if i == 20:
            before = next_serial()
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    made = next_serial() - before - 1  # less the probe's own
    print(f"rank {dist.get_rank()} thread states made: {made}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
