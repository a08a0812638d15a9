"""Checks of the CUDA paths, for a machine with a GPU (none runs in CI).

    python -m benchmarks.gpu_check --out gpu_check.json

1. Fingerprints computed on the GPU equal those of the same tensors on the
   CPU, for every dtype ddpscope digests (the hash is defined on raw bits),
   and the GPU's NaN/inf test (multi-tensor norms) flags what the CPU's sums
   flag, without a synchronising call.
2. EventClock: a matmul timed with two events read lazily agrees with the
   same matmul timed by synchronising around it.
3. A real one-process DDP job (NCCL) under ddpscope: steps report
   clock "cuda", positive phases, bucket all-reduce durations within the
   step on the steps that carry bucket detail (sampled: ``b_detail``), the
   steps between with empty bucket arrays, fingerprints, and no dropped
   messages.
4. The hot path on CUDA, in this process (NCCL, world size 1): an attached
   model trains under ``torch.cuda.set_sync_debug_mode("error")`` without a
   synchronising call (its timed and untimed bucket paths both), and makes
   no more caching-allocator requests per step than the same model plain.

Prints one JSON object; exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def check_digests() -> dict[str, Any]:
    from ddpscope.hooks.fingerprint import digest_tensors

    torch.manual_seed(0)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
              torch.int8, torch.bool, torch.complex64]  # fmt: skip
    cpu = [torch.randn(1000, 333).to(d) if d != torch.bool else torch.rand(999) > 0.5
           for d in dtypes]  # fmt: skip
    gpu = [t.cuda() for t in cpu]
    t0 = time.perf_counter()
    on_gpu = digest_tensors(gpu)
    on_gpu.wait()
    elapsed = time.perf_counter() - t0
    same = on_gpu.values() == digest_tensors(cpu).values()
    # The NaN/inf test takes the grouped (multi-tensor) path on the GPU: same flags as the
    # CPU's sums, and still no synchronisation before the copy lands.
    floats = [i for i, d in enumerate(dtypes) if d.is_floating_point]
    for i in floats[1::2]:
        cpu[i].view(-1)[7] = float("nan")
        gpu[i].view(-1)[7] = float("nan")
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = digest_tensors(gpu, finite=set(floats))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    flagged = pending.nonfinite()
    expected = floats[1::2]
    return {
        "ok": same and flagged == expected == digest_tensors(cpu, finite=set(floats)).nonfinite(),
        "dtypes": [str(d) for d in dtypes],
        "gpu_digest_s": elapsed,
        "nonfinite_flagged": flagged,
        "nonfinite_expected": expected,
    }


def check_event_clock() -> dict[str, Any]:
    from ddpscope.hooks.clocks import clock_for

    clock = clock_for("cuda")
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(5):
        a @ a
    torch.cuda.synchronize()
    synced_ns = (time.perf_counter_ns() - t0) / 5
    start = clock.stamp()
    for _ in range(5):
        a @ a
    end = clock.stamp()
    early = clock.resolve([start, end], force=False)  # must not block
    torch.cuda.synchronize()
    got = clock.resolve([start, end], force=False)
    assert got is not None
    event_ns = (got[1] - got[0]) / 5
    ratio = event_ns / synced_ns
    return {"ok": 0.8 < ratio < 1.25, "synced_ms": synced_ns / 1e6, "events_ms": event_ns / 1e6,
            "ratio": ratio, "resolved_before_sync": early is not None}  # fmt: skip


def check_job() -> dict[str, Any]:
    from ddpscope.record import open_run
    from ddpscope.schema import Fingerprint, Heartbeat, Step

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(
            os.environ,
            DDPSCOPE_RECORD=f"{tmp}/rec",
            DDPSCOPE_ENDPOINT=f"ipc://{tmp}/s",
            DDPSCOPE_CHECKSUM_EVERY="4",
            DDPSCOPE_BUCKET_EVERY="4",
            PYTHONPATH=str(ROOT),
        )  # buckets timed every 4th step: the CUDA event path
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=1", str(ROOT / "demos" / "train.py"), "--epochs", "2",
               "--samples", "4096", "--batch", "256", "--width", "2048",
               "--bucket-mb", "4"]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            return {"ok": False, "stderr": proc.stderr[-3000:]}
        msgs = open_run(f"{tmp}/rec").messages[0]
    steps = [m for m in msgs if isinstance(m, Step)]
    fps = [m for m in msgs if isinstance(m, Fingerprint)]
    beats = [m for m in msgs if isinstance(m, Heartbeat)]
    later = steps[2:]
    timed = [s for s in later if s.b_detail]
    untimed = [s for s in later if not s.b_detail]
    within = all(0 < d <= s.t_end - s.t_start for s in timed for d in s.b_dur_ns)
    return {
        "ok": bool(timed)
        and all(s.clock == "cuda" for s in steps)
        and within
        and all(s.b_index == [] for s in untimed)
        and bool(fps)
        and all(s.forward_ns > 0 and s.backward_ns > 0 for s in later),
        "steps": len(steps),
        "steps_with_bucket_detail": len(timed),
        "bucket_every": sorted({s.b_every for s in later}),
        "clock": sorted({s.clock for s in steps}),
        "median_step_ms": sorted((s.t_end - s.t_start) for s in later)[len(later) // 2] / 1e6,
        "buckets_per_step": len(timed[-1].b_index) if timed else 0,
        "bucket_ms_last_timed_step": [d / 1e6 for d in timed[-1].b_dur_ns] if timed else [],
        "fingerprints": [(f.step, f.reason, f.cost_ns) for f in fps],
        "dropped": beats[-1].dropped_queue + beats[-1].dropped_send if beats else None,
    }


def check_hot_path() -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpscope
    from ddpscope.hooks import attach as attach_mod

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["DDPSCOPE_ENDPOINT"] = f"ipc://{tmp}/s"
        os.environ["DDPSCOPE_CHECKSUM_EVERY"] = "-1"  # fingerprints allocate by design
        dist.init_process_group("nccl", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:

            def make() -> DDP:
                torch.manual_seed(0)
                net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)]).cuda()
                return DDP(net, device_ids=[0], bucket_cap_mb=4)

            plain, watched, untimed = make(), make(), make()
            # Buckets timed every 4th step (the hook's timed and cheap paths);
            # the third model is at defaults, where 16 buckets on a short step
            # keep DDP's C++ path (autograd callbacks only).
            handle = ddpscope.attach(watched, bucket_every=4)
            quiet = ddpscope.attach(untimed)
            assert isinstance(handle, attach_mod.Handle) and isinstance(quiet, attach_mod.Handle)
            models = (plain, watched, untimed)
            opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-4) for m in models}
            x = torch.randn(256, 1024, device="cuda")

            def train(m: DDP, n: int) -> None:
                opt = opts[id(m)]
                for _ in range(n):
                    opt.zero_grad(set_to_none=False)
                    m(x).square().mean().backward()
                    opt.step()

            def allocations(m: DDP, n: int) -> float:
                torch.cuda.synchronize()
                before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
                train(m, n)
                torch.cuda.synchronize()
                after = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
                return (after - before) / n

            for m in models:
                train(m, 40)  # warm-up: bucket rebuild, the sampling interval settles
            per_step = {
                "plain": allocations(plain, 64),
                "watched": allocations(watched, 64),
                "untimed": allocations(untimed, 64),
            }
            synced = {}
            for name, m in (("plain", plain), ("watched", watched), ("untimed", untimed)):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    train(m, 64)  # covers timed and untimed bucket steps
                    synced[name] = ""
                except RuntimeError as exc:
                    synced[name] = str(exc)[:300]
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            every = handle.tracker.bucket_every
            hooked = {"watched": handle.comm is not None, "untimed": quiet.comm is not None}
            attach_mod._reset_for_tests()
        finally:
            dist.destroy_process_group()
    return {
        "ok": not synced["watched"]
        and not synced["untimed"]
        and max(per_step["watched"], per_step["untimed"]) <= per_step["plain"],
        "allocations_per_step": per_step,
        "synchronising_call": synced,
        "bucket_every": every,
        "comm_hook": hooked,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 2
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, fn in (("digests", check_digests), ("event_clock", check_event_clock),
                     ("ddp_job", check_job), ("hot_path", check_hot_path)):  # fmt: skip
        try:
            result[name] = fn()
        except Exception as exc:  # report every check, even after one fails
            result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    result["ok"] = all(v.get("ok") for v in result.values() if isinstance(v, dict))
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
