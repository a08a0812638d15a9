"""Where the per-bucket microseconds go: DDP's C++ path against Python comm hooks.

One 2-rank torchrun job (gloo, CPU), identical DDP models of 40 one-bucket
layers trained in rotating blocks of steps:

- ``cpp``: no comm hook (DDP's own C++ all-reduce);
- ``default_py``: ``default_hooks.allreduce_hook``, the stock Python hook;
- ``minimal``: the least a Python hook can do (divide, all-reduce, one
  ``then`` callback returning the tensor: the reducer requires a Python
  object back);
- ``nodiv``: ``minimal`` without the divide, so gradients come out summed,
  not averaged: not a usable hook, it only measures the divide's share
  (DDP's C++ path fuses the divide into the copy into the bucket; a Python
  hook gets the bucket already copied and divides it in a second pass);
- ``ddpscope``: attached at default settings (bucket detail sampled);
- ``ddpscope_all``: attached, bucket detail on every step.

Per bucket, the training thread's CPU time over ``cpp`` (median of the
per-round differences, with a 95% bootstrap interval), and wall time the
same way (much noisier here: two ranks share two busy cores).

    python -m benchmarks.comm_hook_floor --rounds 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.stats import paired_ci
from benchmarks.table import print_json
from benchmarks.torchjob import job_env, torchrun

LAYERS = 40


def _first(fut: Any) -> Any:
    return fut.value()[0]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    width = args.width

    def make() -> DDP:
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)])
        return DDP(net, bucket_cap_mb=(width * width + width) * 4 / 2**20)

    # No annotations on the hooks: DDP rejects any but GradBucket, and this
    # module's are strings.
    def minimal(group, bucket):  # type: ignore[no-untyped-def]
        t = bucket.buffer()
        t.div_(world)
        return group.allreduce([t]).get_future().then(_first)

    def nodiv(group, bucket):  # type: ignore[no-untyped-def]
        return group.allreduce([bucket.buffer()]).get_future().then(_first)

    names = ("cpp", "default_py", "minimal", "nodiv", "ddpscope", "ddpscope_all")
    models = {name: make() for name in names}
    group = dist.distributed_c10d._get_default_group()
    models["default_py"].register_comm_hook(group, default_hooks.allreduce_hook)
    models["minimal"].register_comm_hook(group, minimal)
    models["nodiv"].register_comm_hook(group, nodiv)
    # Imported only now: from then on ddpscope's class shim would route the
    # registrations above into its own wrapper.
    import ddpscope

    ddpscope.attach(models["ddpscope"])
    ddpscope.attach(models["ddpscope_all"], bucket_every=1)  # hook at attach, every step
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
    x = torch.randn(64, width)

    def block(name: str, steps: int) -> tuple[float, float]:
        model, opt = models[name], opts[name]
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        for _ in range(steps):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        return (t1 - t0) / steps / 1e3, (c1 - c0) / steps / 1e3

    for n in names:
        block(n, 10)
    got: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for i in range(args.rounds):
        for n in (*names[i % len(names) :], *names[: i % len(names)]):
            got[n].append(block(n, args.steps))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--json", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        # Fingerprints are measured apart.
        env = job_env(tmp, DDPSCOPE_CHECKSUM_EVERY="-1")
        cmd = torchrun(2, __file__, "--worker", "--out", str(out), "--rounds", str(args.rounds),
                       "--steps", str(args.steps), "--width", str(args.width))  # fmt: skip
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        got = json.loads(out.read_text())
    base = got["cpp"]
    result: dict[str, Any] = {"layers": LAYERS, "buckets": LAYERS, "rounds": args.rounds}
    for name, blocks in got.items():
        cpu, cpu_ci = paired_ci([b[1] for b in blocks], [b[1] for b in base], lambda a, b: a - b)
        wall, wall_ci = paired_ci([b[0] for b in blocks], [b[0] for b in base], lambda a, b: a - b)
        result[name] = {
            "train_thread_cpu_us_per_step": statistics.median(b[1] for b in blocks),
            "cpu_us_per_bucket_over_cpp": cpu / LAYERS,
            "cpu_ci": [v / LAYERS for v in cpu_ci],
            "wall_us_per_bucket_over_cpp": wall / LAYERS,
            "wall_ci": [v / LAYERS for v in wall_ci],
        }
    print_json(result, args.json)


if __name__ == "__main__":
    main()
