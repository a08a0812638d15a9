"""ddpscope against plain training and against TraceML, interleaved inside one job.

Whole jobs on a shared machine differ by more than the effect (step time
moves by up to 2x between two torchrun jobs here), so every side runs in
the same processes: identical DDP models, one left plain, one attached to
ddpscope at default settings, one traced by TraceML (``traceml_ai``, its
default automatic mode, each step inside ``traceml.trace_step``) with its
aggregator started by this script as ``traceml serve``. Rounds of short
blocks rotate the order of the sides; the ratio of a side's block to the
plain block of the same round is one sample. Reported per side: the median
ratio with a 95% bootstrap interval, training-thread CPU per step (and its
cost over plain, with an interval), the CPU of each tool's own threads and
of any helper process, per step of that tool's model.

Both tools hook process-wide (ddpscope's optimizer hooks and collective
wrappers, TraceML's forward/backward/DataLoader patches), so the plain side
pays both tools' pass-through checks; they are a few function calls per step.

    python -m benchmarks.overhead_peers --preset 5ms --buckets 40 [--record] [--no-traceml]

Without ``traceml_ai`` installed the TraceML side is left out and the output
says so (``"traceml": "not installed"``); install it with
``pip install traceml-ai``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.stats import bootstrap_ci, paired_ci
from benchmarks.table import print_json
from benchmarks.threadtime import thread_cpu_s
from benchmarks.torchjob import job_env, torchrun
from ddpscope.hooks.bucket_cost import DECIDE_AT_STEP

#: Model shapes that give steps of about this length on one CPU thread here
#: (40 square layers; the measured step time is reported, not assumed).
PRESETS = {"5ms": {"width": 96, "batch": 64}, "50ms": {"width": 384, "batch": 128}}
LAYERS = 40


def _tool_threads() -> dict[str, list[threading.Thread]]:
    """Python threads each tool started, by their names (gloo's are native, not listed)."""
    out: dict[str, list[threading.Thread]] = {"ddpscope": [], "traceml": []}
    for t in threading.enumerate():
        if t is threading.main_thread():
            continue
        name = t.name.lower()
        if "ddpscope" in name:
            out["ddpscope"].append(t)
        elif "traceml" in name or "trace" in name or "sampler" in name or "sender" in name:
            out["traceml"].append(t)
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpscope

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    traceml: Any = None
    if args.traceml:
        import traceml_ai

        traceml_ai.init(on_missing_aggregator="raise")
        traceml = traceml_ai
    layer_mb = (args.width * args.width + args.width) * 4 / 2**20

    def build() -> DDP:
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
        cap = layer_mb if args.buckets > 1 else 4096.0
        return DDP(net, bucket_cap_mb=cap)

    sides: dict[str, DDP] = {"plain": build(), "ddpscope": build()}
    handle = ddpscope.attach(sides["ddpscope"], bucket_every=args.every)
    if traceml is not None:
        sides["traceml"] = build()
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in sides.items()}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    loss_fn = nn.MSELoss()
    y = torch.zeros(args.batch, args.width)

    def one_step(name: str) -> None:
        model, opt = sides[name], opts[name]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    def block(name: str) -> tuple[float, float]:
        c0, t0 = time.thread_time(), time.perf_counter()
        if name == "traceml":
            model = sides[name]
            for _ in range(args.steps):
                with traceml.trace_step(model):
                    one_step(name)
        else:
            for _ in range(args.steps):
                one_step(name)
        t1, c1 = time.perf_counter(), time.thread_time()
        return (t1 - t0) / args.steps, (c1 - c0) / args.steps

    names = list(sides)
    # Warm-up: DDP rebuilds its buckets; ddpscope decides on its comm hook after
    # bucket_cost.DECIDE_AT_STEP steps and then adapts its sampling.
    warm_blocks = max(3, -(-(DECIDE_AT_STEP + 8) // args.steps))
    for n in names:
        for _ in range(warm_blocks):
            block(n)
    threads = _tool_threads()
    cpu0 = {k: sum(thread_cpu_s(t) for t in v) for k, v in threads.items()}
    proc0 = time.process_time()
    helper0 = _helper_cpu_s(int(os.environ.get("BENCH_HELPER_PID", "0")))
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        for n in order:
            w, c = block(n)
            wall[n].append(w)
            cpu[n].append(c)
    threads_cpu = {
        k: sum(thread_cpu_s(t) for t in v) - cpu0.get(k, 0.0) for k, v in _tool_threads().items()
    }
    steps_each = args.rounds * args.steps
    helper = _helper_cpu_s(int(os.environ.get("BENCH_HELPER_PID", "0"))) - helper0
    out = {
        "helper_cpu_s": helper,
        "rank": rank,
        "wall": wall,
        "cpu": cpu,
        "tool_threads_cpu_s": threads_cpu,
        "thread_names": {k: sorted({t.name for t in v}) for k, v in _tool_threads().items()},
        "process_cpu_s": time.process_time() - proc0,
        "steps_each": steps_each,
        "bucket_every": getattr(getattr(handle, "tracker", None), "bucket_every", None),
        "buckets": len(getattr(getattr(handle, "tracker", None), "_layout", {})),
        "comm_hook": getattr(handle, "comm", None) is not None,
    }
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_traceml(tmp: str, nproc: int) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    port = _free_port()
    run = f"bench-{os.getpid()}"
    env = {
        "TRACEML_AGGREGATOR_HOST": "127.0.0.1",
        "TRACEML_AGGREGATOR_PORT": str(port),
        "TRACEML_SESSION_ID": run,
        "TRACEML_LOGS_DIR": f"{tmp}/traceml",
    }
    traceml = str(Path(sys.executable).with_name("traceml"))
    cmd = [traceml, "serve", "--mode", "summary", "--logs-dir", f"{tmp}/traceml",
           "--run-name", run, "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--aggregator-port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, env
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("traceml serve did not start listening within 30 s")


def _helper_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a helper process and its children so far."""
    import psutil

    if not pid:
        return 0.0
    try:
        p = psutil.Process(pid)
        total = sum(p.cpu_times()[:2])
        for child in p.children(recursive=True):
            total += sum(child.cpu_times()[:2])
        return float(total)
    except psutil.Error:
        return float("nan")


def summarize(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    r0 = ranks[0]
    per_block = r0["steps_each"] // max(1, args.rounds)
    names = list(r0["wall"])
    steps = r0["steps_each"]
    # The job's pace is its slowest rank's: per block, the larger of the ranks' times.
    wall = {
        n: [max(r["wall"][n][i] for r in ranks) for i in range(len(r0["wall"][n]))] for n in names
    }
    cpu = {
        n: [statistics.mean(r["cpu"][n][i] for r in ranks) for i in range(len(r0["cpu"][n]))]
        for n in names
    }
    sides: dict[str, Any] = {}
    for n in names:
        ratio, ci = paired_ci(wall[n], wall["plain"], lambda a, b: a / b)
        cost, cost_ci = paired_ci(cpu[n], cpu["plain"], lambda a, b: (a - b) * 1e6)
        side: dict[str, Any] = {
            "median_step_ms": statistics.median(wall[n]) * 1e3,
            "step_ms_ci": [v * 1e3 for v in bootstrap_ci(wall[n])],
            "ratio_to_plain": ratio,
            "ratio_ci": ci,
            "train_thread_cpu_us_per_step": statistics.median(cpu[n]) * 1e6,
            "train_thread_cpu_cost_us": cost,
            "train_thread_cpu_cost_ci_us": cost_ci,
        }
        if n != "plain":
            own = statistics.mean(r["tool_threads_cpu_s"].get(n, 0.0) for r in ranks)
            side["tool_threads_cpu_us_per_step"] = own / steps * 1e6
            side["tool_threads"] = r0["thread_names"].get(n, [])
        sides[n] = side
    return {
        "method": "interleaved blocks, rotating order, one torchrun job",
        "preset": args.preset,
        "width": args.width,
        "batch": args.batch,
        "layers": args.layers,
        "buckets": r0["buckets"],
        "bucket_every": r0["bucket_every"],
        "comm_hook": r0.get("comm_hook"),
        "rounds": args.rounds,
        "steps_per_block": per_block,
        "record": args.record,
        "sides": sides,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="5ms")
    p.add_argument("--buckets", type=int, choices=(1, 40), default=40)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=0, help="steps per block (0: ~100 ms blocks)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--record", action="store_true", help="ddpscope records to disk")
    p.add_argument("--no-traceml", action="store_true")
    p.add_argument(
        "--every",
        type=int,
        default=0,
        help="register the timing comm hook at attach, detail every Nth step (0: defaults)",
    )
    p.add_argument("--json", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--traceml", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=LAYERS, help="square linear layers")
    p.add_argument("--width", type=int, default=0, help="layer width (0: the preset's)")
    p.add_argument("--batch", type=int, default=0, help="batch rows (0: the preset's)")
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    preset = PRESETS[args.preset]
    args.width = args.width or preset["width"]
    args.batch = args.batch or preset["batch"]
    steps = args.steps or (20 if args.preset == "5ms" else 2)
    # Stopped from outside (kill, a timeout): unwind, so that the job and the
    # TraceML aggregator it started stop too instead of outliving the benchmark.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    have_traceml = importlib.util.find_spec("traceml_ai") is not None
    use_traceml = have_traceml and not args.no_traceml
    if not have_traceml:
        print("TraceML is not installed (pip install traceml-ai): its side is left out.")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times"
        env = job_env(tmp, record=args.record)
        helper = None
        if use_traceml:
            helper, extra = _start_traceml(tmp, args.nproc)
            env.update(extra)
            env["BENCH_HELPER_PID"] = str(helper.pid)
        cmd = torchrun(args.nproc, __file__, "--worker", "--out", str(out),
                       "--preset", args.preset, "--buckets", str(args.buckets),
                       "--rounds", str(args.rounds), "--steps", str(steps),
                       "--width", str(args.width), "--batch", str(args.batch),
                       "--layers", str(args.layers),
                       "--every", str(args.every))  # fmt: skip
        if use_traceml:
            cmd.append("--traceml")
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"job failed:\n{done.stderr[-4000:]}")
            ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(args.nproc)]
        finally:
            if helper is not None:
                helper.terminate()
                try:
                    helper.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    helper.kill()
    result = summarize(ranks, args)
    result["traceml"] = (
        "not installed" if not have_traceml else ("left out" if args.no_traceml else "traced")
    )
    if use_traceml:
        # Read by rank 0 over the measured rounds only (not the helper's start-up).
        result["sides"]["traceml"]["helper_process_cpu_us_per_step"] = (
            ranks[0]["helper_cpu_s"] / ranks[0]["steps_each"] * 1e6
        )
        result["sides"]["traceml"]["helper_process"] = "traceml serve (aggregator)"
    result["sides"]["ddpscope"]["helper_process_cpu_us_per_step"] = 0.0  # none started
    print_json(result, args.json)


if __name__ == "__main__":
    main()
