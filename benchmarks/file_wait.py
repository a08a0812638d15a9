"""What one heartbeat's file-wait sample costs the publisher thread.

``ddpscope/hooks/fileio.py`` reads ``/proc/self/task/<tid>/syscall`` once a
heartbeat (one ``pread`` on a file kept open), and only when the training
thread is asleep in a read, write, sync, close or copy on a descriptor does it
also ``fstat`` that descriptor and read its ``/proc/self/fd`` link. Three
cases, each timed from Python on this thread, ``--rounds`` rounds of
``--samples`` calls (median and range of the rounds' per-call means):
a thread blocked on a pipe (a read of a descriptor that is not a file), this
thread itself (on a CPU: "running"), and a thread asleep in ``fsync`` of an
8 MiB file written in a loop (only the samples that named the file count).

    python -m benchmarks.file_wait [--rounds 7] [--samples 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

from benchmarks.table import print_json
from ddpscope.hooks.fileio import FileWait


def _thread(target: object) -> int:
    """Start ``target`` on a daemon thread; its native id."""
    tid: list[int] = []
    started = threading.Event()

    def run() -> None:
        tid.append(threading.get_native_id())
        started.set()
        target()  # type: ignore[operator]

    threading.Thread(target=run, daemon=True).start()
    started.wait(5)
    return tid[0]


def _per_call_us(wait: FileWait, rounds: int, samples: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(samples):
            wait.sample()
        out.append((time.perf_counter_ns() - t0) / samples / 1000)
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median_us": round(statistics.median(values), 2),
        "min_us": round(min(values), 2),
        "max_us": round(max(values), 2),
        "n": len(values),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--json", default="")
    args = p.parse_args()
    result: dict[str, object] = {}
    if not FileWait(threading.get_native_id()).available:
        print_json({"error": "no /proc/self/task/<tid>/syscall here"}, args.json)
        return

    r, w = os.pipe()
    on_pipe = FileWait(_thread(lambda: os.read(r, 1)))
    time.sleep(0.1)
    result["blocked_on_a_pipe"] = _summary(_per_call_us(on_pipe, args.rounds, args.samples))
    result["on_a_cpu"] = _summary(
        _per_call_us(FileWait(threading.get_native_id()), args.rounds, args.samples)
    )
    os.write(w, b"x")

    stop = threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.bin")
        chunk = os.urandom(8 << 20)

        def flush_loop() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT)
            while not stop.is_set():
                os.pwrite(fd, chunk, 0)
                os.fsync(fd)
            os.close(fd)

        flushing = FileWait(_thread(flush_loop))
        named: list[float] = []
        deadline = time.monotonic() + 30
        while len(named) < args.samples and time.monotonic() < deadline:
            t0 = time.perf_counter_ns()
            op, _ = flushing.sample()
            took = (time.perf_counter_ns() - t0) / 1000
            if op:
                named.append(took)
            time.sleep(0.0005)
        stop.set()
        time.sleep(0.2)
    result["naming_a_file"] = _summary(named) if named else {"n": 0}
    print_json(result, args.json)


if __name__ == "__main__":
    main()
