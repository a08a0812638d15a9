"""A healthy 2-rank DDP job (gloo, CPU) that uploads a checkpoint over HTTP mid-run.

At step ``--save-at`` rank 0 serialises its model into memory and PUTs
``--size-mb`` MB to ``--url`` from a worker thread, as boto3's and s3fs's
transfer threads do, while its training thread waits on the future; then both
ranks meet in a barrier, so rank 1 waits there for the whole upload. The
bytes go out with ``send`` on a plain TCP socket: no file, no read or write
call. Each rank attaches ddpscope itself and prints "done: RANK" at the end.
"""

from __future__ import annotations

import argparse
import http.client
import io
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpscope


def upload(url: str, body: bytes) -> int:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=120)
    try:
        conn.request("PUT", u.path or "/", body=body)
        return conn.getresponse().status
    finally:
        conn.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-at", type=int, default=15)
    p.add_argument("--size-mb", type=int, default=32)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)))
    ddpscope.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pool = ThreadPoolExecutor(max_workers=1)
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        model(torch.randn(16, 256)).sum().backward()
        opt.step()
        time.sleep(0.01)
        if step == args.save_at:
            if rank == 0:
                buf = io.BytesIO()
                torch.save(model.module.state_dict(), buf)
                body = buf.getvalue().ljust(args.size_mb << 20, b"\0")
                t0 = time.monotonic()
                status = pool.submit(upload, args.url, body).result()
                took = time.monotonic() - t0
                # One write per line (end=""): rank 1 shares torchrun's stdout unbuffered.
                line = f"rank 0 uploaded step {step}: {status} in {took:.1f} s\n"
                print(line, end="", flush=True)
            dist.barrier()
    dist.barrier()
    pool.shutdown()
    print(f"done: {rank}\n", end="", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
